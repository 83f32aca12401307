#!/usr/bin/env python3
"""The simulator against the real cluster (issue 17, acceptance 1): one cluster.toml (2 prefill +
2 decode workers, mock engines), one slice of the Mooncake conversation trace, replayed through
`tandem up` by `tandem bench load` and simulated by `tandem simulate`, side by side; prints the
TTFT and ITL p50/p90 of both and the simulator's error.

The machine's own costs — what a real worker's steps take beside the timing model's time (its
`tandem_{pool}_step_overhead_seconds` histogram: the simulator draws each step's overhead from
it, `--step-overheads`; `--overhead mean` gives it the means instead), a KV transfer's exposed
wait, and a decode engine's time writing arrived KV into its cache (its running batch waits for
it) — are read from the workers' and the router's metrics, two ways: over the compared run
itself (`same`: what the machine cost while it ran — this 2-core machine's costs move by 2-5x
between runs of one slice, with the other processes on it), and over the next slice of the
trace, run on the same cluster right after (`next`: held out). The simulator runs the compared
slice with each.

    cargo build --release && python3 scripts/sim_fidelity.py [--requests 300] [--time-scale 0.05]
        [--length-scale 0.05] [--preset cpu-smollm2] [--kv-blocks 4096]
        [--tiers HOST_BYTES,DISK_BYTES]   # the tiered arm: small pools, tiers under them
"""
import argparse
import http.client
import json
import os
import re
import subprocess
import tempfile

from tandem_cluster import EXE, ROOT, cluster, get_json, operator

TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation_trace.jsonl")


def config(a):
    pool = (f'replicas = 2\nthreads = 1\nmax_batch_tokens = {a.max_batch_tokens}\nengine = "mock"\n'
            f'kv_blocks = {a.kv_blocks}\n')
    disk = f'disk_path = "g3"\ndisk_bytes = {a.tiers[1]}\n' if a.tiers and a.tiers[1] else ""
    tiers = lambda name: f'[{name}.kv_tiers]\nhost_bytes = {a.tiers[0]}\n{disk}' if a.tiers else ""
    # With tiers, `tandem up` embeds a store node unless told not to (--store: keep it).
    store = f'[store]\nembedded = {"true" if a.store else "false"}\n'
    return (f'[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'
            f'[prefill]\n{pool}[prefill.mock]\npreset = "{a.preset}"\n{tiers("prefill")}'
            f'[decode]\n{pool}[decode.mock]\npreset = "{a.preset}"\n{tiers("decode")}'
            '[kv_transfer]\nprefer = ["tcp"]\n' + store)


def workload(a, out, skip=0):
    return ["--trace", a.trace, "--requests", str(a.requests), "--skip", str(skip),
            "--time-scale", str(a.time_scale), "--length-scale", str(a.length_scale), "--json", out]


def fetch_metrics(addr):
    """Prometheus text from host:port/metrics."""
    host, port = operator(addr).rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("GET", "/metrics")
    return c.getresponse().read().decode()


SAMPLE = re.compile(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$")


def samples(text):
    """Prometheus text as {name{labels}: value}."""
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := SAMPLE.match(line))}


def since(after, before):
    """The counters and histograms of `after` less those of `before` (what happened between
    two scrapes of one process), as Prometheus text."""
    b = samples(before)
    return "".join(f"{k} {v - b.get(k, 0.0)}\n" for k, v in samples(after).items())


def total(text, name):
    """`name` summed over its labels."""
    return sum(v for k, v in samples(text).items() if k.split("{")[0] == name)


def mean(texts, name):
    n = sum(total(t, name + "_count") for t in texts)
    return sum(total(t, name + "_sum") for t in texts) / n if n else 0.0


def scrape_all(http, workers):
    return {w["metrics_endpoint"]: fetch_metrics(w["metrics_endpoint"]) for w in workers} | \
        {"router": fetch_metrics(http)}


