"""cuflash.attention_kvcache on the GPU against the float64 reference (docs/contract.md: KV cache)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from conftest import (GPU_MISSING, assert_close_to_reference, assert_lse_close, eps, poisoned_allocations, random_array,
                      requires_gpu)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = requires_gpu

if GPU_MISSING is None:
    import cupy
    import ml_dtypes  # noqa: F401

    import cuflash
    from cuflash import naive, reference


def _cache_problem(rng, dtype, batch, hkv, group, nq, d, dv, paged, page_size, lengths, n_new):
    """q (B, Hkv, G, Nq, D), caches (contiguous or paged, with spare room), new keys, table."""
    q = random_array(rng, (batch, hkv, group, nq, d), dtype, 2.0)
    capacity = max(lengths) + n_new + int(rng.integers(0, 40))
    if paged:
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch * pages_per_seq + 3
        table = rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)
        k = random_array(rng, (num_pages, hkv, 1, page_size, d), dtype)
        v = random_array(rng, (num_pages, hkv, 1, page_size, dv), dtype)
    else:
        table = None
        k = random_array(rng, (batch, hkv, 1, capacity, d), dtype)
        v = random_array(rng, (batch, hkv, 1, capacity, dv), dtype)
    news = (None, None)
    if n_new:
        news = (random_array(rng, (batch, hkv, 1, n_new, d), dtype), random_array(rng, (batch, hkv, 1, n_new, dv), dtype))
    return q, k, v, news, table


def _naive(q, k_cache, v_cache, table, lengths, mask):
    """Attention per sequence in the inputs' dtype over its gathered keys (cuflash.naive);
    ``mask``: the mask's keywords and the modifiers' (slopes and sinks of q's dims before Nq,
    or of those after B)."""
    mask = dict(mask)
    per_sequence = {n: mask.pop(n) for n in ("alibi_slopes", "sinks") if getattr(mask.get(n), "ndim", 0) == q.ndim - 2}
    outs = []
    for b, n in enumerate(lengths):
        if n == 0:   # no key: out 0
            outs.append(cupy.zeros(q.shape[1:-1] + (v_cache.shape[-1],), dtype=q.dtype))
            continue
        j = np.arange(int(n))
        if table is None:
            k, v = k_cache[b][..., j, :], v_cache[b][..., j, :]
        else:
            page, row = cupy.asarray(table[b, j // k_cache.shape[-2]]), cupy.asarray(j % k_cache.shape[-2])
            k = cupy.moveaxis(k_cache[page, ..., row, :], 0, -2)
            v = cupy.moveaxis(v_cache[page, ..., row, :], 0, -2)
        outs.append(naive.attention(q[b], k, v, **mask, **{n: x[b] for n, x in per_sequence.items()}))
    return cupy.stack(outs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(("float16", "bfloat16", "float32")),
    batch=st.integers(1, 4),
    hkv=st.integers(1, 3),
    group=st.sampled_from((1, 2, 4, 5)),
    nq=st.sampled_from((1, 2, 3, 4, 20, 40)),   # 20, 40: row groups whose rows wrap past Nq
    dims=st.sampled_from(((64, 64), (128, 128), (32, 64), (256, 256))),
    paged=st.booleans(),
    page_size=st.sampled_from((1, 7, 16, 64, 256)),
    n_new=st.integers(0, 3),
    mask=st.sampled_from(({}, {"causal": True}, {"window": (30, 0)})),
    seqlens_as=st.sampled_from(("numpy", "cupy", "int")),
    num_splits=st.sampled_from((None, 1, 3)),
    seed=st.integers(0, 2**32 - 1),
)
def test_kvcache_against_reference(dtype, batch, hkv, group, nq, dims, paged, page_size, n_new, mask, seqlens_as,
                                   num_splits, seed):
    """Ragged cache lengths (0 included, and full), appends, pages in a random order, masks,
    GQA groups, new rows per sequence from 1 to more than a block's row group, forced splits: out and lse against the reference, the caches after the
    append equal to the reference's, under the forward's accuracy criterion."""
    d, dv = dims
    if dtype == "float32" and d > 128:
        d = dv = 128
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 300, size=batch)
    lengths[rng.integers(0, batch)] = 0
    if seqlens_as == "int":
        lengths[:] = lengths[0]
    q, k, v, (k_new, v_new), table = _cache_problem(rng, dtype, batch, hkv, group, nq, d, dv, paged, page_size,
                                                    lengths.tolist(), n_new)
    seqlens = {"numpy": lengths.astype(np.int32), "cupy": cupy.asarray(lengths, dtype=cupy.int32),
               "int": int(lengths[0])}[seqlens_as]
    host = {name: None if x is None else cupy.asnumpy(x) for name, x in
            (("q", q), ("k", k), ("v", v), ("k_new", k_new), ("v_new", v_new))}
    r_out, r_lse = reference.attention_kvcache(host["q"], host["k"], host["v"], k_new=host["k_new"],
                                               v_new=host["v_new"], cache_seqlens=lengths, block_table=table,
                                               return_lse=True, **mask)
    with poisoned_allocations():
        out, lse = cuflash.attention_kvcache(q, k, v, k_new=k_new, v_new=v_new, cache_seqlens=seqlens,
                                             block_table=None if table is None else cupy.asarray(table),
                                             num_splits=num_splits, return_lse=True, **mask)
    assert np.array_equal(cupy.asnumpy(k), host["k"]) and np.array_equal(cupy.asnumpy(v), host["v"]), \
        "the caches after the append differ from the reference's"
    n = _naive(q, k, v, table, lengths + n_new, mask)
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(n), r_out, q.dtype, c=2)
    assert_lse_close(cupy.asnumpy(lse), r_lse)


def _paged_and_contiguous(rng, batch, hkv, group, nq, d, lengths, page_size, dtype="bfloat16"):
    """q, a contiguous cache, the same keys in pages placed in a shuffled order, and the table."""
    q = random_array(rng, (batch, hkv, group, nq, d), dtype)
    cap = -(-max(lengths) // page_size) * page_size
    k = random_array(rng, (batch, hkv, 1, cap, d), dtype)
    v = random_array(rng, (batch, hkv, 1, cap, d), dtype)
    pages = cap // page_size
    table = rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32)
    kp = cupy.empty((batch * pages, hkv, 1, page_size, d), dtype=k.dtype)
    vp = cupy.empty_like(kp)
    for b in range(batch):
        for i in range(pages):
            kp[int(table[b, i])] = k[b, :, :, i * page_size:(i + 1) * page_size]
            vp[int(table[b, i])] = v[b, :, :, i * page_size:(i + 1) * page_size]
    return q, (k, v), (kp, vp), cupy.asarray(table)


@pytest.mark.parametrize("page_size", (16, 64, 256))
def test_paged_equals_contiguous(page_size):
    """The same keys in pages (in a shuffled order) and in one contiguous cache give the same result."""
    rng = np.random.default_rng(page_size)
    lengths = [700, 1, 1200]
    q, (k, v), (kp, vp), table = _paged_and_contiguous(rng, 3, 2, 4, 1, 128, lengths, page_size)
    seqlens = cupy.asarray(lengths, dtype=cupy.int32)
    a = cuflash.attention_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=1)
    b = cuflash.attention_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, num_splits=1)
    assert np.array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
    # with splits, and with and without lse (then written where nobody reads it): the same out
    c = cuflash.attention_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, num_splits=3)
    d, lse = cuflash.attention_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, num_splits=3,
                                       return_lse=True)
    assert np.array_equal(cupy.asnumpy(c), cupy.asnumpy(d)) and lse.shape == q.shape[:-1]
    assert np.isfinite(cupy.asnumpy(lse)).all()


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("d", (64, 48, 128))
@pytest.mark.parametrize("page_size", (16, 64))
def test_pages_equal_contiguous_with_32_row_tiles(dtype, d, page_size):
    """Pages of 16 and 64 rows (read in runs of 16 keys, each run copied by threads of its own,
    but at head dim 128 over pages of 64, one block a page) under 32 query rows per block (G 8,
    Nq 4, causal), with ragged lengths (partial runs and blocks) and narrow heads (d 48 in 64
    columns): bitwise the contiguous cache's result, split and not."""
    rng = np.random.default_rng(d + page_size)
    lengths = [1000, 5, 2061, 16]
    q, (k, v), (kp, vp), table = _paged_and_contiguous(rng, 4, 2, 8, 4, d, lengths, page_size, dtype)
    seqlens = cupy.asarray(lengths, dtype=cupy.int32)
    for splits in (1, 4):
        a = cuflash.attention_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, num_splits=splits)
        b = cuflash.attention_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=True,
                                      num_splits=splits)
        assert np.array_equal(cupy.asnumpy(a), cupy.asnumpy(b)), f"num_splits={splits}"
    ref = reference.attention_kvcache(*(cupy.asnumpy(x) for x in (q, k, v)), cache_seqlens=np.array(lengths),
                                      causal=True)
    n = _naive(q, k, v, None, lengths, {"causal": True})
    assert_close_to_reference("out", cupy.asnumpy(b), cupy.asnumpy(n), ref, q.dtype, c=2)


