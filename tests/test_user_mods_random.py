"""cuflash.attention and attention_backward with generated score and mask functions (the random
expression trees of tests/test_trace.py: arithmetic, tanh, exp, sqrt, log, reads of captured
tables, comparisons and bool logic) on random shapes, dtypes and head dims, against
cuflash.reference running the same functions on NumPy arrays."""

import math

import numpy as np
from conftest import assert_lse_close, eps, poisoned_allocations, random_array, requires_gpu
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_trace import FLAGS, IDS, TABLE, bools, floats, make_function
from test_user_mods import _assert_grads_close, _grad_errors, _host

import cuflash
from cuflash import _trace, reference

pytestmark = requires_gpu

# Each example compiles its own kernels (a forward and two backward passes): a few per run.
SLOW = dict(max_examples=8, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])


@settings(**SLOW)
@given(score_tree=floats(2, smooth=True), mask_tree=bools(2, score=False), which=st.sampled_from(["score", "mask", "both"]),
       dtype=st.sampled_from(["float16", "bfloat16"]), d=st.sampled_from([32, 64, 128]), b=st.integers(1, 2),
       h=st.integers(1, 3), nq=st.integers(1, 150), nk=st.integers(1, 150), sequences=st.integers(0, 4),
       seed=st.integers(0, 2**31 - 1))
def test_generated_functions_match_the_reference(score_tree, mask_tree, which, dtype, d, b, h, nq, nk, sequences,
                                                 seed):
    """out and lse, then dq, dk, dv, within the plain call's error as the gallery's tests bound
    them, and the table's gradient where the score function reads it (score_mod_grads). Score functions are continuous (no comparison of the score: float32 and float64 scores
    may fall on either side of a threshold) and keep the scores they make under 100 in
    magnitude (float32 keeps such logits to 1e-5); mask functions may leave rows with no key.
    With ``sequences`` > 0 the rows and keys are that many packed sequences of random lengths
    (the functions see positions in the packed arrays)."""
    import cupy

    rng = np.random.default_rng(seed)
    host_seqs, gpu_seqs = {}, {}
    if sequences:
        cuts = {name: np.concatenate([[0], np.sort(rng.integers(0, n + 1, sequences - 1)), [n]]).astype(np.int32)
                for name, n in (("cu_seqlens_q", nq), ("cu_seqlens_k", nk))}
        host_seqs = cuts
        gpu_seqs = {name: cupy.asarray(x) for name, x in cuts.items()}
    q = random_array(rng, (b, h, nq, d), dtype, scale=1.5)
    k, v = (random_array(rng, (b, h, nk, d), dtype, scale=1.5) for _ in range(2))
    dout = random_array(rng, (b, h, nq, d), dtype)
    q64, k64, v64, dout64 = _host(q, k, v, dout)
    on_gpu, on_host = {}, {}
    tables_gpu = tuple(cupy.asarray(x) for x in (TABLE, IDS, FLAGS))
    if which in ("score", "both"):
        on_host["score_mod"] = make_function(score_tree, TABLE, IDS, FLAGS)
        on_gpu["score_mod"] = make_function(score_tree, *tables_gpu)
        scores = q64 @ k64.swapaxes(-1, -2) / math.sqrt(d)
        grids = _trace.index_grids((b, h), np.arange(nq), np.arange(nk))
        with np.errstate(all="ignore"):
            made = np.broadcast_to(np.asarray(_trace.call(on_host["score_mod"], scores, *grids), dtype=np.float64),
                                   scores.shape)
        assume(np.isfinite(made).all() and np.abs(made).max() < 100)
    if which in ("mask", "both"):
        on_host["mask_mod"] = make_function(mask_tree, TABLE, IDS, FLAGS, role="mask_mod")
        on_gpu["mask_mod"] = make_function(mask_tree, *tables_gpu, role="mask_mod")

    # the table's gradient too, where the score function reads it (score_mod_grads)
    reads_table = "score_mod" in on_host and any(
        a is TABLE for a in _trace.captured_arrays(on_host["score_mod"], _trace.trace(on_host["score_mod"], "score_mod", 2)))
    host_grads, gpu_grads = ({"score_mod_grads": [t]} if reads_table else {} for t in (TABLE, tables_gpu[0]))
    want, want_lse = reference.attention(q64, k64, v64, return_lse=True, **host_seqs, **on_host)
    with np.errstate(all="ignore"):
        want_grads = reference.attention_backward(dout64, q64, k64, v64, want, want_lse, **host_seqs, **on_host,
                                                  **host_grads)
    assume(all(np.isfinite(g).all() for g in want_grads))   # (0 * inf where sqrt or log meet 0)

    plain, plain_lse = cuflash.attention(q, k, v, return_lse=True, **gpu_seqs)
    plain_want, plain_want_lse = reference.attention(q64, k64, v64, return_lse=True, **host_seqs)
    plain_err = np.abs(cupy.asnumpy(plain).astype(np.float64) - plain_want).max()
    plain_want_grads = reference.attention_backward(dout64, q64, k64, v64, plain_want, plain_want_lse, **host_seqs)
    plain_errs = _grad_errors(cuflash.attention_backward(dout, q, k, v, plain, plain_lse, **gpu_seqs), plain_want_grads)

    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **gpu_seqs, **on_gpu)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **gpu_seqs, **on_gpu, **gpu_grads)
    err = np.abs(cupy.asnumpy(out).astype(np.float64) - want).max()
    atol = 4 * eps(dtype) * max(1.0, np.abs(want).max())
    assert err <= 2 * plain_err + atol, f"out: error {err:.3g} > 2 x plain {plain_err:.3g} + {atol:.3g}"
    assert_lse_close(cupy.asnumpy(lse), want_lse)
    _assert_grads_close("generated functions", grads[:3], want_grads[:3], plain_errs, dtype)
    if reads_table:   # within four times the plain backward's relative error of its scale, against the
        # reference's backward from the kernels' out and lse (test_user_mods)
        relative = max(e / max(np.abs(w).max(), 1e-30) for e, w in zip(plain_errs, plain_want_grads))
        with np.errstate(all="ignore"):
            want_table = reference.attention_backward(dout64, q64, k64, v64, *_host(out),
                                                      cupy.asnumpy(lse).astype(np.float64), **host_seqs, **on_host,
                                                      **host_grads)[3]
        got_table = cupy.asnumpy(grads[3]).astype(np.float64)
        scale = np.abs(want_table).max()
        err = np.abs(got_table - want_table).max()
        assert np.isfinite(got_table).all() and err <= 4 * relative * scale + 4 * eps("float32") * max(1.0, scale), \
            f"the table's gradient: error {err:.3g}"


