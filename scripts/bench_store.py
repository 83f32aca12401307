#!/usr/bin/env python3
"""The cluster KV store on the shared Mooncake conversation trace (issue 35, acceptances 6 and
7), simulated: `tandem simulate` runs the router's request core and KV index, the engine's own
scheduler, prefix cache and tiers, and the store's own `Objects` over the mock engine's
`h200-llama8b` timings (a store fetch priced at a 100 Gb/s network's rate) on a virtual clock.
In one run:

  acceptance 6 — 2 prefill + 4 decode workers whose pools together hold a quarter of the
  slice's working set, each with a host tier twice its pool:
    tiers        per-worker tiers alone
    store        the same, and a cluster store every worker puts to and fetches from

  acceptance 7 — the same total KV (pools and host tiers) as 4 workers, with `cluster.toml`'s
  default router settings (`local_prefill_max_tokens = 0`):
    2p2d         2 prefill + 2 decode, no store
    colocated    4 colocated workers, no store
    2p2d-store   2 prefill + 2 decode with the store
    colo-store   4 colocated with the store
    2p2d-bare    2 prefill + 2 decode, pools alone (cluster.toml's default: no tiers, no store)
    colo-bare    4 colocated, pools alone

each beside the infinite-cache floor of computed prompt tokens (scripts/ideal_cache.py).

With --real, acceptance 6's two arms and acceptance 7's two arms with the store also run as
real mock clusters under `tandem up` (the store the one `tandem up` embeds), one after the
other on the same slice through `tandem bench load`, beside the simulator's.

    cargo build --release && python3 scripts/bench_store.py [--requests 2000]
        [--time-scale 0.05] [--length-scale 0.05] [--real] [--json out.json]
"""
import argparse
import json
import subprocess
import tempfile

from bench_kv_tiers import PAGE_BYTES, TRACE, ideal_floor, row, simulate
from tandem_cluster import EXE, cluster, metrics


def config(model, pools, blocks, store, router="", tiers=True, peer=False):
    """`pools`: {name: replicas}; every pool's workers `blocks` blocks and (with `tiers`) a
    host tier twice that; the store `tandem up` embeds (the simulator keeps one) when `store`;
    `router`: more lines of its section; `peer`: peer fetch on."""
    text = f'[model]\npath = "{model}"\n[router]\npolicy = "kv"\n{router}'
    for name, n in pools.items():
        text += (f'[{name}]\nreplicas = {n}\nengine = "mock"\nkv_blocks = {blocks}\nmax_batch_tokens = 8192\n'
                 f'[{name}.mock]\npreset = "h200-llama8b"\n')
        if tiers:
            text += f'[{name}.kv_tiers]\nhost_bytes = {2 * blocks * PAGE_BYTES}\n'
    # The store `tandem up` embeds, or none. The mock's objects carry a block's tokens only
    # (its KV has no values): a node of this size never fills on the slice, as a store sized
    # for the working set would not.
    text += f'[store]\nembedded = {"true" if store else "false"}\ncapacity_bytes = 8_000_000_000\n'
    if peer:
        text += "[kv_transfer]\npeer_fetch = true\n"
    return text


LOOPBACK = 'listen = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'


