#!/usr/bin/env bash
# Copies what ctitan's build needs beyond a PyTorch + CMake + compiler image — toml11,
# spdlog + fmt, sentencepiece, GoogleTest, PCRE2, ICU (uc, data), zlib headers, Gloo's headers —
# out of this machine's Debian 12 packages into build-deps/usr (the /usr layout kept, so the
# packages' CMake configs find themselves), for a machine with no Debian packages and no
# network: the GPU machine (scripts/gpu_check.sh uses it). build-deps/ is git-ignored and
# travels with the working tree (the device tool's `carry`: 64 MiB at most, checked below).
#   scripts/vendor_build_deps.sh            # (re)creates build-deps/
# Needs the Debian packages scripts/install_deps.sh installs. Documentation, static libraries
# other than GoogleTest's and the other ICU libraries are left out.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${CTITAN_BUILD_DEPS:-$ROOT/build-deps}"
PACKAGES=(libtoml11-dev libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libsentencepiece-dev libsentencepiece0
          libgtest-dev libpcre2-dev libpcre2-8-0 libicu-dev libicu72 zlib1g-dev zlib1g libgloo-dev)
rm -rf "$OUT"
mkdir -p "$OUT"
n=0
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    { echo "vendor_build_deps: Debian package $p is not installed (scripts/install_deps.sh)" >&2; exit 1; }
  while IFS= read -r f; do
    [[ -f "$f" || -L "$f" ]] || continue
    case "$f" in
      /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/* | /usr/bin/*) continue ;;
      */libgtest*.a | */libgmock*.a) ;;                  # GoogleTest: static libraries only
      *.a) continue ;;
      */libicu*) [[ "$f" =~ /libicu(uc|data)\.so ]] || continue ;;
      */libpcre2-*) [[ "$f" =~ libpcre2-8\.so|pcre2\.h|libpcre2-8\.pc ]] || continue ;;
    esac
    mkdir -p "$OUT$(dirname "$f")"
    cp -a "$f" "$OUT$f"
    n=$((n + 1))
  done < <(dpkg -L "$p")
done
# cuda_runtime.h's crt/ and cuda_fp16.h's nv/ headers (the nvidia-cuda-crt and -cccl wheels, which
# PyTorch's CUDA wheel does not depend on): in case the GPU image's PyTorch lacks them too
# (cmake/torch_cuda.cmake looks in build-deps/cuda/include). From .venv-cuda (scripts/test_cuda.sh).
CUDA_INC="$(ls -d "$ROOT"/.venv-cuda/lib/python3*/site-packages/nvidia/cu13/include 2>/dev/null | head -1 || true)"
if [[ -n "$CUDA_INC" && -f "$CUDA_INC/crt/host_config.h" && -d "$CUDA_INC/nv" ]]; then
  mkdir -p "$OUT/cuda/include"
  cp -a "$CUDA_INC/crt" "$CUDA_INC/nv" "$OUT/cuda/include/"
else
  echo "vendor_build_deps: no crt/ and nv/ headers in .venv-cuda (run scripts/test_cuda.sh first); left out" >&2
fi
size_kib=$(du -sk "$OUT" | cut -f1)
echo "vendor_build_deps: $n files, $((size_kib / 1024)) MiB in $OUT" >&2
if ((size_kib > 60 * 1024)); then
  echo "vendor_build_deps: $((size_kib / 1024)) MiB is more than the 60 MiB left for it beside the working tree" >&2
  exit 1
fi
