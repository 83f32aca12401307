#!/usr/bin/env bash
# The fault scenario of issue 17 (acceptance 4), simulated: the whole Mooncake conversation
# trace at time x 0.04 (its minute 20 is 48 s, minute 30 is 72 s) on 400 prefill + 25 decode
# mock workers (H200-like timings) over 10 racks; 10% of the decode workers die at 48 s (restarted
# after 20 s), rack 3's links run at 10% of their bandwidth from 72 s. Runs it without faults
# first, then with them, and plots both (attainment over time shows the dip and the recovery).
#   cargo build --release && scripts/sim_faults.sh [OUT.svg]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/plots/sim-faults.svg}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
scripts/sim_cluster.sh "$dir/cluster.toml" 400 25 8192
sim=(./target/release/tandem simulate --config "$dir/cluster.toml"
  --trace ../shared/traces/mooncake_conversation_trace.jsonl --requests 100000 --time-scale 0.04
  --context-len 131072 --racks 10 --start-up-ms 20000 --ttft-slo-ms 3000)
"${sim[@]}" --json "$dir/base.json"
"${sim[@]}" --fault kill:decode:10%@48s --fault link:rack3:10%@72s --json "$dir/fault.json" \
  --label "3 of 25 decode workers die at 48 s (back at 68 s); rack 3's links at 10% from 72 s" \
  --plot-with "no faults=$dir/base.json" --plot "$out"
