"""Packed variable-length sequences and native grouped-query attention on the GPU, against the
float64 reference (docs/contract.md: packed sequences, grouped-query attention, accuracy)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    GPU_MISSING,
    assert_close_to_reference,
    assert_lse_close,
    poisoned_allocations,
    random_array,
    requires_gpu,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = requires_gpu

if GPU_MISSING is None:
    import cupy
    import ml_dtypes  # noqa: F401

    import cuflash
    from cuflash import _plans, naive, reference

DTYPES = ("float16", "bfloat16", "float32")
MASKS = ({}, {"causal": True}, {"window": (20, 7)}, {"window": (None, 0)}, {"window": (5, None)})


def offsets(lengths):
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)


def packed_naive(q, k, v, cu_q, cu_k, **mask):
    """The plain matmul-softmax-matmul of each sequence, in the input dtype: the criterion's baseline."""
    out = cupy.zeros(np.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + (q.shape[-2], v.shape[-1]), dtype=q.dtype)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        if q1 > q0 and k1 > k0:
            shape = out.shape[:-2]
            qs, ks, vs = (cupy.ascontiguousarray(cupy.broadcast_to(x, shape + x.shape[-2:]))
                          for x in (q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :]))
            out[..., q0:q1, :] = naive.attention(qs, ks, vs, **mask)
    return cupy.asnumpy(out)


def check_packed(q, k, v, lengths_q, lengths_k, dout=None, **mask):
    """Forward (and with dout the backward) over packed sequences against the reference."""
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    seqs = {"cu_seqlens_q": cupy.asarray(cu_q), "cu_seqlens_k": cupy.asarray(cu_k)}
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **seqs, **mask)
    host = [cupy.asnumpy(x) for x in (q, k, v)]
    keys = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    r_out, r_lse = reference.attention(*host, return_lse=True, **keys, **mask)
    assert out.shape == r_out.shape and out.dtype == q.dtype and lse.shape == r_lse.shape
    nv = packed_naive(q, k, v, cu_q, cu_k, **mask)
    assert_close_to_reference("out", cupy.asnumpy(out), nv, r_out, q.dtype, c=2)
    assert_lse_close(cupy.asnumpy(lse), r_lse)
    if dout is None:
        return out, lse
    with poisoned_allocations():
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **seqs, **mask)
    hdo = cupy.asnumpy(dout)
    refs = reference.attention_backward(hdo, *host, r_out, r_lse, **keys, **mask)
    naive_grads = packed_naive_backward(dout, q, k, v, out, lse, cu_q, cu_k, **mask)
    # dq and dk hold ds = p (dp - delta), whose terms cancel: their rounding is at the scale
    # of |dp| + |delta| times the scale and the k or q rows summed (as in test_backward.py)
    hq, hk, hv, hd = (np.asarray(x, dtype=np.float64) for x in (*host, hdo))
    scale = mask.get("scale", 1 / np.sqrt(q.shape[-1]))
    dp = max((np.abs(hd[..., q0:q1, :] @ np.swapaxes(hv[..., k0:k1, :], -1, -2)).max(initial=0)
              for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])), default=0)
    cancel = scale * (dp + np.abs((hd * r_out).sum(-1)).max(initial=0))
    term_scales = (cancel * np.abs(hk).max(initial=0), cancel * np.abs(hq).max(initial=0), 0.0)
    for name, got, nv, ref, x, ts in zip(("dq", "dk", "dv"), grads, naive_grads, refs, (q, k, v), term_scales):
        assert got.shape == x.shape and got.dtype == x.dtype
        assert_close_to_reference(name, cupy.asnumpy(got), nv, ref, q.dtype, c=3, term_scale=ts)
    return out, lse, grads


def packed_naive_backward(dout, q, k, v, out, lse, cu_q, cu_k, **mask):
    """The naive backward chain of each sequence (k, v repeated over the batch and summed
    back), in float64 arrays of the shapes of q, k, v."""
    from cuflash._checks import sum_to_shape

    grads = [np.zeros(x.shape) for x in (q, k, v)]
    shape = out.shape[:-2]
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        if q1 == q0 or k1 == k0:
            continue
        rows, keys = (..., slice(q0, q1), slice(None)), (..., slice(k0, k1), slice(None))
        qs, ks, vs = (cupy.ascontiguousarray(cupy.broadcast_to(x, shape + x.shape[-2:]))
                      for x in (q[rows], k[keys], v[keys]))
        parts = naive.attention_backward(cupy.ascontiguousarray(dout[rows]), qs, ks, vs,
                                         cupy.ascontiguousarray(out[rows]), cupy.ascontiguousarray(lse[..., q0:q1]),
                                         **mask)
        for g, x, region, part in zip(grads, (q, k, v), (rows, keys, keys), parts):
            g[region] += sum_to_shape(cupy.asnumpy(part).astype(np.float64), x[region].shape)
    return grads


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    d=st.sampled_from((8, 40, 64, 128, 256)),
    lengths=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=7),
    group=st.sampled_from((1, 2, 4)),
    mask=st.sampled_from(MASKS),
    logit=st.sampled_from((1.0, 6.0)),
    seed=st.integers(0, 2**32 - 1),
)
def test_packed_against_reference(dtype, d, lengths, group, mask, logit, seed):
    """Ragged lengths (including empty sequences and sequences without keys or queries),
    GQA by broadcasting, every mask, forward and backward."""
    rng = np.random.default_rng(seed)
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    tq, tk = sum(lq), sum(lk)
    q = random_array(rng, (2, group, tq, d), dtype, logit)
    k = random_array(rng, (2, 1, tk, d), dtype)
    v = random_array(rng, (2, 1, tk, d), dtype)
    dout = random_array(rng, (2, group, tq, d), dtype)
    check_packed(q, k, v, lq, lk, dout, **mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128))