def test_refused_call_writes_nothing():
    """check=True: a sequence that would run past its cache, or a page outside it, raises
    before anything is written."""
    rng = np.random.default_rng(5)
    q = random_array(rng, (2, 2, 1, 1, 64), "float16")
    k, v = (random_array(rng, (2, 2, 1, 32, 64), "float16") for _ in range(2))
    kn, vn = (random_array(rng, (2, 2, 1, 2, 64), "float16") for _ in range(2))
    before = cupy.asnumpy(k), cupy.asnumpy(v)
    with pytest.raises(ValueError, match="run past its cache"):
        cuflash.attention_kvcache(q, k, v, k_new=kn, v_new=vn, cache_seqlens=cupy.asarray([3, 31], dtype=cupy.int32))
    with pytest.raises(ValueError, match="not a page"):
        cuflash.attention_kvcache(q, k, v, k_new=kn, v_new=vn, cache_seqlens=[3, 4],
                                  block_table=np.array([[0], [2]], dtype=np.int32))
    assert np.array_equal(cupy.asnumpy(k), before[0]) and np.array_equal(cupy.asnumpy(v), before[1])


def test_bad_lengths_without_check_stay_inside_the_arrays():
    """check=False with lengths past the cache and negative ones, and pages outside it:
    clamped, with every output finite (the sanitizer cases run the same under memcheck)."""
    rng = np.random.default_rng(6)
    q = random_array(rng, (3, 2, 2, 1, 64), "bfloat16")
    k, v = (random_array(rng, (4, 2, 1, 16, 64), "bfloat16") for _ in range(2))
    kn, vn = (random_array(rng, (3, 2, 1, 3, 64), "bfloat16") for _ in range(2))
    seqlens = cupy.asarray([-5, 1000, 20], dtype=cupy.int32)
    table = cupy.asarray([[0, 9], [-3, 1], [2, 3]], dtype=cupy.int32)
    out = cuflash.attention_kvcache(q, k, v, k_new=kn, v_new=vn, cache_seqlens=seqlens, block_table=table,
                                    check=False)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.isfinite(out.astype(cupy.float32)).all())


