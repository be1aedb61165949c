"""GPU backward kernels against the float64 reference, under the accuracy criterion of docs/contract.md (c = 3)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    GPU_MISSING,
    assert_close_to_reference,
    poisoned_allocations,
    random_array,
    requires_gpu,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuflash import _tiles

pytestmark = requires_gpu

if GPU_MISSING is None:
    import cupy
    import ml_dtypes  # noqa: F401

    import cuflash
    from cuflash import naive, reference
    from cuflash._checks import sum_to_shape

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def check_backward(q, k, v, dout, deterministic=True, **mask):
    out, lse = cuflash.attention(q, k, v, return_lse=True, **mask)
    with poisoned_allocations():
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **mask)
    host = [cupy.asnumpy(x) for x in (q, k, v, dout)]
    r_out, r_lse = reference.attention(*host[:3], return_lse=True, **mask)
    refs = reference.attention_backward(host[3], *host[:3], r_out, r_lse, **mask)
    if q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        naive_grads = naive.attention_backward(dout, q, k, v, out, lse, **mask)
    else:  # the naive chain on explicitly repeated k, v, summed back
        shape = q.shape[:-2]
        kb, vb = (cupy.ascontiguousarray(cupy.broadcast_to(x, shape + x.shape[-2:])) for x in (k, v))
        ndq, ndk, ndv = naive.attention_backward(dout, q, kb, vb, out, lse, **mask)
        naive_grads = (ndq,) + tuple(
            sum_to_shape(cupy.asnumpy(g).astype(np.float64), x.shape) for g, x in ((ndk, k), (ndv, v))
        )
    # dq and dk hold ds = p (dp - delta): dp and delta cancel, so their rounding is at the
    # scale of |dp| + |delta|, times the scale and the q or k row the result is summed over
    hq, hk, hv, hdo = (np.asarray(x, dtype=np.float64) for x in host)
    scale = mask.get("scale", 1 / np.sqrt(q.shape[-1]) if q.shape[-1] else 1.0)
    cancel = scale * (np.abs(hdo @ np.swapaxes(hv, -1, -2)).max(initial=0) + np.abs((hdo * r_out).sum(-1)).max(initial=0))
    term_scales = (cancel * np.abs(hk).max(initial=0), cancel * np.abs(hq).max(initial=0), 0.0)
    for name, got, nv, ref, x, ts in zip(("dq", "dk", "dv"), (dq, dk, dv), naive_grads, refs, (q, k, v), term_scales):
        assert got.shape == x.shape and got.dtype == x.dtype
        nv = nv if isinstance(nv, np.ndarray) else cupy.asnumpy(nv)
        assert_close_to_reference(name, cupy.asnumpy(got), nv, ref, q.dtype, c=3, term_scale=ts)
    return dq, dk, dv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_dtype_and_head_dim(dtype, d, causal):
    rng = np.random.default_rng(d * 11 + causal)
    q = random_array(rng, (2, 2, 77, d), dtype)
    k = random_array(rng, (2, 2, 131, d), dtype)
    v = random_array(rng, (2, 2, 131, d), dtype)
    dout = random_array(rng, (2, 2, 77, d), dtype)
    check_backward(q, k, v, dout, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d, dv", [(1, 1), (7, 7), (59, 59), (111, 111), (255, 255), (3, 130), (200, 13)])
def test_odd_head_dims(dtype, d, dv):
    rng = np.random.default_rng(d * 17 + dv)
    q = random_array(rng, (2, 3, 77, d), dtype)
    k = random_array(rng, (2, 1, 131, d), dtype)   # broadcast along the heads: gradients summed
    v = random_array(rng, (2, 1, 131, dv), dtype)
    dout = random_array(rng, (2, 3, 77, dv), dtype)
    for g in check_backward(q, k, v, dout, causal=True):
        assert g.flags.c_contiguous


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    d=st.sampled_from((8, 59, 64, 72, 128, 255)),
    dv=st.sampled_from((8, 13, 64, 128)),
    nq=st.integers(1, 200),
    nk=st.integers(1, 200),
    group=st.integers(1, 3),
    mask=st.sampled_from(({}, {"causal": True}, {"window": (20, 7)}, {"window": (None, 3)})),
    logit=st.sampled_from((1.0, 4.0)),
    seed=st.integers(0, 2**32 - 1),
)
def test_backward_properties(dtype, d, dv, nq, nk, group, mask, logit, seed):
    rng = np.random.default_rng(seed)
    q = random_array(rng, (2, group, nq, d), dtype, logit)
    k = random_array(rng, (2, 1, nk, d), dtype)
    v = random_array(rng, (2, 1, nk, dv), dtype)
    dout = random_array(rng, (2, group, nq, dv), dtype)
    check_backward(q, k, v, dout, **mask)


def test_rows_that_see_no_key_get_zero_gradient():
    rng = np.random.default_rng(1)
    q = random_array(rng, (2, 150, 64), "float16")
    k = random_array(rng, (2, 60, 64), "float16")
    v = random_array(rng, (2, 60, 64), "float16")
    dout = random_array(rng, (2, 150, 64), "float16")
    dq, _, _ = check_backward(q, k, v, dout, causal=True)
    assert (cupy.asnumpy(dq[:, :90]).astype(np.float32) == 0).all()


def test_backward_is_deterministic():
    rng = np.random.default_rng(2)
    q, k, v, dout = (random_array(rng, (2, 4, 300, 128), "bfloat16") for _ in range(4))
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    second = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for a, b in zip(first, second):
        assert cupy.array_equal(a.view(np.uint16), b.view(np.uint16))


LOADING_WARPGROUP_CASES = [
    ((1, 3, 700), (1, 3, 1300), {"causal": True}),        # more keys than queries
    ((1, 2, 1000), (1, 2, 777), {"causal": True}),        # key blocks no row sees
    ((2, 1, 513), (2, 1, 1500), {"window": (100, 50)}),   # few query blocks per key block
    ((2, 1, 4, 400), (2, 1, 1, 400), {}),                 # grouped queries: steps across the group
    ((3, 2, 256), (1, 2, 256), {"window": (None, 0)}),    # k and v broadcast along the batch
]


SM90_BWD_CANDIDATES = [t for ts in _tiles.SM90_BWD_CANDIDATES.values() for t in ts]
BWD_CANDIDATES = [t for ts in _tiles.BWD_CANDIDATES.values() for t in ts]


@pytest.mark.parametrize("tiles", SM90_BWD_CANDIDATES + BWD_CANDIDATES, ids=str)
@pytest.mark.parametrize("q_shape, k_shape, mask", LOADING_WARPGROUP_CASES)
def test_the_tuners_backward_candidates(monkeypatch, tiles, q_shape, k_shape, mask):
    """The Hopper and portable backward shapes bench/tune_tiles.py may time (ring depths and
    steps of the passes with and without a loading warpgroup), also where the default does
    not pick them."""
    from cuflash import _compile, _dispatch, _plans

    hopper = isinstance(tiles, _tiles.Sm90BwdTiles)
    if hopper and _compile.current_arch() != "sm_90a":
        pytest.skip("the Hopper backward passes run on sm_90a only")
    monkeypatch.setattr(_dispatch, "sm90_bwd_tiles", lambda *args: tiles if hopper else None)
    monkeypatch.setattr(_dispatch, "bwd_tiles", lambda *args: tiles)
    _plans.clear()
    try:
        d = tiles.head_dim
        rng = np.random.default_rng(d + len(str(tiles)) + len(mask))
        q = random_array(rng, q_shape + (d,), "float16", 4.0)
        k, v = (random_array(rng, k_shape + (d,), "float16") for _ in range(2))
        batch = np.broadcast_shapes(q_shape[:-1], k_shape[:-1])
        dout = random_array(rng, batch + (q_shape[-1], d), "float16")
        check_backward(q, k, v, dout, **mask)
        if hopper:
            out, lse = cuflash.attention(q, k, v, return_lse=True, **mask)
            plan, _ = _plans.backward(dout, q, k, v, out, lse, mask.get("causal", False), mask.get("window"), None)
            threads = [run.threads for run in plan.launches.runs]
            # the loading warpgroups' launches
            assert threads.count(384) == (tiles.dkdv_ws_stages > 0) + (tiles.dq_ws_stages > 0)
    finally:
        _plans.clear()


def _dq_pass_runs(plan) -> bool:
    """Whether a backward plan has a dq pass (else its dk/dv pass adds dq up)."""
    return plan.launches.dq_sums is None


@pytest.mark.parametrize("dtype, d", [("float16", 64), ("bfloat16", 64), ("float16", 128), ("bfloat16", 128)])
@pytest.mark.parametrize(
    "q_shape, k_shape, mask",
    # the loading-warpgroup cases with rows in multiples of 16 (those the pass adds up)
    [((1, 3, 704), (1, 3, 1300), {"causal": True}), ((1, 2, 1008), (1, 2, 777), {"causal": True}),
     ((2, 1, 528), (2, 1, 1500), {"window": (100, 50)})] + LOADING_WARPGROUP_CASES[3:],
)
def test_dq_added_up_by_the_dkdv_pass(monkeypatch, dtype, d, q_shape, k_shape, mask):
    """deterministic=False on Hopper at head dims 64 and 128: attn_bwd_dkdv_sm90_ws adds dq up in
    float32 and no dq pass runs, here also at lengths where the default would not take it
    (the tiles of 4096 queries forced)."""
    from cuflash import _compile, _dispatch, _plans

    if _compile.current_arch() != "sm_90a":
        pytest.skip("the dk/dv pass that adds dq up is Hopper's (sm_90a)")
    tiles_of = _dispatch.sm90_bwd_tiles
    monkeypatch.setattr(_dispatch, "sm90_bwd_tiles", lambda dt, hd, queries, deterministic, *rest: tiles_of(
        dt, hd, 4096, deterministic, *rest))
    _plans.clear()
    try:
        rng = np.random.default_rng(len(q_shape) + 3 * len(mask) + q_shape[-1] + d)
        q = random_array(rng, q_shape + (d,), dtype, 4.0)
        k, v = (random_array(rng, k_shape + (d,), dtype) for _ in range(2))
        batch = np.broadcast_shapes(q_shape[:-1], k_shape[:-1])
        dout = random_array(rng, batch + (q_shape[-1], d), dtype)
        check_backward(q, k, v, dout, deterministic=False, **mask)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **mask)
        plan, _ = _plans.backward(dout, q, k, v, out, lse, mask.get("causal", False), mask.get("window"), None,
                                  None, False)
        assert [run.threads for run in plan.launches.runs] == [128, 384]   # delta, then dk/dv: no dq pass
        assert not _dq_pass_runs(plan)
    finally:
        _plans.clear()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_not_deterministic_where_it_runs_by_default(dtype, causal, d):
    """deterministic=False as a user calls it: at head dim 128, and from 2048 queries at head
    dim 64, the dk/dv pass adds dq up on Hopper; dk and dv are the same from call to call."""
    from cuflash import _compile, _plans

    rng = np.random.default_rng(11 + causal + d)
    q, k, v, dout = (random_array(rng, (1, 2, 2048, d), dtype, 3.0) for _ in range(4))
    dq, dk, dv = check_backward(q, k, v, dout, deterministic=False, causal=causal)
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=causal)
    again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=False)
    for a, b in zip((dk, dv), again[1:]):
        assert cupy.array_equal(a.view(np.uint16), b.view(np.uint16))
    plan, _ = _plans.backward(dout, q, k, v, out, lse, causal, None, None, None, False)
    assert _dq_pass_runs(plan) == (_compile.current_arch() != "sm_90a")


@pytest.mark.parametrize(
    "shape, d, dv, packed",
    [((1, 2, 2050), 64, 64, False),   # rows not a multiple of 16
     ((1, 2, 2048), 40, 40, False),   # head dim 64's bucket, but not 64
     ((1, 2, 2048), 64, 32, False),   # v's head dim other than q's
     ((1, 2, 2048), 64, 64, True)],   # packed sequences
)
def test_not_deterministic_falls_back_to_the_dq_pass(shape, d, dv, packed):
    """Where the dk/dv pass cannot add dq up, deterministic=False runs the deterministic
    kernels: the same gradients, bit for bit."""
    from cuflash import _plans

    rng = np.random.default_rng(d + dv + shape[-1])
    q, k = (random_array(rng, shape + (d,), "float16", 3.0) for _ in range(2))
    v, dout = (random_array(rng, shape + (dv,), "float16") for _ in range(2))
    extra = {}
    if packed:   # three sequences along the rows of one entry
        lengths = [700, 900, shape[-1] - 1600]
        cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        extra = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max(lengths), "max_seqlen_k": max(lengths)}
        q, k, v, dout = (x[0] for x in (q, k, v, dout))
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True, **extra)
    exact = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **extra)
    with poisoned_allocations():
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=False, **extra)
    for a, b in zip(grads, exact):
        assert cupy.array_equal(a.view(np.uint16), b.view(np.uint16))
    plan, _ = _plans.backward(dout, q, k, v, out, lse, True, None, None, dict(extra, check=True) if packed else None,
                              False)
    assert _dq_pass_runs(plan)


def test_vjp_closure_matches_backward():
    rng = np.random.default_rng(3)
    q, k, v, dout = (random_array(rng, (2, 3, 100, 64), "float16") for _ in range(4))
    out, vjp = cuflash.attention_vjp(q, k, v, window=(30, 2))
    out2, lse = cuflash.attention(q, k, v, window=(30, 2), return_lse=True)
    assert cupy.array_equal(out.view(np.uint16), out2.view(np.uint16))
    for a, b in zip(vjp(dout), cuflash.attention_backward(dout, q, k, v, out2, lse, window=(30, 2))):
        assert cupy.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_memory_is_linear(causal):
    """N = 131072, H = 8, D = 128 fp16: forward and backward with the memory pool's
    peak under 3x the bytes of q, k, v, out, dout, dq, dk, dv (the scores alone
    would be 8 * 131072^2 * 4 bytes = 550 GB)."""
    n, h, d = 131072, 8, 128
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    rng = np.random.default_rng(4)
    q, k, v, dout = (random_array(rng, (h, n, d), "float16") for _ in range(4))
    out, vjp = cuflash.attention_vjp(q, k, v, causal=causal)
    dq, dk, dv = vjp(dout)
    cupy.cuda.Device().synchronize()
    # the pool keeps every block it ever took (freed ones stay cached), so the bytes it
    # holds now bound the peak from above
    peak = pool.total_bytes()
    budget = 3 * 8 * q.nbytes
    print(f"N={n} causal={causal}: pool peak {peak / 2**30:.2f} GiB, budget {budget / 2**30:.2f} GiB")
    assert peak < budget, f"peak {peak / 2**30:.2f} GiB >= {budget / 2**30:.2f} GiB"
    assert all(bool(cupy.isfinite(g.astype(np.float32)).all()) for g in (out, dq, dk, dv))
