"""Ring attention over several GPUs: a causal, grouped-query problem sharded along the sequence.

    python examples/ring_attention.py --gpus 2                    # spawns one process per GPU (NCCL)
    torchrun --nproc-per-node 2 examples/ring_attention.py        # processes started by torchrun
    python examples/ring_attention.py --cpu --ranks 4             # the stand-in: threads, NumPy reference

Every rank draws the whole problem from one seed, keeps its zigzag shard (`shard`), runs
`ring_attention` and its backward, and checks its rows against cuflash.attention on the whole
sequence (on the CPU: cuflash.reference). The NCCL path has not been run on several GPUs yet.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
from cuflash import distributed  # noqa: E402


def problem(xp, n, dtype, seed=0):
    """q (1, 2, 4, n, 64) against k, v (1, 2, 1, n, 64) and dout: GQA 4:1, drawn from ``seed``."""
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16   # CuPy's bfloat16 needs it too
    rng = np.random.default_rng(seed)
    shapes = ((1, 2, 4, n, 64), (1, 2, 1, n, 64), (1, 2, 1, n, 64), (1, 2, 4, n, 64))
    return [xp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in shapes]


def rank_main(comm, n, dtype):
    """This rank's part: its shard through the ring, then its rows against attention on the whole
    sequence. Returns the largest differences of out and dq and of dk, dv (float64)."""
    xp = comm.xp
    whole = problem(xp, n, dtype)
    q, k, v, dout = (distributed.shard(x, comm.size, layout="zigzag")[comm.rank] for x in whole)
    out, vjp = distributed.ring_attention_vjp(q, k, v, comm, causal=True, layout="zigzag")
    dq, dk, dv = vjp(dout)
    single = cuflash if xp is not np else cuflash.reference
    want_out, want_lse = single.attention(*whole[:3], causal=True, return_lse=True)
    want = [want_out, *single.attention_backward(whole[3], *whole[:3], want_out, want_lse, causal=True)]
    rows = distributed.shard_positions(n, comm.size, comm.rank, layout="zigzag")
    errors = []
    for got, full in zip((out, dq, dk, dv), want):
        mine = full[..., xp.asarray(rows), :]
        errors.append(float(xp.abs(got.astype(xp.float64) - mine.astype(xp.float64)).max()))
    return errors


def report(rank, errors):
    e_out, e_dq, e_dk, e_dv = errors
    print(f"rank {rank}: max |out - attention| {e_out:.2e}, dq {e_dq:.2e}, dk {e_dk:.2e}, dv {e_dv:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, help="processes to spawn, one per GPU (without torchrun)")
    ap.add_argument("--cpu", action="store_true", help="the single-process stand-in on the CPU reference")
    ap.add_argument("--ranks", type=int, default=4, help="ranks of the stand-in (with --cpu)")
    ap.add_argument("--n", type=int, default=None, help="sequence length (default 8192; 64 with --cpu)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    args = ap.parse_args()
    if args.cpu:
        n = args.n or 64
        for rank, errors in enumerate(distributed.run_ranks(args.ranks, lambda comm: rank_main(comm, n, np.float64))):
            report(rank, errors)
        return
    try:
        cuflash.require_gpu()
    except RuntimeError as err:
        sys.exit(f"ring_attention.py: {err}")
    n = args.n or 8192
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:   # started by torchrun: this process is one rank
        comm = distributed.NcclCommunicator.from_env()
        report(comm.rank, rank_main(comm, n, args.dtype))
        comm.close()
        return
    for rank, errors in enumerate(distributed.launch(rank_main, args.gpus, n, args.dtype)):
        report(rank, errors)


if __name__ == "__main__":
    main()