@pytest.mark.parametrize("num_splits", (1, 3))
def test_decoding_loop_in_a_cuda_graph(num_splits):
    """256 steps of decoding with appends (check=False, device lengths) captured in one CUDA
    graph, replayed, against the same steps run eagerly on a copy of the cache; with splits,
    the graph replays into the partials and counters kept for its stream."""
    rng = np.random.default_rng(7)
    batch, hkv, group, d, steps = 2, 2, 4, 64, 256
    k = random_array(rng, (batch, hkv, 1, 512, d), "float16")
    v = random_array(rng, (batch, hkv, 1, 512, d), "float16")
    q = random_array(rng, (steps, batch, hkv, group, 1, d), "float16")
    kn = random_array(rng, (steps, batch, hkv, 1, 1, d), "float16")
    vn = random_array(rng, (steps, batch, hkv, 1, 1, d), "float16")
    start = cupy.asarray([100, 3], dtype=cupy.int32)
    k2, v2 = k.copy(), v.copy()
    eager = [cuflash.attention_kvcache(q[i], k2, v2, k_new=kn[i], v_new=vn[i], cache_seqlens=start + i, check=False,
                                       num_splits=num_splits) for i in range(steps)]
    seqlens = [start + i for i in range(steps)]   # allocated before the capture
    cuflash.attention_kvcache(q[0], k.copy(), v.copy(), k_new=kn[0], v_new=vn[0], cache_seqlens=start, check=False,
                              num_splits=num_splits)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        outs = [cuflash.attention_kvcache(q[i], k, v, k_new=kn[i], v_new=vn[i], cache_seqlens=seqlens[i], check=False,
                                          num_splits=num_splits) for i in range(steps)]
        graph = stream.end_capture()
        for out in outs:   # poisoned: the replay must write every output
            out.fill(np.nan)
        graph.launch()
    stream.synchronize()
    assert np.array_equal(cupy.asnumpy(k), cupy.asnumpy(k2))
    for a, b in zip(outs, eager):
        assert np.array_equal(cupy.asnumpy(a), cupy.asnumpy(b))


