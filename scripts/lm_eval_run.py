"""lm-evaluation-harness against a tandem cluster (issue 15, acceptance 2).

Starts a cluster (one prefill and one decode worker on the default SmolLM2 model), writes a
small multiple-choice task of its own (this machine cannot fetch the harness's datasets from
the Hugging Face hub; the items are generated here: arithmetic, sequences, capitals,
opposites), and runs `lm_eval --model local-completions` on it: loglikelihood requests, i.e.
`/v1/completions` with `echo` and `logprobs`, the tokens counted through the router's
`/tokenize` (the harness's `remote` tokenizer backend). Prints the harness's table, the
router's decisions by reason and what the harness sent.

    pip install lm-eval==0.4.13 && cargo build --release
    python3 scripts/lm_eval_run.py [--limit N]
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile

from tandem_cluster import cluster, get_json

CONFIG = ('[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\noperator = "127.0.0.1:0"\n'
          "[prefill]\nreplicas = 1\nthreads = 1\nkv_blocks = 512\n"
          "[decode]\nreplicas = 1\nthreads = 1\nkv_blocks = 1024\n"
          '[kv_transfer]\nprefer = ["tcp"]\n')

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
            ("Japan", "Tokyo"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Greece", "Athens"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Norway", "Oslo"),
            ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Ireland", "Dublin"),
            ("China", "Beijing"), ("England", "London"), ("Canada", "Ottawa"),
            ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"), ("Finland", "Helsinki"),
            ("Denmark", "Copenhagen"), ("Hungary", "Budapest"), ("Thailand", "Bangkok")]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"),
             ("fast", "slow"), ("happy", "sad"), ("old", "young"), ("open", "closed"),
             ("light", "dark"), ("early", "late"), ("full", "empty"), ("hard", "soft"),
             ("rich", "poor"), ("strong", "weak"), ("wet", "dry"), ("high", "low")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]


def items(rng):
    """(question, choices, index of the right one): ~300 items."""
    out = []
    for a in range(1, 10):
        for b in range(1, 10):
            right = a + b
            wrong = rng.sample([n for n in range(2, 19) if n != right], 3)
            out.append((f"Question: What is {a} plus {b}?\nAnswer:", [right] + wrong))
    for seq in (DAYS, MONTHS):
        for i in range(len(seq) - 2):
            wrong = rng.sample([s for s in seq if s != seq[i + 2]], 3)
            out.append((f"{seq[i]}, {seq[i + 1]},", [seq[i + 2]] + wrong))
    for i in range(20):
        letters = [chr(65 + i + k) for k in range(3)]
        wrong = rng.sample([chr(c) for c in range(65, 91) if chr(c) != chr(68 + i)], 3)
        out.append((", ".join(letters) + ",", [chr(68 + i)] + wrong))
    for country, city in CAPITALS:
        wrong = rng.sample([c for _, c in CAPITALS if c != city], 3)
        out.append((f"The capital of {country} is", [city] + wrong))
    for word, opp in OPPOSITES:
        wrong = rng.sample([o for _, o in OPPOSITES if o != opp], 3)
        out.append((f"The opposite of {word} is", [opp] + wrong))
    docs = []
    for q, choices in out:
        choices = [str(c) for c in choices]
        right = choices[0]
        rng.shuffle(choices)
        docs.append({"question": q, "choices": choices, "label": choices.index(right)})
    return docs


TASK = """task: tandem_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=0, help="items to run (0: all)")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="tandem-lmeval-")
    data = os.path.join(d, "tandem_facts.jsonl")
    docs = items(random.Random(0))
    with open(data, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in docs)
    with open(os.path.join(d, "tandem_facts.yaml"), "w") as f:
        f.write(TASK.format(data=data))
    with cluster(CONFIG, prefix="tandem-lmeval-cluster-") as (addr, _):
        model = get_json(addr, "/v1/models")["data"][0]["id"]
        cmd = ["lm_eval", "--model", "local-completions", "--tasks", "tandem_facts",
               "--include_path", d, "--output_path", os.path.join(d, "out"),
               "--model_args",
               f"model={model},base_url=http://{addr}/v1/completions,tokenizer_backend=remote,"
               "num_concurrent=1,max_retries=1"]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        print("$", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, text=True, capture_output=True)
        print(r.stdout)
        if r.returncode != 0:
            print(r.stderr[-4000:], file=sys.stderr)
            sys.exit(r.returncode)
        metrics = subprocess.run(["curl", "-s", f"http://{addr.operator}/metrics"], text=True,
                                 capture_output=True).stdout
        for line in metrics.splitlines():
            if re.match(r"tandem_router_(prefill_decisions|requests)_total", line):
                print(line)
    print(f"items: {len(docs) if not args.limit else args.limit}; task files in {d}")


if __name__ == "__main__":
    main()
