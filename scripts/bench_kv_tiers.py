#!/usr/bin/env python3
"""KV tiers below the pool on the shared Mooncake conversation trace (issue 34, acceptances 3
and 4), simulated: `tandem simulate` runs the router's request core and the engine's own
scheduler, prefix cache and tiers over the mock engine's `h200-llama8b` timings (tier loads
priced at PCIe and NVMe rates) on a virtual clock. 2 prefill + 2 decode workers whose pools
together hold a quarter of the trace slice's working set (--pool-share; 1.0 for each pool's
two workers holding a quarter), in one run of arms:

  g1       the pools alone (evicted blocks are forgotten and computed again)
  tiers    host memory (G2: twice the pool) and disk (G3: the whole working set) under them
  blind    the same tiers, routed blind to them (`[router] tier_weights = [0.0, 0.0]`)

beside the infinite-cache floor of computed prompt tokens (scripts/ideal_cache.py), and a
workload with no reuse (unique prompts) with tiers off and on.

    cargo build --release && python3 scripts/bench_kv_tiers.py [--requests 2000]
        [--time-scale 0.05] [--length-scale 0.05] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import tempfile

from tandem_cluster import EXE, ROOT

TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
BLOCK = 16
# Bytes of one KV page of the default model (SmolLM2-135M: 30 layers, K and V, 16 tokens of
# 3 KV heads x 64, f16): what a tier holds of a block.
PAGE_BYTES = 30 * 2 * BLOCK * 3 * 64 * 2


def config(model, blocks, tiers, router="", policy="evicted"):
    pool = lambda name: (f'[{name}]\nreplicas = 2\nengine = "mock"\nkv_blocks = {blocks}\n'
                         f'max_batch_tokens = 8192\n[{name}.mock]\npreset = "h200-llama8b"\n')
    text = f'[model]\npath = "{model}"\n[router]\npolicy = "kv"\n{router}\n' + pool("prefill") + pool("decode")
    if tiers:
        host, disk = tiers
        for name in ("prefill", "decode"):
            text += (f'[{name}.kv_tiers]\nhost_bytes = {host * PAGE_BYTES}\ndisk_path = "g3"\n'
                     f'disk_bytes = {disk * PAGE_BYTES}\nwrite_policy = "{policy}"\n')
        # Each worker's tiers alone: no cluster store (scripts/bench_store.py measures it).
        text += "[store]\nembedded = false\n"
    return text


def simulate(d, name, text, work):
    path = os.path.join(d, f"{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    out = os.path.join(d, f"{name}.json")
    subprocess.run([EXE, "simulate", "--config", path, *work, "--ttft-slo-ms", "200",
                    "--itl-slo-ms", "50", "--json", out], check=True, stdout=subprocess.DEVNULL)
    return json.load(open(out))


def ideal_floor(a):
    """The infinite-cache floor of `a`'s trace slice (scripts/ideal_cache.py)."""
    return json.loads(subprocess.run(
        ["python3", os.path.join(ROOT, "scripts", "ideal_cache.py"), "--trace", a.trace,
         "--requests", str(a.requests), "--length-scale", str(a.length_scale),
         "--capacity-blocks", str(1 << 40), "--json", "/dev/stdout"],
        check=True, capture_output=True, text=True).stdout.split("\n", 1)[1])


def row(name, r, floor=None):
    t = r.get("tier_hit_blocks") or {}
    over = f"{r['computed_prompt_ratio'] / floor:.3f}x" if floor else "-"
    return (f"| {name} | {r['prefix_hit_ratio']:.1%} | {r['computed_prompt_ratio']:.1%} | {over} | "
            f"{t.get('host', 0)} | {t.get('disk', 0)} | {r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p90']:.0f} | "
            f"{r['goodput_requests_per_s']:.2f} | {r['errors']} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--unique-rate", type=float, default=20.0, help="requests/s of the no-reuse workload")
    ap.add_argument("--pool-share", type=float, default=0.25,
                    help="the four workers' pools together hold this share of the working set")
    ap.add_argument("--write-policy", default="evicted", choices=["evicted", "hit-twice"])
    ap.add_argument("--json")
    a = ap.parse_args()
    model = subprocess.run([EXE, "model", "path"], check=True, capture_output=True, text=True).stdout.strip()
    d = tempfile.mkdtemp(prefix="tandem-tiers-")
    floor = ideal_floor(a)
    ws = floor["working_set_blocks"]
    blocks = int(ws * a.pool_share) // 4
    tiers = (2 * blocks, ws)
    trace = ["--trace", a.trace, "--requests", str(a.requests), "--time-scale", str(a.time_scale),
             "--length-scale", str(a.length_scale)]
    runs = {
        "g1": simulate(d, "g1", config(model, blocks, None), trace),
        "tiers": simulate(d, "tiers", config(model, blocks, tiers, policy=a.write_policy), trace),
        "blind": simulate(d, "blind", config(model, blocks, tiers, "tier_weights = [0.0, 0.0]", a.write_policy), trace),
    }
    unique = ["--rate", str(a.unique_rate), "--requests", str(a.requests), "--prompt-tokens", "1024",
              "--output-tokens", "32"]
    runs["unique-g1"] = simulate(d, "unique-g1", config(model, blocks, None), unique)
    runs["unique-tiers"] = simulate(d, "unique-tiers", config(model, blocks, tiers, policy=a.write_policy), unique)
    f = floor["floor_computed_ratio"]
    print(f"trace: {a.requests} requests, lengths x {a.length_scale}, time x {a.time_scale}; working set {ws} "
          f"blocks; pools {blocks} blocks a worker; tiers {tiers[0]} blocks of host memory and {tiers[1]} on "
          f"disk a worker; floor: {f:.1%} of the prompt tokens computed")
    print("| arm | prefix-hit ratio | computed / sent | over the floor | host hits | disk hits | TTFT p50 ms "
          "| TTFT p90 ms | goodput req/s | errors |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("g1", "tiers", "blind"):
        print(row(name, runs[name], f))
    for name in ("unique-g1", "unique-tiers"):
        print(row(name, runs[name]))
    g, t, b = runs["g1"], runs["tiers"], runs["blind"]
    ratio = lambda x, y: x / y if y else float("inf")
    print(f"tiers over the floor {t['computed_prompt_ratio'] / f:.3f}x (target <= 1.15); TTFT p50 g1/tiers "
          f"{ratio(g['ttft_ms']['p50'], t['ttft_ms']['p50']):.2f}x (target >= 2); goodput tiers/g1 "
          f"{ratio(t['goodput_requests_per_s'], g['goodput_requests_per_s']):.2f}x (target >= 1.3)")
    print(f"tier-aware over blind: prefix-hit ratio {ratio(t['prefix_hit_ratio'], b['prefix_hit_ratio']):.2f}x, "
          f"TTFT p50 {ratio(b['ttft_ms']['p50'], t['ttft_ms']['p50']):.2f}x (target: either >= 1.2)")
    u0, u1 = runs["unique-g1"], runs["unique-tiers"]
    print(f"no reuse: goodput tiers/g1 {ratio(u1['goodput_requests_per_s'], u0['goodput_requests_per_s']):.3f}x "
          f"(target >= 0.97)")
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"floor": floor, "pool_blocks": blocks, "tiers": tiers, "runs": runs}, out, indent=2)


if __name__ == "__main__":
    main()
