"""Checks a .pt file written by ctitan's checkpoint_tool against PyTorch itself.

  python scripts/pt_load_check.py <file.pt> <reference folder>

The reference folder holds what the .pt file should contain, written independently of the
.pt writer (tests/test_checkpoint_hf.cpp writes it from the checkpoint it exported):
  manifest.txt   one line per tensor, in the dict's order: "<name> <dtype> <dim,dim,...>"
                 (an empty last field for a scalar)
  <i>.bin        tensor i's bytes, row-major, little endian

Checks, each a failure (exit 1) when it does not hold:
  - torch.load(path) -- the default, weights_only=True -- and
    torch.load(path, weights_only=True, mmap=True) both return a dict whose names, order,
    dtypes, shapes and bytes equal the reference's (bitwise, through uint8 views);
  - the zip archive is torch.save's layout: one "<archive>/" folder, data.pkl, byteorder
    "little", version "3", data/<i> records stored (not compressed), each record's data at a
    multiple of 64 bytes in the file;
  - data.pkl is pickle protocol 2 and names no global outside the ones a state dict of
    float32/bfloat16/float16 tensors needs (no torch.jit._pickle type tags);
  - torch.save of the loaded dict, to a file of the same name, gives the same bytes.
Prints one line per file on success.
"""
import io
import os
import pickletools
import struct
import sys
import tempfile
import zipfile

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
ALLOWED_GLOBALS = {"collections OrderedDict", "torch._utils _rebuild_tensor_v2", "torch FloatStorage",
                   "torch BFloat16Storage", "torch HalfStorage"}


def fail(msg):
    print(f"pt_load_check: {msg}", file=sys.stderr)
    sys.exit(1)


def read_reference(folder):
    ref = []
    with open(os.path.join(folder, "manifest.txt")) as f:
        for i, line in enumerate(f.read().splitlines()):
            name, dtype, dims = (line.split(" ") + [""])[:3]
            shape = [int(d) for d in dims.split(",") if d]
            with open(os.path.join(folder, f"{i}.bin"), "rb") as b:
                raw = b.read()
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            ref.append((name, DTYPES[dtype], shape, t))
    return ref


def check_loaded(sd, ref, how):
    if type(sd) is not dict:
        fail(f"{how}: returned {type(sd).__name__}, not a dict")
    if list(sd.keys()) != [r[0] for r in ref]:
        fail(f"{how}: names {list(sd.keys())[:5]}... differ from the reference's {[r[0] for r in ref][:5]}...")
    for name, dtype, shape, raw in ref:
        t = sd[name]
        if not isinstance(t, torch.Tensor):
            fail(f"{how}: {name} is a {type(t).__name__}")
        if t.dtype != dtype or list(t.shape) != shape:
            fail(f"{how}: {name} is {t.dtype} {list(t.shape)}, the reference {dtype} {shape}")
        got = t.contiguous().view(torch.uint8).reshape(-1) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if not torch.equal(got, raw):
            diff = int((got != raw).sum()) if got.numel() == raw.numel() else "size"
            fail(f"{how}: {name}: bytes differ from the reference ({diff} bytes)")


def check_archive(path, ntensors):
    with open(path, "rb") as f:
        blob = f.read()
    z = zipfile.ZipFile(io.BytesIO(blob))
    infos = z.infolist()
    folders = {i.filename.split("/", 1)[0] for i in infos}
    if len(folders) != 1:
        fail(f"{path}: records in {len(folders)} folders, not one")
    archive = folders.pop()
    names = {i.filename[len(archive) + 1:] for i in infos}
    want = {"data.pkl", "byteorder", "version"} | {f"data/{i}" for i in range(ntensors)}
    if not want <= names:
        fail(f"{path}: records {sorted(want - names)} missing")
    if z.read(f"{archive}/byteorder") != b"little" or z.read(f"{archive}/version") != b"3\n":
        fail(f"{path}: byteorder {z.read(f'{archive}/byteorder')!r}, version {z.read(f'{archive}/version')!r}")
    for i in infos:
        if i.compress_type != zipfile.ZIP_STORED:
            fail(f"{path}: {i.filename} is compressed")
        # The local header's name and extra lengths give where the data starts.
        nlen, xlen = struct.unpack("<HH", blob[i.header_offset + 26:i.header_offset + 30])
        data = i.header_offset + 30 + nlen + xlen
        if i.filename.split("/", 1)[1].startswith("data/") and data % 64:
            fail(f"{path}: {i.filename} starts at offset {data}, not a multiple of 64")
    pkl = z.read(f"{archive}/data.pkl")
    proto = None
    for op, arg, _ in pickletools.genops(pkl):
        if op.name == "PROTO":
            proto = arg
        if op.name in ("GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD"):
            if op.name != "GLOBAL" or arg not in ALLOWED_GLOBALS:
                fail(f"{path}: data.pkl has {op.name} {arg!r}")
    if proto != 2:
        fail(f"{path}: pickle protocol {proto}, not 2")
    return blob


def main():
    if len(sys.argv) != 3:
        fail("usage: pt_load_check.py <file.pt> <reference folder>")
    path, folder = sys.argv[1], sys.argv[2]
    ref = read_reference(folder)
    blob = check_archive(path, len(ref))
    check_loaded(torch.load(path), ref, "torch.load(path)")
    sd = torch.load(path, weights_only=True, mmap=True)
    check_loaded(sd, ref, "torch.load(path, weights_only=True, mmap=True)")
    with tempfile.TemporaryDirectory() as tmp:
        again = os.path.join(tmp, os.path.basename(path))
        torch.save(sd, again)
        with open(again, "rb") as f:
            saved = f.read()
    if saved != blob:
        first = next((i for i in range(min(len(saved), len(blob))) if saved[i] != blob[i]), min(len(saved), len(blob)))
        fail(f"{path}: torch.save of the loaded dict differs ({len(saved)} bytes against {len(blob)}, "
             f"first at offset {first})")
    nbytes = sum(r[3].numel() for r in ref)
    print(f"pt_load_check: {os.path.basename(path)}: {len(ref)} tensors, {nbytes} bytes: torch {torch.__version__} "
          f"torch.load (weights_only=True) and mmap=True equal the reference bitwise; torch.save writes the same bytes")


if __name__ == "__main__":
    main()
