#!/usr/bin/env python3
"""KV tiers on the real CPU engine (issue 34, acceptance 2): 16 interleaved conversations of 8
turns each through a disaggregated cluster (1 prefill + 1 decode worker) whose KV pools hold
about a quarter of the conversations' KV; the same turns sent, one request at a time and
alternately, to the same cluster with host-memory and disk tiers under the pools and to one
without (which evicts and computes again). Each turn's prompt is the whole conversation so far.

Reports the last turns' TTFT p50 of each, the tier hits that served them (the prefill worker's
blocks loaded from host memory and from disk), and whether every answer was identical.

    cargo build --release && python3 scripts/bench_tier_turns.py [--conversations 16] [--turns 8] \
        [--device cuda:0]
"""
import argparse
import contextlib
import statistics

from bench_chat_turns import chat
from tandem_cluster import cluster, worker_stats

TOPICS = ["rivers", "bridges", "volcanoes", "libraries", "bicycles", "forests", "harbours", "clocks",
          "glaciers", "lighthouses", "canals", "orchards", "deserts", "markets", "railways", "islands"]


def config(blocks, tiers, device):
    pool = f"threads = 1\nkv_blocks = {blocks}\nmax_batch_tokens = 512\ndevice = \"{device}\"\n"
    text = ('[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'
            f"[prefill]\nreplicas = 1\n{pool}")
    if tiers:
        text += '[prefill.kv_tiers]\nhost_bytes = 150_000_000\ndisk_path = "g3"\ndisk_bytes = 2_000_000_000\n'
    text += f"[decode]\nreplicas = 1\n{pool}"
    if tiers:
        text += '[decode.kv_tiers]\nhost_bytes = 150_000_000\ndisk_path = "g3"\ndisk_bytes = 2_000_000_000\n'
    # Each worker's tiers alone: no cluster store (tandem up would embed one with host tiers).
    return text + '[kv_transfer]\nprefer = ["tcp"]\n[store]\nembedded = false\n'


def turn_text(conv, k):
    topic = TOPICS[conv % len(TOPICS)]
    return (f"Conversation {conv}, turn {k}. Tell me three short facts about {topic} number {k}, then "
            f"one sentence on how {topic} changed between the years 1800 and 1900, and end with a "
            "question for me. Keep every fact under twenty words and do not repeat earlier answers.")


def counts(addr, role):
    s = next(s for _, r, s in worker_stats(addr) if r == role)
    return {k: s.get(k, 0) for k in ("prompt_tokens", "prefix_hit_tokens", "kv_host_hits", "kv_disk_hits",
                                     "kv_host_blocks", "kv_disk_blocks", "kv_tier_corrupt")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=240, help="KV blocks of each worker's pool")
    ap.add_argument("--device", default="cpu", help="every worker's device: cpu, or cuda:N")
    a = ap.parse_args()
    with contextlib.ExitStack() as stack:
        arms = {name: stack.enter_context(cluster(config(a.blocks, tiers, a.device), f"tandem-tier-turns-{name}-"))[0]
                for name, tiers in (("tiers", True), ("g1", False))}
        messages = {name: [[] for _ in range(a.conversations)] for name in arms}
        ttft = {name: [[] for _ in range(a.conversations)] for name in arms}
        same = total = 0
        for k in range(a.turns):
            last_round = counts(arms["g1"], "prefill")["prompt_tokens"]
            for conv in range(a.conversations):
                answers = {}
                for name, addr in arms.items():
                    m = messages[name][conv]
                    m.append({"role": "user", "content": turn_text(conv, k)})
                    t, answers[name] = chat(addr, m)
                    m.append({"role": "assistant", "content": answers[name]})
                    ttft[name][conv].append(t)
                same += answers["tiers"] == answers["g1"]
                total += 1
            print(f"turn {k}: TTFT p50 " + ", ".join(
                f"{name} {statistics.median(t[k] for t in ttft[name]) * 1e3:.0f} ms" for name in arms), flush=True)
        stats = {name: {role: counts(addr, role) for role in ("prefill", "decode")} for name, addr in arms.items()}
        # The last round's prompts are the whole conversations (all but their last answers).
        kv_tokens = stats["g1"]["prefill"]["prompt_tokens"] - last_round
    last = {name: statistics.median(t[-1] for t in ttft[name]) for name in arms}
    print(f"last turn's TTFT p50: tiers {last['tiers'] * 1e3:.0f} ms, g1 {last['g1'] * 1e3:.0f} ms = "
          f"{last['tiers'] / last['g1']:.0%} (target <= 40%); answers identical {same}/{total}")
    for name in arms:
        for role, s in stats[name].items():
            print(f"{name} {role}: prompt {s['prompt_tokens']} hit {s['prefix_hit_tokens']} "
                  f"({s['prefix_hit_tokens'] / max(s['prompt_tokens'], 1):.0%}); tier hits host {s['kv_host_hits']} "
                  f"disk {s['kv_disk_hits']}; held host {s['kv_host_blocks']} disk {s['kv_disk_blocks']}; "
                  f"corrupt {s['kv_tier_corrupt']}")
    print(f"the last turns' prompts: {kv_tokens} tokens in all, {kv_tokens / 16:.0f} blocks of 16 = "
          f"{kv_tokens / 16 / a.blocks:.1f}x a pool of {a.blocks} blocks")


if __name__ == "__main__":
    main()