def test_a_generated_mask_with_no_key_for_any_row():
    """A generated-style mask function that refuses every key: out 0, lse -inf, gradients 0,
    as the reference gives them."""
    import cupy

    rng = np.random.default_rng(3)
    q, k, v, dout = (random_array(rng, (1, 2, 33, 64), "float16") for _ in range(4))
    mask_mod = make_function(("lt", ("index", 2), ("const", -1)), TABLE, IDS, FLAGS, role="mask_mod")   # q_idx < -1
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, mask_mod=mask_mod, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=mask_mod)
    assert not cupy.asnumpy(out).any() and np.isneginf(cupy.asnumpy(lse)).all()
    assert all(not cupy.asnumpy(g).any() for g in grads)


@settings(**SLOW)
@given(score_tree=floats(2, smooth=True), mask_tree=bools(2, score=False), which=st.sampled_from(["score", "mask", "both"]),
       dtype=st.sampled_from(["float16", "bfloat16"]), d=st.sampled_from([64, 128]),
       lengths=st.lists(st.integers(0, 200), min_size=1, max_size=3), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 4]), nq=st.integers(1, 4), n_new=st.integers(0, 2),
       page_size=st.sampled_from([None, 16, 7]), num_splits=st.sampled_from([None, 1, 3]),
       seed=st.integers(0, 2**31 - 1))
