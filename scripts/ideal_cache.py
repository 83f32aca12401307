#!/usr/bin/env python3
"""The floor of computed prompt tokens for a Mooncake-format trace (issue 12): every request's
prompt goes through one ideal LRU cache of the cluster's total KV size with perfect placement —
as if every worker's cache were one and every request landed where its prefix is. Prompts are
built exactly as `tandem bench load` builds them (each trace hash id a run of
512 x length-scale tokens, the rest unique to the request), in KV blocks of --block-size
tokens; a request can reuse at most all but its last prompt token, as the engines do.

    python3 scripts/ideal_cache.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --requests 400 --length-scale 0.05 --capacity-blocks 8192

Prints the prompt tokens sent, the floor of those computed, and the prefix-hit ratio at the
floor; with --json FILE writes them too. Put a measured `computed_prompt_ratio` from
`tandem bench load --json` beside the floor's.
"""
import argparse
import collections
import json


def prompts(path, requests, length_scale):
    block = max(1, round(512 * length_scale))
    with open(path) as f:
        lines = [l for l in f if l.strip()][:requests]
    for n, line in enumerate(lines):
        v = json.loads(line)
        size = max(1, round(v["input_length"] * length_scale))
        # A token is (trace block, offset): equal exactly when `tandem bench load`'s are.
        p = [(h, i) for h in v.get("hash_ids", []) for i in range(block)][:size]
        p += [("tail", n, i) for i in range(size - len(p))]
        yield p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--length-scale", type=float, default=1.0)
    ap.add_argument("--capacity-blocks", type=int, required=True,
                    help="KV blocks of the whole cluster (the sum of every worker's kv_blocks)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    bs = a.block_size
    lru = collections.OrderedDict()  # block name -> None, least recently used first
    sent = computed = 0
    seen = set()  # every block name: the working set an infinite cache would hold
    for p in prompts(a.trace, a.requests, a.length_scale):
        names, parent = [], None
        for i in range(len(p) // bs):
            parent = hash((parent, tuple(p[i * bs:(i + 1) * bs])))
            names.append(parent)
        usable = (len(p) - 1) // bs
        hit = 0
        while hit < usable and names[hit] in lru:
            hit += 1
        sent += len(p)
        computed += len(p) - hit * bs
        seen.update(names)
        for name in names:
            lru[name] = None
            lru.move_to_end(name)
        while len(lru) > a.capacity_blocks:
            lru.popitem(last=False)
    out = {
        "requests": a.requests, "length_scale": a.length_scale, "block_size": bs,
        "capacity_blocks": a.capacity_blocks, "prompt_tokens_sent": sent,
        "floor_computed_tokens": computed,
        "floor_computed_ratio": computed / max(sent, 1),
        "floor_prefix_hit_ratio": (sent - computed) / max(sent, 1),
        "working_set_blocks": len(seen),
    }
    print(f"{a.requests} requests, {sent} prompt tokens sent; ideal cache of {a.capacity_blocks} "
          f"blocks computes at least {computed} ({out['floor_computed_ratio']:.1%}); "
          f"prefix-hit ratio at most {out['floor_prefix_hit_ratio']:.1%}; working set {len(seen)} blocks")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
