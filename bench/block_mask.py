#!/usr/bin/env python3
"""cuflash.block_mask's cost: the masks of examples/score_functions.py classified on the GPU.

    python bench/block_mask.py --out DIR            # N 2048 to 16384
    python bench/block_mask.py --out DIR --quick    # N 4096

For each mask (causal, sliding window, global tokens, prefix-LM, documents) at (B, H) = (2, 16)
and tiles of 128 x 128: the first call with the function (its trace, and the compilation: in
the process the first time a mask's code is seen, else the kernel kept from then), a repeat call's device time (CUDA events, the median of --repeat) and
host time (the median of as many calls, each synchronized), and the tiles' kinds (empty / full /
partial). The repeat is what a model pays when it builds its block mask once per shape. Writes
results.json; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "examples")]

import cuflash  # noqa: E402
import score_functions as gallery  # noqa: E402
from bench_attention import log, median_ms, run_meta  # noqa: E402
from cuflash.reference import BlockMask  # noqa: E402


def masks(cupy, batch: int, n: int, rng) -> dict:
    """The gallery's masks, their arrays on the GPU (documents of about 512 positions)."""
    docs = np.sort(rng.integers(0, max(1, n // 512), (batch, n)), axis=-1).astype(np.int32)
    return {
        "causal": gallery.causal(),
        "sliding window (1024 back)": gallery.sliding_window(1024),
        "window (1024) + 4 global tokens": gallery.sliding_window_with_global_tokens(1024, 4),
        "prefix-LM": gallery.prefix_lm(cupy.asarray(rng.integers(0, n + 1, batch).astype(np.int32))),
        "documents": gallery.document(cupy.asarray(docs)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for results.json")
    ap.add_argument("--quick", action="store_true", help="N 4096 only")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    try:
        cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
    except RuntimeError as err:
        sys.exit(f"block_mask.py: {err}")
    import cupy

    os.makedirs(args.out, exist_ok=True)
    seqlens = [4096] if args.quick else args.seqlens
    batch, heads, block = 2, 16, (128, 128)
    rows = []
    for n in seqlens:
        for name, mask_mod in masks(cupy, batch, n, np.random.default_rng(n)).items():
            log(f"{name}, N {n}")
            start = time.perf_counter()
            first = cuflash.block_mask(mask_mod, (batch, heads), n, n, block=block)
            cupy.cuda.get_current_stream().synchronize()
            first_ms = (time.perf_counter() - start) * 1e3
            device_ms = median_ms(lambda: cuflash.block_mask(mask_mod, (batch, heads), n, n, block=block), [()],
                                  args.repeat)
            host = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                cuflash.block_mask(mask_mod, (batch, heads), n, n, block=block)
                cupy.cuda.get_current_stream().synchronize()
                host.append((time.perf_counter() - start) * 1e3)
            kinds = first.kinds.get()
            counts = {kind: int((kinds == getattr(BlockMask, kind.upper())).sum()) for kind in ("empty", "full",
                                                                                                 "partial")}
            rows.append(dict(mask=name, N=n, first_ms=first_ms, device_ms=device_ms,
                             synchronized_ms=float(np.median(host)), **counts))
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"meta": run_meta(args.repeat, batch=batch, heads=heads, block=block), "rows": rows}, f,
                          indent=1)
    print("| mask | N | first call ms | device ms | synchronized call ms | empty | full | partial |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mask']} | {r['N']} | {r['first_ms']:.1f} | {r['device_ms']:.3f} | {r['synchronized_ms']:.3f} "
              f"| {r['empty']} | {r['full']} | {r['partial']} |")


if __name__ == "__main__":
    main()
