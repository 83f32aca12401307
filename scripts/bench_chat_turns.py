#!/usr/bin/env python3
"""Prefix cache on the real CPU engine (issue 12, acceptance 5): an 8-turn chat through a
disaggregated cluster (1 prefill + 1 decode worker); each turn's time to first token beside the
same prompt sent to the same cluster with `prefix_cache = false` (cold), side by side in one run.

Each turn's prompt is the whole conversation so far (the chat template's rendering of every
earlier message and answer), so turn k repeats turn k-1's prompt and answer: with the cache,
the prefill worker computes only what it has not seen and the decode worker is sent only the
blocks it lacks. TTFT is measured by the client, from sending to the first streamed token.

    cargo build --release && python3 scripts/bench_chat_turns.py [--conversations 3]
"""
import argparse
import contextlib
import http.client
import json
import statistics
import time

from tandem_cluster import cluster, worker_stats

TOPICS = ["rivers", "bridges", "volcanoes", "libraries", "bicycles", "forests", "harbours", "clocks"]


def config(cache):
    pools = f"threads = 1\nkv_blocks = 1024\nmax_batch_tokens = 512\nprefix_cache = {str(cache).lower()}\n"
    return ('[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'
            f"[prefill]\nreplicas = 1\n{pools}[decode]\nreplicas = 1\n{pools}"
            '[kv_transfer]\nprefer = ["tcp"]\n')


def chat(addr, messages):
    """Streams one chat completion; returns (TTFT seconds, answer text)."""
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": 48, "stream": True})
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    ttft, text = None, ""
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        if delta and ttft is None:
            ttft = time.perf_counter() - t0
        text += delta
    c.close()
    return ttft, text


def prefill_counts(addr):
    """The prefill worker's (prompt tokens, prefix-cache hit tokens) since it started."""
    s = next(s for _, role, s in worker_stats(addr) if role == "prefill")
    return s["prompt_tokens"], s["prefix_hit_tokens"]


def turn_text(conv, k):
    topic = TOPICS[(conv + k) % len(TOPICS)]
    return (f"Turn {k}. Tell me three short facts about {topic}, then one sentence on how "
            f"{topic} changed between the years 1800 and 1900, and end with a question for me. "
            "Keep every fact under twenty words and do not repeat earlier answers. " * 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=8)
    a = ap.parse_args()
    rows = []
    with contextlib.ExitStack() as stack:
        warm, _ = stack.enter_context(cluster(config(True), "tandem-chat-"))
        cold, _ = stack.enter_context(cluster(config(False), "tandem-chat-"))
        for conv in range(a.conversations):
            messages, ttfts = [], []
            for k in range(a.turns):
                messages.append({"role": "user", "content": turn_text(conv, k)})
                before = prefill_counts(warm)
                t, answer = chat(warm, messages)
                after = prefill_counts(warm)
                ttfts.append(t)
                last = list(messages)
                messages.append({"role": "assistant", "content": answer})
            cold_t, _ = chat(cold, last)
            prompt, hit = after[0] - before[0], after[1] - before[1]
            rows.append((ttfts, cold_t))
            print(f"conversation {conv}: warm TTFT by turn (ms) "
                  + " ".join(f"{t * 1e3:.0f}" for t in ttfts)
                  + f"; last prompt cold {cold_t * 1e3:.0f} ms "
                  + f"= {ttfts[-1] / cold_t:.0%} of cold; the last turn's prefill computed "
                  + f"{prompt - hit} of {prompt} prompt tokens ({(prompt - hit) / prompt:.0%})")
    ratios = [r[0][-1] / r[1] for r in rows]
    print(f"last turn's TTFT over the cold TTFT of the same prompt: median {statistics.median(ratios):.0%}, "
          f"worst {max(ratios):.0%} ({len(rows)} conversations of {a.turns} turns)")


if __name__ == "__main__":
    main()
