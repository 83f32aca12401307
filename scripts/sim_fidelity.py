#!/usr/bin/env python3
"""The simulator against the real cluster (issue 17, acceptance 1): one cluster.toml (2 prefill +
2 decode workers, mock engines), one slice of the Mooncake conversation trace, replayed through
`tandem up` by `tandem bench load` and simulated by `tandem simulate`, side by side; prints the
TTFT and ITL p50/p90 of both and the simulator's error.

The machine's own costs — what a real worker's step takes beside the timing model's time, a
KV transfer's exposed wait, and a decode engine's time writing arrived KV into its cache (its
running batch waits for it) — are measured first on another slice of the trace (the requests
after the compared ones) from the workers' and the router's metrics, and given to the simulator
as `--prefill/--decode-step-overhead-us`, `--link-latency-us` and `--kv-write-ns-per-byte`;
then both run the compared
slice.

    cargo build --release && python3 scripts/sim_fidelity.py [--requests 300] [--time-scale 0.05]
        [--length-scale 0.05] [--preset cpu-smollm2]
"""
import argparse
import http.client
import json
import os
import re
import subprocess

from tandem_cluster import EXE, ROOT, cluster, get_json

TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")


def config(a):
    pool = (f'replicas = 2\nthreads = 1\nmax_batch_tokens = {a.max_batch_tokens}\nengine = "mock"\n')
    return (f'[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\n'
            f'[prefill]\n{pool}kv_blocks = 4096\n[prefill.mock]\npreset = "{a.preset}"\n'
            f'[decode]\n{pool}kv_blocks = 4096\n[decode.mock]\npreset = "{a.preset}"\n'
            '[kv_transfer]\nprefer = ["tcp"]\n')


def workload(a, out, skip=0):
    return ["--trace", a.trace, "--requests", str(a.requests), "--skip", str(skip),
            "--time-scale", str(a.time_scale), "--length-scale", str(a.length_scale), "--json", out]


def scrape(addr):
    """Prometheus text from host:port/metrics as {name{labels}: value}."""
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def mean(metrics, name):
    n = sum(m.get(name + "_count", 0) for m in metrics)
    return sum(m.get(name + "_sum", 0) for m in metrics) / n if n else 0.0


def calibrate(a):
    """Per-step overheads of each pool and the KV transfer's exposed wait, measured on the
    trace's next `a.requests` requests."""
    with cluster(config(a), "tandem-calibrate-") as (http, d):
        load = workload(a, os.path.join(d, "real.json"), skip=a.requests)
        subprocess.run([EXE, "bench", "load", "--addr", http] + load, check=True,
                       stdout=subprocess.DEVNULL)
        workers = get_json(http, "/debug/workers")["workers"]
        per_pool = {p: [scrape(w["metrics_endpoint"]) for w in workers if w["role"] == p]
                    for p in ["prefill", "decode"]}
        router = scrape(http)
        out = os.path.join(d, "sim.json")
        subprocess.run([EXE, "simulate", "--config", os.path.join(d, "cluster.toml")]
                       + workload(a, out, skip=a.requests), check=True, stdout=subprocess.DEVNULL)
        steps = json.load(open(out))["simulation"]["step_seconds"]
    over = {}
    for p in ["prefill", "decode"]:
        real = mean(per_pool[p], f"tandem_{p}_step_seconds")
        model = steps[p]["sum"] / steps[p]["count"]
        over[p] = max(0, round((real - model) * 1e6))
    wait = mean([router], "tandem_kv_exposed_wait_seconds")
    # The decode engines' time writing arrived KV into their caches, per byte received.
    written = sum(m.get("tandem_decode_kv_admit_seconds_sum", 0) for m in per_pool["decode"])
    received = sum(m.get("tandem_kv_received_bytes_total", 0) for m in per_pool["decode"])
    write_ns = written * 1e9 / received if received else 0.0
    return {"prefill_us": over["prefill"], "decode_us": over["decode"], "link_us": round(wait * 1e6),
            "write_ns": write_ns}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--preset", default="cpu-smollm2")
    a = ap.parse_args()
    cal = calibrate(a)
    print(f"calibrated on requests {a.requests}..{2 * a.requests}: step overhead prefill {cal['prefill_us']} µs, "
          f"decode {cal['decode_us']} µs; KV exposed wait {cal['link_us']} µs; "
          f"KV written into the decode cache at {cal['write_ns']:.3f} ns/byte")
    sim_flags = ["--prefill-step-overhead-us", str(cal["prefill_us"]), "--decode-step-overhead-us",
                 str(cal["decode_us"]), "--link-latency-us", str(cal["link_us"]),
                 "--link-gbytes-per-s", "1000", "--kv-write-ns-per-byte", f"{cal['write_ns']:.4f}"]
    with cluster(config(a), "tandem-fidelity-") as (http, d):
        out = os.path.join(d, "real.json")
        subprocess.run([EXE, "bench", "load", "--addr", http] + workload(a, out), check=True,
                       stdout=subprocess.DEVNULL)
        real = json.load(open(out))
        cfg = os.path.join(d, "cluster.toml")
        out = os.path.join(d, "sim.json")
        subprocess.run([EXE, "simulate", "--config", cfg] + workload(a, out) + sim_flags,
                       check=True, stdout=subprocess.DEVNULL)
        sim = json.load(open(out))
    print(f"{a.requests} requests, time x{a.time_scale}, lengths x{a.length_scale}, preset {a.preset}; "
          f"real errors {real['errors']}, simulated errors {sim['errors']}; "
          f"simulated in {sim['simulation']['wall_s']:.2f} s")
    print("| metric | real `tandem up` | `tandem simulate` | error |\n|---|---:|---:|---:|")
    for k in ["ttft_ms", "itl_ms", "e2e_ms"]:
        for q in ["p50", "p90"]:
            r, s = real[k][q], sim[k][q]
            print(f"| {k} {q} | {r:.1f} | {s:.1f} | {100 * (s - r) / r:+.1f}% |")
    for k in ["prefix_hit_ratio", "requests_per_s", "output_tokens_per_s"]:
        print(f"| {k} | {real[k]:.3f} | {sim[k]:.3f} | |")


if __name__ == "__main__":
    main()
