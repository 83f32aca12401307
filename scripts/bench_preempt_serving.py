#!/usr/bin/env python3
"""Decode memory pressure under load, through the router (issue 34, acceptance 5): preempted
sequences swapped to G2 against recomputed, measured as goodput.

A real CPU cluster (1 prefill + 1 decode worker, SmolLM2, 1 thread each) under `tandem up`
serves the same Poisson load in each arm, the arms alternating over the rounds. The decode
pool is a fraction of what the streams at that rate grow to, under optimistic admission
(`[decode] admission = "optimistic"`):

- **swap**: with `[decode.kv_tiers] host_bytes`, a preempted sequence's KV goes to G2 and is
  loaded back when it resumes;
- **recompute**: without a host tier, a resumed sequence's context is computed again — on the
  decode worker, inside its decode steps, where every stream in the batch waits for it;
- **reserve**: the same pool under the default admission (never preempts; fewer at once);
- **roomy**: a pool with room for all (the limit).

`tandem bench load` sends the requests and reports goodput with its default targets (TTFT
<= 1,000 ms, each request's ITL p90 <= 100 ms); the path is read from the router's /metrics
(the decode worker's preemptions by kind, resumed tokens and those found, G2 hits), and every
answer (greedy) is compared with the first arm's, request by request.

    cargo build --release && python3 scripts/bench_preempt_serving.py [--rate 1.0] [--requests 60]
    python3 scripts/bench_preempt_serving.py --arms roomy,swap,recompute --rounds 1   # answers vs room for all
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
kv_blocks = {blocks}
admission = "{admission}"
{tiers}"""

FIELDS = ("preempted_swapped", "preempted_recomputed", "resumed_tokens", "resumed_hit_tokens",
          "kv_host_hits")


def load(http, d, a, requests, seed):
    out = os.path.join(d, f"report-{time.time_ns()}.json")
    subprocess.run([EXE, "bench", "load", "--addr", http, "--operator", http.operator, "--rate", str(a.rate),
                    "--requests", str(requests), "--prompt-tokens", str(a.prompt_tokens),
                    "--output-tokens", str(a.output_tokens), "--seed", str(seed), "--json", out],
                   check=True, stdout=subprocess.DEVNULL)
    return json.load(open(out))


def arm_config(name, a):
    pages = (a.prompt_tokens + a.output_tokens + 15) // 16
    roomy = pages * a.requests
    tight = int(pages * a.streams * a.fraction)
    host = 'kv_tiers = { host_bytes = 2_000_000_000 }\n' if name == "swap" else ""
    # (a table inline under [decode]: the same key as [decode.kv_tiers])
    blocks, admission = {"roomy": (roomy, "reserve"), "swap": (tight, "optimistic"),
                         "recompute": (tight, "optimistic"), "reserve": (tight, "reserve")}[name]
    return CONFIG.format(blocks=blocks, admission=admission, tiers=host), blocks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals a second")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=16,
                    help="the streams the tight pool is sized against (what run at once with room)")
    ap.add_argument("--fraction", type=float, default=0.25, help="the tight pool: this much of those streams' KV")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--arms", default="swap,recompute,reserve,roomy")
    a = ap.parse_args()
    rows = {}
    for rnd in range(a.rounds):
        for name in a.arms.split(","):
            config, blocks = arm_config(name, a)
            with cluster(config, f"tandem-preempt-{name}-") as (http, d):
                load(http, d, a, 4, 99)  # warm-up
                before = settled(http, 30)
                r = load(http, d, a, a.requests, a.seed)
                after = settled(http, 30)
            path = {f: decode_stat(after, f) - decode_stat(before, f) for f in FIELDS}
            rows.setdefault(name, []).append(r)
            print(f"round {rnd + 1}, {name} ({blocks} pages): goodput {r['goodput_requests_per_s']:.3f} req/s "
                  f"({r['slo_attainment'] * 100:.1f}% met), {r['output_tokens_per_s']:.1f} output tokens/s, "
                  f"TTFT p50/p90 {r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p90']:.0f} ms, "
                  f"ITL p50/p90 {r['itl_ms']['p50']:.1f}/{r['itl_ms']['p90']:.1f} ms, errors {r['errors']}{' (' + r['first_error'] + ')' if r['errors'] else ''}; "
                  f"{ {k: int(v) for k, v in path.items()} }", flush=True)

    def mean(name, key):
        return sum(r[key] for r in rows[name]) / len(rows[name])

    # Every answer against the first arm's first round's, request by request.
    ref = rows[a.arms.split(",")[0]][0]["answers"] if rows else []
    for name, rs in rows.items():
        pairs = [(x, y) for r in rs for x, y in zip(ref, r["answers"]) if x and y and r["answers"] is not ref]
        if pairs:
            same = sum(x == y for x, y in pairs)
            print(f"{name}: answers identical to the first arm's {same} of {len(pairs)}")
    if "swap" in rows and "recompute" in rows:
        for key in ("goodput_requests_per_s", "output_tokens_per_s"):
            s, c = mean("swap", key), mean("recompute", key)
            print(f"swap / recompute, {key}: {s:.3f} / {c:.3f} = {s / c if c else float('inf'):.2f}x")
    print(f"rate {a.rate}/s, {a.requests} requests of {a.prompt_tokens} + {a.output_tokens} tokens")


if __name__ == "__main__":
    main()
