#!/usr/bin/env python3
"""A hot prefix (issue 12, acceptance 4): 200 requests sharing one 2,048-token system prompt
(each with its own 64-token question) over 4 colocated decode workers running the mock engine;
how many requests each worker took and how often each computed the shared prefix, with
`policy = "kv"` and `"least-loaded"` side by side.

The requests are a Mooncake-format trace written here (hash ids 0-3 are the system prompt's four
512-token blocks, the rest of each prompt is unique), replayed by `tandem bench load`.

    cargo build --release && python3 scripts/bench_hot_prefix.py [--rate 40]
"""
import argparse
import json
import os
import subprocess
import tempfile

from tandem_cluster import EXE, cluster, worker_stats

SYSTEM = 2048


def config(policy, a):
    return (f'[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\npolicy = "{policy}"\n'
            '[decode]\nreplicas = 4\nthreads = 1\nkv_blocks = 2048\n'
            f'max_batch_tokens = {a.max_batch_tokens}\n'
            'engine = "mock"\n[decode.mock]\npreset = "h200-llama8b"\n')


def run(policy, a, trace):
    with cluster(config(policy, a), "tandem-hot-") as (addr, d):
        out = os.path.join(d, "load.json")
        subprocess.run([EXE, "bench", "load", "--addr", addr, "--operator", addr.operator, "--trace", trace, "--requests",
                        str(a.requests), "--json", out], check=True, stdout=subprocess.DEVNULL)
        prompt = SYSTEM + 64
        rows = []
        for name, _, s in worker_stats(addr):
            requests = s["prompt_tokens"] // prompt
            computed = s["prompt_tokens"] - s["prefix_hit_tokens"]
            # Each request computes its own 64-token question (plus the partial block before
            # it); what exceeds that is the shared prefix computed again.
            prefix_runs = round((computed - requests * 64) / SYSTEM)
            rows.append((name, requests, prefix_runs))
        return rows, json.load(open(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=40.0, help="requests per second")
    ap.add_argument("--max-batch-tokens", type=int, default=4096,
                    help="tokens per engine step (below the prompt's length: chunked prefill)")
    a = ap.parse_args()
    trace = os.path.join(tempfile.mkdtemp(prefix="tandem-hot-trace-"), "trace.jsonl")
    with open(trace, "w") as f:
        for n in range(a.requests):
            # Unique hash ids after the system prompt's four: the question.
            f.write(json.dumps({"timestamp": round(n * 1000 / a.rate), "input_length": SYSTEM + 64,
                                "output_length": 16, "hash_ids": [0, 1, 2, 3, 100 + n]}) + "\n")
    print("| policy | requests per worker | largest share | shared prefix computed, per worker | TTFT p90 ms | errors |")
    print("|---|---|---:|---|---:|---:|")
    for policy in ("kv", "least-loaded"):
        rows, r = run(policy, a, trace)
        share = max(n for _, n, _ in rows) / max(1, sum(n for _, n, _ in rows))
        print(f"| {policy} | {' '.join(str(n) for _, n, _ in rows)} | {share:.0%} | "
              f"{' '.join(str(p) for _, _, p in rows)} | {r['ttft_ms']['p90']:.0f} | {r['errors']} |")


if __name__ == "__main__":
    main()
