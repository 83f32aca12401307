"""Slow clients against the router's HTTP front (RELIABILITY.md, "Slow and greedy clients").

A cluster (one mock-engine decode worker, colocated) is started with `tandem up`. A normal
client sends REQUESTS completions one after another, first alone (quiet), then while ATTACKERS
connections from another address (127.0.0.2) trickle request headers one byte a second, each
reopened as soon as the router closes it. Throughout both runs `/health` is probed every 100 ms
(2-s deadline). Prints the normal client's latency p50/p99 in both runs, the ratio, the health
probes that failed, and how the router shed the attackers (connections refused at accept by
reason, from its /metrics).

    python3 scripts/bench_slow_clients.py [--attackers 2000] [--requests 200]
"""
import argparse
import asyncio
import http.client
import json
import resource
import threading
import time

import tandem_cluster

CONFIG = tandem_cluster.colocated("engine = \"mock\"\nkv_blocks = 1024\n")


def completion(addr):
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"prompt": "Hello there", "max_tokens": 4, "temperature": 0})
    t0 = time.monotonic()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    c.close()
    assert r.status == 200, r.status
    return time.monotonic() - t0


def run_client(addr, n):
    return sorted(completion(addr) for _ in range(n))




class Health(threading.Thread):
    """Probes /health every 100 ms until stopped; counts the probes that failed."""

    def __init__(self, addr):
        super().__init__(daemon=True)
        self.addr, self.stop, self.ok, self.failed, self.worst = addr, False, 0, 0, 0.0

    def run(self):
        host, port = self.addr.rsplit(":", 1)
        while not self.stop:
            t0 = time.monotonic()
            try:
                c = http.client.HTTPConnection(host, int(port), timeout=2)
                c.request("GET", "/health")
                status = c.getresponse().status
                c.close()
                self.ok += status == 200
                self.failed += status != 200
            except OSError:
                self.failed += 1
            self.worst = max(self.worst, time.monotonic() - t0)
            time.sleep(0.1)


async def trickler(addr, stop):
    host, port = addr.rsplit(":", 1)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" * 100
    while not stop.is_set():
        try:
            r, w = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
        except OSError:
            await asyncio.sleep(1)
            continue
        try:
            for b in head:
                if stop.is_set() or r.at_eof():
                    break
                w.write(bytes([b]))
                await w.drain()
                await asyncio.sleep(1)
        except (ConnectionError, OSError):
            pass
        w.close()
        await asyncio.sleep(1)


def attack(addr, n, stop):
    async def main():
        ev = asyncio.Event()
        tasks = [asyncio.create_task(trickler(addr, ev)) for _ in range(n)]
        while not stop.is_set():
            await asyncio.sleep(0.2)
        ev.set()
        for t in tasks:
            t.cancel()
    asyncio.run(main())


def refused(addr):
    host, port = tandem_cluster.operator(addr).rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=5)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return [l for l in text.splitlines() if l.startswith("tandem_router_connections_refused_total")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attackers", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=200)
    a = ap.parse_args()
    # The attackers' sockets, and the router's (tandem up's children inherit the limit).
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
    with tandem_cluster.cluster(CONFIG, prefix="tandem-slow-") as (addr, _):
        run_client(addr, 10)  # warm up
        health = Health(addr)
        health.start()
        quiet = run_client(addr, a.requests)
        stop = threading.Event()
        t = threading.Thread(target=attack, args=(addr, a.attackers, stop), daemon=True)
        t.start()
        time.sleep(15)  # the attackers connected and the first header deadlines passed
        loud = run_client(addr, a.requests)
        stop.set()
        t.join(timeout=30)
        health.stop = True
        health.join()
        pct = tandem_cluster.pct
        q50, q99, l50, l99 = pct(quiet, 50), pct(quiet, 99), pct(loud, 50), pct(loud, 99)
        print(f"normal client, {a.requests} requests: quiet p50 {q50*1000:.1f} ms p99 {q99*1000:.1f} ms; "
              f"with {a.attackers} slow clients p50 {l50*1000:.1f} ms p99 {l99*1000:.1f} ms "
              f"(p99 ratio {l99/q99:.2f})")
        print(f"/health: {health.ok} answered, {health.failed} failed, slowest {health.worst*1000:.0f} ms")
        print("router:", "; ".join(refused(addr)) or "no connection refused")


if __name__ == "__main__":
    main()
