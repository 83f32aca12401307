#!/usr/bin/env bash
# The planner against the cheapest static fleets on the whole conversation trace (issue 36,
# acceptance 1 and 2): `tandem plan` on the sim_cluster.sh cluster with both pools autoscaled
# (prefill 10–512 from 400, decode 10–128 from 50, tick 1 s, cooldown and window 10 s, the
# `command` actuator; a replica serves 20 s after it is asked for), TTFT p90 ≤ 3 s, ITL p90 ≤
# 100 ms for 90% of requests, time x 0.04.
#   cargo build --release && scripts/plan_trace.sh [--planner-only] OUT.json [--rate-profile day]
# --planner-only: only the planner's run (`tandem simulate` on the same file), no static search.
# START_UP_MS: the replicas' start-up instead of 20000. ADMISSION_MS: the decode pool's
# admission_p90_ms (default: a quarter of the TTFT target, 750 ms).
set -euo pipefail
cd "$(dirname "$0")/.."
only=
if [ "${1:-}" = --planner-only ]; then only=1; shift; fi
out=$1
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
scripts/sim_cluster.sh "$dir/cluster.toml" 400 50 8192
autoscale() {
  printf '[%s.slo]\n%s\n[%s.autoscale]\nmin = 10\nmax = %s\ntick_ms = 1000\n' "$1" "$2" "$1" "$3"
  printf 'cooldown_ms = 10000\nwindow_ms = 10000\nactuator = "command"\ncommand = "true"\n'
}
nl=$'\n'
# The pools' sections end the file in order: append each one's SLO and autoscaling after it.
python3 - "$dir/cluster.toml" "$(autoscale prefill 'ttft_p90_ms = 3000' 512)" \
  "$(autoscale decode "itl_p90_ms = 100${ADMISSION_MS:+${nl}admission_p90_ms = $ADMISSION_MS}" 128)" <<'PY'
import sys
path, prefill, decode = sys.argv[1:]
text = open(path).read().replace("[decode]\n", prefill + "\n[decode]\n", 1) + decode + "\n"
open(path, "w").write(text)
PY
run=(--config "$dir/cluster.toml" --trace ../shared/traces/mooncake_conversation_trace.jsonl
  --requests 100000 --time-scale 0.04 --context-len 131072 --start-up-ms "${START_UP_MS:-20000}"
  --ttft-p90-ms 3000 --itl-p90-ms 100 --json "$out")
if [ -n "$only" ]; then
  ./target/release/tandem simulate "${run[@]}" "$@"
else
  ./target/release/tandem plan "${run[@]}" --max-replicas 512 "$@"
fi
