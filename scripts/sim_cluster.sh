#!/usr/bin/env bash
# Writes the mock cluster file the simulator scripts share: H200-like mock workers
# (preset h200-llama8b), KV-aware routing.
#   scripts/sim_cluster.sh OUT.toml PREFILL_REPLICAS DECODE_REPLICAS DECODE_KV_BLOCKS
set -euo pipefail
out=$1 prefill=$2 decode=$3 decode_blocks=$4
model=$(./target/release/tandem model path)
cat > "$out" <<TOML
[model]
path = "$model"
[router]
policy = "kv"
[prefill]
replicas = $prefill
engine = "mock"
kv_blocks = 16384
max_batch_tokens = 8192
[prefill.mock]
preset = "h200-llama8b"
[decode]
replicas = $decode
engine = "mock"
kv_blocks = $decode_blocks
max_batch_tokens = 8192
[decode.mock]
preset = "h200-llama8b"
TOML
