#!/usr/bin/env bash
# Builds the baseline of `PARTS=ab bench/perf.sh`: ctitan at e41dd51, the last commit built on
# Debian 12's LibTorch 1.13.1 (apt's libtorch-dev, which links Debian's oneDNN libdnnl.so.2),
# beside the current tree, which builds on PyTorch 2.13's wheel (.venv).
#
# Debian's libtorch is NOT installed system-wide: its headers in /usr/include and its libc10 /
# libtorch in /usr/lib would then be on every default search path, where the current build could
# pick them up instead of the wheel's. Instead its .debs (and those of its library dependencies
# this machine lacks) are unpacked with dpkg -x into a prefix of their own, the old commit is
# checked out with `git worktree` and built against that prefix, and its `train` carries a DT_RPATH
# into the prefix (DT_RPATH, unlike DT_RUNPATH, also serves the libraries libtorch itself loads:
# libdnnl.so.2, OpenCV, ...), so `$BUILD/train` runs as is, and nothing else sees the prefix.
#
#   bench/build_baseline_113.sh          # idempotent: skips the steps already done
#   CTITAN_BASELINE_PREFIX=/opt/x CTITAN_BASELINE_SRC=/tmp/y bench/build_baseline_113.sh
#   then: PARTS=ab BASELINE=<printed build folder> bench/perf.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
COMMIT="${CTITAN_BASELINE_COMMIT:-e41dd51}"
PREFIX="${CTITAN_BASELINE_PREFIX:-/opt/ctitan-libtorch113}"
SRC="${CTITAN_BASELINE_SRC:-/tmp/ctitan-$COMMIT}"
BUILD="$SRC/build"
DEBS="$PREFIX/debs"
LIB="$PREFIX/usr/lib/x86_64-linux-gnu"
JOBS="${JOBS:-2}"
log() { echo "[baseline] $*" >&2; }
secs() { echo "$(($(date +%s) - $1)) s"; }

# ---- 1. Debian's LibTorch 1.13 and the libraries it needs that are missing here, unpacked ----
if [[ ! -f "$PREFIX/.unpacked" ]]; then
  t0=$(date +%s)
  mkdir -p "$DEBS"
  # What `apt-get install libtorch-dev` would add on this machine (pinned versions), less the
  # data / -common / -bin packages no library loads. Saved, so a rerun downloads the same set.
  if [[ ! -s "$PREFIX/packages.txt" ]]; then
    apt-get install -s --no-install-recommends libtorch-dev |
      awk '/^Inst /{ v = $3; sub(/^\(/, "", v); print $2 "=" v }' |
      grep -Ev '^[^=]*-(data|common|bin|plugins)=' >"$PREFIX/packages.txt.tmp"
    mv "$PREFIX/packages.txt.tmp" "$PREFIX/packages.txt"
  fi
  want=()
  while read -r pv; do
    compgen -G "$DEBS/${pv%%=*}_*.deb" >/dev/null || want+=("$pv")
  done <"$PREFIX/packages.txt"
  if ((${#want[@]})); then
    log "downloading ${#want[@]} packages into $DEBS"
    # apt-get download as root warns that _apt cannot write here; let it.
    (cd "$DEBS" && { apt-get download -q "${want[@]}" ||
      { apt-get update -q && apt-get download -q "${want[@]}"; }; }) 2>&1 |
      { grep -v '^W: Download is performed unsandboxed' || true; } >&2
  fi
  log "download: $(secs "$t0"); unpacking $(wc -l <"$PREFIX/packages.txt") packages into $PREFIX"
  for d in "$DEBS"/*.deb; do dpkg -x "$d" "$PREFIX"; done
  # Absolute symlinks (e.g. /etc/alternatives/...) would lead out of the prefix: point them at
  # the prefix's copy when it has one.
  while read -r l; do
    tgt=$(readlink "$l")
    if [[ -e "$PREFIX$tgt" ]]; then ln -sfn "$PREFIX$tgt" "$l"; fi
  done < <(find "$PREFIX/usr" -type l -lname '/*')
  # CMake files naming /usr (glog's module path, ATen's include dir, ...) name the prefix instead.
  grep -rl --include='*.cmake' '"/usr/' "$LIB/cmake" | grep -v Modules_CUDA_fix |
    xargs -r sed -i "s|\"/usr/|\"$PREFIX/usr/|g"
  touch "$PREFIX/.unpacked"
  log "prefix ready in $(secs "$t0"): $(du -sh --exclude=debs "$PREFIX" | cut -f1) unpacked, $(du -sh "$DEBS" | cut -f1) of .debs"
fi
[[ -f "$LIB/cmake/Torch/TorchConfig.cmake" ]] || { log "no TorchConfig.cmake in $LIB"; exit 1; }

# ---- 2. The old commit, checked out beside the current tree ----
if [[ ! -d "$SRC/.git" && ! -f "$SRC/.git" ]]; then
  git -C "$ROOT" worktree add --detach "$SRC" "$COMMIT" >&2
fi

# ---- 3. Configure against the prefix only, and build the `train` perf.sh's ab part runs ----
# Every folder of the prefix holding shared libraries goes into the RPATH (not only libtorch's),
# then the system's (its libgomp, ...): DT_RPATH comes before LD_LIBRARY_PATH, so not even an
# LD_LIBRARY_PATH into the wheel swaps a library under the baseline.
RPATH="$(find "$PREFIX/usr/lib" -name '*.so.*' -printf '%h\n' | sort -u | paste -sd';');/usr/lib/x86_64-linux-gnu"
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  nice -n 10 cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCTITAN_BUILD_TESTS=OFF -DCTITAN_USE_CCACHE=OFF \
    -DTorch_DIR="$LIB/cmake/Torch" -DCMAKE_PREFIX_PATH="$PREFIX/usr" \
    -DCMAKE_BUILD_RPATH="$RPATH" -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags" >&2
fi
grep -q "^Torch_DIR:[A-Z]*=$LIB/cmake/Torch$" "$BUILD/CMakeCache.txt" ||
  { log "$BUILD is configured with another Torch_DIR"; exit 1; }
t0=$(date +%s)
nice -n 10 cmake --build "$BUILD" -j"$JOBS" --target train >&2
log "build: $(secs "$t0")"

# ---- 4. No leak: the baseline's libtorch / c10 / dnnl come from the prefix, all resolve, and
# nothing comes from the wheel even with the wheel's folders on LD_LIBRARY_PATH ----
wheel=$(compgen -G "$ROOT/.venv/lib/python3*/site-packages/torch/lib" || true)
deps=$(LD_LIBRARY_PATH="${wheel:+$wheel:}$ROOT/.venv/lib" ldd "$BUILD/train")
if grep -q 'not found' <<<"$deps"; then
  log "unresolved libraries:"; grep 'not found' <<<"$deps" >&2; exit 1
fi
for so in libtorch.so libtorch_cpu.so libc10.so libdnnl.so; do
  grep -Eq "^\s*$so\S* => $PREFIX/" <<<"$deps" || { log "$so not loaded from $PREFIX"; exit 1; }
done
if grep -E 'site-packages/torch|\.venv' <<<"$deps" >&2; then log "the wheel leaks into the baseline"; exit 1; fi
log "baseline train: $BUILD/train"
grep -E '^\s*(libtorch|libc10|libdnnl)' <<<"$deps" >&2
echo
echo "Baseline (ctitan $COMMIT on LibTorch 1.13.1) built: $BUILD/train"
echo "Compare this tree against it:"
echo "  PARTS=ab BASELINE=$BUILD bench/perf.sh"
