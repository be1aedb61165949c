"""CPU tests of user-defined score and mask functions in cuflash.reference (``score_mod``,
``mask_mod``, ``score_mod_grads``, `block_mask`; docs/contract.md, "User-defined score and mask
functions").

No GPU and no CuPy needed. Functions that rebuild a built-in keyword (softcap, ALiBi, causal,
window, packed sequences) must give that keyword's results; gradients must match central finite
differences.
"""

import numpy as np
import pytest
from conftest import finite_difference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _trace, reference

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, max_n=7):
    """q, k, v of batch (B, H) with H heads, Nq and Nk independent."""
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    nq, nk = draw(st.integers(0, max_n)), draw(st.integers(0, max_n))
    d, dv = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return dict(q=rng.standard_normal((b, h, nq, d)) * 2, k=rng.standard_normal((b, h, nk, d)),
                v=rng.standard_normal((b, h, nk, dv)))


def assert_same(a, b, tol=1e-12):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.isneginf(x), np.isneginf(y))
        finite = np.isfinite(y)
        np.testing.assert_allclose(x[finite], y[finite], rtol=tol, atol=tol)


def gradients(p, fn_kwargs, builtin_kwargs, seed=0):
    """The backward of ``p`` with ``fn_kwargs`` and with ``builtin_kwargs``, each from its own
    forward."""
    out = []
    for kwargs in (fn_kwargs, builtin_kwargs):
        o, lse = reference.attention(**p, return_lse=True, **kwargs)
        dout = np.random.default_rng(seed).standard_normal(o.shape)
        out.append(reference.attention_backward(dout, p["q"], p["k"], p["v"], o, lse, **kwargs))
    return out


# ---------------------------------------------------------------------------------------------
# Functions equal to the built-in keywords
# ---------------------------------------------------------------------------------------------


@settings(max_examples=25, **FAST)
@given(problems(), st.sampled_from([0.5, 2.0, 30.0]))
def test_softcap_as_a_score_function(p, cap):
    def softcap(score, b, h, q, k):
        return cap * cuflash.tanh(score / cap)

    fn = dict(score_mod=softcap)
    assert_same(reference.attention(**p, return_lse=True, **fn), reference.attention(**p, return_lse=True, softcap=cap))
    assert_same(*gradients(p, fn, dict(softcap=cap)))


@settings(max_examples=25, **FAST)
@given(problems(), st.integers(0, 2**32 - 1))
def test_alibi_as_a_score_function_reading_captured_slopes(p, seed):
    heads = p["q"].shape[1]
    slopes = np.random.default_rng(seed).uniform(0, 1, heads).astype(np.float32)
    off = p["k"].shape[-2] - p["q"].shape[-2]

    def alibi(score, b, h, q, k):
        return score - slopes[h] * abs(q + off - k)

    fn, builtin = dict(score_mod=alibi, causal=True), dict(alibi_slopes=slopes, causal=True)
    assert_same(reference.attention(**p, return_lse=True, **fn), reference.attention(**p, return_lse=True, **builtin))
    assert_same(reference.tiled_attention(**p, return_lse=True, block_m=4, block_n=4, **fn),
                reference.attention(**p, return_lse=True, **builtin))
    assert_same(*gradients(p, fn, builtin))


@settings(max_examples=25, **FAST)
@given(problems(), st.one_of(st.none(), st.integers(0, 4)), st.one_of(st.none(), st.integers(0, 4)))
def test_causal_and_window_as_mask_functions(p, left, right):
    off = p["k"].shape[-2] - p["q"].shape[-2]

    def band(b, h, q, k):
        allowed = k <= q + off
        if left is not None:   # Python control flow on captured numbers is fine: they are constants
            allowed = allowed & (k >= q + off - left)
        return allowed

    fn = dict(mask_mod=band)
    builtin = dict(window=(left, None), causal=True)
    assert_same(reference.attention(**p, return_lse=True, **fn), reference.attention(**p, return_lse=True, **builtin))
    assert_same(reference.tiled_attention(**p, return_lse=True, block_m=3, block_n=4, **fn),
                reference.attention(**p, return_lse=True, **builtin))
    assert_same(*gradients(p, fn, builtin))
    both = dict(window=(None, right), mask_mod=band)   # AND-ed with the keywords' mask
    expected = dict(window=(left, 0 if right is None else min(right, 0)))
    assert_same(reference.attention(**p, return_lse=True, **both), reference.attention(**p, return_lse=True, **expected))


@settings(max_examples=25, **FAST)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.lists(st.integers(0, 5), min_size=4, max_size=4),
       st.booleans(), st.integers(0, 2**32 - 1))
