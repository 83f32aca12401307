#!/usr/bin/env python3
"""The interference disaggregation removes, on the real CPU engine (issue 5): inter-token latency
of a decode-heavy stream while long prompts arrive, with 1 prefill + 1 decode worker versus 2
colocated workers (each prefilling and decoding) — the same two cores either way.

Two `tandem bench load` runs go at once against `tandem up`: the decode-heavy stream (short
prompts, long answers) whose ITL is reported, and long prompts (one output token) whose TTFT is.

    cargo build --release && python3 scripts/bench_interference.py [--decode-rate 5] [--plot out.svg]

With --plot, the colocated run's decode-stream report is drawn under the disaggregated one's
(`tandem bench load --plot ... --plot-with colocated=...`).
"""
import argparse
import json
import os
import re
import subprocess
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EXE = os.path.join(ROOT, "target", "release", "tandem")

from tandem_cluster import up_addresses  # noqa: E402


def config(colocated):
    c = '[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'
    if not colocated:
        c += "[prefill]\nreplicas = 1\nthreads = 1\nkv_blocks = 512\nmax_batch_tokens = 256\n"
    c += f"[decode]\nreplicas = {2 if colocated else 1}\nthreads = 1\nkv_blocks = 1024\nmax_batch_tokens = 256\n"
    return c


def run(colocated, rate, plot=()):
    d = tempfile.mkdtemp(prefix="tandem-interference-")
    cfg = os.path.join(d, "cluster.toml")
    open(cfg, "w").write(config(colocated))
    up = subprocess.Popen([EXE, "up", "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        http = up_addresses(up.stdout)
        def bench(name, *args):
            out = os.path.join(d, name + ".json")
            p = subprocess.Popen([EXE, "bench", "load", "--addr", http, "--operator", http.operator, "--json", out, *args],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return p, out
        decode = bench("decode", "--rate", str(rate), "--requests", str(int(12 * rate)), "--prompt-tokens", "32",
                       "--output-tokens", "64", "--ttft-slo-ms", "1000", "--itl-slo-ms", "100", *plot)
        prompts = bench("prompts", "--rate", "0.5", "--requests", "6", "--prompt-tokens", "1024", "--output-tokens", "1")
        for p, _ in (decode, prompts):
            p.wait()
        return json.load(open(decode[1])), json.load(open(prompts[1]))
    finally:
        up.send_signal(2)
        try:
            up.wait(timeout=15)
        except subprocess.TimeoutExpired:
            up.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-rate", type=float, default=5.0, help="decode-heavy requests per second")
    ap.add_argument("--plot", help="draw both clusters' decode streams into this SVG")
    args = ap.parse_args()
    keep = tempfile.mkdtemp(prefix="tandem-interference-reports-")
    print("| cluster (2 cores) | decode stream ITL p50 ms | ITL p90 ms | ITL p99 ms | long-prompt TTFT p50 ms | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    colocated_json = os.path.join(keep, "colocated.json")
    for name, colocated in (("colocated: 2 workers", True), ("disaggregated: 1 prefill + 1 decode", False)):
        plot = ()
        if args.plot and not colocated:
            plot = ("--plot", args.plot, "--label", "disaggregated (1 prefill + 1 decode)",
                    "--plot-with", f"colocated (2 workers)={colocated_json}")
        d, p = run(colocated, args.decode_rate, plot)
        if colocated:
            json.dump(d, open(colocated_json, "w"))
        print(f"| {name} | {d['itl_ms']['p50']:.1f} | {d['itl_ms']['p90']:.1f} | {d['itl_ms']['p99']:.1f} | "
              f"{p['ttft_ms']['p50']:.0f} | {d['errors'] + p['errors']} |")


if __name__ == "__main__":
    main()