def test_kernels_launch_programmatically_on_hopper():
    """On Hopper the append and the decoding kernel are launched with programmatic stream
    serialization (each may start under the tail of the kernel before it and waits for it
    before touching memory), and a call of 2 to 16 splits in clusters of its splits, which
    merge on chip without partials in global memory, 24 in clusters whose parts then merge
    through global memory, and 17 (prime) through global memory alone; elsewhere the
    ordinary way, the splits merged through global memory. So every kvcache test here runs
    through the launches that users get on this GPU."""
    from cuflash import _compile, _plans

    hopper = _compile.current_arch() == "sm_90a"
    rng = np.random.default_rng(3)
    q, k, v, (kn, vn), _ = _cache_problem(rng, "float16", 2, 2, 4, 1, 64, 64, False, None, [5, 9], 2)
    plan, _ = _plans.kvcache(q, k, v, kn, vn, 5, None, False, None, None, None, True)
    assert len(plan.launches.runs) == 2
    assert all(run.programmatic == hopper for run in plan.launches.runs)
    for splits, nk in ((2, 3072), (16, 3072), (24, 3072), (17, 17 * 64)):   # (blocks of 64 keys: each count as asked)
        q, k, v = _split_problem(rng, 1, 2, 4, nk)
        plan, _ = _plans.kvcache(q, k, v, None, None, None, None, False, None, None, splits, True)
        (run,) = plan.launches.runs
        assert run.grid[1] == splits
        if not hopper or splits == 17:
            assert run.cluster == 1 and plan.launches.parts[0] == splits
        elif splits <= 16:
            assert run.cluster == splits and plan.launches.parts is None
        else:
            assert 1 < run.cluster < splits and splits % run.cluster == 0
            assert plan.launches.parts[0] == splits // run.cluster
            assert plan.launches.parts[3] == run.grid[0] * run.grid[2] * run.cluster


def _split_problem(rng, batch, hkv, group, nk, d=128):
    q = random_array(rng, (batch, hkv, group, 1, d), "bfloat16", 2.0)
    k = random_array(rng, (batch, hkv, 1, nk, d), "bfloat16")
    v = random_array(rng, (batch, hkv, 1, nk, d), "bfloat16")
    return q, k, v


@pytest.mark.parametrize("num_splits, nk", [(3, 1000), (17, 17 * 64), (24, 3072)])
def test_split_decoding_replayed_from_a_cuda_graph(num_splits, nk):
    """Issue 49: split decoding (device lengths, check=False) captured in a CUDA graph and
    replayed twice (the counters one replay leaves must serve the next) into outputs poisoned
    before each replay: out and lse against the float64 reference. The launch has num_splits
    blocks per row group (on Hopper, 3 merge in a cluster, 17 through global memory, 24 in
    clusters and then through global memory); one sequence fills the cache, the other
    leaves its last splits without keys."""
    from cuflash import _plans

    rng = np.random.default_rng(num_splits)
    q, k, v = _split_problem(rng, 2, 2, 4, nk)
    lengths = np.array([nk, nk // 2 + 1], dtype=np.int32)
    seqlens = cupy.asarray(lengths)
    plan, _ = _plans.kvcache(q, k, v, None, None, seqlens, None, False, None, None, num_splits, False)
    (run,) = plan.launches.runs
    assert run.grid[1] == num_splits > 1
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=num_splits, check=False)   # (workspace)
        stream.begin_capture()
        out, lse = cuflash.attention_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=num_splits, check=False,
                                             return_lse=True)
        graph = stream.end_capture()
    ref_out, ref_lse = reference.attention_kvcache(*(cupy.asnumpy(x) for x in (q, k, v)), cache_seqlens=lengths,
                                                   return_lse=True)
    n = _naive(q, k, v, None, lengths, {})
    for _ in range(2):
        with stream:
            out.fill(np.nan)
            lse.fill(np.nan)
            graph.launch()
        stream.synchronize()
        assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(n), ref_out, q.dtype, c=2)
        assert_lse_close(cupy.asnumpy(lse), ref_lse)


