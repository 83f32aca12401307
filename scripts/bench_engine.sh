#!/usr/bin/env bash
# Side-by-side engine benchmark: tandem and llama.cpp on the same GGUF, threads and workload,
# run one after the other in the same session. Needs `pip install llama-cpp-python==0.3.36`.
#   scripts/bench_engine.sh [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
cargo build --release --quiet
model=$(./target/release/tandem model fetch)
echo "== machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
for round in 1 2; do
  echo "== round $round: tandem"
  ./target/release/tandem bench engine --model "$model" --threads "$threads" 2>/dev/null
  echo "== round $round: llama.cpp"
  python3 scripts/bench_llamacpp.py --model "$model" --threads "$threads" 2>/dev/null
done
