"""float32 forward accuracy at extreme logits, head dim by head dim.

With float32 q, k and v of standard deviation ``--std`` (100 gives scores near
±1e4), prints for each head dim the largest error of cuflash and of plain CuPy
attention (matmul, softmax, matmul in float32) against the float64 reference,
their ratio (the accuracy criterion of docs/contract.md accepts up to 2) and the
forward's time on a larger problem.

    python bench/float32_accuracy.py [--std 100] [--seeds 3] [--head-dims 8,64,...]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import cuflash

DEFAULT_HEAD_DIMS = (1, 7, 8, 16, 32, 40, 59, 64, 96, 100, 111, 128, 160, 192, 255, 256)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--std", type=float, default=100.0, help="standard deviation of q, k and v (default: 100)")
    ap.add_argument("--seeds", type=int, default=3, help="random problems per head dim and mask (default: 3)")
    ap.add_argument("--head-dims", default=",".join(map(str, DEFAULT_HEAD_DIMS)),
                    help="comma-separated head dims (default: %(default)s)")
    ap.add_argument("--no-timing", action="store_true", help="skip the timing column")
    args = ap.parse_args(argv)
    try:
        cuflash.require_gpu()
    except RuntimeError as err:
        sys.exit(f"float32_accuracy.py: {err}")
    import cupy

    from cuflash import naive, reference

    print(f"float32, q, k, v ~ N(0, {args.std:g}^2), shape (2, 4, 200, D) against (2, 4, 300, D); "
          f"worst of {args.seeds} seeds")
    print(f"{'D':>4s} {'causal':>6s} {'cuflash err':>12s} {'naive err':>12s} {'ratio':>6s} {'fwd ms':>8s}")
    worst = 0.0
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (False, True):
            ratio, errs = 0.0, (0.0, 0.0)
            for seed in range(args.seeds):
                rng = np.random.default_rng(1000 * d + 10 * seed + causal)
                q = rng.standard_normal((2, 4, 200, d), dtype=np.float32) * np.float32(args.std)
                k, v = (rng.standard_normal((2, 4, 300, d), dtype=np.float32) * np.float32(args.std) for _ in range(2))
                ref = reference.attention(q, k, v, causal=causal)
                gq, gk, gv = (cupy.asarray(x) for x in (q, k, v))
                err = np.abs(cupy.asnumpy(cuflash.attention(gq, gk, gv, causal=causal)) - ref).max()
                naive_err = np.abs(cupy.asnumpy(naive.attention(gq, gk, gv, causal=causal)) - ref).max()
                if err / naive_err >= ratio:
                    ratio, errs = err / naive_err, (err, naive_err)
            worst = max(worst, ratio)
            ms = float("nan") if args.no_timing else _forward_ms(cupy, d, causal)
            print(f"{d:4d} {str(causal):>6s} {errs[0]:12.3e} {errs[1]:12.3e} {ratio:6.2f} {ms:8.3f}")
    print(f"worst ratio {worst:.2f} (criterion: at most 2, plus a few ulps)")


def _forward_ms(cupy, d, causal):
    """Median time of a (4, 8, 1024, D) float32 forward, in milliseconds."""
    rng = np.random.default_rng(d)
    q, k, v = (cupy.asarray(rng.standard_normal((4, 8, 1024, d), dtype=np.float32)) for _ in range(3))
    cuflash.attention(q, k, v, causal=causal)
    times = []
    for _ in range(10):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        cuflash.attention(q, k, v, causal=causal)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


if __name__ == "__main__":
    main()
