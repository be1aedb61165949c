"""Ring attention on the GPU (docs/contract.md, "Ring attention"): the single-process stand-in
running cuflash's kernels on one device, and the NCCL communicator across two or more GPUs, each
against the float64 reference over the whole sequence under the accuracy criterion (c = 2 for
out, 3 for the gradients, against cuflash.naive on the whole sequence). Skipped without a GPU
(and the NCCL tests without two).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GPU_MISSING, assert_close_to_reference, assert_lse_close, random_array, requires_gpu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = requires_gpu

if GPU_MISSING is None:
    import cupy
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    from cuflash import _checks, distributed, naive, reference

N_DEVICES = cupy.cuda.runtime.getDeviceCount() if GPU_MISSING is None else 0
needs_two_gpus = pytest.mark.skipif(N_DEVICES < 2, reason=f"needs 2 GPUs for NCCL, {N_DEVICES} here")
DTYPES = ("float16", "bfloat16", "float32")
MASKS = ({}, {"causal": True}, {"window": (40, 9)}, {"causal": True, "window": (100, None)})


def keywords(rng, mods, batch):
    kw = {}
    if "softcap" in mods:
        kw["softcap"] = 20.0
    if "alibi" in mods:
        kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, batch[-1:]).astype(np.float32))
    if "sinks" in mods:
        kw["sinks"] = cupy.asarray(rng.normal(0, 2, batch[-1:]).astype(np.float32))
    return kw


def host(kw):
    return {k: (v.get() if hasattr(v, "get") else v) for k, v in kw.items()}


def naive_whole(q, k, v, dout, cu, **kw):
    """cuflash.naive over the whole sequence (each packed sequence alone), k and v expanded to
    q's heads for its backward: out and the host gradients dq, dk, dv (in the expanded shapes),
    and dsinks per batch entry, summed over the sequences, with sinks."""
    shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    q, k, v = (cupy.ascontiguousarray(cupy.broadcast_to(x, shape + x.shape[-2:])) for x in (q, k, v))
    n = q.shape[-2]
    bounds = [0, n] if cu is None else [int(x) for x in cu]
    out = cupy.zeros(shape + (n, v.shape[-1]), dtype=q.dtype)
    grads = [cupy.zeros(x.shape, dtype=x.dtype) for x in (q, k, v)]
    dsinks = np.zeros(shape)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        part = [cupy.ascontiguousarray(x[..., a:b, :]) for x in (q, k, v)]
        o, lse = naive.attention(*part, return_lse=True, **kw)
        out[..., a:b, :] = o
        got = naive.attention_backward(cupy.ascontiguousarray(dout[..., a:b, :]), *part, o, lse, **kw)
        for g, dg in zip(grads, got[:3]):
            g[..., a:b, :] = dg
        if "sinks" in kw:
            dsinks += cupy.asnumpy(got[3]).reshape(shape)
    return out.get(), [g.get() for g in grads] + ([dsinks] if "sinks" in kw else [])


def check_ring(size, layout, dtype, rng, n_chunk=64, heads=(2, 3), gqa=False, d=64, mods=(), cuts=None, **mask):
    """The stand-in on this GPU (size ranks as threads) against the reference and naive."""
    n = 2 * n_chunk * size
    if gqa:
        q = random_array(rng, (2, 2, 2, n, d), dtype)
        k, v = (random_array(rng, (2, 2, 1, n, d), dtype) for _ in range(2))
    else:
        q, k, v = (random_array(rng, heads + (n, d), dtype) for _ in range(3))
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    kw = keywords(rng, mods, batch)
    whole = dict(mask, **host(kw))
    ring = dict(mask, layout=layout, **kw)
    if cuts is not None:
        cu = np.asarray([0, *sorted(cuts), n], dtype=np.int32)
        whole.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
        ring["cu_seqlens"] = cu
    dout = random_array(rng, batch + (n, d), dtype)
    shards = [distributed.shard(x, size, layout=layout) for x in (q, k, v, dout)]

    def rank(comm):
        qs, ks, vs, ds = (s[comm.rank] for s in shards)
        out, lse = distributed.ring_attention(qs, ks, vs, comm, return_lse=True, **ring)
        return (out, lse) + tuple(distributed.ring_attention_backward(ds, qs, ks, vs, out, lse, comm, **ring))

    results = distributed.run_ranks(size, rank, xp=cupy)
    hq, hk, hv, hd = (x.get().astype(np.float64) for x in (q, k, v, dout))
    ref_out, ref_lse = reference.attention(hq, hk, hv, return_lse=True, **whole)
    ref_grads = reference.attention_backward(hd, hq, hk, hv, ref_out, ref_lse, **whole)
    n_out, n_grads = naive_whole(q, k, v, dout, cuts and whole["cu_seqlens_q"], **dict(mask, **kw))
    got = [distributed.unshard([r[i] for r in results], layout=layout, axis=-1 if i == 1 else -2).get()
           for i in range(5)]
    assert got[0].dtype == q.dtype and got[1].dtype == np.float32
    assert_close_to_reference("out", got[0], n_out, ref_out, q.dtype, c=2)
    assert_lse_close(got[1], ref_lse)
    for name, g, ng, want in zip(("dq", "dk", "dv"), got[2:], n_grads, ref_grads):
        ng = _checks.sum_to_shape(ng.astype(np.float64), want.shape)
        assert_close_to_reference(name, g, ng, want, q.dtype, c=3)
    if "sinks" in kw:   # each rank's rows' share, summed over the ranks
        dsinks = sum(r[5] for r in results).get()
        assert dsinks.dtype == np.float32 and dsinks.shape == kw["sinks"].shape
        naive_dsinks = _checks.sum_to_shape(n_grads[3], dsinks.shape)
        assert_close_to_reference("dsinks", dsinks, naive_dsinks, ref_grads[3], q.dtype, c=3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(1, 8), layout=st.sampled_from(("contiguous", "zigzag")), dtype=st.sampled_from(DTYPES),
       mask=st.sampled_from(MASKS), gqa=st.booleans(), mods=st.sets(st.sampled_from(("softcap", "alibi", "sinks"))),
       seed=st.integers(0, 2**32 - 1))
def test_stand_in_on_the_gpu_is_attention_over_the_whole_sequence(size, layout, dtype, mask, gqa, mods, seed):
    check_ring(size, layout, dtype, np.random.default_rng(seed), n_chunk=24, gqa=gqa, mods=mods, **mask)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("size", [2, 4])
def test_stand_in_on_the_fast_kernels(dtype, size):
    """Shards long enough for the Hopper kernels (D 128, 1024 rows a rank), zigzag and causal."""
    check_ring(size, "zigzag", dtype, np.random.default_rng(size), n_chunk=512, heads=(1, 2), d=128, causal=True)


@pytest.mark.parametrize("mods", [(), ("alibi", "sinks")])
def test_stand_in_with_packed_sequences(mods):
    """Packed sequences across shard boundaries: packed calls with the GPU's own offsets."""
    rng = np.random.default_rng(5)
    check_ring(3, "contiguous", "bfloat16", rng, n_chunk=40, mods=mods, cuts=[7, 100, 101, 180], causal=True)