def test_packed_tokens_heads_layout_is_read_in_place(dtype, d):
    """(total, H, D) arrays transposed to (H, total, D), as training code holds them."""
    rng = np.random.default_rng(d)
    lq = [130, 1, 0, 257, 64]
    lk = lq
    t = sum(lq)
    q, dout = (random_array(rng, (t, 8, d), dtype).transpose(1, 0, 2) for _ in range(2))
    k, v = (random_array(rng, (t, 2, d), dtype).transpose(1, 0, 2)[:, None] for _ in range(2))
    q, dout = q.reshape(2, 4, t, d), dout.reshape(2, 4, t, d)   # heads 0-3 share K/V head 0
    assert not q.flags.c_contiguous
    check_packed(q, k, v, lq, lk, dout, causal=True)


def test_packed_equals_dense_on_equal_lengths():
    """S sequences of one length packed give bitwise the dense (S, ...) batch's results."""
    rng = np.random.default_rng(7)
    s, n, h, d = 5, 200, 4, 64
    q, k, v, dout = (random_array(rng, (h, s * n, d), "bfloat16") for _ in range(4))
    cu = cupy.arange(0, s * n + 1, n, dtype=cupy.int32)
    seqs = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "check": False}
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **seqs)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **seqs)
    dense = [x.reshape(h, s, n, d).transpose(1, 0, 2, 3) for x in (q, k, v, dout)]
    d_out, d_lse = cuflash.attention(*dense[:3], causal=True, return_lse=True)
    d_grads = cuflash.attention_backward(dense[3], *dense[:3], d_out, d_lse, causal=True)
    as_dense = lambda x: x.reshape(h, s, n, -1).transpose(1, 0, 2, 3)  # noqa: E731
    assert cupy.array_equal(as_dense(out).view(np.uint16), d_out.view(np.uint16))
    for a, b in zip(grads, d_grads):
        assert cupy.array_equal(as_dense(a).view(np.uint16), b.view(np.uint16))


