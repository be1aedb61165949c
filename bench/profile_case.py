"""One grid cell's forward and backward, a few times over, for a profiler to attach to.

    ncu --clock-control none -k regex:attn --launch-skip 8 --launch-count 4 \\
        python bench/profile_case.py --seqlen 4096 --head-dim 64

The inputs have the grid's shape (batch 16384/N, heads 2048/D). Without a profiler it
prints each direction's median time, so it also works as a quick check of one cell.
``--impl cuflash-any`` runs cuflash's backward with ``deterministic=False``; ``--impl
torch-cudnn`` runs torch SDPA's cuDNN backend on the same inputs instead (the backward
through autograd), to set the rival's kernels beside cuflash's in the profiler.
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

import bench_attention as ba  # noqa: E402, I001  (this directory)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--impl", choices=("cuflash", "cuflash-any", "torch-cudnn"), default="cuflash",
                    help="whose kernels run (default: cuflash; cuflash-any: its backward with deterministic=False)")
    args = ap.parse_args()
    n, d = args.seqlen, args.head_dim
    b, h = 16384 // n, 2048 // d
    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(args.dtype) for _ in range(4))
    flops = 4 * b * h * n * n * d / (2 if args.causal else 1)
    if args.impl == "torch-cudnn":
        fwd, bwd = cudnn_calls(q, k, v, do, args.causal)
    else:
        fwd, bwd = cuflash_calls(q, k, v, do, args.causal, args.impl == "cuflash")
    for name, fn, work in (("fwd", fwd, flops), ("bwd", bwd, 2.5 * flops)):
        ms = ba.median_ms(fn, [()], args.repeat)
        print(f"{name} N={n} D={d} causal={args.causal:d} {args.dtype} {args.impl}: {ms:8.3f} ms "
              f"{work / ms / 1e9:6.1f} TFLOP/s")


def cuflash_calls(q, k, v, do, causal, deterministic=True):
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    return (lambda: cuflash.attention(q, k, v, causal=causal),
            lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=deterministic))


def cudnn_calls(q, k, v, do, causal):
    if "torch-cudnn" not in ba.TORCH_BACKENDS:
        sys.exit("profile_case.py: --impl torch-cudnn needs torch")
    torch = ba.torch
    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_() for x in (q, k, v))
    tdo = torch.from_dlpack(do)

    def fwd():
        with ba.sdpa_kernel(ba.TORCH_BACKENDS["torch-cudnn"]):
            return ba.sdpa(tq, tk, tv, is_causal=causal)

    out = fwd()
    return fwd, lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)


if __name__ == "__main__":
    main()
