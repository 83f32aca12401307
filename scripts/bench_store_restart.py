#!/usr/bin/env python3
"""No fate-sharing (issue 35, acceptance 3): a real mock cluster under `tandem up` (2 prefill +
2 decode workers, `h200-llama8b` timings, pools a quarter of the slice's working set, host tiers
twice that) replays a slice of the shared conversation trace through `tandem bench load`; at
`--kill-at` seconds every prefill and decode worker is killed -9 at once and `tandem up` starts
them again. Two arms, one after the other on the same slice:

    store      with the store node `tandem up` embeds (it is not killed)
    no-store   the same cluster without it

`tandem bench load` samples the engines' prompt tokens and prefix hits every second from the
router (a restarted worker counts from zero), so each report's timeline holds the prefix-hit
ratio over time; both are drawn on one plot (`--plot`). Printed: the ratio over the 30 s before
the kill, over the 30 s after it, and how long after the kill it first came back to 90% of its
level before.

    cargo build --release && python3 scripts/bench_store_restart.py [--requests 3000]
        [--time-scale 0.1] [--length-scale 0.05] [--kill-at 50] [--plot FILE.svg] [--json out.json]
"""
import argparse
import json
import os
import signal
import subprocess
import tempfile
import time

from bench_kv_tiers import TRACE, ideal_floor
from bench_store import LOOPBACK, config
from tandem_cluster import EXE, cluster


def worker_pids(cfg):
    """The pids of the prefill and decode workers `tandem up` runs on the cluster file `cfg`."""
    out = subprocess.run(["pgrep", "-f", f"tandem (prefill|decode) .*--config {cfg}"],
                         capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def arm(name, text, trace, d, kill_at, plot):
    """One arm: the slice through `tandem bench load`, every worker killed -9 at `kill_at` s."""
    out = os.path.join(d, f"{name}.json")
    with cluster(text, f"tandem-restart-{name}-") as (http, cdir):
        cmd = [EXE, "bench", "load", "--addr", http, "--operator", http.operator, *trace,
               "--ttft-slo-ms", "200", "--itl-slo-ms", "50", "--json", out, "--label", name, *plot]
        load = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        t0 = time.monotonic()
        time.sleep(kill_at)
        pids = worker_pids(os.path.join(cdir, "cluster.toml"))
        for p in pids:
            os.kill(p, signal.SIGKILL)
        killed = time.monotonic() - t0
        load.wait(timeout=900)
    r = json.load(open(out))
    return r, len(pids), killed


def levels(r, killed, window=30.0):
    """The prefix-hit ratio before and after the kill (prompt tokens in the `window` s each
    side, the bins' ratios averaged), and the seconds from the kill to the first bin back at
    90% of the level before (None: never)."""
    t = r["timeline"]
    bin_s, ratio = t["bin_s"], t["prefix_hit_ratio"]
    mid = lambda i: (i + 0.5) * bin_s
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    before = mean([x for i, x in enumerate(ratio) if x is not None and killed - window <= mid(i) < killed])
    after = mean([x for i, x in enumerate(ratio) if x is not None and killed <= mid(i) < killed + window])
    back = next((mid(i) - killed for i, x in enumerate(ratio)
                 if x is not None and mid(i) > killed + bin_s and x >= 0.9 * before), None)
    return before, after, back


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--kill-at", type=float, default=50.0, help="seconds into the run")
    ap.add_argument("--plot", help="an SVG of both arms")
    ap.add_argument("--json")
    a = ap.parse_args()
    model = subprocess.run([EXE, "model", "path"], check=True, capture_output=True, text=True).stdout.strip()
    d = tempfile.mkdtemp(prefix="tandem-restart-")
    ws = ideal_floor(a)["working_set_blocks"]
    blocks = ws // 4 // 4
    pools = {"prefill": 2, "decode": 2}
    trace = ["--trace", a.trace, "--requests", str(a.requests), "--time-scale", str(a.time_scale),
             "--length-scale", str(a.length_scale)]
    runs = {}
    first = os.path.join(d, "no-store.json")
    for name in ("no-store", "store"):
        text = config(model, pools, blocks, name == "store", LOOPBACK)
        plot = ["--plot", a.plot, "--plot-with", f"no-store={first}"] if a.plot and name == "store" else []
        runs[name] = arm(name, text, trace, d, a.kill_at, plot)
    print(f"trace: {a.requests} requests, lengths x {a.length_scale}, time x {a.time_scale}; working set "
          f"{ws} blocks; 2 prefill + 2 decode, {blocks} blocks a pool, host tiers twice that")
    print("| arm | workers killed at | prefix-hit ratio, 30 s before | 30 s after | back to 90% after | "
          "whole run | errors |\n|---|---:|---:|---:|---:|---:|---:|")
    out = {}
    for name, (r, n, killed) in runs.items():
        before, after, back = levels(r, killed)
        back_s = f"{back:.0f} s" if back is not None else "never"
        print(f"| {name} | {n} at {killed:.0f} s | {before:.1%} | {after:.1%} | {back_s} | "
              f"{r['prefix_hit_ratio']:.1%} | {r['errors']} |")
        out[name] = {"killed": n, "killed_at_s": killed, "before": before, "after": after,
                     "back_to_90pct_s": back, "report": r}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