def test_packed_backward_is_deterministic():
    rng = np.random.default_rng(8)
    lengths = [700, 3, 0, 1500, 64, 129]
    t = sum(lengths)
    q, dout = (random_array(rng, (2, 4, t, 128), "float16") for _ in range(2))
    k, v = (random_array(rng, (2, 1, t, 128), "float16") for _ in range(2))
    cu = cupy.asarray(offsets(lengths))
    seqs = {"cu_seqlens_q": cu, "cu_seqlens_k": cu}
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **seqs)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **seqs)
    second = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **seqs)
    for a, b in zip(first, second):
        assert cupy.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_vjp_takes_the_packed_keywords():
    rng = np.random.default_rng(9)
    lengths = [50, 0, 77]
    q, k, v, dout = (random_array(rng, (3, sum(lengths), 64), "float16") for _ in range(4))
    cu = cupy.asarray(offsets(lengths))
    out, vjp = cuflash.attention_vjp(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out2, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert cupy.array_equal(out.view(np.uint16), out2.view(np.uint16))
    want = cuflash.attention_backward(dout, q, k, v, out2, lse, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for a, b in zip(vjp(dout), want):
        assert cupy.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize(
    "cu_q, cu_k, message",
    [
        ([1, 5, 10], [0, 5, 10], "cu_seqlens_q must start at 0"),
        ([0, 6, 5, 10], [0, 5, 5, 10], r"cu_seqlens_q must not decrease, got cu_seqlens_q\[2\] = 5"),
        ([0, 5, 9], [0, 5, 10], "cu_seqlens_q must end at q.shape"),
        ([0, 5, 10], [0, 5, 11], "cu_seqlens_k must end at k.shape"),
        ([0, 5, 10], [0, 10], "the same length"),
    ],
)
def test_check_true_refuses_bad_offsets_before_any_launch(cu_q, cu_k, message):
    q, k, v = (cupy.ones((2, 10, 64), dtype=cupy.float16) for _ in range(3))
    out = cupy.full((2, 10, 64), 7, dtype=cupy.float16)
    lse = cupy.zeros((2, 10), dtype=cupy.float32)
    seqs = {"cu_seqlens_q": cupy.asarray(cu_q, dtype=cupy.int32), "cu_seqlens_k": cupy.asarray(cu_k, dtype=cupy.int32)}
    with pytest.raises(ValueError, match=message):
        cuflash.attention(q, k, v, **seqs)
    with pytest.raises(ValueError, match=message):
        cuflash.attention_backward(out, q, k, v, out, lse, **seqs)
    assert bool((out == 7).all())


def test_packed_argument_errors():
    q = cupy.ones((2, 10, 64), dtype=cupy.float16)
    cu = cupy.asarray([0, 10], dtype=cupy.int32)
    with pytest.raises(ValueError, match="go together"):
        cuflash.attention(q, q, q, cu_seqlens_q=cu)
    with pytest.raises(TypeError, match="int32"):
        cuflash.attention(q, q, q, cu_seqlens_q=cu.astype(cupy.int64), cu_seqlens_k=cu)
    with pytest.raises(TypeError, match="cupy.ndarray"):
        cuflash.attention(q, q, q, cu_seqlens_q=np.asarray([0, 10], np.int32), cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is less than the length 10"):
        cuflash.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4)
    with pytest.raises(ValueError, match="go with cu_seqlens"):
        cuflash.attention(q, q, q, max_seqlen_q=4)


@pytest.mark.parametrize(
    "cu_q, cu_k",
    [
        ([0, 300, 100, 5000], [0, 300, 100, 5000]),          # decreasing, past the end
        ([-7, 120, 2**31 - 1], [0, -50, 400]),                # negative, huge
        ([0, 400, 400, 400, 400], [0, 400, 0, 400, 0]),       # overlapping key ranges
        ([0, 2**31 - 1] * 3, [0, 2**31 - 1] * 3),            # every sequence claiming everything
    ],
)
@pytest.mark.parametrize("d", [64, 128])
def test_check_false_bad_offsets_stay_inside_the_arrays(cu_q, cu_k, d):
    """Bad offsets with check=False give wrong rows, never a read or write outside the
    arrays: guard bytes around every output stay as they were (compute-sanitizer runs the
    same cases, tools/sanitize_cases.py), and valid rows are still right."""
    rng = np.random.default_rng(10)
    h, t = 2, 400
    q, k, v, dout = (random_array(rng, (h, t, d), "float16") for _ in range(4))
    seqs = {"cu_seqlens_q": cupy.asarray(cu_q, dtype=cupy.int32), "cu_seqlens_k": cupy.asarray(cu_k, dtype=cupy.int32),
            "check": False}
    with guarded_allocations() as guards:
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **seqs)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **seqs)
        cupy.cuda.Device().synchronize()   # no CUDA error
    assert out.shape == (h, t, d) and all(g.shape == (h, t, d) for g in grads)
    guards.check()


class _Guards:
    GUARD = 4096   # bytes before and after every allocation
    BYTE = 0x5A

    def __init__(self):
        self.blocks = []

    def malloc(self, size):
        import cupy

        mem = cupy.get_default_memory_pool().malloc(size + 2 * self.GUARD)
        mem.memset_async(self.BYTE, size + 2 * self.GUARD)
        self.blocks.append((mem, size))
        return mem + self.GUARD

    def check(self):
        import cupy

        cupy.cuda.Device().synchronize()
        assert self.blocks
        for mem, size in self.blocks:
            raw = cupy.ndarray((size + 2 * self.GUARD,), dtype=cupy.uint8, memptr=mem)
            for part in (raw[: self.GUARD], raw[self.GUARD + size:]):
                assert bool((part == self.BYTE).all()), "a kernel wrote outside an output array"


class guarded_allocations:   # noqa: N801 (a context manager, named as one)
    """Every CuPy allocation inside gets GUARD bytes of a known value on both sides."""

    def __enter__(self):
        import cupy

        self.guards = _Guards()
        cupy.cuda.set_allocator(self.guards.malloc)
        return self.guards

    def __exit__(self, *exc):
        import cupy

        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


