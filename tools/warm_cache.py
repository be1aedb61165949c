#!/usr/bin/env python3
"""Compiles every kernel specialization for the current GPU into CuPy's disk cache, in parallel.

    python tools/warm_cache.py [--jobs N]

cuflash compiles a specialization on its first use, one at a time (about a second each on a
fast host); a fresh machine running the whole test suite or the benchmarks spends minutes on
that. This fills the cache first with one process per CPU (default), so that later processes
find every kernel compiled. Prints the count and the time taken.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def compile_one(name: str) -> str:
    from cuflash import _compile

    _compile.get_function(name, 0)
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    import cuflash
    from cuflash import _compile, _tiles

    try:
        cuflash.require_gpu()
    except RuntimeError as err:
        sys.exit(f"warm_cache.py: {err}")
    names = _tiles.all_specializations(_compile.current_arch())
    start = time.perf_counter()
    with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
        for _ in pool.map(compile_one, names):
            pass
    print(f"{len(names)} specializations for {_compile.current_arch()} in CuPy's cache, "
          f"{time.perf_counter() - start:.1f} s with {args.jobs} processes")


if __name__ == "__main__":
    main()
