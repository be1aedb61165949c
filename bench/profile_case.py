"""One grid cell's forward and backward, a few times over, for a profiler to attach to.

    ncu --clock-control none -k regex:attn --launch-skip 8 --launch-count 4 \\
        python bench/profile_case.py --seqlen 4096 --head-dim 64

The inputs have the grid's shape (batch 16384/N, heads 2048/D). Without a profiler it
prints each direction's median time, so it also works as a quick check of one cell.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402

try:
    cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
except RuntimeError as err:
    sys.exit(f"profile_case.py: {err}")

import cupy  # noqa: E402

from bench_attention import median_ms  # noqa: I001  (this directory)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, d = args.seqlen, args.head_dim
    b, h = 16384 // n, 2048 // d
    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(args.dtype) for _ in range(4))
    flops = 4 * b * h * n * n * d / (2 if args.causal else 1)
    out, lse = cuflash.attention(q, k, v, causal=args.causal, return_lse=True)
    fwd = lambda: cuflash.attention(q, k, v, causal=args.causal)  # noqa: E731
    bwd = lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=args.causal)  # noqa: E731
    for name, fn, work in (("fwd", fwd, flops), ("bwd", bwd, 2.5 * flops)):
        ms = median_ms(fn, [()], args.repeat)
        print(f"{name} N={n} D={d} causal={args.causal:d} {args.dtype}: {ms:8.3f} ms {work / ms / 1e9:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
