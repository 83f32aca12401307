#!/usr/bin/env bash
# The simulator at scale (issue 17, acceptance 2): the whole Mooncake conversation trace
# (12,031 requests over about an hour, time x 0.02 so that its load fits) on a cluster of
# 500 prefill + 500 decode mock workers with H200-like timings; prints the report and the wall
# time the simulation took (its "simulated ... in N s" line).
#   cargo build --release && scripts/sim_scale.sh [extra tandem simulate flags]
# (TANDEM_EXE=path runs another build of tandem, e.g. to compare before and after.)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
scripts/sim_cluster.sh "$dir/cluster.toml" 500 500 16384
time "${TANDEM_EXE:-./target/release/tandem}" simulate --config "$dir/cluster.toml" \
  --trace ../shared/traces/mooncake_conversation_trace.jsonl --requests 100000 \
  --time-scale 0.02 --context-len 131072 "$@"