def costs(texts, workers, overheads):
    """The machine's costs in one stretch of a cluster's metrics (`texts`: each process's
    counters over it): the workers' step-overhead histograms (each step's time beyond the
    timing model's; written to `overheads` for `--step-overheads`), their means, the KV
    transfer's exposed wait and the decode engines' KV write cost per byte."""
    per_pool = {p: [texts[w["metrics_endpoint"]] for w in workers if w["role"] == p]
                for p in ["prefill", "decode"]}
    with open(overheads, "w") as f:
        f.write("".join(per_pool["prefill"] + per_pool["decode"]))
    # The router's: the tokens' delays on their way out (`--token-delays`).
    router = overheads.replace("-metrics", "-router")
    with open(router, "w") as f:
        f.write(texts["router"])
    over = {p: mean(per_pool[p], f"tandem_{p}_step_overhead_seconds") * 1e6 for p in ["prefill", "decode"]}
    # The transfer's exposed wait ends at the decode worker's answer, so it holds the wait for
    # the decode engine's step in progress and the KV's write into its cache, both of which
    # the simulator has of its own: the link's latency is the rest.
    wait = mean([texts["router"]], "tandem_kv_exposed_wait_seconds")
    queued = mean(per_pool["decode"], "tandem_decode_kv_queue_seconds")
    admit = mean(per_pool["decode"], "tandem_decode_kv_admit_seconds")
    # The decode engines' time writing arrived KV into their caches, per byte received.
    written = sum(total(t, "tandem_decode_kv_admit_seconds_sum") for t in per_pool["decode"])
    received = sum(total(t, "tandem_kv_received_bytes_total") for t in per_pool["decode"])
    return {"prefill_us": round(over["prefill"]), "decode_us": round(over["decode"]),
            "link_us": round(max(wait - queued - admit, 0.0) * 1e6),
            "wait_us": round(wait * 1e6), "queued_us": round(queued * 1e6),
            "write_ns": written * 1e9 / received if received else 0.0,
            "file": overheads, "router": router, "phases": phases(texts["router"]),
            "refusals": round(total(texts["router"], "tandem_worker_kv_refusals")),
            "holds": round(total(texts["router"], "tandem_router_admission_holds_total")),
            "store_hits": round(total(texts["router"], "tandem_worker_kv_store_hits")),
            "token_delay_us": round(mean([texts["router"]], "tandem_router_token_delay_seconds") * 1e6)}


PHASES = ["admission", "prefill", "first_token"]


def phases(router):
    """The router's mean TTFT phases (ms) from its `tandem_router_ttft_phase_seconds`."""
    m = samples(router)
    out = {}
    for p in PHASES:
        n = m.get(f'tandem_router_ttft_phase_seconds_count{{phase="{p}"}}', 0.0)
        out[p] = 1e3 * m.get(f'tandem_router_ttft_phase_seconds_sum{{phase="{p}"}}', 0.0) / n if n else 0.0
    return out


def run_real(a, scratch):
    """The compared slice through a fresh `tandem up`, then — on the same cluster, right after —
    the trace's next `a.requests` requests. The machine's costs are taken from each stretch's
    own metrics: `same` from the compared run's (what this machine cost while it ran), `next`
    from the slice after it (held out: the costs a moment later, on other requests)."""
    with cluster(config(a), "tandem-fidelity-") as (http, d):
        out = os.path.join(d, "real.json")
        subprocess.run([EXE, "bench", "load", "--addr", http, "--operator", http.operator] + workload(a, out), check=True,
                       stdout=subprocess.DEVNULL)
        real = json.load(open(out))
        workers = get_json(http, "/debug/workers")["workers"]
        first = scrape_all(http, workers)
        load = workload(a, os.path.join(d, "next.json"), skip=a.requests)
        subprocess.run([EXE, "bench", "load", "--addr", http, "--operator", http.operator] + load, check=True,
                       stdout=subprocess.DEVNULL)
        after = scrape_all(http, workers)
        cfg = open(os.path.join(d, "cluster.toml")).read()
    nxt = {k: since(after[k], first[k]) for k in after}
    cal = {"same": costs(first, workers, os.path.join(scratch, "same-metrics.txt")),
           "next": costs(nxt, workers, os.path.join(scratch, "next-metrics.txt"))}
    return real, cal, cfg


