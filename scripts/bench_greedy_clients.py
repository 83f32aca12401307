"""Greedy clients against a running batch (RELIABILITY.md, "Slow and greedy clients").

A colocated cluster on the real default model is started with `tandem up`. STREAMS streamed
completions run (the batch whose inter-token latency is measured), first alone (quiet), then
while 50 clients at once send 8-MiB prompts (half just over the body limit, half just under it)
and one client asks for output matching a pathological JSON schema. Prints the streams' ITL
p50/p99 in both runs and the ratio, what the greedy requests got (status counts), and whether
any worker was marked stalled or any request migrated (router metrics).

    python3 scripts/bench_greedy_clients.py [--streams 4] [--tokens 96]
"""
import argparse
import http.client
import json
import threading
import time

import tandem_cluster

CONFIG = tandem_cluster.colocated("kv_blocks = 1024\nmax_batch_tokens = 256\n")

# A schema whose pattern's automaton grows exponentially (the n-th symbol from the end is
# fixed), nested arrays, and wide alternatives.
PATHOLOGICAL = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "pattern": "^(a|b)*a(a|b){40}$"},
        "b": {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {
            "anyOf": [{"type": "string", "pattern": f"^x{{{i}}}y$"} for i in range(1, 200)]}}}},
    },
    "required": ["a", "b"],
}


def post(addr, body, timeout=120):
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        try:
            c.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        except BrokenPipeError:
            pass  # the router answered (413) before the body was all sent: read its answer
        r = c.getresponse()
        r.read()
        return r.status
    except OSError as e:
        return type(e).__name__
    finally:
        c.close()


def stream(addr, tokens, gaps):
    """One streamed completion; appends its inter-token gaps (s) to `gaps`."""
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    last = None
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
    c.close()


def batch(addr, n, tokens):
    gaps = []
    ts = [threading.Thread(target=stream, args=(addr, tokens, gaps)) for _ in range(n)]
    for t in ts:
        t.start()
    return ts, gaps




def metric(addr, prefix):
    host, port = tandem_cluster.operator(addr).rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(prefix))


def watch_stalls(addr, stop, seen):
    """Polls /debug/workers every 200 ms; records the names of workers marked stalled."""
    while not stop.is_set():
        for w in tandem_cluster.get_json(addr, "/debug/workers")["workers"]:
            if w.get("stalled"):
                seen.add(w["name"])
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args()
    over = json.dumps({"prompt": "hello " * ((8 << 20) // 6 + 1), "max_tokens": 4}).encode()
    under = json.dumps({"prompt": "hello " * ((8 << 20) // 6 - 64), "max_tokens": 4}).encode()
    with tandem_cluster.cluster(CONFIG, prefix="tandem-greedy-") as (addr, _):
        ts, _ = batch(addr, a.streams, 8)  # warm up
        for t in ts:
            t.join()
        ts, quiet = batch(addr, a.streams, a.tokens)
        for t in ts:
            t.join()
        stop, stalled = threading.Event(), set()
        watcher = threading.Thread(target=watch_stalls, args=(addr, stop, stalled))
        watcher.start()
        migrated0 = metric(addr, 'tandem_router_request_phases_total{phase="migrating"}')
        ts, loud = batch(addr, a.streams, a.tokens)
        time.sleep(1.0)  # the batch is running
        results = []
        greedy = [threading.Thread(target=lambda b=b: results.append(post(addr, b)))
                  for b in [over] * 25 + [under] * 25]
        schema = {"prompt": "JSON:", "max_tokens": 16,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PATHOLOGICAL}}}
        greedy.append(threading.Thread(target=lambda: results.append(("schema", post(addr, schema)))))
        t0 = time.monotonic()
        for g in greedy:
            g.start()
        for g in greedy:
            g.join()
        greedy_s = time.monotonic() - t0
        for t in ts:
            t.join()
        stop.set()
        watcher.join()
        counts = {}
        for r in results:
            counts[str(r)] = counts.get(str(r), 0) + 1
        pct = tandem_cluster.pct
        q50, q99, l50, l99 = pct(quiet, 50), pct(quiet, 99), pct(loud, 50), pct(loud, 99)
        print(f"{a.streams} streams x {a.tokens} tokens: quiet ITL p50 {q50*1000:.1f} ms p99 {q99*1000:.1f} ms; "
              f"with the greedy clients p50 {l50*1000:.1f} ms p99 {l99*1000:.1f} ms (p99 ratio {l99/q99:.2f})")
        print(f"greedy requests answered in {greedy_s:.1f} s: {counts}")
        migrated = metric(addr, 'tandem_router_request_phases_total{phase="migrating"}') - migrated0
        print(f"workers marked stalled: {sorted(stalled) or 'none'}; migrations {migrated:+.0f}")


if __name__ == "__main__":
    main()
