"""Times candidate tile shapes of the forward and backward kernels, to choose the table in
cuflash/_tiles.py by measurement.

    python bench/tune_tiles.py [--dtype float16] [--seqlen 4096 ...] [--head-dims 64 128 256]
                               [--direction fwd bwd]

The candidates are cuflash._tiles' tables (SM90_WS_FWD_CANDIDATES and its siblings; on Hopper
only the sm_90a kernels' ones run): the tests run each against the reference and CI compiles
each, so add a shape there. Problem: batch = 16384 / N, heads = 2048 / D, as in the
benchmark; CUDA-event median of 20 runs (bench_attention.median_ms). Prints TFLOP/s per
candidate, causal and not.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
from cuflash import _compile, _dispatch, _plans, _tiles  # noqa: E402


def fixed(tiles, *table_args):
    return tiles


def flash_attention_2(q, k, v, do, causal, flops, directions, median_ms):
    """The rival in the same process, to read the candidates' numbers against (torch SDPA's
    FlashAttention-2 backend; skipped without torch)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
    except ImportError:
        return
    tq, tk, tv, tdo = (torch.from_dlpack(x) for x in (q, k, v, do))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        where = f"N={q.shape[-2]} D={q.shape[-1]} causal={causal:d} FlashAttention-2"
        if "fwd" in directions:
            ms = median_ms(lambda: sdpa(tq, tk, tv, is_causal=causal), [()], 20)
            print(f"fwd {where}: {flops / ms / 1e9:6.1f}")
        if "bwd" in directions:
            tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
            out = sdpa(tq, tk, tv, is_causal=causal)
            ms = median_ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True), [()], 20)
            print(f"bwd {where}: {2.5 * flops / ms / 1e9:6.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--seqlen", nargs="+", type=int, default=[4096])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256], choices=(64, 128, 256))
    ap.add_argument("--direction", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    args = ap.parse_args()
    try:
        cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
    except RuntimeError as err:
        sys.exit(f"tune_tiles.py: {err}")
    for n in args.seqlen:
        for d in args.head_dims:
            tune(args.dtype, n, d, args.direction)


def tune(dtype, n, d, directions):
    """Prints TFLOP/s of each candidate (and of FlashAttention-2) at one (N, D). A
    loading-warpgroup forward loads through tensor maps where they describe the inputs."""
    import cupy
    import ml_dtypes  # noqa: F401
    from bench_attention import median_ms  # (this directory)

    hopper = _compile.current_arch() == "sm_90a"
    b, h = 16384 // n, 2048 // d
    rng = cupy.random.default_rng(d)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(dtype) for _ in range(4))
    for causal in (False, True):
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        flash_attention_2(q, k, v, do, causal, flops, directions, median_ms)
        runs = {
            "fwd": (functools.partial(cuflash.attention, q, k, v, causal=causal), flops),
            "bwd": (functools.partial(cuflash.attention_backward, do, q, k, v, out, lse, causal=causal), 2.5 * flops),
        }
        if hopper:
            table = {"fwd": ("hopper_fwd_tiles", _tiles.SM90_WS_FWD_CANDIDATES[d] + _tiles.SM90_FWD_CANDIDATES[d]),
                     "bwd": ("sm90_bwd_tiles", _tiles.SM90_BWD_CANDIDATES[d])}
        else:
            table = {"fwd": ("fwd_tiles", _tiles.FWD_CANDIDATES[d]), "bwd": ("bwd_tiles", _tiles.BWD_CANDIDATES[d])}
        for direction in directions:
            attr, candidates = table[direction]
            fn, work = runs[direction]
            default = getattr(_dispatch, attr)
            expected = fn()
            for cand in candidates:
                setattr(_dispatch, attr, functools.partial(fixed, cand))
                _plans.clear()  # a kept plan would launch the previous tiles
                ms = median_ms(fn, [()], 20)
                print(f"{direction} N={n} D={d} causal={causal:d} {cand}: {work / ms / 1e9:6.1f}"
                      f"{'' if agrees(fn(), expected) else '  DIFFERS from the default tiles'}", flush=True)
            setattr(_dispatch, attr, default)
            _plans.clear()


def agrees(got, expected) -> bool:
    """A candidate's results against the default tiles' (another summation order): within
    1 % of each output's largest magnitude. A sanity check, not the test suite."""
    import cupy

    got, expected = (x if isinstance(x, tuple) else (x,) for x in (got, expected))
    return all(
        float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
        <= 0.01 * float(cupy.abs(b.astype(cupy.float32)).max())
        for a, b in zip(got, expected)
    )

if __name__ == "__main__":
    main()
