#!/usr/bin/env bash
# Every C++ source and header of the repository formatted as .clang-format says; the test
# script runs this before building and fails on the first unformatted file.
#   scripts/check_format.sh         # lists unformatted files, exit 1 if any
#   scripts/check_format.sh --fix   # formats them in place
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "check_format: clang-format is not installed (scripts/install_deps.sh installs it)" >&2
  exit 1
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.cpp' '*.h' '*.cu')
else
  mapfile -t files < <(find . -path ./build -prune -o -path './build-*' -prune -o -path ./.venv -prune -o \
    \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' \) -print | sort)
fi
if [[ "${1:-}" == "--fix" ]]; then
  clang-format -i --style=file "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  [[ -f "$f" ]] || continue
  clang-format --dry-run -Werror --style=file "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "check_format: ${#bad[@]} file(s) not formatted as .clang-format says (scripts/check_format.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check_format: ${#files[@]} files formatted"