def test_document_mask_over_packed_sequences_equals_cu_seqlens(lq, lk, causal, seed):
    lk = lk[:len(lq)]
    cu_q, cu_k = (np.cumsum([0] + n).astype(np.int32) for n in (lq, lk))
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, n, 3)) for n in (cu_q[-1], cu_k[-1], cu_k[-1]))
    # Per position: its document, and its sequence's start; per document: Nk - Nq.
    # (One more element at the end: a captured array may not be empty.)
    doc_q, doc_k = (np.repeat(np.arange(len(n) + 1), n + [1]).astype(np.int32) for n in (lq, lk))
    start_q, start_k = cu_q[doc_q], cu_k[doc_k]
    off = (np.array(lk) - np.array(lq)).astype(np.int32)

    def documents(h, qi, kj):
        same = doc_q[qi] == doc_k[kj]
        if causal:
            same = same & (kj - start_k[kj] <= qi - start_q[qi] + off[doc_q[qi]])
        return same

    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal)
    assert_same(reference.attention(q, k, v, return_lse=True, mask_mod=documents),
                reference.attention(q, k, v, return_lse=True, **packed))
    p = dict(q=q, k=k, v=v)
    assert_same(*gradients(p, dict(mask_mod=documents), packed))


def test_score_function_with_packed_sequences_sees_positions_in_the_packed_arrays():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 6, 2)) for _ in range(3))
    cu = np.array([0, 2, 6], dtype=np.int32)
    seen = []

    def record(score, h, qi, kj):
        seen.append((np.asarray(qi).ravel().tolist(), np.asarray(kj).ravel().tolist()))
        return score

    reference.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, score_mod=record)
    assert seen[1:] == [([0, 1], [0, 1]), ([2, 3, 4, 5], [2, 3, 4, 5])]   # after the trace


def test_captured_cupy_arrays_are_read_through_get():
    class FakeCupy:   # what the reference needs of a CuPy array
        __module__ = "cupy._core.core"
        __cuda_array_interface__ = {}

        def __init__(self, a):
            self._a, self.dtype, self.shape, self.ndim = a, a.dtype, a.shape, a.ndim

        def get(self):
            return self._a

    table = np.linspace(-1, 1, 9).astype(np.float32)
    on_device = FakeCupy(table)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 5, 3)) for _ in range(3))
    want = reference.attention(q, k, v, score_mod=lambda s, h, i, j: s + table[i - j + 4])
    got = reference.attention(q, k, v, score_mod=lambda s, h, i, j: s + on_device[i - j + 4])
    np.testing.assert_array_equal(got, want)


def test_gpu_calls_refuse_captured_arrays_off_the_device():
    class Device:
        def __init__(self, i):
            self.id = i

    class FakeCupy:
        __module__ = "cupy._core.core"
        __cuda_array_interface__ = {}

        def __init__(self, device):
            self.dtype, self.shape, self.ndim, self.device = np.dtype(np.float32), (3,), 1, Device(device)

    on_1, on_host = FakeCupy(1), np.zeros(3, np.float32)
    for table, words in ((on_1, "on device 1, but q is on device 0"), (on_host, "a NumPy array")):
        fn = (lambda t: lambda s, i, j: s + t[i])(table)
        traced = _trace.trace(fn, "score_mod", 0)
        with pytest.raises(TypeError, match=words):
            _trace.check_devices(traced, _trace.captured_arrays(fn, traced), 0)


# ---------------------------------------------------------------------------------------------
# Gradients: finite differences, captured arrays
# ---------------------------------------------------------------------------------------------


def loss(p, dout, **kwargs):
    return float(np.sum(reference.attention(**p, **kwargs) * dout))


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_a_score_function_match_finite_differences(causal):
    rng = np.random.default_rng(3)
    p = dict(q=rng.standard_normal((2, 2, 4, 3)), k=rng.standard_normal((2, 2, 5, 3)), v=rng.standard_normal((2, 2, 5, 2)))
    # float32 tables, as the rules ask
    rel32 = (rng.integers(-512, 512, (2, 9)) / 256).astype(np.float32)
    scale = np.array([0.5, 1.5], dtype=np.float32)

    def mod(score, b, h, q, k):
        # additive reads, a multiplicative one, and a nonlinear function of the score
        return 3.0 * cuflash.tanh(score / 3.0) * scale[h] + rel32[h, q - k + 4] + rel32[h, 0] * score

    kwargs = dict(score_mod=mod, causal=causal, mask_mod=lambda b, h, q, k: (q + k) % 3 != 1)
    out, lse = reference.attention(**p, return_lse=True, **kwargs)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv, drel, dscale = reference.attention_backward(dout, p["q"], p["k"], p["v"], out, lse,
                                                            score_mod_grads=[rel32, scale], **kwargs)
    def f():
        return loss(p, dout, **kwargs)   # reads q, k, v and the tables as they are at each call

    for name, g in (("q", dq), ("k", dk), ("v", dv)):
        np.testing.assert_allclose(g, finite_difference(f, p[name], 1e-6), atol=1e-6, err_msg=name)
    assert drel.shape == rel32.shape and dscale.shape == scale.shape and drel.dtype == np.float64
    for table, grad in ((rel32, drel), (scale, dscale)):
        np.testing.assert_allclose(grad, finite_difference(f, table, 2**-12), atol=1e-5)


