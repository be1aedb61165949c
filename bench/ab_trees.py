"""Times cuflash from two source trees in alternate processes, each cell against cuDNN in the same
process: a change measured against the code before it, on one machine, in one call.

    python bench/ab_trees.py OLD_TREE [--new NEW_TREE] [--dtype float16 bfloat16] [--head-dims 64]
        [--seqlens 2048 4096] [--causal 0 1] [--direction fwd] [--processes 2] [--rounds 3]

A tree is a directory holding a ``cuflash`` package and its ``kernels/`` (a checkout, or
``git archive COMMIT cuflash kernels | tar -x -C DIR``); NEW_TREE defaults to this checkout.
The processes run old, new, old, new, ... (--processes pairs). In each, every cell times cuflash
and SDPA's cuDNN backend in turn, --rounds times (CUDA-event medians of --repeat calls,
bench_attention's timing: two input sets, batch 16384 / N, heads 2048 / D). A process's reading
of a cell is its median ratio cuflash / cuDNN; the table gives, per tree, the median of its
processes' readings, and new / old. cuDNN is the yardstick because the machine's speed drifts
between processes (its clock under sustained load): a ratio within one process cancels most of
that, a time does not. Needs torch with cuDNN beside cuflash.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD_MARK = "ab_trees:"   # the child's result lines start so (anything else it prints is ignored)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the tree to compare against")
    ap.add_argument("--new", default=str(HERE.parent), help="the tree under test (default: this checkout)")
    ap.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[2048, 4096, 8192, 16384])
    ap.add_argument("--causal", nargs="+", type=int, choices=(0, 1), default=[0, 1])
    ap.add_argument("--direction", nargs="+", choices=("fwd", "bwd"), default=["fwd"])
    ap.add_argument("--processes", type=int, default=2, help="pairs of processes (old, new)")
    ap.add_argument("--rounds", type=int, default=3, help="turns of cuflash and cuDNN per cell and process")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per turn")
    ap.add_argument("--child", help=argparse.SUPPRESS)   # internal: time the cells with this tree's cuflash
    return ap.parse_args(argv)


def cells(args):
    """(dtype, head dim, N, causal, direction) of every cell, in the order they are timed."""
    return [(dt, d, n, bool(c), direction) for dt in args.dtype for d in args.head_dims for n in args.seqlens
            for c in args.causal for direction in args.direction]


def run_child(args):
    """In a process whose cuflash is the tree's: each cell's median ratio cuflash / cuDNN."""
    sys.path.insert(0, args.child)
    import cuflash   # the tree's (imported before bench_attention puts this checkout on the path)

    if Path(cuflash.__file__).resolve().parent.parent != Path(args.child).resolve():
        sys.exit(f"ab_trees.py: cuflash came from {cuflash.__file__}, not from {args.child}")
    sys.path.insert(1, str(HERE))
    import bench_attention as ba

    cudnn = ba.TORCH_BACKENDS["torch-cudnn"]
    last = None
    for dt, d, n, causal, direction in cells(args):
        if last != (dt, d, n):
            data = None
            ba.free()
            data = ba.make_inputs(16384 // n, 2048 // d, n, d, dt)
            last = (dt, d, n)
        ratios = [ba.time_torch(cudnn, data, causal, direction, args.repeat)
                  / ba.time_attention(cuflash, data, causal, direction, args.repeat) for _ in range(args.rounds)]
        print(CHILD_MARK + json.dumps([dt, d, n, causal, direction, statistics.median(ratios)]), flush=True)


def summarize(readings):
    """Rows (cell, old, new, new / old) from {tree: {cell: [each process's ratio]}}, medians over processes."""
    rows = []
    for cell, old in readings["old"].items():
        new = readings["new"].get(cell)
        if new:
            o, m = statistics.median(old), statistics.median(new)
            rows.append((cell, o, m, m / o))
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    sys.path.insert(0, str(HERE.parent))
    import cuflash

    try:
        cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
    except RuntimeError as err:
        sys.exit(f"ab_trees.py: {err}")
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("ab_trees.py: needs torch, whose SDPA cuDNN backend is the yardstick")
    trees = {"old": args.old, "new": args.new}
    for name, tree in trees.items():
        if not (Path(tree) / "cuflash" / "__init__.py").is_file():
            sys.exit(f"ab_trees.py: the {name} tree {tree} holds no cuflash package")
    passed = list(argv if argv is not None else sys.argv[1:])
    readings = {"old": {}, "new": {}}
    for p in range(args.processes):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
            done = subprocess.run([sys.executable, __file__, *passed, "--child", tree], env=env,
                                  capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"ab_trees.py: the {name} process failed:\n{done.stderr[-3000:]}")
            for line in done.stdout.splitlines():
                if line.startswith(CHILD_MARK):
                    *cell, ratio = json.loads(line[len(CHILD_MARK):])
                    readings[name].setdefault(tuple(cell), []).append(ratio)
                    print(f"{name} {line}", file=sys.stderr)   # (kept should a later process not finish)
            print(f"process {p + 1} of {args.processes}, {name} tree: done", file=sys.stderr, flush=True)
    print(f"old: {args.old}  new: {args.new}  ({args.processes} processes each, {args.rounds} rounds)")
    print("| dtype | D | N | causal | dir | old / cuDNN | new / cuDNN | new / old |")
    print("|---|---|---|---|---|---|---|---|")
    for (dt, d, n, causal, direction), old, new, gain in summarize(readings):
        print(f"| {dt} | {d} | {n} | {'yes' if causal else 'no'} | {direction} | {old:.3f} | {new:.3f} | {gain:.3f} |")


if __name__ == "__main__":
    main()
