#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python's C API) on the same workload as `tandem bench engine`:
prefill of a 512-token prompt, and decode at batch 1 and 16 (32-token context per sequence,
64 steps, logits for every sequence every step), best of 3, same thread count.

    pip install llama-cpp-python==0.3.36
    python3 scripts/bench_llamacpp.py [--model PATH] [--threads 2]
"""
import argparse
import os
import time

import llama_cpp as L


def default_model():
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "tandem", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    batches = [int(b) for b in a.batch.split(",")]

    L.llama_backend_init()
    model = L.llama_model_load_from_file(a.model.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = max(4096, a.prompt_len + 64, max(batches) * (32 + a.steps) + 64)
    # The whole prompt in one llama_decode call, computed 512 tokens at a time.
    cp.n_batch = max(512, a.prompt_len)
    cp.n_ubatch = 512
    cp.n_seq_max = max(batches)
    cp.kv_unified = True
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(512, a.prompt_len), 0, max(batches))

    def decode(entries):
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
            batch.seq_id[i][0] = seq
        assert L.llama_decode(ctx, batch) == 0

    prompt = [(i * 7919 + 101) % vocab for i in range(a.prompt_len)]
    print(f"llama.cpp (llama-cpp-python {L.__version__}), threads: {a.threads}")
    best = min(timed(lambda: (L.llama_memory_clear(mem, True), None)[1], lambda: decode(
        [(t, p, 0, p == a.prompt_len - 1) for p, t in enumerate(prompt)])) for _ in range(a.reps))
    print(f"prefill {a.prompt_len} tokens: {a.prompt_len / best:.1f} tokens/s ({best * 1e3:.1f} ms)")
    for b in batches:
        def setup():
            L.llama_memory_clear(mem, True)
            for s in range(b):
                decode([(t, p, s, False) for p, t in enumerate(prompt[s % 8:s % 8 + 32])])

        def run():
            for step in range(a.steps):
                decode([((s * 31 + step * 17 + 5) % vocab, 32 + step, s, True) for s in range(b)])

        best = min(timed(setup, run) for _ in range(a.reps))
        print(f"decode batch {b}: {b * a.steps / best:.1f} tokens/s ({best * 1e3 / a.steps:.2f} ms/step)")


def timed(setup, run):
    setup()
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