def test_score_mod_grads_refuse_what_has_no_gradient():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 3, 2)) for _ in range(3))
    table, ids = np.ones(4, dtype=np.float32), np.arange(4, dtype=np.int32)

    def mod(s, h, i, j):
        return s + table[ids[i]]

    out, lse = reference.attention(q, k, v, return_lse=True, score_mod=mod)
    dout = np.ones(out.shape)
    with pytest.raises(TypeError, match=r"score_mod_grads\[0\] is not an array that score_mod reads"):
        reference.attention_backward(dout, q, k, v, out, lse, score_mod=mod, score_mod_grads=[table.copy()])
    with pytest.raises(TypeError, match=r"score_mod_grads\[1\] .* has dtype int32"):
        reference.attention_backward(dout, q, k, v, out, lse, score_mod=mod, score_mod_grads=[table, ids])
    with pytest.raises(ValueError, match="needs a score_mod"):
        reference.attention_backward(dout, q, k, v, out, lse, score_mod_grads=[table])


def test_bias_gradient_goes_through_the_score_function():
    rng = np.random.default_rng(4)
    p = dict(q=rng.standard_normal((1, 3, 2)), k=rng.standard_normal((1, 4, 2)), v=rng.standard_normal((1, 4, 2)))
    bias = rng.standard_normal((3, 4))
    kwargs = dict(bias=bias, score_mod=lambda s, h, i, j: 2.0 * cuflash.tanh(s / 2.0))
    out, lse = reference.attention(**p, return_lse=True, **kwargs)
    dout = rng.standard_normal(out.shape)
    dbias = reference.attention_backward(dout, p["q"], p["k"], p["v"], out, lse, bias_grad=True, **kwargs)[3]
    fd = finite_difference(lambda: loss(p, dout, **kwargs), bias, 1e-6)
    np.testing.assert_allclose(dbias, fd, atol=1e-6)


def test_reference_functions_raise_the_tracers_type_errors_first():
    q = k = v = np.zeros((1, 2, 2))
    with pytest.raises(TypeError, match="Python `if`"):
        reference.attention(q, k, v, score_mod=lambda s, h, i, j: s if s > 0 else -s)
    with pytest.raises(TypeError, match="mask_mod returned a float"):
        reference.tiled_attention(q, k, v, mask_mod=lambda h, i, j: i * 1.0)
    with pytest.raises(TypeError, match=r"called with 3 arguments, \(b0, q_idx, kv_idx\)"):
        reference.attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j)


# ---------------------------------------------------------------------------------------------
# Block masks
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, **FAST)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 9), st.integers(1, 9), st.integers(0, 6),
       st.integers(0, 2**32 - 1))
