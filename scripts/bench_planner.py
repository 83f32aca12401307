#!/usr/bin/env python3
"""The planner against the cheapest static fleet on a real mock cluster, with the simulator
beside it (issue 36, acceptance 3).

Each configuration runs `tandem up` (the real router and planner, real worker processes started
and drained by the router's local actuator, real KV transfers of the real model's KV size; the
mock engine sleeps per its `h200-llama8b` timing model instead of computing) and replays the
same slice of the Mooncake conversation trace with `tandem bench load`, its arrival rate
modulated over the run (`--rate-profile day`: a 0.3x night, a ramp, a 1.5x peak, a 3x burst).

  planner   prefill 1–5 and decode 1–3 replicas (8 workers at most), from 1 + 1
  simulated the same cluster and slice in `tandem simulate`, its start-up the one the real
            planner measured (`tandem_planner_start_up_seconds`)
  static    fixed fleets: the simulator ranks them; the real runs start at the cheapest it says
            meets the target and go on with the fleets one worker smaller (and larger, while
            none met it), so the cheapest static fleet is one measured on the real cluster

SLO: TTFT <= 250 ms and per-request ITL p90 <= 25 ms; the target: 90% of requests meeting both.
Worker-seconds: the planner's live replicas integrated over its ticks
(`tandem_planner_replica_seconds`), a static fleet's workers times the run's length.

    cargo build --release && python3 scripts/bench_planner.py [--requests 3000]
        [--time-scale 0.1] [--length-scale 0.05] [--rate-profile day] [--json out.json]
"""
import argparse
import json
import os
import re
import subprocess
import tempfile
import time

from tandem_cluster import EXE, cluster, metrics

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
TTFT_MS, ITL_MS, TARGET = 250, 25, 0.90
MAX = {"prefill": 5, "decode": 3}

POOL = """[{name}]
replicas = {replicas}
engine = "mock"
kv_blocks = {blocks}
max_batch_tokens = 2048
[{name}.mock]
preset = "h200-llama8b"
"""
AUTOSCALE = "[{name}.autoscale]\nmin = 1\nmax = {max}\ntick_ms = 250\ncooldown_ms = 3000\nwindow_ms = 3000\n"


def config(planner, prefill=1, decode=1):
    """A cluster.toml: `prefill` + `decode` fixed replicas, or (`planner`) both pools
    autoscaled from 1 + 1."""
    c = '[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'
    for name, n, blocks, slo in [("prefill", prefill, 1024, f"ttft_p90_ms = {TTFT_MS}"),
                                 ("decode", decode, 2048, f"itl_p90_ms = {ITL_MS}")]:
        c += POOL.format(name=name, replicas=n, blocks=blocks) + f"[{name}.slo]\n{slo}\n"
        if planner:
            c += AUTOSCALE.format(name=name, max=MAX[name])
    return c


def total(m, prefix):
    """The sum of every series of `prefix` (any labels)."""
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


def workload(a, out):
    return ["--trace", TRACE, "--requests", str(a.requests), "--time-scale", str(a.time_scale),
            "--length-scale", str(a.length_scale), "--rate-profile", a.rate_profile,
            "--ttft-slo-ms", str(TTFT_MS), "--itl-slo-ms", str(ITL_MS), "--json", out]