def test_split_counts_change_from_call_to_call():
    """Calls on one stream with split counts and grids that change from call to call: the
    counters each call leaves behind must be ready for the next. Each against the same
    call with one split, whose result does not go through the merge. (On Hopper, counts up
    to 16 merge in clusters, 16 the largest; 20, 24 and 32 in clusters and then through the
    counters, 40 rows in two row groups, the second's 8 rows fewer than a cluster's ranks;
    17, a prime past the largest cluster, through the counters alone.)"""
    rng = np.random.default_rng(8)
    cases = [(2, 2, 4, 1000, 3), (1, 3, 5, 700, 7), (3, 1, 1, 2000, 2), (2, 2, 4, 1000, 5), (1, 1, 8, 64, 2),
             (1, 2, 4, 5000, 16), (2, 1, 8, 7000, 24), (2, 2, 4, 1000, 3), (4, 2, 2, 513, 9), (1, 2, 2, 6000, 20),
             (2, 2, 16, 4096, 32), (1, 1, 40, 4096, 32), (1, 2, 4, 3264, 17), (2, 2, 4, 1000, 3)]
    for batch, hkv, group, nk, splits in cases:
        q, k, v = _split_problem(rng, batch, hkv, group, nk)
        lengths = cupy.asarray(rng.integers(0, nk + 1, size=batch), dtype=cupy.int32)
        one, one_lse = cuflash.attention_kvcache(q, k, v, cache_seqlens=lengths, num_splits=1, return_lse=True)
        many, many_lse = cuflash.attention_kvcache(q, k, v, cache_seqlens=lengths, num_splits=splits, return_lse=True)
        np.testing.assert_allclose(cupy.asnumpy(many.astype(cupy.float32)), cupy.asnumpy(one.astype(cupy.float32)),
                                   rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(cupy.asnumpy(many_lse), cupy.asnumpy(one_lse), rtol=1e-5, atol=1e-5)


def test_split_decoding_on_two_streams_at_once():
    """Split decoding queued on two streams at once, without synchronizing between them:
    each stream's calls merge their own partials (the workspace is per stream), so every
    result equals the same call run alone."""
    rng = np.random.default_rng(9)
    problems = [_split_problem(rng, 2, 2, 4, 4096) for _ in range(2)]
    alone = [cupy.asnumpy(cuflash.attention_kvcache(q, k, v, num_splits=8)) for q, k, v in problems]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = [[], []]
    for _ in range(20):
        for i, ((q, k, v), stream) in enumerate(zip(problems, streams)):
            with stream:
                outs[i].append(cuflash.attention_kvcache(q, k, v, num_splits=8))
    for stream in streams:
        stream.synchronize()
    for i in range(2):
        for out in outs[i]:
            assert np.array_equal(cupy.asnumpy(out), alone[i])


# The score modifiers (softcap, ALiBi, sinks), as in tests/test_modifiers.py
MODS = {
    "softcap": dict(softcap=20.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all": dict(softcap=30.0, alibi=True, sinks=True),
}


def _mod_keywords(rng, mods, heads_shape, sink_scale=2.0):
    """The modifiers' keywords: softcap, and per query head slopes and sinks (CuPy float32)."""
    kw = {"softcap": mods["softcap"]} if "softcap" in mods else {}
    if mods.get("alibi"):
        kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, heads_shape).astype(np.float32))
    if mods.get("sinks"):
        kw["sinks"] = cupy.asarray(rng.normal(0, sink_scale, heads_shape).astype(np.float32))
    return kw