def test_block_mask_classifies_every_tile(nq, nk, bm, bn, window, seed):
    doc = np.sort(np.random.default_rng(seed).integers(0, 3, (2, max(nq, nk, 1)))).astype(np.int32)

    def mask(b, h, q, k):
        return (doc[b, q] == doc[b, k]) & (k <= q) & (q - k <= window + h)

    blocks = reference.block_mask(mask, (2, 2), nq, nk, block=(bm, bn))
    dense = np.broadcast_to(mask(*_trace.index_grids((2, 2), np.arange(nq), np.arange(nk))), (2, 2, nq, nk))
    assert blocks.kinds.shape == (2, 2, -(-nq // bm), -(-nk // bn)) and blocks.kinds.dtype == np.int8
    assert blocks.block == (bm, bn) and blocks.shape == (nq, nk)
    for idx in np.ndindex(blocks.kinds.shape):
        m, n = idx[-2:]
        tile = dense[idx[:-2]][m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
        want = reference.BlockMask.FULL if tile.all() else reference.BlockMask.PARTIAL if tile.any() else \
            reference.BlockMask.EMPTY
        assert blocks.kinds[idx] == want, (idx, tile)


def test_block_mask_refuses_bad_sizes_and_bad_functions():
    with pytest.raises(ValueError, match="block must be two positive ints"):
        reference.block_mask(lambda q, k: q >= k, (), 4, 4, block=(0, 4))
    with pytest.raises(ValueError, match="nq must be a non-negative int"):
        reference.block_mask(lambda q, k: q >= k, (), -1, 4)
    with pytest.raises(TypeError, match="mask_mod returned a int"):
        reference.block_mask(lambda q, k: q - k, (), 4, 4)


def test_a_block_mask_applies_its_function():
    """reference.attention, tiled_attention and attention_backward given block_mask= compute
    with its mask_mod (alone, or beside that same function), for a block mask built for a batch
    that broadcasts to the call's."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (20, 24, 24))
    dout = rng.standard_normal((2, 3, 20, 8))
    doc = np.sort(rng.integers(0, 3, (2, 24))).astype(np.int32)

    def mask(b, h, qi, kj):
        return (doc[b, qi] == doc[b, kj]) & (kj <= qi + 4)

    want, lse = reference.attention(q, k, v, mask_mod=mask, return_lse=True)
    grads = reference.attention_backward(dout, q, k, v, want, lse, mask_mod=mask)
    for blocks in (reference.block_mask(mask, (2, 1), 20, 24, block=(8, 16)),
                   reference.block_mask(mask, (2, 3), 20, 24)):
        assert blocks.mask_mod is mask
        for given in ({"block_mask": blocks}, {"block_mask": blocks, "mask_mod": mask}):
            np.testing.assert_array_equal(reference.attention(q, k, v, **given), want)
            np.testing.assert_allclose(reference.tiled_attention(q, k, v, **given), want, atol=1e-12)
            for g, w in zip(reference.attention_backward(dout, q, k, v, want, lse, **given), grads):
                np.testing.assert_array_equal(g, w)


def test_a_block_mask_block_may_be_any_two_positive_ints():
    """A block mask's ``block`` as a tuple of ints, a list or NumPy ints: the same results (the
    check of a block on each call takes a tuple of ints at little cost, anything else through
    `_checks.check_block_mask`)."""
    import dataclasses

    q, k, v = (np.random.default_rng(5).standard_normal((2, 16, 8)) for _ in range(3))

    def mask(h, qi, kj):
        return kj <= qi

    blocks = reference.block_mask(mask, (2,), 16, 16, block=(8, 8))
    want = reference.attention(q, k, v, block_mask=blocks)
    for block in ([8, 8], (np.int64(8), np.int32(8))):
        np.testing.assert_array_equal(reference.attention(q, k, v, block_mask=dataclasses.replace(blocks, block=block)),
                                      want)
    for block in ((8, True), (8.0, 8), (8, -8)):
        with pytest.raises(ValueError, match="block"):
            reference.attention(q, k, v, block_mask=dataclasses.replace(blocks, block=block))


def test_a_block_mask_that_does_not_fit_the_call_is_refused():
    """A block mask for other sizes, a batch that does not broadcast, kinds of another shape or
    dtype, a different mask_mod beside it, one without a function or not a BlockMask at all:
    ValueError or TypeError naming it, in the reference as on the GPU (the checks are shared)."""
    import dataclasses

    q, k, v = (np.zeros((2, 3, 16, 8)) for _ in range(3))

    def mask(b, h, qi, kj):
        return kj <= qi

    good = reference.block_mask(mask, (2, 3), 16, 16, block=(8, 8))
    bad = {
        r"built for \(Nq, Nk\) = \(16, 12\)": reference.block_mask(mask, (2, 3), 16, 12, block=(8, 8)),
        r"batch shape \(3, 3\) does not broadcast": reference.block_mask(mask, (3, 3), 16, 16, block=(8, 8)),
        r"batch shape \(2, 2, 3\) does not broadcast": reference.block_mask(lambda a, b, h, qi, kj: kj <= qi,
                                                                              (2, 2, 3), 16, 16, block=(8, 8)),
        "must be int8 of shape batch": dataclasses.replace(good, kinds=good.kinds[..., :1]),
        "must be int8": dataclasses.replace(good, kinds=good.kinds.astype(np.int32)),
        "block must be two positive ints": dataclasses.replace(good, block=(0, 8)),
        "has no mask function": dataclasses.replace(good, mask_mod=None),
    }
    for message, blocks in bad.items():
        with pytest.raises(ValueError, match=message):
            reference.attention(q, k, v, block_mask=blocks)
    with pytest.raises(ValueError, match="not the function block_mask was built from"):
        reference.attention(q, k, v, block_mask=good, mask_mod=lambda b, h, qi, kj: kj <= qi)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        reference.attention(q, k, v, block_mask=good.kinds)


# ---------------------------------------------------------------------------------------------
# KV cache: the functions see the sequence's index first and positions in the sequence
# ---------------------------------------------------------------------------------------------

@settings(max_examples=30, **FAST)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=3), n_new=st.integers(0, 3),
       nq=st.integers(1, 4), page_size=st.sampled_from((None, 1, 7)), seed=st.integers(0, 2**32 - 1))
def test_kvcache_functions_rebuild_alibi_and_causal(lengths, n_new, nq, page_size, seed):
    """ALiBi as a score function and causal as a mask function, in positions of the sequence
    (q_idx = Nk_b - Nq + i), give the built-in keywords' out and lse, contiguous or paged, with
    keys appended; ragged lengths, empty caches."""
    rng = np.random.default_rng(seed)
    b, h, d, nmax = len(lengths), 2, 4, 40
    seqlens = np.array(lengths)
    slopes = rng.uniform(0.1, 1.0, h).astype(np.float32)
    q = rng.standard_normal((b, h, nq, d)) * 2
    kc, vc = rng.standard_normal((b, h, nmax, d)), rng.standard_normal((b, h, nmax, d))
    kn, vn = rng.standard_normal((b, h, n_new, d)), rng.standard_normal((b, h, n_new, d))
    table = None
    if page_size is not None:   # the same keys in pages of a random order
        pages = -(-nmax // page_size)
        table = rng.permutation(b * pages).reshape(b, pages).astype(np.int32)
        kp, vp = np.zeros((b * pages, h, page_size, d)), np.zeros((b * pages, h, page_size, d))
        for i in range(b):
            for j in range(nmax):
                kp[table[i, j // page_size], :, j % page_size], vp[table[i, j // page_size], :, j % page_size] = \
                    kc[i, :, j], vc[i, :, j]
        kc, vc = kp, vp
    common = dict(k_new=kn, v_new=vn, cache_seqlens=seqlens, block_table=table, return_lse=True)
    got = reference.attention_kvcache(q, kc.copy(), vc.copy(), **common,
                                      score_mod=lambda s, b, h, i, j: s - slopes[h] * abs(i - j),
                                      mask_mod=lambda b, h, i, j: i >= j)
    want = reference.attention_kvcache(q, kc.copy(), vc.copy(), **common, alibi_slopes=slopes, causal=True)
    assert_same(got, want)


def test_kvcache_functions_see_the_sequence_index_first():
    """A mask function reading a per-sequence table by b: each sequence's rows as attention over
    that sequence's keys alone with the table's entry."""
    rng = np.random.default_rng(3)
    b, h, nq, d, nmax = 3, 2, 3, 8, 24
    seqlens = np.array([20, 0, 11])
    first = np.array([4, 0, 9], dtype=np.int32)   # each sequence's first visible key
    q, kc, vc = rng.standard_normal((b, h, nq, d)), rng.standard_normal((b, h, nmax, d)), rng.standard_normal((b, h, nmax, d))
    got = reference.attention_kvcache(q, kc, vc, cache_seqlens=seqlens, mask_mod=lambda b, h, i, j: j >= first[b])
    for i in range(b):
        low = int(first[i])
        want = reference.attention(q[i], kc[i, :, : seqlens[i]], vc[i, :, : seqlens[i]],
                                   mask_mod=lambda h, r, j: j >= low)
        np.testing.assert_allclose(got[i], want, atol=1e-12)


def test_kvcache_functions_that_break_the_rules_raise_before_any_write():
    rng = np.random.default_rng(4)
    q, kc, vc = rng.standard_normal((2, 2, 1, 8)), rng.standard_normal((2, 2, 10, 8)), rng.standard_normal((2, 2, 10, 8))
    kn, vn = rng.standard_normal((2, 2, 1, 8)), rng.standard_normal((2, 2, 1, 8))
    before = kc.copy(), vc.copy()
    for kwargs, match in (({"mask_mod": lambda h, i, j: i >= j}, "one index per batch dim"),
                          ({"score_mod": lambda s, b, h, i, j: s if i > j else s * 2}, "traced value")):
        with pytest.raises(TypeError, match=match):
            reference.attention_kvcache(q, kc, vc, k_new=kn, v_new=vn, cache_seqlens=np.array([3, 5]), **kwargs)
        np.testing.assert_array_equal(kc, before[0])
        np.testing.assert_array_equal(vc, before[1])