def simulate(a, cfg, cal, scratch, name):
    """The compared slice in `tandem simulate` with the costs `cal`."""
    if a.overhead == "drawn":
        steps = ["--step-overheads", cal["file"]]
    else:
        steps = ["--prefill-step-overhead-us", str(cal["prefill_us"]),
                 "--decode-step-overhead-us", str(cal["decode_us"])]
    if a.token_delays:
        steps += ["--token-delays", cal["router"]]
    flags = steps + ["--link-latency-us", str(cal["link_us"]), "--link-gbytes-per-s", "1000",
                     "--kv-write-ns-per-byte", f"{cal['write_ns']:.4f}"]
    out = os.path.join(scratch, f"sim-{name}.json")
    subprocess.run([EXE, "simulate", "--config", cfg] + workload(a, out) + flags,
                   check=True, stdout=subprocess.DEVNULL)
    return json.load(open(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--preset", default="cpu-smollm2")
    ap.add_argument("--kv-blocks", type=int, default=4096, help="KV blocks of each worker's pool")
    ap.add_argument("--tiers", type=lambda v: [int(x) for x in v.split(",")],
                    help="HOST_BYTES,DISK_BYTES: KV tiers under every worker's pool (the tiered arm; DISK_BYTES 0: no disk tier)")
    ap.add_argument("--store", action="store_true",
                    help="with --tiers: the cluster store `tandem up` embeds (and the simulator's)")
    ap.add_argument("--overhead", choices=["drawn", "mean"], default="drawn",
                    help="simulated step overheads: drawn from the measured histograms, or their means")
    ap.add_argument("--no-token-delays", dest="token_delays", action="store_false",
                    help="tokens reach their clients as they are made (no measured delay drawn)")
    a = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="tandem-fidelity-")
    real, cal, cfg_text = run_real(a, scratch)
    cfg = os.path.join(scratch, "cluster.toml")
    with open(cfg, "w") as f:
        f.write(cfg_text)
    sims = {}
    for name in ["same", "next"]:
        c = cal[name]
        print(f"costs from the {name} run: step overhead prefill mean {c['prefill_us']} µs, decode mean "
              f"{c['decode_us']} µs ({'drawn per step from ' + c['file'] if a.overhead == 'drawn' else 'the means'}); "
              f"KV exposed wait {c['wait_us']} µs, of which {c['queued_us']} µs waiting for a decode step's end "
              f"(link latency {c['link_us']} µs); KV written into the decode cache at {c['write_ns']:.3f} ns/byte; "
              f"a token's way to the router's HTTP response {c['token_delay_us']} µs on average")
        sims[name] = simulate(a, cfg, c, scratch, name)
    print(f"{a.requests} requests, time x{a.time_scale}, lengths x{a.length_scale}, preset {a.preset}; "
          f"real errors {real['errors']}, simulated errors {sims['same']['errors']}, {sims['next']['errors']}; "
          f"simulated in {sims['same']['simulation']['wall_s']:.2f} s")
    print("| metric | real `tandem up` | simulated, costs of the same run | error | costs of the next slice | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in ["ttft_ms", "itl_ms", "e2e_ms"]:
        for q in ["p50", "p90"]:
            r = real[k][q]
            cells = "".join(f" {sims[n][k][q]:.1f} | {100 * (sims[n][k][q] - r) / r:+.1f}% |" for n in ["same", "next"])
            print(f"| {k} {q} | {r:.1f} |{cells}")
    for k in ["prefix_hit_ratio", "requests_per_s", "output_tokens_per_s"]:
        print(f"| {k} | {real[k]:.3f} | {sims['same'][k]:.3f} | | {sims['next'][k]:.3f} | |")
    for t in ["host", "disk"]:
        hits = lambda r: (r.get("tier_hit_blocks") or {}).get(t, 0)
        print(f"| {t} tier hits, blocks | {hits(real)} | {hits(sims['same'])} | | {hits(sims['next'])} | |")
    # Decode workers' refusals of a reservation (no room) and the router's waits for room.
    sim = lambda n, k: sims[n]["simulation"].get(k, 0)
    print(f"| decode refusals | {cal['same']['refusals']} | {sim('same', 'refusals')} | | {sim('next', 'refusals')} | |")
    print(f"| store hits, blocks | {cal['same']['store_hits']} | {sim('same', 'store_hits')} | | {sim('next', 'store_hits')} | |")
    print(f"| admission holds | {cal['same']['holds']} | {sim('same', 'admission_holds')} | | {sim('next', 'admission_holds')} | |")
    # Where the TTFT went (means, ms; the router's phases, and the simulator's of its own).
    real_ph = cal["same"]["phases"]
    for p in PHASES:
        r = real_ph[p]
        cells = ""
        for n in ["same", "next"]:
            c = sims[n]["simulation"]["ttft_phase_seconds"].get(p, {"count": 0, "sum": 0.0})
            v = 1e3 * c["sum"] / c["count"] if c["count"] else 0.0
            cells += f" {v:.1f} | {100 * (v - r) / r if r else 0.0:+.1f}% |"
        print(f"| TTFT phase {p}, mean ms | {r:.1f} |{cells}")

if __name__ == "__main__":
    main()
