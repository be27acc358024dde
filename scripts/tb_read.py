#!/usr/bin/env python3
"""Prints every scalar of a TensorBoard run folder as TensorBoard itself reads it.

    .venv/bin/python scripts/tb_read.py <folder with events.out.tfevents.* files>

Reads the folder with TensorBoard's EventAccumulator (PyPI tensorboard, pinned in
scripts/install_deps.sh), the loader behind TensorBoard's own server: it checks both CRCs
of every record and stops at the first record it cannot read, so a value it prints is one a
TensorBoard would show. Output, one line per value:

    file_version<TAB><the first record's version as EventAccumulator parses it: "brain.Event:2" -> 2.0>
    <tag><TAB><step><TAB><value as Python's repr()><TAB><wall_time>

Exit 1 (with a line on stderr) when the folder holds no event file or TensorBoard is missing.
"""
import glob
import os
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    folder = sys.argv[1]
    if not glob.glob(os.path.join(folder, "events.out.tfevents.*")):
        print(f"tb_read: no events.out.tfevents.* file in {folder}", file=sys.stderr)
        return 1
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        print(f"tb_read: TensorBoard is not installed in {sys.executable} ({e}); "
              "run scripts/install_deps.sh", file=sys.stderr)
        return 1
    acc = EventAccumulator(folder, size_guidance={"scalars": 0})  # 0: keep every value
    acc.Reload()
    print(f"file_version\t{acc.file_version}")
    for tag in sorted(acc.Tags()["scalars"]):
        for e in acc.Scalars(tag):
            print(f"{tag}\t{e.step}\t{e.value!r}\t{e.wall_time!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