def _check_modified(rng, dtype, batch, hkv, group, nq, d, paged, page_size, lengths, n_new, mask, kw, num_splits):
    """attention_kvcache with modifiers ``kw`` against the reference (out, lse, the caches)."""
    lengths = np.asarray(lengths)
    q, k, v, (k_new, v_new), table = _cache_problem(rng, dtype, batch, hkv, group, nq, d, d, paged, page_size,
                                                    lengths.tolist(), n_new)
    host = {name: None if x is None else cupy.asnumpy(x) for name, x in
            (("q", q), ("k", k), ("v", v), ("k_new", k_new), ("v_new", v_new))}
    r_out, r_lse = reference.attention_kvcache(host["q"], host["k"], host["v"], k_new=host["k_new"],
                                               v_new=host["v_new"], cache_seqlens=lengths, block_table=table,
                                               return_lse=True, **mask, **{n: cupy.asnumpy(x) if n != "softcap" else x
                                                                           for n, x in kw.items()})
    with poisoned_allocations():
        out, lse = cuflash.attention_kvcache(q, k, v, k_new=k_new, v_new=v_new,
                                             cache_seqlens=cupy.asarray(lengths, dtype=cupy.int32),
                                             block_table=None if table is None else cupy.asarray(table),
                                             num_splits=num_splits, return_lse=True, **mask, **kw)
    assert np.array_equal(cupy.asnumpy(k), host["k"]) and np.array_equal(cupy.asnumpy(v), host["v"])
    n = _naive(q, k, v, table, lengths + n_new, {**mask, **kw})
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(n), r_out, q.dtype, c=2)
    assert_lse_close(cupy.asnumpy(lse), r_lse)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32"))
@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("mask", ({}, {"causal": True}, {"window": (30, 0)}))
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
@pytest.mark.parametrize("num_splits", (1, 3))
def test_kvcache_modifiers_against_reference(dtype, mods, mask, layout, num_splits):
    """Each modifier and all three under GQA (G 4, per query head slopes and sinks), appends
    of 2 rows for 3 new rows (ALiBi's positions from the cache length), ragged lengths with
    an empty cache, contiguous and paged (16 rows: read run by run; 7: row by row)."""
    rng = np.random.default_rng(zlib.crc32(repr((dtype, mods, mask, layout, num_splits)).encode()))
    kw = _mod_keywords(rng, MODS[mods], (2, 4))
    for page_size, n_new in ((16, 2), (7, 0)):
        _check_modified(rng, dtype, 3, 2, 4, 3, 64, layout == "paged", page_size, [150, 0, 301], n_new, mask, kw,
                        num_splits)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("d", (64, 128, 256))
def test_kvcache_modifiers_with_32_row_tiles(dtype, d):
    """G 8 x Nq 5 = 40 rows per K/V head: tiles of 32 rows whose rows wrap past Nq and span
    query heads, each its own slope and sink (per sequence too: (B, Hkv, G)); causal, appends,
    split and not."""
    rng = np.random.default_rng(d)
    kw = _mod_keywords(rng, MODS["all"], (2, 2, 8))
    for num_splits in (1, 4):
        _check_modified(rng, dtype, 2, 2, 8, 5, d, True, 64, [700, 9], 5, {"causal": True}, kw, num_splits)


@pytest.mark.parametrize("num_splits", (None, 1, 2, 7, 17, 24))
@pytest.mark.parametrize("window", (None, (40, 0)))
def test_kvcache_sinks_count_once_over_splits(num_splits, window):
    """Sinks large against the keys (logits near 6), so that a sink counted in more than one
    split moves out and lse far past the criterion; split count up to clusters (Hopper) and
    clusters of clusters; under a window the first splits see no key (the sink still joins
    there)."""
    rng = np.random.default_rng(29)
    kw = {"sinks": cupy.asarray(rng.normal(6, 1, (2, 4)).astype(np.float32))}
    mask = {} if window is None else {"window": window}
    _check_modified(rng, "bfloat16", 2, 2, 4, 1, 128, False, 0, [3000, 1800], 1, mask, kw, num_splits)


def test_kvcache_sinks_on_sequences_with_no_key():
    """An empty cache and no append: out 0 and lse equal to each row's sink, split or not."""
    rng = np.random.default_rng(31)
    q = random_array(rng, (2, 2, 3, 2, 64), "float16")
    k, v = (random_array(rng, (2, 2, 1, 32, 64), "float16") for _ in range(2))
    z = cupy.asarray(rng.normal(size=(2, 3)).astype(np.float32))
    for num_splits in (1, 3):
        with poisoned_allocations():
            out, lse = cuflash.attention_kvcache(q, k, v, cache_seqlens=cupy.asarray([0, 0], dtype=cupy.int32),
                                                 sinks=z, num_splits=num_splits, return_lse=True)
        assert (cupy.asnumpy(out) == 0).all()
        np.testing.assert_allclose(cupy.asnumpy(lse), np.broadcast_to(cupy.asnumpy(z)[..., None], (2, 2, 3, 2)),
                                   rtol=1e-6)


