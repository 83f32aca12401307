#!/usr/bin/env bash
# GPU check (issue 6): builds the CUDA kernels, runs the GPU suite (each kernel against the CPU
# kernels) and prints a summary. One command on a GPU machine, from the repository root:
#
#   scripts/gpu-check.sh
#
# The machine needs an NVIDIA driver and libnvrtc (a CUDA toolkit, or the `nvidia-cuda-nvrtc`
# wheel's lib directory in ~/.cache/tandem/nvrtc/lib, which .ci/run fills). With no network
# there, build the test binaries beforehand (`cargo test --release -p kernels --features cuda
# --no-run`) and carry `target/`; this script then only runs them.
set -uo pipefail
cd "$(dirname "$0")/.."
nvrtc="$HOME/.cache/tandem/nvrtc/lib"
[ -d "$nvrtc" ] && export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
done
echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
t0=$(date +%s)
echo "== build"
for p in kernels tandem-tests; do
  cargo test --release -p $p --features cuda --no-run --offline 2>&1 | tail -1 \
    || cargo test --release -p $p --features cuda --no-run 2>&1 | tail -1
done
echo "== PTX for sm_80 / sm_90, and the GPU suite"
out=$(TANDEM_GPU=1 cargo test --release -p kernels --features cuda --offline --test ptx --test cuda -- --include-ignored 2>&1)
rc=$?
echo "== the whole model on the GPU against the CPU engine (golden prompts)"
model=$(TANDEM_GPU=1 cargo test --release -p tandem-tests --features cuda --offline --test gpu_model -- --include-ignored 2>&1)
rc2=$?
out="$out
$model"
[ $rc -eq 0 ] && rc=$rc2
echo "$out" | grep -E "^test |panicked|tolerance" | head -40
echo "== summary"
echo "$out" | awk '/^test result:/ { p += $4; f += $6 } END { printf "kernels on the GPU: %d passed, %d failed\n", p, f }'
echo "== benchmark (BENCHMARKS.md)"
cargo bench -p tandem-tests --features cuda --offline --bench gpu 2>&1 | grep -E "^\||device:|no GPU"
echo "elapsed: $(( $(date +%s) - t0 )) s"
echo "then: tandem generate --device cuda:0 --chat 'What is the capital city of Germany?' (a build with --features cuda)"
exit $rc
