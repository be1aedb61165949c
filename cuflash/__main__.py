"""python -m cuflash: attention on a realistic example, checked and timed.

On a GPU: B=4, H=16, N=4096, D=128 in float16, checked against the float64
reference on a few heads and timed against plain CuPy attention. Without a
GPU: the NumPy tiled algorithm (the kernel's loop) on a small example,
checked against the reference.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from . import reference


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _median_ms(fn, repeat=20):
    import cupy

    fn()  # warm-up: compilation, allocation
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def run_gpu(b, h, n, d, causal):
    import cupy

    import cuflash
    from cuflash import naive

    rng = np.random.default_rng(0)
    q, k, v = (cupy.asarray(rng.standard_normal((b, h, n, d), dtype=np.float32)).astype(cupy.float16) for _ in range(3))
    print(f"attention on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: "
          f"B={b} H={h} N={n} D={d} float16 causal={causal}")

    t0 = time.perf_counter()
    out = cuflash.attention(q, k, v, causal=causal)
    cupy.cuda.Device().synchronize()
    print(f"first call (compiles on first use, then cached on disk): {time.perf_counter() - t0:.2f} s")

    heads = (0, h - 1)
    hq, hk, hv = (cupy.asnumpy(x[0, list(heads)]) for x in (q, k, v))
    ref = reference.attention(hq, hk, hv, causal=causal)
    err = np.abs(cupy.asnumpy(out[0, list(heads)]).astype(np.float64) - ref).max()
    print(f"max |cuflash - float64 reference| over heads {heads}: {err:.2e}")

    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    t_flash = _median_ms(lambda: cuflash.attention(q, k, v, causal=causal))
    t_naive = _median_ms(lambda: naive.attention(q, k, v, causal=causal))
    print(f"{'':12s} {'ms':>8s} {'TFLOP/s':>8s}")
    print(f"{'cuflash':12s} {t_flash:8.3f} {flops / t_flash / 1e9:8.1f}")
    print(f"{'naive CuPy':12s} {t_naive:8.3f} {flops / t_naive / 1e9:8.1f}")
    print(f"speed-up over naive: {t_naive / t_flash:.1f}x")


def run_cpu():
    print("no CUDA GPU found: running the kernel's algorithm in NumPy (cuflash.reference.tiled_attention)")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 300, 64)) for _ in range(3))
    for causal in (False, True):
        tiled, lse = reference.tiled_attention(q, k, v, causal=causal, return_lse=True)
        ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
        print(f"causal={causal}: max |tiled - reference| = {np.abs(tiled - ref).max():.2e}, "
              f"lse {np.abs(lse - ref_lse).max():.2e}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args(argv)
    if _gpu_available():
        run_gpu(args.batch, args.heads, args.seqlen, args.head_dim, args.causal)
    else:
        run_cpu()


if __name__ == "__main__":
    main()