def real(text, trace, d, name):
    """`text` as a real mock cluster under `tandem up`, the slice through `tandem bench load`."""
    out = f"{d}/{name}-real.json"
    with cluster(text, "tandem-store-real-") as (http, _):
        subprocess.run([EXE, "bench", "load", "--addr", http, "--operator", http.operator, *trace,
                        "--ttft-slo-ms", "200", "--itl-slo-ms", "50", "--json", out],
                       check=True, stdout=subprocess.DEVNULL)
        m = metrics(http)
    r = json.load(open(out))
    # The router's peer-fetch decisions, by label.
    prefix = 'tandem_router_peer_fetch_total{decision="'
    r["peer_fetch"] = {k[len(prefix):-2]: int(v) for k, v in m.items() if k.startswith(prefix)}
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--real", action="store_true", help="acceptance 6's and 7's store arms on real mock clusters too")
    ap.add_argument("--peer", action="store_true",
                    help="only peer fetch, on real mock clusters: 2P+2D with and without it (no store) and 4 colocated")
    ap.add_argument("--json")
    a = ap.parse_args()
    model = subprocess.run([EXE, "model", "path"], check=True, capture_output=True, text=True).stdout.strip()
    d = tempfile.mkdtemp(prefix="tandem-store-")
    floor = ideal_floor(a)
    ws = floor["working_set_blocks"]
    trace = ["--trace", a.trace, "--requests", str(a.requests), "--time-scale", str(a.time_scale),
             "--length-scale", str(a.length_scale)]
    six = ws // 4 // 6
    four = ws // 4 // 4
    disagg6 = {"prefill": 2, "decode": 4}
    arms = {
        "tiers": config(model, disagg6, six, False),
        "store": config(model, disagg6, six, True),
        "2p2d": config(model, {"prefill": 2, "decode": 2}, four, False),
        "colocated": config(model, {"decode": 4}, four, False),
        "2p2d-store": config(model, {"prefill": 2, "decode": 2}, four, True),
        "colo-store": config(model, {"decode": 4}, four, True),
        # cluster.toml's defaults: no tier below the pools, so no store.
        "2p2d-bare": config(model, {"prefill": 2, "decode": 2}, four, False, tiers=False),
        "colo-bare": config(model, {"decode": 4}, four, False, tiers=False),
    }
    f = floor["floor_computed_ratio"]
    if a.peer:
        return peer_fetch(a, model, trace, d, four, f)
    runs = {name: simulate(d, name, text, trace) for name, text in arms.items()}
    print(f"trace: {a.requests} requests, lengths x {a.length_scale}, time x {a.time_scale}; working set {ws} "
          f"blocks; pools {six} blocks a worker (6 workers) or {four} (4 workers), host tiers twice that; "
          f"floor: {f:.1%} of the prompt tokens computed")
    print("| arm | prefix-hit ratio | computed / sent | over the floor | host hits | disk hits | TTFT p50 ms "
          "| TTFT p90 ms | goodput req/s | errors | store hits |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(row(name, r, f) + f" {r['simulation'].get('store_hits', 0)} |")
    t, s = runs["tiers"], runs["store"]
    print(f"acceptance 6: computed tokens store/tiers {s['computed_prompt_ratio'] / t['computed_prompt_ratio']:.3f}x, "
          f"TTFT p50 {s['ttft_ms']['p50']:.0f} vs {t['ttft_ms']['p50']:.0f} ms (target: both better with the store)")
    c = lambda n: runs[n]["computed_prompt_ratio"]
    print(f"acceptance 7: 2P+2D over 4 colocated, computed tokens: no store {c('2p2d') / c('colocated'):.3f}x, "
          f"with the store {c('2p2d-store') / c('colo-store'):.3f}x, pools alone (no tiers, no store) "
          f"{c('2p2d-bare') / c('colo-bare'):.3f}x (target <= 1.15)")
    if a.real:
        shapes = {"tiers": (disagg6, six), "store": (disagg6, six),
                  "2p2d-store": ({"prefill": 2, "decode": 2}, four), "colo-store": ({"decode": 4}, four)}
        for name, (pools, blocks) in shapes.items():
            text = config(model, pools, blocks, name != "tiers", LOOPBACK)
            runs[f"{name}-real"] = real(text, trace, d, name)
            print(row(f"{name}, real", runs[f"{name}-real"], f) + " |")
        print(f"acceptance 7, real: 2P+2D over 4 colocated with the store "
              f"{c('2p2d-store-real') / c('colo-store-real'):.3f}x (target <= 1.15)")
    if a.json:
        with open(a.json, "w") as out:
            json.dump({"floor": floor, "runs": runs}, out, indent=2)


def peer_fetch(a, model, trace, d, four, f):
    """Peer fetch on real mock clusters: 2P+2D with per-worker tiers and no store, with and
    without peer fetch, beside 4 colocated workers of the same KV; then the same arms in the
    simulator."""
    two = {"prefill": 2, "decode": 2}
    arms = {"2p2d": config(model, two, four, False, LOOPBACK),
            "2p2d-peer": config(model, two, four, False, LOOPBACK, peer=True),
            "colocated": config(model, {"decode": 4}, four, False, LOOPBACK)}
    print("| arm, real mock cluster | prefix-hit ratio | computed / sent | over the floor | host hits | disk hits "
          "| TTFT p50 ms | TTFT p90 ms | goodput req/s | errors |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    runs = {}
    for name, text in arms.items():
        runs[name] = real(text, trace, d, name)
        print(row(name, runs[name], f) + f" peer-fetch decisions {runs[name]['peer_fetch']} |")
    for name, text in arms.items():
        r = simulate(d, name, text, trace)
        sim = r["simulation"]
        print(row(f"{name}, simulated", r, f)
              + f" peer hits {sim.get('peer_hits', 0)}, decisions {sim.get('peer_fetch', {})} |")
    c = lambda n: runs[n]["computed_prompt_ratio"]
    print(f"2P+2D over 4 colocated, computed tokens: without peer fetch {c('2p2d') / c('colocated'):.3f}x, "
          f"with it {c('2p2d-peer') / c('colocated'):.3f}x (target <= 1.15)")


if __name__ == "__main__":
    main()