def test_ring_alibi_keeps_the_criterion_on_long_shards():
    """ALiBi off the diagonal, in row chunks of ALIBI_SPAN / slope: 4 ranks of 2048 rows."""
    check_ring(4, "contiguous", "float16", np.random.default_rng(9), n_chunk=1024, heads=(1, 2), d=64,
               mods=("alibi",), causal=True)


# ---------------------------------------------------------------------------------------------
# NCCL: one process per GPU (launch)
# ---------------------------------------------------------------------------------------------


def nccl_rank(comm, seed, size, layout, mask):
    """Rank comm.rank's shard of a problem drawn from ``seed``, forward and backward (host results)."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    n = 2 * 256 * size
    arrays = [rng.standard_normal((2, 4, n, 64)).astype(np.float16) for _ in range(4)]
    q, k, v, dout = (cp.asarray(distributed.shard(x, size, layout=layout)[comm.rank]) for x in arrays)
    out, lse = distributed.ring_attention(q, k, v, comm, return_lse=True, layout=layout, **mask)
    grads = distributed.ring_attention_backward(dout, q, k, v, out, lse, comm, layout=layout, **mask)
    return [x.get() for x in (out, lse, *grads)]


def nccl_bad_rank(comm):
    """Rank 1 gives q of another head dim: every rank raises the same ValueError."""
    import cupy as cp

    x = cp.ones((1, 2, 64, 64 if comm.rank == 0 else 32), dtype=cp.float16)
    try:
        distributed.ring_attention(x, x, x, comm)
    except ValueError as err:
        return str(err)
    return None


def nccl_dying_rank(comm):
    """Rank 1 leaves once the handshake is done, as it is about to send its K/V: rank 0, waiting
    for them, times out and says which error it got."""
    import os

    import cupy as cp

    x = cp.ones((1, 2, 4096, 64), dtype=cp.float16)
    if comm.rank == 1:
        comm.sendrecv = lambda *args: os._exit(7)
    try:
        distributed.ring_attention(x, x, x, comm)
    except distributed.RingError as err:
        return type(err).__name__
    return None


@needs_two_gpus
@pytest.mark.parametrize("layout, mask", [("zigzag", {"causal": True}), ("contiguous", {})])
def test_nccl_ring_is_attention_over_the_whole_sequence(layout, mask):
    size = min(N_DEVICES, 4)
    results = distributed.launch(nccl_rank, size, 3, size, layout, mask, timeout=600, comm_timeout=120)
    rng = np.random.default_rng(3)
    n = 2 * 256 * size
    q, k, v, dout = (rng.standard_normal((2, 4, n, 64)).astype(np.float16) for _ in range(4))
    host_in = [x.astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*host_in, return_lse=True, **mask)
    ref_grads = reference.attention_backward(dout.astype(np.float64), *host_in, ref_out, ref_lse, **mask)
    n_out, n_grads = naive_whole(*(cupy.asarray(x) for x in (q, k, v, dout)), None, **mask)   # no broadcast
    got = [distributed.unshard([r[i] for r in results], layout=layout, axis=-1 if i == 1 else -2) for i in range(5)]
    assert_close_to_reference("out", got[0], n_out, ref_out, np.float16, c=2)
    assert_lse_close(got[1], ref_lse)
    for name, g, ng, want in zip(("dq", "dk", "dv"), got[2:], n_grads, ref_grads):
        assert_close_to_reference(name, g, ng, want, np.float16, c=3)


@needs_two_gpus
def test_nccl_errors_reach_every_rank():
    messages = distributed.launch(nccl_bad_rank, 2, timeout=300, comm_timeout=60)
    assert messages[0] == messages[1] and "the ranks disagree on q's shape" in messages[0]


@needs_two_gpus
def test_nccl_rank_that_dies_times_the_others_out():
    with pytest.raises(distributed.LaunchError, match="rank 1 ---\nthe process exited with code 7") as err:
        distributed.launch(nccl_dying_rank, 2, timeout=300, comm_timeout=20)
    assert err.value.results == {0: "RingTimeoutError"}
