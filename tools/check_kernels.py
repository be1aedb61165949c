#!/usr/bin/env python3
"""Compile every cuflash kernel specialization with NVRTC and check ptxas' resource report.

Usage (from any directory, with cuflash and its ``cuda12`` extra installed)::

    python tools/check_kernels.py                     # sm_80 and sm_90a, all kernels
    python tools/check_kernels.py --arch sm_90a       # one architecture (repeatable)
    python tools/check_kernels.py --filter attn_bwd   # only names containing a substring
    python tools/check_kernels.py --jobs 4            # worker processes (default: all CPUs)
    python tools/check_kernels.py --group 1           # one kernel per NVRTC program

No GPU is needed: NVRTC (from the ``nvidia-cuda-nvrtc-cu12`` wheel, reached through
CuPy's ``cupy_backends.cuda.libs.nvrtc``) compiles straight to a cubin. The source is
``cuflash._compile.kernel_source()``, the options are ``cuflash._compile.nvrtc_options(arch)``
plus ``-Xptxas=-v``, and the kernels are ``cuflash._tiles.all_specializations(arch)`` (what the
library launches) and ``cuflash._tiles.candidate_specializations(arch)`` (what the tuner and the
tests launch besides).
Up to ``--group`` name expressions of one arch share an NVRTC program (8 by default: the front
end, parsing the source, is then taken once for them), compiled in a process pool; a program
that fails or warns is compiled again one kernel per program, so the report names the kernel.

A kernel fails when
  * NVRTC or ptxas reports an error (the program log is printed),
  * ptxas reports a nonzero stack frame, spill stores or spill loads for a kernel (entry)
    function in the program, or a nonzero cumulative stack size (stack used by callees),
  * spill stores or loads in a device function of the program,
  * ptxas prints no resource report for the requested kernel.
Only warnings, unless ``--werror`` is given: compiler warnings, ptxas performance advisories
such as the sm_90a "wgmma ... serialized" message, and a stack frame in a device function on
its own (a kernel that calls it fails through its cumulative stack size).

The run also fails when the list of specializations (after ``--filter``) is empty.
A table goes to stdout (arch, name expression, registers, static shared memory, stack
frame, spill stores/loads, compile seconds (a share of its program's), status); progress goes to stderr.
Exit status: 0 when every kernel passes, 1 otherwise (2 for usage errors).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field

DEFAULT_ARCHS = ("sm_80", "sm_90a")
PTXAS_VERBOSE = "-Xptxas=-v"
PROGRAM_NAME = "cuflash_kernels.cu"
MAX_LOG_LINES = 300  # of one failed program log

# ---------------------------------------------------------------------------------------
# Parsing the ptxas report
# ---------------------------------------------------------------------------------------

_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_RE_PROPS = re.compile(r"Function properties for (\S+)")
_RE_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_CUMSTACK = re.compile(r"(\d+) bytes cumulative stack size")
_RE_WARNING = re.compile(r": warning\b|^ptxas warning\b|Performance Loss", re.IGNORECASE)


@dataclass
class FunctionReport:
    name: str
    entry: bool = False
    stack_frame: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    registers: int | None = None
    smem: int | None = None
    cumulative_stack: int | None = None


def parse_ptxas_log(log: str) -> dict[str, FunctionReport]:
    """Per-function resource reports from an NVRTC program log compiled with ``-Xptxas=-v``.

    ptxas prints, for each kernel, ``Compiling entry function 'NAME'``, then
    ``Function properties for NAME`` with the stack/spill line, then ``Used N registers, ...``.
    Device functions get a ``Function properties`` block without the other two lines.
    """
    funcs: dict[str, FunctionReport] = {}
    current: FunctionReport | None = None  # the function whose properties come next
    entry: FunctionReport | None = None  # the kernel whose "Used ..." line comes next

    def get(name: str) -> FunctionReport:
        if name not in funcs:
            funcs[name] = FunctionReport(name)
        return funcs[name]

    for line in log.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            entry = get(m.group(1))
            entry.entry = True
            current = entry
            continue
        m = _RE_PROPS.search(line)
        if m:
            current = get(m.group(1))
            continue
        m = _RE_FRAME.search(line)
        if m and current is not None:
            current.stack_frame, current.spill_stores, current.spill_loads = (
                int(g) for g in m.groups()
            )
            continue
        m = _RE_USED.search(line)
        if m and entry is not None:
            entry.registers = int(m.group(1))
            s = _RE_SMEM.search(line)
            if s:
                entry.smem = int(s.group(1))
            c = _RE_CUMSTACK.search(line)
            entry.cumulative_stack = int(c.group(1)) if c else 0
            entry = None
            continue
    return funcs


def log_warnings(log: str) -> list[str]:
    """Compiler warnings and ptxas warnings or performance advisories of a program log."""
    return [line.strip() for line in log.splitlines() if _RE_WARNING.search(line.strip())]


# ---------------------------------------------------------------------------------------
# One compilation (runs in a worker process)
# ---------------------------------------------------------------------------------------


@dataclass
class Result:
    index: int
    arch: str
    name: str
    ok: bool = False
    compiled: bool = False
    seconds: float = 0.0
    lowered: str | None = None
    registers: int | None = None
    smem: int | None = None
    stack_frame: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    log: str = ""


_SOURCE: str | None = None


def _init_worker(source: str) -> None:
    global _SOURCE
    _SOURCE = source


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # pragma: no cover - environment problem
        raise RuntimeError(
            "cannot import NVRTC through CuPy (cupy_backends.cuda.libs.nvrtc): "
            f"{exc!r}; install the package with its cuda12 extra"
        ) from exc
    return nvrtc


def compile_group(indices: tuple[int, ...], arch: str, names: tuple[str, ...],
                  options: tuple[str, ...]) -> list[Result]:
    """Compile name expressions ``names`` for one arch as one NVRTC program (its front end,
    parsing the source, taken once: a seventh of a program's time) and judge each kernel's
    ptxas report. A group whose program fails is compiled again one kernel per program, so
    that an error or warning names its own kernel."""
    t0 = time.perf_counter()
    log, lowered, problems = _compile_program(arch, names, options)
    seconds = (time.perf_counter() - t0) / len(names)
    warnings = log_warnings(log)
    if len(names) > 1 and (problems or warnings):
        return [r for i, n in zip(indices, names) for r in compile_group((i,), arch, (n,), options)]
    funcs = parse_ptxas_log(log)
    results = []
    for i, name in zip(indices, names):
        res = Result(index=i, arch=arch, name=name, compiled=not problems, seconds=seconds,
                     lowered=lowered.get(name), problems=list(problems), warnings=list(warnings),
                     log=log)
        if res.compiled:
            judge(res, funcs)
        res.ok = res.compiled and not res.problems
        results.append(res)
    return results


def _compile_program(arch: str, names: tuple[str, ...], options: tuple[str, ...]):
    """(program log, lowered name of each name expression, problems) of one NVRTC program."""
    log, lowered, problems = "", {}, []
    prog = None
    try:
        nvrtc = _nvrtc()
        prog = nvrtc.createProgram(_SOURCE, PROGRAM_NAME, [], [])
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            problems.append(f"compilation failed: {exc}")
        log = (nvrtc.getProgramLog(prog) or "").rstrip("\x00").rstrip()
        if not problems:
            lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
    except Exception:
        problems.append("exception while compiling:\n" + traceback.format_exc())
    finally:
        if prog is not None:
            try:
                _nvrtc().destroyProgram(prog)
            except Exception:
                pass
    return log, lowered, problems


def judge(res: Result, funcs: dict[str, FunctionReport]) -> None:
    """Fill the resource columns of ``res`` from its program's ptxas report ``funcs`` and record
    what is wrong: its own kernel's report, and any device function's of the program."""
    kernel = funcs.get(res.lowered) if res.lowered else None
    if kernel is None or kernel.stack_frame is None or kernel.registers is None:
        res.problems.append(
            f"no ptxas resource report for {res.name} (lowered name {res.lowered!r}) "
            "in the program log; was -Xptxas=-v passed?"
        )
    else:
        res.registers = kernel.registers
        res.smem = kernel.smem
        res.stack_frame = kernel.stack_frame
        res.spill_stores = kernel.spill_stores
        res.spill_loads = kernel.spill_loads
    for f in funcs.values():
        if f.entry and f.name != res.lowered:
            continue   # another kernel of the same program: judged as its own result
        label = ("kernel " if f.entry else "device function ") + f.name
        if f.spill_stores or f.spill_loads:
            res.problems.append(
                f"{label}: {f.spill_stores} bytes spill stores, {f.spill_loads} bytes spill loads"
            )
        if f.entry and f.stack_frame:
            res.problems.append(f"{label}: {f.stack_frame} bytes stack frame")
        elif f.entry and f.cumulative_stack:
            res.problems.append(
                f"{label}: {f.cumulative_stack} bytes cumulative stack size (from callees)"
            )
        elif not f.entry and f.stack_frame:
            res.warnings.append(
                f"{label}: {f.stack_frame} bytes stack frame "
                "(fails only through a kernel's cumulative stack size)"
            )


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


def _load_project():
    """Import the real cuflash modules, from the installed package or from this checkout."""
    try:
        from cuflash import _compile, _tiles
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, root)
        try:
            from cuflash import _compile, _tiles
        except ImportError as exc:
            sys.exit(
                f"check_kernels: cannot import cuflash ({exc}); install it first, e.g. "
                'python -m pip install ".[cuda12,test]"'
            )
    return _compile, _tiles


def _fmt(v) -> str:
    return "-" if v is None else str(v)


def print_table(results: list[Result], out=sys.stdout) -> None:
    headers = ["arch", "kernel", "regs", "smem", "stack", "spill st/ld", "time s", "status"]
    rows = []
    for r in results:
        spill = (
            "-"
            if r.spill_stores is None
            else f"{r.spill_stores}/{r.spill_loads}"
        )
        rows.append([
            r.arch, r.name, _fmt(r.registers), _fmt(r.smem), _fmt(r.stack_frame), spill,
            f"{r.seconds:.1f}", "ok" if r.ok else "FAIL",
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    left = {0, 1, 7}

    def line(cells):
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    print(line(headers), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in rows:
        print(line(row), file=out)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Compile every cuflash kernel with NVRTC and fail on errors, "
        "stack frames or register spills.",
    )
    p.add_argument("--arch", action="append", metavar="ARCH",
                   help="target such as sm_80 or sm_90a; repeatable (default: sm_80 and sm_90a)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="worker processes (default: os.cpu_count())")
    p.add_argument("--group", type=int, default=8, metavar="N",
                   help="kernels per NVRTC program (default 8; a failed program is compiled again "
                        "one kernel per program)")
    p.add_argument("--filter", metavar="SUBSTR",
                   help="only name expressions containing SUBSTR")
    p.add_argument("--werror", action="store_true",
                   help="treat compiler warnings and ptxas advisories as failures")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.group < 1:
        p.error("--group must be at least 1")
    args.arch = list(dict.fromkeys(args.arch or DEFAULT_ARCHS))
    return args


def _arch_starts(tasks: list[tuple[str, str]]) -> list[tuple[int, int]]:
    """The [start, end) of each arch's run of tasks (a program compiles for one arch)."""
    bounds = [i for i in range(1, len(tasks)) if tasks[i][0] != tasks[i - 1][0]]
    return list(zip([0, *bounds], [*bounds, len(tasks)]))


def main(argv=None) -> int:
    args = parse_args(argv)
    _compile, _tiles = _load_project()

    names_by_arch = {arch: list(dict.fromkeys(_tiles.all_specializations(arch) + _tiles.candidate_specializations(arch)))
                     for arch in args.arch}
    if not all(names_by_arch.values()):
        print("check_kernels: FAIL: cuflash._tiles.all_specializations() is empty",
              file=sys.stderr)
        return 1
    if args.filter:
        names_by_arch = {arch: [n for n in names if args.filter in n]
                         for arch, names in names_by_arch.items()}
        if not any(names_by_arch.values()):
            print(f"check_kernels: FAIL: no specialization matches --filter {args.filter!r}",
                  file=sys.stderr)
            return 1

    source = _compile.kernel_source()
    options = {}
    for arch in args.arch:
        opts = tuple(_compile.nvrtc_options(arch))
        if not any(o in (PTXAS_VERBOSE, "--ptxas-options=-v") for o in opts):
            opts += (PTXAS_VERBOSE,)
        options[arch] = opts

    tasks = [(arch, name) for arch in args.arch for name in names_by_arch[arch]]
    groups = [tuple(range(i, min(i + args.group, len(tasks))))
              for arch_start in _arch_starts(tasks)
              for i in range(arch_start[0], arch_start[1], args.group)]
    jobs = min(args.jobs, len(groups))
    counts = ", ".join(f"{len(names_by_arch[a])} for {a}" for a in args.arch)
    print(f"check_kernels: specializations {counts} = {len(tasks)} kernels in {len(groups)} programs, "
          f"{jobs} jobs", file=sys.stderr)
    for arch in args.arch:
        print(f"check_kernels: options for {arch}: {' '.join(options[arch])}", file=sys.stderr)

    results: list[Result] = []
    t_start = time.perf_counter()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                initializer=_init_worker, initargs=(source,)) as pool:
        futures = {}
        for group in groups:
            arch = tasks[group[0]][0]
            names = tuple(tasks[i][1] for i in group)
            futures[pool.submit(compile_group, group, arch, names, options[arch])] = (group, arch, names)
        for fut in cf.as_completed(futures):
            group, arch, names = futures[fut]
            try:
                done_here = fut.result()
            except Exception as exc:  # a worker died (e.g. BrokenProcessPool)
                done_here = [Result(index=i, arch=arch, name=n, problems=[f"worker failed: {exc!r}"])
                             for i, n in zip(group, names)]
            for res in done_here:
                if args.werror and res.warnings:
                    res.problems.extend(f"warning (--werror): {w}" for w in res.warnings)
                    res.ok = False
                results.append(res)
                print(f"[{len(results)}/{len(tasks)}] {'ok  ' if res.ok else 'FAIL'} {arch} {res.name} "
                      f"({res.seconds:.1f} s)", file=sys.stderr, flush=True)

    results.sort(key=lambda r: r.index)
    failed = [r for r in results if not r.ok]

    logs_shown: dict[str, str] = {}
    for r in failed:
        print(f"\n=== FAIL {r.arch} {r.name}")
        for p in r.problems:
            print(f"  - {p}")
        if r.log and not r.compiled:
            if r.log in logs_shown:
                print(f"  program log: same as for {logs_shown[r.log]}")
                continue
            logs_shown[r.log] = f"{r.arch} {r.name}"
            lines = r.log.splitlines()
            print("  program log:")
            for line in lines[:MAX_LOG_LINES]:
                print(f"    {line}")
            if len(lines) > MAX_LOG_LINES:
                print(f"    ... ({len(lines) - MAX_LOG_LINES} more lines)")
    warned = [r for r in results if r.warnings]
    if warned:
        print("\nwarnings:")
        for r in warned:
            for w in dict.fromkeys(r.warnings):
                print(f"  {r.arch} {r.name}: {w}")

    print()
    print_table(results)
    elapsed = time.perf_counter() - t_start
    print(f"\n{len(results) - len(failed)}/{len(results)} passed, {len(failed)} failed "
          f"in {elapsed:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
