#!/usr/bin/env python3
"""Share of time-to-first-token spent waiting for KV, with layer-wise streaming on and off.

Starts `tandem up` (1 prefill + 1 decode worker, TCP) twice, sends 2k-token prompts one at a
time, and reads each request's exposed KV wait (last layer computed -> decode worker's ack) from
the router's /debug/workers. TTFT is measured by this client.

    cargo build --release && python3 scripts/bench_kv_wait.py [--prompt-tokens 2048] [--requests 5]
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def run(layerwise, n_prompt, n_req):
    http, ctrl = free_port(), free_port()
    cfg = f"""
[router]
listen = "127.0.0.1:{http}"
control = "127.0.0.1:{ctrl}"
[prefill]
threads = 1
kv_blocks = 512
max_batch_tokens = 512
[decode]
threads = 1
kv_blocks = 512
[kv_transfer]
prefer = ["tcp"]
layerwise = {str(layerwise).lower()}
"""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
    proc = subprocess.Popen([os.path.join(ROOT, "target/release/tandem"), "up", "--config", f.name],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        while "tandem is up" not in (proc.stdout.readline() or "tandem is up"):
            pass
        base = f"http://127.0.0.1:{http}"
        ttfts, waits = [], []
        for r in range(n_req + 1):
            prompt = [(i * 7919 + r * 13 + 101) % 40000 + 100 for i in range(n_prompt)]
            body = json.dumps({"prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}).encode()
            req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req) as resp:
                ttft = None
                for line in resp:
                    if line.startswith(b"data: {") and ttft is None:
                        ttft = time.perf_counter() - t0
            ws = json.load(urllib.request.urlopen(base + "/debug/workers"))["workers"]
            compute_us, wait_us = next(w for w in ws if w["role"] == "prefill")["last_prefill_us"]
            if r > 0:  # the first request warms up connections
                ttfts.append(ttft)
                waits.append(wait_us / 1e6)
        return statistics.median(ttfts), statistics.median(waits)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        os.unlink(f.name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=5)
    a = ap.parse_args()
    print(f"| layer-wise | TTFT (median, s) | exposed KV wait (median, ms) | share of TTFT |")
    print(f"|---|---:|---:|---:|")
    for layerwise in (True, False):
        ttft, wait = run(layerwise, a.prompt_tokens, a.requests)
        print(f"| {'on' if layerwise else 'off'} | {ttft:.3f} | {wait * 1e3:.2f} | {100 * wait / ttft:.2f}% |")


if __name__ == "__main__":
    main()
