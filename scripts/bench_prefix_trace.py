#!/usr/bin/env python3
"""Prefix reuse on the shared Mooncake conversation trace (issue 12, acceptances 2 and 3): the
mock engine with H200-like timings, 2 prefill + 2 decode workers, the same trace slice replayed
with `policy = "kv"`, `"round-robin"` and with the prefix cache off, beside the floor of
computed prompt tokens from an ideal cache of the prefill pool's size (scripts/ideal_cache.py).
Several time scales (a rate sweep) give one table each and the goodput of kv over cache-off.

    cargo build --release && python3 scripts/bench_prefix_trace.py [--requests 400]
        [--time-scale 0.1,0.05] [--configs kv,round-robin,off] [--plot out.svg]

With --plot, the last configuration's `tandem bench load` draws its run with the earlier ones'
reports over it (`--plot-with`): one SVG per time scale (`out-<scale>.svg` when several).
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile

from tandem_cluster import EXE, ROOT, cluster

TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
def config(policy, cache, a):
    pool = (f"replicas = 2\nthreads = 1\nmax_batch_tokens = 2048\n"
            f'prefix_cache = {str(cache).lower()}\nengine = "mock"\n')
    return (f'[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\npolicy = "{policy}"\n'
            f'[prefill]\n{pool}kv_blocks = {a.prefill_blocks}\n[prefill.mock]\npreset = "h200-llama8b"\n'
            f'[decode]\n{pool}kv_blocks = {a.decode_blocks}\n[decode.mock]\npreset = "h200-llama8b"\n'
            '[kv_transfer]\nprefer = ["tcp"]\n')


def run(policy, cache, a, time_scale, keep, plot=()):
    """One replay; its report is also copied to `keep` (for a later run's --plot-with)."""
    with cluster(config(policy, cache, a), "tandem-prefix-") as (http, d):
        out = os.path.join(d, "load.json")
        subprocess.run([EXE, "bench", "load", "--addr", http, "--operator", http.operator, "--trace", a.trace,
                        "--requests", str(a.requests), "--time-scale", str(time_scale),
                        "--length-scale", str(a.length_scale), "--ttft-slo-ms", "200",
                        "--itl-slo-ms", "50", "--json", out, *plot],
                       check=True, stdout=subprocess.DEVNULL)
        shutil.copy(out, keep)
        return json.load(open(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--time-scale", default="0.1", help="one or more, comma-separated")
    ap.add_argument("--configs", default="kv,round-robin,off",
                    help="of kv, round-robin, off (the prefix cache off, policy kv)")
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--prefill-blocks", type=int, default=4096, help="KV blocks per prefill worker")
    ap.add_argument("--decode-blocks", type=int, default=4096, help="KV blocks per decode worker")
    ap.add_argument("--plot", help="draw each time scale's runs into this SVG")
    a = ap.parse_args()
    keep = tempfile.mkdtemp(prefix="tandem-prefix-reports-")
    scales = [float(t) for t in a.time_scale.split(",")]
    floor = json.loads(subprocess.run(
        ["python3", os.path.join(ROOT, "scripts", "ideal_cache.py"), "--trace", a.trace,
         "--requests", str(a.requests), "--length-scale", str(a.length_scale),
         "--capacity-blocks", str(2 * a.prefill_blocks), "--json", "/dev/stdout"],
        check=True, capture_output=True, text=True).stdout.split("\n", 1)[1])
    print(f"floor (ideal cache of the prefill pool, {2 * a.prefill_blocks} blocks): computed "
          f"{floor['floor_computed_ratio']:.1%} of {floor['prompt_tokens_sent']} prompt tokens, "
          f"hit ratio {floor['floor_prefix_hit_ratio']:.1%}")
    configs = {"kv": ("kv", True), "round-robin": ("round-robin", True), "off": ("kv", False)}
    for ts in scales:
        print(f"\ntime x {ts}:")
        print("| cluster | prefix-hit ratio | computed / sent | over the floor | goodput req/s | TTFT p90 ms | errors |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        goodput = {}
        names = a.configs.split(",")
        for i, name in enumerate(names):
            policy, cache = configs[name]
            label = f"policy = {policy}" + ("" if cache else ", prefix cache off")
            report = os.path.join(keep, f"{name}-{ts}.json")
            plot = ()
            if a.plot and i == len(names) - 1:
                svg = a.plot if len(scales) == 1 else a.plot.replace(".svg", f"-{ts}.svg")
                plot = ["--plot", svg, "--label", label]
                for n in names[:-1]:
                    p, c = configs[n]
                    plot += ["--plot-with", f"policy = {p}" + ("" if c else ", prefix cache off")
                             + "=" + os.path.join(keep, f"{n}-{ts}.json")]
            r = run(policy, cache, a, ts, report, plot)
            goodput[name] = r["goodput_requests_per_s"]
            computed = r["computed_prompt_ratio"]
            print(f"| {label} | {r['prefix_hit_ratio']:.1%} | {computed:.1%} | "
                  f"{computed / floor['floor_computed_ratio']:.3f}x | {goodput[name]:.2f} | "
                  f"{r['ttft_ms']['p90']:.0f} | {r['errors']} |", flush=True)
        if "kv" in goodput and "off" in goodput and goodput["off"] > 0:
            print(f"goodput kv / cache off: {goodput['kv'] / goodput['off']:.2f}x")


if __name__ == "__main__":
    main()
