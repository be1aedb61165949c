"""python -m cuflash: attention on an example problem, checked and timed.

On a GPU it runs cuflash.attention, checks it against the float64 reference
(cuflash.reference.attention) and times it against plain CuPy attention
(cuflash.naive: matmul, float32 softmax, matmul). Without a GPU it says why,
then runs the kernel's algorithm in NumPy (cuflash.reference.tiled_attention)
on the same options and checks it against the reference.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import __version__, _gpu, reference

DTYPES = ("float16", "bfloat16", "float32")
# (GPU, CPU) defaults of the size options: the NumPy run keeps whole score matrices
DEFAULTS = {"batch": (4, 1), "heads": (16, 4), "seqlen": (4096, 512), "head_dim": (128, 64)}
CPU_MAX_SCORES = 1 << 24   # batch * heads * seqlen^2 allowed in the NumPy run (128 MiB per float64 copy)
CHECK_ROWS = 1024          # query rows of each checked head compared with the reference on a GPU


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m cuflash",
        description=__doc__.split(": ", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, help_text in (
        ("batch", "batch size B"),
        ("heads", "heads H"),
        ("seqlen", "sequence length N of queries and keys"),
        ("head-dim", "head dim D of q, k and v, 1 to 256"),
    ):
        gpu, cpu = DEFAULTS[name.replace("-", "_")]
        ap.add_argument(f"--{name}", type=int, default=None, metavar="N",
                        help=f"{help_text} (default: {gpu} on a GPU, {cpu} without)")
    ap.add_argument("--dtype", choices=DTYPES, default="float16", help="dtype of q, k and v (default: float16)")
    ap.add_argument("--causal", action="store_true", help="causal mask, bottom-right aligned (default: off)")
    ap.add_argument("--cpu", action="store_true", help="run the NumPy version even where a GPU is present (default: off)")
    args = ap.parse_args(argv)
    for name in ("batch", "heads", "seqlen"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name} must be at least 1, got {value}")
    if args.head_dim is not None and not 1 <= args.head_dim <= 256:
        ap.error(f"--head-dim must be between 1 and 256, got {args.head_dim}")
    return ap, args


def sizes(args, on_gpu: bool) -> tuple[int, int, int, int]:
    """(B, H, N, D): the options given, the defaults of this kind of run for the rest."""
    pick = 0 if on_gpu else 1
    return tuple(
        getattr(args, name) if getattr(args, name) is not None else DEFAULTS[name][pick]
        for name in ("batch", "heads", "seqlen", "head_dim")
    )


def describe(b, h, n, d, dtype, causal) -> str:
    return (f"q, k, v of shape ({b}, {h}, {n}, {d}) (B, H, N, D), {dtype}, "
            f"{'causal' if causal else 'no mask'}, scale 1/sqrt({d})")


def random_inputs(b, h, n, d, dtype):
    """q, k, v as NumPy arrays of `dtype`, standard normal (drawn in float32, then rounded)."""
    rng = np.random.default_rng(0)
    np_dtype = _numpy_dtype(dtype)
    return tuple(rng.standard_normal((b, h, n, d), dtype=np.float32).astype(np_dtype) for _ in range(3))


def _numpy_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes   # CuPy's bfloat16 needs it too

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def run_gpu(b, h, n, d, dtype, causal):
    import cupy

    import cuflash
    from cuflash import _compile, naive

    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode()
    free, total = device.mem_info
    print(f"cuflash {__version__} on {name} (device {device.id}, {total / 2**30:.0f} GiB, "
          f"kernels built for {_compile.current_arch()})")
    print(f"problem: {describe(b, h, n, d, dtype, causal)}")
    q, k, v = (cupy.asarray(x) for x in random_inputs(b, h, n, d, dtype))

    t0 = time.perf_counter()
    out = cuflash.attention(q, k, v, causal=causal)
    device.synchronize()
    print(f"first call, compilation included (kept in CuPy's disk cache): {time.perf_counter() - t0:.2f} s")

    # the last query rows of two heads: under a bottom-right mask the last rows of q see the
    # same keys whether or not the earlier rows are there
    rows = slice(max(0, n - CHECK_ROWS), n)
    heads = sorted({0, h - 1})
    hq, hk, hv = (cupy.asnumpy(x[0, heads]) for x in (q, k, v))
    ref = reference.attention(hq[:, rows], hk, hv, causal=causal)
    got = cupy.asnumpy(out[0, heads, rows]).astype(np.float64)
    print(f"max |cuflash - float64 reference| over batch entry 0, heads {tuple(heads)}, query rows "
          f"{rows.start}..{n - 1}: {np.abs(got - ref).max():.2e} (max |reference| {np.abs(ref).max():.2f})")

    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    t_flash = _median_ms(cupy, lambda: cuflash.attention(q, k, v, causal=causal))
    print(f"{'':34s} {'ms':>9s} {'TFLOP/s':>8s}")
    print(f"{'cuflash':34s} {t_flash:9.3f} {flops / t_flash / 1e9:8.1f}")
    chunk = _naive_chunk(b, h, n, free)
    if chunk == 0:
        print(f"naive CuPy attention skipped: one batch entry's score matrices would need "
              f"{_naive_bytes(h, n) / 2**30:.1f} GiB, more than half the {free / 2**30:.1f} GiB free")
        return
    label = "naive CuPy" if chunk == b else f"naive CuPy ({chunk} batch entr{'y' if chunk == 1 else 'ies'} a call)"

    def run_naive():
        for i in range(0, b, chunk):
            naive.attention(q[i:i + chunk], k[i:i + chunk], v[i:i + chunk], causal=causal)

    t_naive = _median_ms(cupy, run_naive)
    print(f"{label:34s} {t_naive:9.3f} {flops / t_naive / 1e9:8.1f}")
    print(f"cuflash is {t_naive / t_flash:.1f}x faster than naive CuPy attention")


def _naive_bytes(h, n) -> int:
    """Device memory naive CuPy attention takes for one batch entry: a few (H, N, N) float32 copies."""
    return 4 * h * n * n * 4


def _naive_chunk(b, h, n, free) -> int:
    """Batch entries per naive call that keep its score matrices within half the free memory."""
    return min(b, int(free // 2 // _naive_bytes(h, n)))


def _median_ms(cupy, fn, repeat=20) -> float:
    fn()   # warm-up
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def run_cpu(ap, b, h, n, d, dtype, causal):
    scores = b * h * n * n
    if scores > CPU_MAX_SCORES:
        ap.error(f"without a GPU the NumPy run keeps whole score matrices: B*H*N^2 = {scores:,} is over "
                 f"its limit of {CPU_MAX_SCORES:,}; lower --batch, --heads or --seqlen")
    try:
        q, k, v = random_inputs(b, h, n, d, dtype)
    except ImportError:
        ap.error("--dtype bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    print("running the kernel's algorithm in NumPy float64 instead (cuflash.reference.tiled_attention)")
    print(f"problem: {describe(b, h, n, d, dtype, causal)} (values of that dtype, computed in float64)")
    t0 = time.perf_counter()
    tiled, lse = reference.tiled_attention(q, k, v, causal=causal, return_lse=True)
    elapsed = time.perf_counter() - t0
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    print(f"max |tiled - reference| = {np.abs(tiled - ref).max():.2e} (out), "
          f"{np.abs(lse - ref_lse).max():.2e} (lse); tiled run {elapsed:.2f} s")


def main(argv=None) -> int:
    ap, args = parse_args(argv)
    problem = None if args.cpu else _gpu.problem()
    if args.cpu or problem:
        print("--cpu: no GPU run" if args.cpu else f"no GPU run: {problem}")
        run_cpu(ap, *sizes(args, on_gpu=False), args.dtype, args.causal)
    else:
        run_gpu(*sizes(args, on_gpu=True), args.dtype, args.causal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
