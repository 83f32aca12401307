#!/usr/bin/env bash
# GPU check (issue 6): the GPU suite (every CUDA kernel against the CPU kernels; the whole model
# and the engine on cuda:0 against the CPU engine on the golden prompts), the GPU benchmark, and
# a chat through `tandem generate --device cuda:0`, with a summary.
#
# The GPU machines have no Rust toolchain and no network, so the work is split:
#
#   scripts/gpu-check.sh prepare   # here: builds the binaries (--features cuda), packs them and
#                                  # the model into .gpu/ (ignored by git), in parts that each fit
#                                  # one device call's 64 MiB, and prints the calls to make
#   scripts/gpu-check.sh run       # there, from the repository root: unpacks, runs, summarises
#
# `run` also works on a machine with a Rust build of its own (then `prepare` is not needed: it
# takes the binaries from target/release), and it is rehearsed without a GPU on the CUDA
# emulator: `scripts/gpu-check.sh rehearse` (a test double: it proves the script, not the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
carry=.gpu
part=44M   # the model's first part rides with the packed binaries, the rest alone

# The four executables the check runs, built here (--features cuda), as "name path" lines.
executables() {
  local json='import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
  {
    cargo test --release --features cuda --no-run --message-format=json -p kernels --test cuda
    cargo test --release --features cuda --no-run --message-format=json -p tandem-tests --test gpu_model
    cargo bench --features cuda --no-run --message-format=json -p tandem-tests --bench gpu
    cargo build --release --features cuda --message-format=json --bin tandem
  } 2>/dev/null | python3 -c "$json"
}

# Copies them into $1.
collect() {
  mkdir -p "$1"
  executables | while read -r name path; do
    case "$name" in cuda | gpu_model | gpu | tandem) cp "$path" "$1/$name" ;; esac
  done
}

prepare() {
  set -e
  rm -rf "$carry" && mkdir -p "$carry/bin" "$carry/1" "$carry/2"
  collect "$carry/bin"
  strip "$carry"/bin/*
  tar -C "$carry" -czf "$carry/1/bin.tar.gz" bin
  rm -rf "$carry/bin"
  model=$(cargo run --release --quiet -- model path 2>/dev/null || true)
  [ -f "$model" ] || model="$HOME/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  split -b "$part" -d "$model" "$carry/model.part-"
  mv "$carry/model.part-00" "$carry/1/"
  mv "$carry"/model.part-* "$carry/2/"
  (cd "$carry" && sha256sum "$model" | sed "s|  .*|  model.gguf|" >1/model.sha256)
  du -sh "$carry"/1 "$carry"/2
  cat <<EOF
Device calls (each within 64 MiB; the second must come while the machine is still warm):
  1. run(command="true", carry=["$carry/1"], timeout_s=60)
  2. run(command="scripts/gpu-check.sh run 2>&1 | tee \$OUT/gpu-check.log", carry=["$carry/2"], timeout_s=540)
EOF
}

libpaths() {
  local d p
  for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    "$HOME/.cache/tandem/nvrtc/lib"; do
    [ -d "$d" ] && p="${p:+$p:}$d"
  done
  # The image's Python packages carry libnvrtc and libcublas too.
  for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    for l in "$d"/nvidia/cu13/lib "$d"/nvidia/cuda_nvrtc/lib "$d"/nvidia/cublas/lib; do
      [ -d "$l" ] && p="${p:+$p:}$l"
    done
  done
  echo "${p:-}"
}

run() {
  local bin=$carry/bin
  if [ -f "$carry/1/bin.tar.gz" ]; then
    tar -C "$carry" -xzf "$carry/1/bin.tar.gz"
    if [ ! -f "$carry/2/model.part-01" ]; then
      echo "missing $carry/2: make the second device call while the first one's machine is warm"
      exit 2
    fi
    mkdir -p "$HOME/.cache/tandem/models"
    export TANDEM_MODEL="$HOME/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    cat "$carry"/1/model.part-* "$carry"/2/model.part-* >"$TANDEM_MODEL"
    (cd "$HOME/.cache/tandem/models" && sed "s|model.gguf|$TANDEM_MODEL|" "$OLDPWD/$carry/1/model.sha256" | sha256sum -c --quiet) ||
      { echo "the model's parts do not add up"; exit 2; }
  elif command -v cargo >/dev/null; then
    collect "$bin"
  else
    echo "no binaries: run 'scripts/gpu-check.sh prepare' on a machine with Rust, and carry $carry"
    exit 2
  fi
  local extra
  extra=$(libpaths)
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$extra"
  export TANDEM_GPU=1
  t0=$(date +%s)
  echo "== device"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  echo "== the GPU suite: kernels against the CPU kernels"
  out=$("$bin/cuda" --include-ignored --test-threads=1 --skip on_the_cuda_emulator 2>&1)
  rc=$?
  echo "== the whole model and the engine on cuda:0 against the CPU engine (golden prompts)"
  model=$("$bin/gpu_model" --include-ignored --test-threads=1 --skip on_the_cuda_emulator 2>&1)
  rc2=$?
  out="$out
$model"
  [ $rc -eq 0 ] && rc=$rc2
  echo "$out" | grep -E "^test |panicked|tolerance|emulator" | head -40
  echo "== benchmark (BENCHMARKS.md)"
  "$bin/gpu" --bench 2>&1 | grep -E "^\||device:|no GPU|error"
  echo "== chat on cuda:0"
  "$bin/tandem" generate --device cuda:0 --max-tokens 16 --chat 'What is the capital city of Germany?' 2>&1 | tail -3
  echo "== summary"
  echo "$out" | awk '/^test result:/ { p += $4; f += $6 } END { printf "GPU tests: %d passed, %d failed\n", p, f }'
  echo "elapsed: $(($(date +%s) - t0)) s"
  exit $rc
}

# `run` on the CUDA emulator (kernels/emu, a test double): checks this script end to end where
# no GPU is. Builds the emulator through its test, then runs with its libraries first.
rehearse() {
  local emu
  emu=$(cargo test --release -p kernels --features cuda --test cuda on_the_cuda_emulator \
    -- --nocapture 2>&1 | sed -n 's/^CUDA emulator: //p' | head -1)
  [ -d "$emu" ] || { echo "the emulator did not build: cargo test -p kernels --features cuda"; exit 2; }
  echo "rehearsing on the CUDA emulator in $emu (a test double, not a GPU)"
  export TANDEM_CUDA_EMU=1 LD_LIBRARY_PATH="$emu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  run
}

case "$mode" in
  prepare) prepare ;;
  run) run ;;
  rehearse) rehearse ;;
  *) echo "usage: scripts/gpu-check.sh [prepare|run|rehearse]"; exit 2 ;;
esac
