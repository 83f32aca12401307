#!/usr/bin/env python3
"""Writes tests/golden/gemma3_llamacpp.json: llama.cpp's tokenisation of a varied text set and
its logits over a golden prompt set for Gemma 3 270M (Q4_K_M GGUF), the reference of
tests/tests/engine_gemma3.rs.

    pip install llama-cpp-python==0.3.36      # builds llama.cpp from source
    tandem model fetch --model gemma3-270m
    python3 scripts/golden_gemma3.py [--model PATH] [--out tests/golden/gemma3_llamacpp.json]

Prompts are raw text (a base model, no chat template) of 6 to ~1,900 tokens: the longer ones
pass the 512-token sliding window of five layers in six. For each prompt llama.cpp evaluates the
prompt in one batch (logits at every position), then generates 24 tokens greedily one by one;
the file keeps the top two logits at every position of both, which is what the test compares
(teacher-forced argmax where llama.cpp's top-two margin exceeds 0.3). It also runs the whole
sequence again one token at a time and keeps that run's top two: llama.cpp's batched and
incremental runs disagree with each other at some positions, by margins above 0.3 on the long
CSV table, and the test needs to know where llama.cpp's own answer is unstable.
"""
import argparse
import json
import os

import numpy as np
from llama_cpp import Llama, __version__ as llama_cpp_version

NEW_TOKENS = 24

PROSE = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
    "and a rag. For thirty years he had trimmed the wick and polished the great lens, and in all "
    "that time the light had never once failed. Ships passing the headland in winter storms "
    "counted on it, though few of their sailors ever knew his name.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant "
    "cells, chlorophyll absorbs mostly red and blue light, and the energy drives the splitting "
    "of water into oxygen, protons and electrons. The electrons pass along a chain of proteins, "
    "and the plant stores their energy in sugars built from carbon dioxide taken from the air.",
    "When the committee met on Tuesday, the first item on the agenda was the budget for the new "
    "library wing. The architect presented three designs: a glass pavilion facing the park, a "
    "brick extension matching the old building, and a smaller timber structure that could be "
    "finished a year earlier. After two hours of discussion the members voted for the brick one.",
    "Rivers shape the land they cross. Over thousands of years a river cuts its valley deeper, "
    "carries sand and gravel downstream, and lays them down where the current slows: on the "
    "inside of bends, in lakes, and finally in the delta where it meets the sea. A flood can "
    "move more material in a day than the river moves in an ordinary year.",
    "The recipe calls for two cups of flour, one teaspoon of salt, a spoonful of sugar and a "
    "packet of dried yeast. Mix them in a large bowl, add warm water a little at a time, and "
    "knead the dough for ten minutes until it is smooth and elastic. Leave it covered in a warm "
    "place for an hour, then shape the loaf and bake it at two hundred degrees for forty minutes.",
]

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        have = self.items.get(name, 0)
        if count > have:
            raise ValueError(f"only {have} of {name} in stock")
        self.items[name] = have - count

    def total(self):
        return sum(self.items.values())
'''


def table(rows):
    cities = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Perth", "Quebec", "Tunis", "Hanoi", "Bergen"]
    lines = ["id,city,year,population,rainfall_mm"]
    for i in range(rows):
        c = cities[(i * 7) % len(cities)]
        lines.append(f"{i + 1},{c},{1950 + (i * 3) % 70},{(i * 7919) % 900000 + 10000},{(i * 37) % 1900 + 100}")
    return "\n".join(lines) + "\n"


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The numbers 12345 and 67890 add up to",
    PROSE[0] + " One night, however,",
    " ".join(PROSE) + "\n\nIn summary, the five paragraphs above describe",
    "\n\n".join(PROSE) + "\n\n" + CODE + "\n\n# Example:\nprint(merge_intervals([[1, 3], [2, 6], [8, 10]]))\n# Output:",
    table(80) + "\nThe city in row 7 is",
]

TEXTS = [
    "",
    "Hello world",
    " leading space",
    "trailing space ",
    "two  spaces,   three,    four",
    "tabs\tand\t\ttwo tabs",
    "new\nline and\n\ntwo and\n\n\n\nfour",
    "mixed \n \t \n  whitespace",
    "Digits 0 1 12 123 1234 12345 3.14159 -42 1e10 2026-12-01",
    "Ünïcödé: café, naïve, Straße, Ærøskøbing",
    "中文测试：你好，世界。日本語のテキスト。한국어 문장.",
    "Emoji: 🚀🔥👍🏽 and 🇫🇷",
    "Greek αβγδ, Cyrillic привет, Arabic مرحبا, Hebrew שלום",
    "Rare: \u0001\u0002 control, \ue000 private use, \U0001f9ff nazar, \u2581 lower block",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<div class=\"x\"><span>html</span></div><br/>",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "camelCaseIdentifier snake_case_name SCREAMING_CASE kebab-case",
    "    indented code:\n        return x ** 2  # comment\n",
    "Ellipsis… dashes – — quotes “double” ‘single’ «guillemets»",
    "<bos>literal bos and <eos> and <unused0> and <unk>",
]


def default_model():
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "tandem", "models", "gemma-3-270m-q4_k_m.gguf")


def top2(row):
    order = np.argsort(-row, kind="stable")[:2]
    return [[int(i), float(row[i])] for i in order]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("TANDEM_GEMMA3") or default_model())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden", "gemma3_llamacpp.json"))
    args = ap.parse_args()
    llm = Llama(model_path=args.model, n_ctx=2304, n_threads=2, n_batch=512, logits_all=True, verbose=False)

    out = {"llama_cpp_python": llama_cpp_version, "model": os.path.basename(args.model), "new_tokens": NEW_TOKENS}
    out["texts"] = [{"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=True, special=True)} for t in TEXTS]
    cases, worst, mism = [], 0.0, []
    for text in PROMPTS:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        prompt_top = [top2(np.array(llm.scores[i], dtype=np.float64)) for i in range(len(ids))]
        gen, gen_top = [], []
        for _ in range(NEW_TOKENS):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            gen_top.append(top2(row))
            gen.append(gen_top[-1][0][0])
            llm.eval([gen[-1]])
        # llama.cpp against itself: the whole sequence again, one token at a time.
        seq = ids + gen[:-1]
        top = prompt_top + gen_top[1:]
        llm.reset()
        for t in seq:
            llm.eval([t])
        other = [top2(np.array(llm.scores[i], dtype=np.float64)) for i in range(len(seq))]
        for st, o in zip(top, other):
            worst = max(worst, abs(st[0][1] - o[0][1]) if st[0][0] == o[0][0] else worst)
            if st[0][0] != o[0][0]:
                mism.append(st[0][1] - st[1][1])
        # top[i] predicts token i + 1 of prompt_ids + generated; `other` is the same position
        # computed token by token (where the two disagree, llama.cpp's own argmax is unstable).
        cases.append({"text": text, "prompt_ids": ids, "generated": gen, "top": top, "top_incremental": other})
        print(f"{len(ids)} tokens: ...{text[-40:]!r} -> {llm.detokenize(gen).decode('utf-8', 'replace')!r}")
    out["cases"] = cases
    out["self_check"] = {"max_logit_diff": worst, "argmax_mismatch_margins": sorted(mism)}
    print("llama.cpp batch vs incremental:", out["self_check"])
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