def test_grouped_backward_runs_natively_and_matches_the_expanded_problem():
    """k, v broadcast along the query heads: dk, dv summed over each group inside the
    kernels (no broadcast-size temporary), equal to the sum over the expanded problem's
    per-head gradients within rounding."""
    rng = np.random.default_rng(11)
    b, hkv, g, n, d = 2, 2, 4, 333, 128
    q, dout = (random_array(rng, (b, hkv, g, n, d), "bfloat16") for _ in range(2))
    k, v = (random_array(rng, (b, hkv, 1, n, d), "bfloat16") for _ in range(2))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    plan, _ = _plans.backward(dout, q, k, v, out, lse, True, None, None)
    assert plan.dkdv_entries is not None, "the dk/dv pass did not group"
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    expanded = [cupy.ascontiguousarray(cupy.broadcast_to(x, q.shape)) for x in (k, v)]
    e_dq, e_dk, e_dv = cuflash.attention_backward(dout, q, *expanded, out, lse, causal=True)
    assert cupy.array_equal(dq.view(np.uint16), e_dq.view(np.uint16))
    for got, per_head in ((dk, e_dk), (dv, e_dv)):
        want = per_head.astype(cupy.float32).sum(axis=2, keepdims=True)
        err = float(cupy.abs(got.astype(cupy.float32) - want).max())
        assert err <= 2e-2 * max(1.0, float(cupy.abs(want).max())), err


@pytest.mark.parametrize("b, hq, hkv, n, causal", [(1, 16, 1, 512, True), (2, 32, 8, 256, False), (1, 8, 2, 700, True)])
def test_grouped_backward_peak_memory_is_at_most_the_ungrouped_problems(b, hq, hkv, n, causal):
    """Peak pool growth of a grouped backward <= that of the same problem with K/V
    expanded to every query head (whose gradients are themselves G times larger)."""
    rng = np.random.default_rng(12)
    d = 128
    pool = cupy.get_default_memory_pool()

    def peak_growth(q, k, v, dout):
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        cupy.cuda.Device().synchronize()
        pool.free_all_blocks()
        before = pool.total_bytes()
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        cupy.cuda.Device().synchronize()
        grown = pool.total_bytes() - before
        del grads
        return grown

    q, dout = (random_array(rng, (b, hkv, hq // hkv, n, d), "float16") for _ in range(2))
    k, v = (random_array(rng, (b, hkv, 1, n, d), "float16") for _ in range(2))
    grouped = peak_growth(q, k, v, dout)
    expanded = [cupy.ascontiguousarray(cupy.broadcast_to(x, q.shape)) for x in (k, v)]
    ungrouped = peak_growth(q, *expanded, dout)
    assert grouped <= ungrouped, (grouped, ungrouped)


@pytest.mark.parametrize("hq, hkv", [(16, 1), (32, 8), (8, 2)])
def test_grouped_backward_split_groups(hq, hkv):
    """Few K/V heads and keys leave too few dk/dv blocks to fill the GPU: each group is then
    split in parts whose partial sums are added afterwards; still the reference's gradients."""
    rng = np.random.default_rng(hq + hkv)
    n, d = 256, 64
    q, dout = (random_array(rng, (1, hkv, hq // hkv, n, d), "float16") for _ in range(2))
    k, v = (random_array(rng, (1, hkv, 1, n, d), "float16") for _ in range(2))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    plan, _ = _plans.backward(dout, q, k, v, out, lse, True, None, None)
    assert plan.dkdv_entries is not None and plan.dkdv_entries[1] > 1, plan.dkdv_entries
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    host = [cupy.asnumpy(x) for x in (q, k, v, dout)]
    r_out, r_lse = reference.attention(*host[:3], causal=True, return_lse=True)
    refs = reference.attention_backward(host[3], *host[:3], r_out, r_lse, causal=True)
    for got, ref in zip((dq, dk, dv), refs):
        err = np.abs(cupy.asnumpy(got).astype(np.float64) - ref).max()
        assert err <= 2e-2 * max(1.0, np.abs(ref).max()), err


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("mask", ({}, {"causal": True}, {"window": (40, 3)}))
def test_many_short_tiles(dtype, d, mask):
    """Many short sequences, dense and packed: more tiles than fit the GPU at once (on Hopper at
    D = 128 each block of the forward with a loading warpgroup runs several in turn; at D = 64,
    with at most 128 keys, blocks of one warpgroup run one tile each; cuflash/_tiles.py:
    hopper_fwd_tiles)."""
    rng = np.random.default_rng(d)
    b, h, n = 40, 8, (100 if d == 64 else 190)   # keys short enough for the short-sequence tiles
    q, k, v = (random_array(rng, (b, h, n, d), dtype, 2.0) for _ in range(3))
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **mask)
    host = [cupy.asnumpy(x) for x in (q, k, v)]
    r_out, r_lse = reference.attention(*host, return_lse=True, **mask)
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(naive.attention(q, k, v, **mask)), r_out,
                              q.dtype, c=2)
    assert_lse_close(cupy.asnumpy(lse), r_lse)
    lengths = rng.integers(0, 2 * n, size=60)
    t = int(lengths.sum())
    q, k, v = (random_array(rng, (h, t, d), dtype) for _ in range(3))
    check_packed(q, k, v, lengths.tolist(), lengths.tolist(), **mask)
