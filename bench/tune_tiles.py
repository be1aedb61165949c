"""Times candidate tile shapes of the forward and backward kernels, to choose the table in
cuflash/_tiles.py by measurement.

    python bench/tune_tiles.py [--dtype float16] [--seqlen 4096 ...] [--head-dims 64 128 256]
                               [--direction fwd bwd]

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

import cuflash  # noqa: E402

try:
    cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
except RuntimeError as err:
    sys.exit(f"tune_tiles.py: {err}")

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402,F401

from cuflash import _compile, _dispatch, _plans, _tiles
from cuflash._tiles import BwdTiles, FwdTiles, Sm90BwdTiles, Sm90FwdTiles
from bench_attention import median_ms  # noqa: I001  (this directory)

# (block_m, block_n, warps) and (dcol, step, warps) per head dim, for 16-bit types
FWD_CANDIDATES = {
    64: [(64, 64, 4), (128, 64, 4), (128, 32, 4)],
    128: [(128, 32, 4), (128, 64, 4)],
    256: [(64, 32, 4), (64, 64, 4)],
}
# The Hopper forward (sm_90a only): ("ws", block_n, stages[, pingpong[, q_buffers[, consumers]]]) for the
# kernel with a loading warpgroup (through tensor maps where they describe the inputs; pingpong:
# its computing warpgroups take turns issuing products; one Q buffer where two do not fit; three
# computing warpgroups of 64 rows each, through tensor maps only), else (block_n, warpgroups, stages, min_blocks) of
# attn_fwd_sm90 (one warpgroup per block and 2-4 blocks per SM: the blocks' prologues and
# softmaxes overlap each other's products without a barrier between them)
SM90_FWD_CANDIDATES = {
    64: [("ws", 128, 2), ("ws", 128, 2, True), ("ws", 128, 2, False, 2, 3), ("ws", 128, 3, False, 2, 3), (64, 2, 2, 1), (64, 1, 2, 3),
         (64, 1, 2, 4), (128, 1, 2, 2)],
    128: [("ws", 128, 2), ("ws", 128, 2, True), ("ws", 176, 2, False, 1), (128, 2, 2, 1), (64, 2, 2, 1),
          (64, 1, 2, 2)],
    256: [(64, 2, 2, 1), ("ws", 64, 2, False, 1), ("ws", 64, 2, True, 1), ("ws", 80, 2, False, 1)],
}


def hopper_fwd(d, *cand):
    """A Hopper forward candidate as the tiles hopper_fwd_tiles returns."""
    if cand[0] == "ws":
        block_n, stages = cand[1:3]
        pingpong, q_buffers = (cand[3] if len(cand) > 3 else False), (cand[4] if len(cand) > 4 else 2)
        consumers = cand[5] if len(cand) > 5 else 2
        return _tiles.Sm90WsFwdTiles(d, block_n, stages, pingpong=pingpong, q_buffers=q_buffers, consumers=consumers)
    return Sm90FwdTiles(d, *cand)
# (dkdv_dcol, dq_dcol, step, warpgroups, stages, min_blocks[, wide_dkdv, dq_step, dq_stages, dkdv_ws_stages,
# dq_ws_stages]) of the Hopper backward (ws stages: the passes on a loading warpgroup)
# (three or more stages: a step's gradient products run during the next step; one warpgroup
# per block and two blocks per SM: no barrier between the two sets of 64 resident rows)
SM90_BWD_CANDIDATES = {
    64: [(64, 64, 64, 2, 3, 1, False, 128, 3), (64, 64, 64, 2, 4, 1, False, 128, 3),
         (64, 64, 64, 1, 3, 2, False, 128, 2), (64, 64, 64, 1, 3, 2, False, 64, 3),
         (64, 64, 64, 1, 4, 2, False, 64, 4), (64, 64, 64, 1, 3, 2, False, 128, 2, 4)],
    128: [(128, 128, 64, 2, 2, 1), (128, 128, 64, 2, 2, 1, False, 0, 0, 2), (128, 128, 64, 2, 2, 1, False, 0, 0, 2, 2),
          (128, 128, 64, 2, 2, 1, False, 0, 0, 2, 3), (128, 128, 64, 2, 2, 1, False, 0, 0, 3, 2),
          (128, 128, 64, 2, 2, 1, False, 128, 0, 2, 2)],
    256: [(256, 256, 32, 2, 3, 1, True), (128, 128, 32, 2, 3, 1), (256, 256, 32, 2, 3, 1, True, 0, 0, 0, 3),
          (256, 256, 32, 2, 3, 1, True, 0, 0, 3), (256, 256, 32, 2, 3, 1, True, 0, 0, 4, 3)],
}
BWD_CANDIDATES = {
    64: [(64, 64, 4), (64, 32, 4)],
    128: [(128, 16, 4), (128, 32, 4)],
    256: [(128, 16, 4), (128, 32, 4)],
}


def fixed(tiles, *table_args):
    return tiles


def flash_attention_2(q, k, v, do, causal, flops, directions):
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
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--seqlen", nargs="+", type=int, default=[4096])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--direction", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    args = ap.parse_args()
    for n in args.seqlen:
        for d in args.head_dims:
            tune(args.dtype, n, d, args.direction)


def tune(dtype, n, d, directions):
    """Prints TFLOP/s of each candidate (and of FlashAttention-2) at one (N, D)."""
    hopper = _compile.current_arch() == "sm_90a"
    b, h = 16384 // n, 2048 // d
    rng = cupy.random.default_rng(d)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(dtype) for _ in range(4))
    for causal in (False, True):
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        flash_attention_2(q, k, v, do, causal, flops, directions)
        runs = {
            "fwd": (functools.partial(cuflash.attention, q, k, v, causal=causal), flops),
            "bwd": (functools.partial(cuflash.attention_backward, do, q, k, v, out, lse, causal=causal), 2.5 * flops),
        }
        if hopper:
            table = {"fwd": ("hopper_fwd_tiles", hopper_fwd, SM90_FWD_CANDIDATES),
                     "bwd": ("sm90_bwd_tiles", Sm90BwdTiles, SM90_BWD_CANDIDATES)}
        else:
            table = {"fwd": ("fwd_tiles", lambda d, *c: FwdTiles(d, d, *c), FWD_CANDIDATES),
                     "bwd": ("bwd_tiles", BwdTiles, BWD_CANDIDATES)}
        for direction in directions:
            attr, make, candidates = table[direction]
            fn, work = runs[direction]
            default = getattr(_dispatch, attr)
            expected = fn()
            for cand in candidates[d]:
                setattr(_dispatch, attr, functools.partial(fixed, make(d, *cand)))
                _plans.clear()  # a kept plan would launch the previous tiles
                ms = median_ms(fn, [()], 20)
                print(f"{direction} N={n} D={d} causal={causal:d} {cand}: {work / ms / 1e9:6.1f}"
                      f"{'' if agrees(fn(), expected) else '  DIFFERS from the default tiles'}", flush=True)
            setattr(_dispatch, attr, default)
            _plans.clear()


def agrees(got, expected) -> bool:
    """A candidate's results against the default tiles' (another summation order): within
    1 % of each output's largest magnitude. A sanity check, not the test suite."""
    got, expected = (x if isinstance(x, tuple) else (x,) for x in (got, expected))
    return all(
        float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
        <= 0.01 * float(cupy.abs(b.astype(cupy.float32)).max())
        for a, b in zip(got, expected)
    )

if __name__ == "__main__":
    main()