@pytest.mark.parametrize("bad, error", [
    (dict(softcap=-1.0), ValueError), (dict(softcap=float("nan")), ValueError), (dict(softcap="1"), TypeError),
    (dict(alibi_slopes="float64"), TypeError), (dict(alibi_slopes=(5,)), ValueError), (dict(sinks=(3, 2, 1)), ValueError),
    (dict(sinks="numpy"), TypeError), (dict(score_mod="too few indices"), TypeError),
    (dict(mask_mod="a NumPy table"), TypeError),
])
def test_kvcache_bad_modifiers_raise_before_any_launch(monkeypatch, bad, error):
    """Checked as attention checks them, against q's dims before Nq, (B, Hkv, G) = (2, 2, 4),
    naming the argument; no kernel launched and the caches untouched (no append)."""
    from cuflash import _launch

    rng = np.random.default_rng(37)
    q = random_array(rng, (2, 2, 4, 1, 64), "float16")
    k, v = (random_array(rng, (2, 2, 1, 32, 64), "float16") for _ in range(2))
    kn, vn = (random_array(rng, (2, 2, 1, 1, 64), "float16") for _ in range(2))
    before = cupy.asnumpy(k)
    name, value = next(iter(bad.items()))
    if name.endswith("_mod"):   # (q's dims before Nq are three: five indices; tables on the GPU)
        table = np.ones(8, dtype=np.float32)
        value = (lambda s, b, h, i, j: s) if name == "score_mod" else (lambda b, h, g, i, j: table[j % 8] > 0)
    elif name != "softcap":
        value = {"float64": cupy.ones(4, dtype=cupy.float64), "numpy": np.ones(4, dtype=np.float32)}.get(
            value, cupy.ones(value, dtype=cupy.float32) if isinstance(value, tuple) else value)

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(_launch.Launch, "run", launched)
    with pytest.raises(error, match=name):
        cuflash.attention_kvcache(q, k, v, k_new=kn, v_new=vn, cache_seqlens=3, **{name: value})
    assert np.array_equal(cupy.asnumpy(k), before)


# ---------------------------------------------------------------------------------------------
# Score and mask functions on the cache
# ---------------------------------------------------------------------------------------------