def test_generated_functions_on_the_kv_cache_match_the_reference(score_tree, mask_tree, which, dtype, d, lengths, hkv,
                                                                 group, nq, n_new, page_size, num_splits, seed):
    """attention_kvcache with generated functions (q_idx from each sequence's length) against
    the reference, out within twice the plain call's error and lse; ragged lengths, empty caches,
    appends, pages, splits, grouped query heads (q (B, Hkv, G, Nq, D) against caches (B, Hkv, 1,
    N, D); the functions see the query head h = Hkv index * G + g). Scores the functions make
    stay under 100."""
    import cupy

    rng = np.random.default_rng(seed)
    b = len(lengths)
    nmax = max(lengths) + n_new + 5
    q = random_array(rng, (b, hkv, group, nq, d), dtype, scale=1.5)
    kc, vc = (random_array(rng, (b, hkv, nmax, d), dtype, scale=1.5) for _ in range(2))
    kn, vn = (random_array(rng, (b, hkv, 1, n_new, d), dtype) if n_new else None for _ in range(2))
    table = None
    if page_size is not None:   # the same rows in pages of a random order
        pages = -(-nmax // page_size)
        table = rng.permutation(b * pages).reshape(b, pages).astype(np.int32)
        where = np.zeros((b * pages, page_size), dtype=np.int64)   # (page, row) -> (sequence, key) of the flat cache
        for i in range(b):
            for j in range(pages * page_size):
                where[table[i, j // page_size], j % page_size] = i * nmax + min(j, nmax - 1)
        kc, vc = (cupy.moveaxis(c.swapaxes(0, 1).reshape(hkv, b * nmax, d)[:, cupy.asarray(where)], 0, 1)
                  for c in (kc, vc))
    kc, vc = kc[:, :, None], vc[:, :, None]   # (a view: the caches' group dim)
    host = {name: None if x is None else cupy.asnumpy(x).astype(np.float64)
            for name, x in (("q", q), ("k", kc), ("v", vc), ("k_new", kn), ("v_new", vn))}
    tables_gpu = tuple(cupy.asarray(x) for x in (TABLE, IDS, FLAGS))
    on_gpu, on_host, made = {}, {}, []
    if which in ("score", "both"):
        score_host, score_gpu = make_function(score_tree, TABLE, IDS, FLAGS), make_function(score_tree, *tables_gpu)

        def recorded(score, b, hk, g, i, j):   # (the reference calls it on arrays after tracing it)
            result = score_host(score, b, hk * group + g, i, j)
            if isinstance(score, np.ndarray):
                made.append(np.asarray(result, dtype=np.float64))
            return result

        on_host["score_mod"] = recorded
        on_gpu["score_mod"] = lambda score, b, hk, g, i, j: score_gpu(score, b, hk * group + g, i, j)
    if which in ("mask", "both"):
        mask_host = make_function(mask_tree, TABLE, IDS, FLAGS, role="mask_mod")
        mask_gpu = make_function(mask_tree, *tables_gpu, role="mask_mod")
        on_host["mask_mod"] = lambda b, hk, g, i, j: mask_host(b, hk * group + g, i, j)
        on_gpu["mask_mod"] = lambda b, hk, g, i, j: mask_gpu(b, hk * group + g, i, j)
    common = dict(cache_seqlens=np.asarray(lengths), block_table=table, return_lse=True)
    with np.errstate(all="ignore"):
        want, want_lse = reference.attention_kvcache(host["q"], host["k"].copy(), host["v"].copy(), k_new=host["k_new"],
                                                     v_new=host["v_new"], **common, **on_host)
    assume(all(np.isfinite(m).all() and (m.size == 0 or np.abs(m).max() < 100) for m in made))
    plain_want = reference.attention_kvcache(host["q"], host["k"].copy(), host["v"].copy(), k_new=host["k_new"],
                                             v_new=host["v_new"], **common)[0]
    gpu = dict(k_new=kn, v_new=vn, cache_seqlens=cupy.asarray(lengths, dtype=cupy.int32), num_splits=num_splits,
               block_table=None if table is None else cupy.asarray(table), return_lse=True)
    plain = cuflash.attention_kvcache(q, kc.copy(), vc.copy(), **gpu)[0]
    with poisoned_allocations():
        out, lse = cuflash.attention_kvcache(q, kc, vc, **gpu, **on_gpu)
    plain_err = np.abs(cupy.asnumpy(plain).astype(np.float64) - plain_want).max()
    err = np.abs(cupy.asnumpy(out).astype(np.float64) - want).max()
    atol = 4 * eps(dtype) * max(1.0, np.abs(want).max())
    assert err <= 2 * plain_err + atol, f"out: error {err:.3g} > 2 x plain {plain_err:.3g} + {atol:.3g}"
    assert_lse_close(cupy.asnumpy(lse), want_lse)
