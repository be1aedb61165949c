"""Times candidate tile shapes of the forward and backward kernels, to choose the table in
cuflash/_dispatch.py by measurement.

    python bench/tune_tiles.py [--dtype float16] [--seqlen 4096] [--head-dims 64 128 256]

On Hopper only the sm_90a kernels' candidates run. Each candidate is a tile shape that compiles without register spills (tools/check_kernels.py
checks the ones the table picks). Problem: batch = 16384 / N, heads = 2048 / D, as in the
benchmark; CUDA-event median of 20 runs (bench_attention.median_ms). Prints TFLOP/s per candidate, causal and not.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupy
import ml_dtypes  # noqa: F401

import cuflash
from cuflash import _compile, _dispatch
from cuflash._dispatch import BwdTiles, FwdTiles, Sm90BwdTiles, Sm90FwdTiles
from bench_attention import median_ms  # noqa: I001  (this directory)

# (block_m, block_n, warps) and (dcol, step, warps) per head dim, for 16-bit types
FWD_CANDIDATES = {
    64: [(64, 64, 4), (128, 64, 4), (128, 32, 4)],
    128: [(128, 32, 4), (128, 64, 4)],
    256: [(64, 32, 4), (64, 64, 4)],
}
# (block_n, warpgroups, stages, min_blocks) of the Hopper forward (sm_90a only)
SM90_FWD_CANDIDATES = {
    64: [(64, 2, 2, 1), (128, 2, 2, 1)],
    128: [(128, 2, 2, 1), (64, 2, 2, 1)],
    256: [(64, 2, 2, 1)],
}
# (dkdv_dcol, dq_dcol, step, warpgroups, stages, min_blocks[, wide_dkdv]) of the Hopper backward
SM90_BWD_CANDIDATES = {
    64: [(64, 64, 64, 2, 2, 1), (64, 64, 64, 2, 3, 1)],
    128: [(128, 128, 64, 2, 2, 1), (128, 128, 64, 2, 3, 1)],
    256: [(128, 128, 32, 2, 3, 1), (128, 256, 32, 2, 3, 1), (256, 256, 32, 2, 3, 1, True)],
}
BWD_CANDIDATES = {
    64: [(64, 64, 64, 2, 1), (64, 64, 32, 2, 1)],
    128: [(128, 128, 64, 2, 1)],
    256: [(128, 128, 32, 2, 1)],
}
BWD_CANDIDATES = {
    64: [(64, 64, 4), (64, 32, 4)],
    128: [(128, 16, 4), (128, 32, 4)],
    256: [(128, 16, 4), (128, 32, 4)],
}


def fixed(tiles, dtype_name, head_dim):
    return tiles


def flash_attention_2(q, k, v, do, causal, flops):
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
        ms = median_ms(lambda: sdpa(tq, tk, tv, is_causal=causal), [()], 20)
        print(f"fwd D={q.shape[-1]} causal={causal:d} FlashAttention-2:               {flops / ms / 1e9:6.1f}")
        tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
        out = sdpa(tq, tk, tv, is_causal=causal)
        ms = median_ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True), [()], 20)
        print(f"bwd D={q.shape[-1]} causal={causal:d} FlashAttention-2:             {2.5 * flops / ms / 1e9:6.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    args = ap.parse_args()
    n = args.seqlen
    fwd_default, bwd_default = _dispatch.fwd_tiles, _dispatch.bwd_tiles
    sm90_default, sm90_bwd_default = _dispatch.sm90_fwd_tiles, _dispatch.sm90_bwd_tiles
    hopper = _compile.current_arch() == "sm_90a"
    for d in args.head_dims:
        b, h = 16384 // n, 2048 // d
        rng = cupy.random.default_rng(d)
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(args.dtype) for _ in range(4))
        for causal in (False, True):
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            flash_attention_2(q, k, v, do, causal, flops)
            forward = functools.partial(cuflash.attention, q, k, v, causal=causal)
            backward = functools.partial(cuflash.attention_backward, do, q, k, v, out, lse, causal=causal)
            for cand in SM90_FWD_CANDIDATES[d] if hopper else ():
                _dispatch.sm90_fwd_tiles = functools.partial(fixed, Sm90FwdTiles(d, *cand))
                ms = median_ms(forward, [()], 20)
                print(f"fwd D={d} causal={causal:d} sm90 (block_n, warpgroups, stages, min_blocks)={cand}: "
                      f"{flops / ms / 1e9:6.1f}")
            _dispatch.sm90_fwd_tiles = functools.partial(fixed, None)
            for bm, bn, w in () if hopper else FWD_CANDIDATES[d]:
                _dispatch.fwd_tiles = functools.partial(fixed, FwdTiles(d, d, bm, bn, w))
                ms = median_ms(forward, [()], 20)
                print(f"fwd D={d} causal={causal:d} block_m={bm:3d} block_n={bn:3d} warps={w}: {flops / ms / 1e9:6.1f}")
            _dispatch.fwd_tiles, _dispatch.sm90_fwd_tiles = fwd_default, sm90_default
            for cand in SM90_BWD_CANDIDATES[d] if hopper else ():
                _dispatch.sm90_bwd_tiles = functools.partial(fixed, Sm90BwdTiles(d, *cand))
                ms = median_ms(backward, [()], 20)
                print(f"bwd D={d} causal={causal:d} sm90 (dkdv_dcol, dq_dcol, step, warpgroups, stages, min_blocks)={cand}: "
                      f"{2.5 * flops / ms / 1e9:6.1f}", flush=True)
            _dispatch.sm90_bwd_tiles = sm90_bwd_default
            for dcol, step, w in () if hopper else BWD_CANDIDATES[d]:
                _dispatch.bwd_tiles = functools.partial(fixed, BwdTiles(d, dcol, step, w))
                ms = median_ms(backward, [()], 20)
                print(f"bwd D={d} causal={causal:d} dcol={dcol:3d} step={step:3d} warps={w}: "
                      f"{2.5 * flops / ms / 1e9:6.1f}", flush=True)
            _dispatch.bwd_tiles = bwd_default


if __name__ == "__main__":
    main()
