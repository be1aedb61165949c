"""Counts the instructions that matter in the SASS of kernel specializations.

    python bench/sass_report.py [--arch sm_90a] [--dump DIR] [NAME_EXPRESSION ...]

Compiles each name expression (default: the float16 forward and backward kernels at head
dims 64, 128 and 256, as cuflash/_tiles.py picks them) with NVRTC, disassembles the cubin
with ``cuobjdump -sass`` (from the CUDA toolkit, or NVIDIA's ``nvidia-cuda-cuobjdump`` wheel on
PyPI, whose ``nvidia/cu13/bin`` has it: no GPU needed) and prints, per kernel: tensor-core MMAs
(HMMA), ldmatrix (LDSM), async copies (LDGSTS), exp2 (MUFU.EX2), float multiplies and FMAs,
barriers, and local-memory traffic (LDL/STL, which must be 0). ``--dump`` keeps the SASS.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuflash import _compile, _gpu, _tiles  # noqa: E402

try:   # NVRTC through CuPy; no GPU needed
    from cupy_backends.cuda.libs import nvrtc
except ImportError as err:
    sys.exit(f"sass_report.py compiles with CuPy's NVRTC: {_gpu.cupy_import_problem(err)}")

COUNTED = ("HGMMA", "HMMA", "LDSM", "LDGSTS", "MUFU.EX2", "FMUL", "FFMA", "FADD", "FMNMX", "SHFL", "BAR", "LDL", "STL")


def default_names():
    names = []
    for d in (64, 128, 256):
        names.append(_tiles.fwd_name("float16", _tiles.fwd_tiles("float16", d)))
        names.extend(_tiles.bwd_names("float16", _tiles.bwd_tiles("float16", d))[1:])
    return names


def cubin(name: str, arch: str) -> bytes:
    prog = nvrtc.createProgram(_compile.kernel_source(), "cuflash.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, list(_compile.nvrtc_options(arch)))
        data = bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    # CuPy's binding returns the image one byte short, cutting the last program header
    # (whose top byte is 0); the disassemblers reject a cut table, so pad to its end.
    phoff, = struct.unpack_from("<Q", data, 0x20)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    phsize, phnum, shsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    end = max(phoff + phsize * phnum, shoff + shsize * shnum)
    return data + bytes(max(0, end - len(data)))



def disassemble(path: str) -> str:
    """SASS text of a cubin: cuobjdump, else nvdisasm (both come with the CUDA toolkit)."""
    errors = []
    for cmd in (["cuobjdump", "-sass", path], ["nvdisasm", "-c", path]):
        try:
            run = subprocess.run(cmd, check=False, capture_output=True, text=True)
        except FileNotFoundError as err:
            errors.append(str(err))
            continue
        if run.returncode == 0 and run.stdout.strip():
            return run.stdout
        errors.append(f"{' '.join(cmd[:2])}: exit {run.returncode}: {run.stderr.strip()[:300]}")
    raise RuntimeError("cannot disassemble " + path + ": " + "; ".join(errors))


def count(sass: str) -> collections.Counter:
    counts = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if not m:
            continue
        op = m.group(1)
        counts["total"] += 1
        for key in COUNTED:
            if op == key or op.startswith(key + "."):
                counts[key] += 1
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--dump", help="directory to write each kernel's SASS into")
    args = ap.parse_args()
    if not (shutil.which("cuobjdump") or shutil.which("nvdisasm")):
        sys.exit("sass_report.py: needs cuobjdump or nvdisasm on the PATH (from the CUDA toolkit, or "
                 "pip install nvidia-cuda-cuobjdump: its nvidia/cu13/bin)")
    names = args.names or default_names()
    print("| kernel | " + " | ".join(("total",) + COUNTED) + " |")
    print("|---" * (len(COUNTED) + 2) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            path = os.path.join(tmp, f"k{i}.cubin")
            with open(path, "wb") as f:
                f.write(cubin(name, args.arch))
            sass = disassemble(path)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, re.sub(r"\W+", "_", name).strip("_") + ".sass"), "w") as f:
                    f.write(sass)
            c = count(sass)
            print(f"| {name} | " + " | ".join(str(c[k]) for k in ("total",) + COUNTED) + " |", flush=True)


if __name__ == "__main__":
    main()