def real(a, text, name):
    """`text` under `tandem up`, the slice through `tandem bench load`."""
    with cluster(text, f"tandem-planner-{name}-") as (http, d):
        before = metrics(http)
        out = os.path.join(d, "report.json")
        t0 = time.time()
        subprocess.run([EXE, "bench", "load", "--addr", http, "--operator", http.operator, *workload(a, out)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        secs = time.time() - t0
        after = metrics(http)
    r = json.load(open(out))
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    r["seconds"] = secs
    r["worker_seconds"] = total(grew, "tandem_planner_replica_seconds")
    r["start_up_s"] = {p: after.get(f'tandem_planner_start_up_seconds{{pool="{p}"}}', 0.0) for p in MAX}
    r["moves"] = total(grew, "tandem_router_moves_total")
    r["migrations"] = total(grew, "tandem_router_migrations_total")
    r["recomputed"] = total(grew, "tandem_kv_transfer_failures_total")
    # Why prompts were computed again on their decode workers.
    r["recomputed_why"] = {k.split('"')[1]: v for k, v in grew.items()
                           if k.startswith("tandem_router_recomputes_total{") and v}
    return r


def simulate(a, text, start_up_ms=1000):
    d = tempfile.mkdtemp(prefix="tandem-planner-sim-")
    cfg, out = os.path.join(d, "cluster.toml"), os.path.join(d, "sim.json")
    open(cfg, "w").write(text)
    subprocess.run([EXE, "simulate", "--config", cfg, *workload(a, out), "--start-up-ms", str(start_up_ms)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.load(open(out))
    r["worker_seconds"] = sum(r["simulation"]["worker_seconds"].values())
    return r


def static_search(a):
    """Real runs of fixed fleets: from the simulator's cheapest meeting the target, the fleets one
    worker smaller, then larger while none has met it. Returns [(prefill, decode, report)]."""
    fleets = [(p, d) for p in range(1, MAX["prefill"] + 2) for d in range(1, MAX["decode"] + 1)
              if p + d <= sum(MAX.values())]
    sims = {f: simulate(a, config(False, *f)) for f in fleets}
    meets = sorted((f for f in fleets if sims[f]["slo_attainment"] >= TARGET), key=lambda f: (sum(f), f))
    start = meets[0] if meets else max(fleets, key=sum)
    tried, queue = {}, [start, (start[0] - 1, start[1]), (start[0], start[1] - 1)]
    queue = [f for f in queue if f in sims]
    while queue:
        f = queue.pop(0)
        if f in tried:
            continue
        r = real(a, config(False, *f), f"static-{f[0]}p{f[1]}d")
        r["worker_seconds"] = sum(f) * r["seconds"]
        r["simulated"] = sims[f]["slo_attainment"]
        tried[f] = r
        if not queue and not any(t["slo_attainment"] >= TARGET for t in tried.values()):
            # None met it: the cheapest fleet the simulator rates above every one tried.
            best = max(sims[g]["slo_attainment"] for g in tried)
            better = [g for g in fleets if g not in tried and sims[g]["slo_attainment"] > best]
            queue += sorted(better, key=lambda g: (sum(g), -sims[g]["slo_attainment"]))[:1]
    return [(f[0], f[1], r) for f, r in sorted(tried.items(), key=lambda x: (sum(x[0]), x[0]))]


def row(name, r):
    return (f"| {name} | {100 * r['slo_attainment']:.1f}% | {r['goodput_requests_per_s']:.2f} | "
            f"{r['ttft_ms']['p90']:.0f} | {r['itl_ms']['p90']:.1f} | {r['errors']} | {r['worker_seconds']:.0f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--rate-profile", default="day")
    ap.add_argument("--json", help="write every arm's report here")
    a = ap.parse_args()
    planner = real(a, config(True), "planner")
    start_up = max(planner["start_up_s"].values()) or 1.0
    sim = simulate(a, config(True), round(start_up * 1000))
    statics = static_search(a)
    met = [(p, d, r) for p, d, r in statics if r["slo_attainment"] >= TARGET]
    cheapest = min(met, key=lambda x: x[2]["worker_seconds"]) if met else None
    print(f"Mooncake conversation trace, first {a.requests} requests, time x{a.time_scale}, lengths x{a.length_scale}, "
          f"--rate-profile {a.rate_profile}; SLO: TTFT <= {TTFT_MS} ms and ITL p90 <= {ITL_MS} ms for {TARGET:.0%}")
    print("| configuration | SLO attainment | goodput req/s | TTFT p90 ms | ITL p90 ms | errors | worker-seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(row("planner (prefill 1–5, decode 1–3), real", planner))
    print(row(f"planner, simulated (start-up {start_up:.1f} s)", sim))
    for p, d, r in statics:
        print(row(f"static {p} + {d}, real (simulated {100 * r['simulated']:.1f}%)", r))
    print(f"planner: moves {planner['moves']:.0f}, migrations {planner['migrations']:.0f}, "
          f"recomputed {planner['recomputed']:.0f} {planner['recomputed_why']}; start-up measured {planner['start_up_s']}")
    if cheapest:
        ratio = planner["worker_seconds"] / cheapest[2]["worker_seconds"]
        print(f"planner / cheapest static ({cheapest[0]} + {cheapest[1]}): {ratio:.2f}x worker-seconds "
              f"(target <= 0.85x at >= {TARGET:.0%}: planner at {100 * planner['slo_attainment']:.1f}%)")
    err = lambda k, f=lambda r, k: r[k]: abs(f(sim, k) / f(planner, k) - 1) if f(planner, k) else float("nan")
    print(f"simulator against the real planner: worker-seconds {100 * err('worker_seconds'):.1f}% off, "
          f"attainment {100 * err('slo_attainment'):.1f}% off, TTFT p90 "
          f"{100 * err('ttft_ms', lambda r, k: r[k]['p90']):.1f}% off (target within 15%)")
    if a.json:
        json.dump({"planner": planner, "simulated": sim,
                   "static": [{"prefill": p, "decode": d, "report": r} for p, d, r in statics]},
                  open(a.json, "w"))


if __name__ == "__main__":
    main()
