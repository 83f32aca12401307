#!/usr/bin/env python3
"""Planner vs a static pool sized for the peak vs colocated workers, on a replayed slice of the
Mooncake conversation trace, with mock-engine workers on H200-like timings (issue 5).

Each configuration runs `tandem up` (real router, real worker processes, real KV transfers of
the real model's KV size; the mock engine sleeps per its timing model instead of computing),
replays the same trace slice with `tandem bench load`, and reports SLO attainment (requests
meeting both the TTFT and the ITL target), goodput and worker-seconds. The static pool gets
the most replicas the planner used at any point; colocated gets that many workers in all, each
prefilling and decoding.

    cargo build --release && python3 scripts/bench_planner.py [--requests 1200]
"""
import argparse
import json
import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EXE = os.path.join(ROOT, "target", "release", "tandem")

from tandem_cluster import up_addresses  # noqa: E402
TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
TTFT_MS, ITL_MS = 250, 25

POOL = """engine = "mock"
kv_blocks = {blocks}
max_batch_tokens = {batch}
[{name}.mock]
preset = "h200-llama8b"
"""


def config(kind, prefill=1, decode=1):
    c = '[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'
    if kind != "colocated":
        c += f"[prefill]\nreplicas = {prefill}\n" + POOL.format(name="prefill", blocks=1024, batch=2048)
        c += f"[prefill.slo]\nttft_p90_ms = {TTFT_MS}\n"
        if kind == "planner":
            c += "[prefill.autoscale]\nmin = 1\nmax = 4\ntick_ms = 250\ncooldown_ms = 3000\nwindow_ms = 3000\n"
    c += f"[decode]\nreplicas = {decode}\n" + POOL.format(name="decode", blocks=2048, batch=2048)
    c += f"[decode.slo]\nitl_p90_ms = {ITL_MS}\n"
    if kind == "planner":
        c += "[decode.autoscale]\nmin = 1\nmax = 3\ntick_ms = 250\ncooldown_ms = 3000\nwindow_ms = 3000\n"
    return c


def metric(http, series):
    text = urllib.request.urlopen(f"http://{http.operator}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def run(kind, args, prefill=1, decode=1):
    d = tempfile.mkdtemp(prefix=f"tandem-planner-{kind}-")
    cfg = os.path.join(d, "cluster.toml")
    open(cfg, "w").write(config(kind, prefill, decode))
    up = subprocess.Popen([EXE, "up", "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        http = up_addresses(up.stdout)
        peak = {"prefill": prefill, "decode": decode}
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                if kind == "planner":
                    for p in peak:
                        peak[p] = max(peak[p], int(metric(http, f'tandem_planner_live_replicas{{pool="{p}"}}')))
                time.sleep(0.25)

        w = threading.Thread(target=watch)
        w.start()
        ws0 = sum(metric(http, f'tandem_planner_replica_seconds{{pool="{p}"}}') for p in peak)
        out = os.path.join(d, "report.json")
        t0 = time.time()
        subprocess.run([EXE, "bench", "load", "--addr", http, "--operator", http.operator, "--trace", TRACE, "--requests", str(args.requests),
                        "--time-scale", str(args.time_scale), "--length-scale", str(args.length_scale),
                        "--ttft-slo-ms", str(TTFT_MS), "--itl-slo-ms", str(ITL_MS), "--json", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        secs = time.time() - t0
        stop.set()
        w.join()
        ws1 = sum(metric(http, f'tandem_planner_replica_seconds{{pool="{p}"}}') for p in peak)
        r = json.load(open(out))
        workers = (prefill if kind != "colocated" else 0) + decode
        r["worker_seconds"] = ws1 - ws0 if kind == "planner" else workers * secs
        r["peak"] = peak
        r["workers"] = workers
        return r
    finally:
        up.send_signal(2)
        try:
            up.wait(timeout=15)
        except subprocess.TimeoutExpired:
            up.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--length-scale", type=float, default=0.05)
    args = ap.parse_args()
    rows = []
    planner = run("planner", args)
    rows.append(("planner (min 1, max 4 + 3)", planner))
    p, dn = planner["peak"]["prefill"], planner["peak"]["decode"]
    rows.append((f"static {p}P + {dn}D (planner's peak)", run("static", args, prefill=p, decode=dn)))
    rows.append((f"colocated, {p + dn} workers", run("colocated", args, decode=p + dn)))
    print(f"Mooncake conversation trace, first {args.requests} requests, time x{args.time_scale}, "
          f"lengths x{args.length_scale}; SLO: TTFT <= {TTFT_MS} ms and ITL p90 <= {ITL_MS} ms")
    print("| configuration | SLO attainment | goodput req/s | TTFT p90 ms | ITL p90 ms | errors | worker-seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {100 * r['slo_attainment']:.1f}% | {r['goodput_requests_per_s']:.2f} | "
              f"{r['ttft_ms']['p90']:.0f} | {r['itl_ms']['p90']:.1f} | {r['errors']} | {r['worker_seconds']:.0f} |")


if __name__ == "__main__":
    main()
