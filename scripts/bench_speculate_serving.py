#!/usr/bin/env python3
"""Speculative decoding under load, through the router (issue 37, acceptances 3 and 5).

A real CPU cluster (1 prefill + 1 decode worker, SmolLM2) under `tandem up` serves the same
Poisson load twice per arm, alternating: `[decode] speculation = 0` (off) and `= 8` (adaptive
prompt lookup, up to 8 drafts a step). `tandem bench load` sends token-id prompts (ordinary
text to the model: nothing to copy), so this is the case the adaptive policy must not lose on.
Reported: output tokens/s, TTFT and ITL p50, and the decode worker's drafts (proposed, accepted,
declined) from the router's /metrics.

`--soak SECONDS` instead runs the speculating cluster that long under the same load, then
checks the decode worker's pool: every block free or cached and unreferenced, the ownership
ledger empty (no block held for a rejected draft).

`--trace N` instead replays the first N requests of the shared conversation trace in
`tandem simulate` (2 prefill + 2 decode mock H200 workers, the engine's and the router's own
code) with speculation off and on: the prefix-hit ratio and the router's decisions must not
move (acceptance 4).

    cargo build --release && python3 scripts/bench_speculate_serving.py [--rate 3] [--requests 120]
    python3 scripts/bench_speculate_serving.py --soak 600
    python3 scripts/bench_speculate_serving.py --trace 2000
"""
import argparse
import json
import os
import subprocess
import time

from tandem_cluster import EXE, ROUTER, cluster, decode_stat, settled

CONFIG = ROUTER + """[prefill]
threads = 1
[decode]
threads = 1
kv_blocks = 1024
max_batch_tokens = 256
speculation = {k}
"""


def load(http, d, a, requests):
    out = os.path.join(d, f"report-{time.time_ns()}.json")
    subprocess.run([EXE, "bench", "load", "--addr", http, "--operator", http.operator, "--rate", str(a.rate),
                    "--requests", str(requests), "--prompt-tokens", str(a.prompt_tokens),
                    "--output-tokens", str(a.output_tokens), "--seed", str(a.seed), "--json", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(out))


def arms(a):
    rows = []
    for rnd in range(2):
        for k in (0, 8):
            with cluster(CONFIG.format(k=k), f"tandem-spec-{k}-") as (http, d):
                load(http, d, a, 8)  # warm-up: the step costs measured, the caches filled
                before = settled(http)
                r = load(http, d, a, a.requests)
                after = settled(http)
            spec = {f: decode_stat(after, f"spec_{f}") - decode_stat(before, f"spec_{f}")
                    for f in ("proposed", "accepted", "declined")}
            rows.append((rnd, k, r, spec))
            print(f"round {rnd + 1}, speculation {k}: {r['output_tokens_per_s']:.1f} output tokens/s, "
                  f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.1f} ms, errors {r['errors']}; "
                  f"drafts {spec}", flush=True)
    off = sum(r["output_tokens_per_s"] for _, k, r, _ in rows if k == 0)
    on = sum(r["output_tokens_per_s"] for _, k, r, _ in rows if k == 8)
    print(f"speculation on / off: {on / off:.3f}x output tokens/s (target >= 0.97x), "
          f"rate {a.rate}/s, {a.requests} requests of {a.prompt_tokens} + {a.output_tokens} tokens")


def soak(a):
    with cluster(CONFIG.format(k=8), "tandem-spec-soak-") as (http, d):
        t0, n = time.time(), 0
        while time.time() - t0 < a.soak:
            r = load(http, d, a, max(8, int(a.rate * 60)))
            n += r["requests"] if "requests" in r else 0
            if r["errors"]:
                raise SystemExit(f"soak: {r['errors']} errors")
        m = settled(http)
    # (WorkerLoad.kv_blocks_total is exported as tandem_worker_kv_blocks_capacity.)
    total, free = decode_stat(m, "kv_blocks_capacity"), decode_stat(m, "kv_blocks_free")
    ledger = {f: decode_stat(m, f"kv_blocks_{f}") for f in ("reserved", "in_flight", "committed")}
    spec = {f: decode_stat(m, f"spec_{f}") for f in ("proposed", "accepted", "declined", "verifies")}
    print(f"soak {time.time() - t0:.0f} s: decode pool {free:.0f} of {total:.0f} blocks free or cached-and-unreferenced, "
          f"ledger {ledger}; drafts {spec}")
    ok = total > 0 and free == total and not any(ledger.values())
    print("balanced" if ok and total > 0 else "NOT BALANCED")
    if not ok:
        raise SystemExit(1)


MOCK = """[router]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"
operator = "127.0.0.1:0"
[prefill]
replicas = 2
engine = "mock"
kv_blocks = 8192
[prefill.mock]
preset = "h200-llama8b"
[decode]
replicas = 2
engine = "mock"
kv_blocks = 8192
speculation = {k}
[decode.mock]
preset = "h200-llama8b"
"""


def trace(a):
    import tempfile
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    path = os.path.join(root, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
    out = {}
    for k in (0, 8):
        d = tempfile.mkdtemp(prefix="tandem-spec-trace-")
        cfg, rep = os.path.join(d, "cluster.toml"), os.path.join(d, "sim.json")
        open(cfg, "w").write(MOCK.format(k=k))
        subprocess.run([EXE, "simulate", "--config", cfg, "--trace", path, "--requests", str(a.trace),
                        "--time-scale", "0.5", "--length-scale", "0.25", "--json", rep],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = json.load(open(rep))
        out[k] = r
        print(f"speculation {k}: prefix-hit ratio {r['prefix_hit_ratio']:.4f}, decisions {r['simulation']['prefill_decisions']}, "
              f"drafts {r['simulation']['speculation']}, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.2f} ms")
    h0, h8 = out[0]["prefix_hit_ratio"], out[8]["prefix_hit_ratio"]
    print(f"prefix-hit ratio on / off: {h8 / h0:.4f} (target within 2%)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--soak", type=float, help="seconds of load on the speculating cluster, then the ledger checked")
    ap.add_argument("--trace", type=int, help="requests of the shared trace through tandem simulate, off and on")
    a = ap.parse_args()
    trace(a) if a.trace else soak(a) if a.soak else arms(a)


if __name__ == "__main__":
    main()