def _cache_functions(kind, rng, batch, hkv, group):
    """(score_mod, mask_mod) on the GPU and on the host, over q's dims (B, Hkv, G): "table", a
    relative-position table per query head under a tanh cap and a mask of each sequence's first
    visible key (past its keys for one sequence: rows with no key) and a band of 96; "builtin",
    ALiBi and causal written as functions (with the keywords' result to meet)."""
    if kind == "builtin":
        slopes = rng.uniform(0.05, 0.5, (hkv, group)).astype(np.float32)
        tables = (slopes,)

        def make(slopes):
            return (lambda s, b, h, g, i, j: s - slopes[h, g] * cuflash.abs(i - j)), (lambda b, h, g, i, j: i >= j)
    else:
        rel = (rng.standard_normal((hkv, group, 64)) * 2).astype(np.float32)
        first = rng.integers(0, 120, batch).astype(np.int32)
        first[-1] = 10**6
        tables = (rel, first)

        def make(rel, first):
            return ((lambda s, b, h, g, i, j: 12.0 * cuflash.tanh((s + rel[h, g, (i - j) % 64]) / 12.0)),
                    (lambda b, h, g, i, j: (j >= first[b]) & (i - j < 96)))
    return make(*(cupy.asarray(t) for t in tables)), make(*tables), tables


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32"))
@pytest.mark.parametrize("kind", ("table", "builtin"))
@pytest.mark.parametrize("layout", ("contiguous", "paged"))
@pytest.mark.parametrize("num_splits", (1, 3))
@pytest.mark.parametrize("group, nq", ((4, 3), (8, 5)))
def test_kvcache_functions_against_reference(dtype, kind, layout, num_splits, group, nq):
    """score_mod and mask_mod in the decoding kernel against the reference running the same
    functions, within twice the plain call's error: each row's functions see its own query head
    (G 8 x Nq 5 = 40 rows: 32-row tiles whose rows wrap past Nq and span heads) and q_idx from
    the sequence's length, with ragged lengths, an empty cache, appends, pages of 16 and 7 rows,
    splits, sinks; ALiBi and causal as functions also meet the keywords' GPU result."""
    rng = np.random.default_rng(zlib.crc32(repr((dtype, kind, layout, num_splits, group, nq)).encode()))
    batch, hkv, d = 3, 2, 64
    (score_gpu, mask_gpu), (score_host, mask_host), tables = _cache_functions(kind, rng, batch, hkv, group)
    sinks = rng.normal(0, 1, (hkv, group)).astype(np.float32)
    for page_size, n_new, lengths in ((16, 2, [150, 0, 301]), (7, 0, [64, 33, 290])):
        lengths = np.asarray(lengths)
        q, k, v, (k_new, v_new), table = _cache_problem(rng, dtype, batch, hkv, group, nq, d, d, layout == "paged",
                                                        page_size, lengths.tolist(), n_new)
        host = {name: None if x is None else cupy.asnumpy(x) for name, x in
                (("q", q), ("k", k), ("v", v), ("k_new", k_new), ("v_new", v_new))}
        common = dict(cache_seqlens=lengths, block_table=table, return_lse=True)
        want, want_lse = reference.attention_kvcache(host["q"], host["k"].copy(), host["v"].copy(),
                                                     k_new=host["k_new"], v_new=host["v_new"], sinks=sinks,
                                                     score_mod=score_host, mask_mod=mask_host, **common)
        plain_want = reference.attention_kvcache(host["q"], host["k"].copy(), host["v"].copy(), k_new=host["k_new"],
                                                 v_new=host["v_new"], sinks=sinks, **common)[0]
        gpu = dict(cache_seqlens=cupy.asarray(lengths, dtype=cupy.int32),
                   block_table=None if table is None else cupy.asarray(table), num_splits=num_splits,
                   sinks=cupy.asarray(sinks), return_lse=True)
        k2, v2 = k.copy(), v.copy()
        plain = cuflash.attention_kvcache(q, k2, v2, k_new=k_new, v_new=v_new, **gpu)[0]
        with poisoned_allocations():
            out, lse = cuflash.attention_kvcache(q, k, v, k_new=k_new, v_new=v_new, score_mod=score_gpu,
                                                 mask_mod=mask_gpu, **gpu)
        assert np.array_equal(cupy.asnumpy(k), cupy.asnumpy(k2)) and np.array_equal(cupy.asnumpy(v), cupy.asnumpy(v2))
        out = cupy.asnumpy(out).astype(np.float64)
        plain_err = np.abs(cupy.asnumpy(plain).astype(np.float64) - plain_want).max()
        err = np.abs(out - want).max()
        atol = 4 * eps(dtype) * max(1.0, np.abs(want).max())
        assert err <= 2 * plain_err + atol, f"out: error {err:.3g} > 2 x plain {plain_err:.3g} + {atol:.3g}"
        assert_lse_close(cupy.asnumpy(lse), want_lse)
        if kind == "builtin":   # (the keywords' call: the append again writes the same keys)
            keywords = cuflash.attention_kvcache(q, k2, v2, k_new=k_new, v_new=v_new, alibi_slopes=cupy.asarray(tables[0]),
                                                 causal=True, **gpu)[0]
            gap = np.abs(out - cupy.asnumpy(keywords).astype(np.float64)).max()
            assert gap <= 2 * plain_err + atol, f"against the keywords: {gap:.3g}"


def test_kvcache_functions_that_refuse_every_key():
    """A mask function that refuses every key: out 0 and lse -inf (with sinks, out 0 and lse the
    sink), split or not."""
    rng = np.random.default_rng(41)
    q = random_array(rng, (2, 2, 3, 2, 64), "bfloat16")
    k, v = (random_array(rng, (2, 2, 1, 96, 64), "bfloat16") for _ in range(2))
    z = rng.normal(size=(2, 3)).astype(np.float32)
    for num_splits in (1, 3):
        for sinks in (None, cupy.asarray(z)):
            with poisoned_allocations():
                out, lse = cuflash.attention_kvcache(q, k, v, cache_seqlens=cupy.asarray([90, 17], dtype=cupy.int32),
                                                     mask_mod=lambda b, h, g, i, j: j < -1, sinks=sinks,
                                                     num_splits=num_splits, return_lse=True)
            assert (cupy.asnumpy(out) == 0).all()
            want = np.broadcast_to((z if sinks is not None else np.full((2, 3), -np.inf))[..., None], (2, 2, 3, 2))
            np.testing.assert_allclose(cupy.asnumpy(lse), want, rtol=1e-6)
