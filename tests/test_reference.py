"""CPU tests of the NumPy reference (cuflash.reference) and of the mask rule (cuflash._mask).

No GPU and no CuPy needed. The reference is the oracle for every GPU test, so it is checked
here against independent computations: a per-row loop, explicit repetition of broadcast
inputs, and finite differences of the forward.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from cuflash import reference
from cuflash._mask import (
    allowed,
    block_allowed,
    block_needs_mask,
    key_range,
    normalize_window,
)

# Any RuntimeWarning (overflow, invalid value, divide by zero) is a failure: fully masked rows
# and large logits must be handled without producing NaN on the way.
pytestmark = pytest.mark.filterwarnings("error")


# ---------------------------------------------------------------------------------------------
# Strategies and helpers
# ---------------------------------------------------------------------------------------------


def window_sides(max_side):
    return st.one_of(st.none(), st.integers(0, max_side))


@st.composite
def masks(draw, max_side):
    """(causal, window) as a user would pass them."""
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.tuples(window_sides(max_side), window_sides(max_side))))
    return causal, window


@st.composite
def problems(draw, *, max_n, max_d, max_dims, max_side, logit_scales=(1.0,)):
    """Random q, k, v with mutually broadcastable batch dims, a mask and a scale."""
    shapes = draw(
        mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=max_dims, min_side=1, max_side=max_side)
    ).input_shapes
    nq = draw(st.integers(1, max_n))
    nk = draw(st.integers(1, max_n))
    d = draw(st.integers(1, max_d))
    dv = draw(st.integers(1, max_d))
    causal, window = draw(masks(max_side=max_n + 2))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0), st.floats(-2.0, -0.05)))
    logit_scale = draw(st.sampled_from(logit_scales))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # Scaling q and k by c scales the scores by c^2: c = 30 gives scores of order 1e3.
    q = rng.standard_normal(shapes[0] + (nq, d)) * logit_scale
    k = rng.standard_normal(shapes[1] + (nk, d)) * logit_scale
    v = rng.standard_normal(shapes[2] + (nk, dv))
    return dict(q=q, k=k, v=v, causal=causal, window=window, scale=scale)


def assert_close(actual, expected, rtol, what, atol=0.0):
    """Max-norm comparison: max|actual - expected| <= rtol * max|expected| + atol."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    if expected.size == 0:
        return
    err = np.max(np.abs(actual - expected))
    ref = np.max(np.abs(expected))
    assert err <= rtol * ref + atol, f"{what}: max abs error {err:.3e}, max |ref| {ref:.3e}"


def assert_lse_close(actual, expected, rtol, what="lse"):
    """-inf exactly where expected is -inf; finite values agree to rtol (relative to max(1, |x|))."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    masked = np.isneginf(expected)
    np.testing.assert_array_equal(np.isneginf(actual), masked, err_msg=f"{what}: -inf pattern")
    a, e = actual[~masked], expected[~masked]
    assert np.all(np.isfinite(a)), f"{what}: non-finite values"
    if e.size:
        err = np.max(np.abs(a - e) / np.maximum(1.0, np.abs(e)))
        assert err <= rtol, f"{what}: max relative error {err:.3e}"


def naive_attention(q, k, v, *, causal, window, scale):
    """Row-by-row attention with Python loops: for each batch index and query row, gather the
    keys the row may attend and apply a softmax to their scores."""
    left, right = normalize_window(causal, window)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q = np.broadcast_to(q, batch + (nq, d))
    k = np.broadcast_to(k, batch + (nk, d))
    v = np.broadcast_to(v, batch + (nk, dv))
    mask = allowed(nq, nk, left, right)
    out = np.zeros(batch + (nq, dv))
    lse = np.full(batch + (nq,), -np.inf)
    for b in np.ndindex(*batch):
        for i in range(nq):
            cols = [j for j in range(nk) if mask[i, j]]
            if not cols:
                continue
            s = [scale * float(np.dot(q[b + (i,)], k[b + (j,)])) for j in cols]
            mx = max(s)
            w = [math.exp(x - mx) for x in s]
            z = math.fsum(w)
            for c in range(dv):
                out[b + (i, c)] = math.fsum(wj * v[b + (j, c)] for wj, j in zip(w, cols)) / z
            lse[b + (i,)] = mx + math.log(z)
    return out, lse


# ---------------------------------------------------------------------------------------------
# (a) attention against a per-row loop
# ---------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(problems(max_n=24, max_d=8, max_dims=2, max_side=3, logit_scales=(1.0, 4.0, 30.0)))
def test_attention_matches_row_loop(p):
    out, lse = reference.attention(**p, return_lse=True)
    want_out, want_lse = naive_attention(**p)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert_close(out, want_out, 1e-11, "out")
    assert_lse_close(lse, want_lse, 1e-12)
    # Without return_lse the same output comes back alone.
    out_only = reference.attention(**p)
    assert isinstance(out_only, np.ndarray)
    np.testing.assert_array_equal(out_only, out)


def test_attention_small_example_by_hand():
    # One query, two keys, scores 0 and log(3): weights 1/4 and 3/4.
    q = np.array([[1.0]])
    k = np.array([[0.0], [math.log(3.0)]])
    v = np.array([[4.0, -8.0], [0.0, 8.0]])
    out, lse = reference.attention(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_allclose(out, [[1.0, 4.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [math.log(4.0)], rtol=1e-15)


def test_attention_accepts_bfloat16_and_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, 7, 8)).astype(np.float32)
    v = rng.standard_normal((2, 7, 4)).astype(np.float32)
    bf = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    out = reference.attention(*bf, causal=True)
    want = reference.attention(*(x.astype(np.float64) for x in bf), causal=True)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, want)
    out32 = reference.attention(q, k, v, causal=True)
    assert out32.dtype == np.float64
    # bfloat16 rounding changes the inputs, so the results differ, but not by much.
    assert 0 < np.max(np.abs(out32 - out)) < 0.1


def test_large_logits_stay_finite():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((3, 40, 16)) * 60.0
    k = rng.standard_normal((3, 50, 16)) * 60.0
    v = rng.standard_normal((3, 50, 8))
    out, lse = reference.attention(q, k, v, return_lse=True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.max(np.abs(lse)) > 1e3  # the scores really are large
    want_out, want_lse = naive_attention(q, k, v, causal=False, window=None, scale=None)
    assert_close(out, want_out, 1e-11, "out")
    assert_lse_close(lse, want_lse, 1e-12)


def test_zero_length_dims():
    # No keys: every row is fully masked.
    out, lse = reference.attention(np.ones((2, 3, 4)), np.ones((2, 0, 4)), np.ones((2, 0, 5)), return_lse=True)
    assert out.shape == (2, 3, 5) and lse.shape == (2, 3)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    # No queries, or an empty batch: empty results.
    out, lse = reference.attention(np.ones((0, 4)), np.ones((6, 4)), np.ones((6, 5)), return_lse=True)
    assert out.shape == (0, 5) and lse.shape == (0,)
    out = reference.attention(np.ones((0, 3, 4)), np.ones((6, 4)), np.ones((6, 5)))
    assert out.shape == (0, 3, 5)
    out, lse = reference.tiled_attention(np.ones((2, 3, 4)), np.ones((0, 4)), np.ones((0, 5)), return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    dq, dk, dv = reference.attention_backward(
        np.ones((3, 5)), np.ones((3, 4)), np.ones((0, 4)), np.ones((0, 5)), np.zeros((3, 5)), np.full(3, -np.inf)
    )
    assert dq.shape == (3, 4) and np.all(dq == 0) and dk.shape == (0, 4) and dv.shape == (0, 5)


@pytest.mark.parametrize(
    "args, match",
    [
        ((np.ones(4), np.ones((3, 4)), np.ones((3, 4))), "q must have at least 2 dims"),
        ((np.ones((2, 4)), np.ones((3, 5)), np.ones((3, 4))), "same head dim"),
        ((np.ones((2, 4)), np.ones((3, 4)), np.ones((2, 4))), "same number of keys"),
        ((np.ones((2, 2, 4)), np.ones((3, 3, 4)), np.ones((3, 3, 4))), "must broadcast"),
    ],
)
def test_reference_shape_errors(args, match):
    with pytest.raises(ValueError, match=match):
        reference.attention(*args)


def test_reference_type_errors():
    with pytest.raises(TypeError, match="q must have a real floating dtype"):
        reference.attention(np.ones((2, 4), dtype=complex), np.ones((3, 4)), np.ones((3, 4)))
    with pytest.raises(TypeError, match="scale"):
        reference.attention(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)), scale="1")
    with pytest.raises(ValueError, match="lse must have shape"):
        reference.attention_backward(
            np.ones((2, 4)), np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)), np.ones((2, 4)), np.ones(3)
        )


# ---------------------------------------------------------------------------------------------
# (b) the tiled algorithm against the direct computation
# ---------------------------------------------------------------------------------------------


def check_tiled(p, block_m, block_n):
    out, lse = reference.tiled_attention(**p, block_m=block_m, block_n=block_n, return_lse=True)
    want_out, want_lse = reference.attention(**p, return_lse=True)
    assert_close(out, want_out, 1e-10, "out")
    assert_lse_close(lse, want_lse, 1e-10)


@settings(max_examples=70, deadline=None)
@given(
    problems(max_n=200, max_d=16, max_dims=2, max_side=2, logit_scales=(1.0, 8.0, 30.0)),
    st.sampled_from([16, 32, 64]),
    st.sampled_from([16, 32, 64]),
)
def test_tiled_matches_attention(p, block_m, block_n):
    check_tiled(p, block_m, block_n)


@pytest.mark.parametrize("nq, nk", [(1, 1), (64, 64), (65, 63), (200, 17), (17, 200), (128, 129)])
@pytest.mark.parametrize(
    "causal, window",
    [(False, None), (True, None), (False, (5, None)), (False, (None, 3)), (False, (7, 2)), (True, (40, None)),
     (False, (0, 0))],
)
def test_tiled_edge_shapes(nq, nk, causal, window):
    rng = np.random.default_rng(nq * 1000 + nk)
    p = dict(
        q=rng.standard_normal((2, nq, 16)) * 30.0,
        k=rng.standard_normal((nk, 16)) * 30.0,
        v=rng.standard_normal((2, nk, 8)),
        causal=causal,
        window=window,
        scale=None,
    )
    check_tiled(p, 32, 16)


def test_tiled_rejects_bad_blocks():
    with pytest.raises(ValueError, match="block_n"):
        reference.tiled_attention(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)), block_n=0)


# ---------------------------------------------------------------------------------------------
# (c) broadcasting: grouped-query attention equals explicit repetition
# ---------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 2),  # B
    st.integers(1, 3),  # Hkv
    st.integers(2, 4),  # G
    st.integers(1, 20),  # Nq
    st.integers(1, 20),  # Nk
    masks(max_side=22),
    st.integers(0, 2**32 - 1),
)
def test_gqa_equals_repetition(b, hkv, g, nq, nk, mask, seed):
    causal, window = mask
    rng = np.random.default_rng(seed)
    d, dv = 8, 4
    q = rng.standard_normal((b, hkv, g, nq, d))
    k = rng.standard_normal((b, hkv, 1, nk, d))
    v = rng.standard_normal((b, hkv, 1, nk, dv))
    k_rep = np.repeat(k, g, axis=2)
    v_rep = np.repeat(v, g, axis=2)
    kw = dict(causal=causal, window=window)

    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    out_rep, lse_rep = reference.attention(q, k_rep, v_rep, return_lse=True, **kw)
    assert out.shape == (b, hkv, g, nq, dv)
    assert_close(out, out_rep, 1e-13, "out")
    assert_lse_close(lse, lse_rep, 1e-13)
    out_tiled = reference.tiled_attention(q, k, v, block_m=16, block_n=16, **kw)
    assert_close(out_tiled, out_rep, 1e-10, "tiled out")

    dout = rng.standard_normal(out.shape)
    dq, dk, dv_ = reference.attention_backward(dout, q, k, v, out, lse, **kw)
    dq_r, dk_r, dv_r = reference.attention_backward(dout, q, k_rep, v_rep, out_rep, lse_rep, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv_.shape == v.shape
    assert_close(dq, dq_r, 1e-12, "dq", atol=1e-14)
    # The gradient of a broadcast input is the sum over the group of the repeated one's.
    assert_close(dk, dk_r.sum(axis=2, keepdims=True), 1e-12, "dk", atol=1e-14)
    assert_close(dv_, dv_r.sum(axis=2, keepdims=True), 1e-12, "dv")


def test_broadcast_added_leading_dims():
    # k and v without batch dims (MQA over everything) and q with two.
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 5, 4))
    k = rng.standard_normal((6, 4))
    v = rng.standard_normal((6, 3))
    out, lse = reference.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse)
    assert dk.shape == k.shape and dv.shape == v.shape
    kb, vb = np.broadcast_to(k, (2, 3, 6, 4)), np.broadcast_to(v, (2, 3, 6, 3))
    _, dk_b, dv_b = reference.attention_backward(dout, q, kb, vb, out, lse)
    assert_close(dk, dk_b.sum(axis=(0, 1)), 1e-12, "dk")
    assert_close(dv, dv_b.sum(axis=(0, 1)), 1e-12, "dv")


# ---------------------------------------------------------------------------------------------
# (d) fully masked rows
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 30),  # Nk
    st.integers(1, 30),  # extra rows: Nq = Nk + extra
    st.one_of(st.none(), st.integers(0, 10)),  # window left
    st.integers(0, 2**32 - 1),
)
def test_fully_masked_rows(nk, extra, left, seed):
    nq = nk + extra
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, nq, 8))
    k = rng.standard_normal((2, nk, 8))
    v = rng.standard_normal((2, nk, 5))
    kw = dict(causal=True, window=(left, None))
    # off = Nk - Nq = -extra: rows i < extra have no key j <= i + off.
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert np.all(out[:, :extra] == 0)
    assert np.all(np.isneginf(lse[:, :extra]))
    assert np.all(np.isfinite(lse[:, extra:]))
    assert np.all(np.any(out[:, extra:] != 0, axis=-1))

    out_t, lse_t = reference.tiled_attention(q, k, v, block_m=16, block_n=16, return_lse=True, **kw)
    assert np.all(out_t[:, :extra] == 0) and np.all(np.isneginf(lse_t[:, :extra]))

    dout = rng.standard_normal(out.shape)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, **kw)
    assert np.all(dq[:, :extra] == 0)
    assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
    # The masked rows contribute nothing: dk and dv equal those of the problem without them,
    # where the remaining rows see the same keys (square, causal).
    q2, out2, lse2, dout2 = q[:, extra:], out[:, extra:], lse[:, extra:], dout[:, extra:]
    dq2, dk2, dv2 = reference.attention_backward(dout2, q2, k, v, out2, lse2, **kw)
    # (With Nk = 1 the exact dq and dk are 0 and only rounding remains: hence the atol.)
    assert_close(dq[:, extra:], dq2, 1e-13, "dq", atol=1e-14)
    assert_close(dk, dk2, 1e-13, "dk", atol=1e-14)
    assert_close(dv, dv2, 1e-13, "dv", atol=1e-14)


def test_fully_masked_by_window():
    # Nq = 6, Nk = 2, window right = 1: off = -4, row i attends j <= i - 3, so rows 0..2 see nothing.
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((6, 3)), rng.standard_normal((2, 3)), rng.standard_normal((2, 2))
    out, lse = reference.attention(q, k, v, window=(None, 1), return_lse=True)
    assert np.all(out[:3] == 0) and np.all(np.isneginf(lse[:3])) and np.all(np.isfinite(lse[3:]))
    dq, dk, dv = reference.attention_backward(rng.standard_normal(out.shape), q, k, v, out, lse, window=(None, 1))
    assert np.all(dq[:3] == 0) and np.any(dq[3:] != 0)


# ---------------------------------------------------------------------------------------------
# (e) backward against finite differences
# ---------------------------------------------------------------------------------------------


def finite_difference(f, x, h=1e-5):
    """Central differences of the scalar function f at every element of x."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        orig = x[idx]
        x[idx] = orig + h
        up = f()
        x[idx] = orig - h
        down = f()
        x[idx] = orig
        grad[idx] = (up - down) / (2 * h)
    return grad


@settings(max_examples=40, deadline=None)
@given(problems(max_n=5, max_d=4, max_dims=2, max_side=2))
def test_backward_matches_finite_differences(p):
    q, k, v = p["q"], p["k"], p["v"]
    kw = dict(causal=p["causal"], window=p["window"], scale=p["scale"])
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    dout = np.random.default_rng(int(abs(q.flat[0]) * 1e6)).standard_normal(out.shape)

    def loss():
        return float(np.sum(reference.attention(q, k, v, **kw) * dout))

    dq, dk, dv = reference.attention_backward(dout, q, k, v, out, lse, **kw)
    assert dq.dtype == dk.dtype == dv.dtype == np.float64
    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        fd = finite_difference(loss, x)
        assert g.shape == x.shape
        err = np.max(np.abs(g - fd))
        assert err <= 1e-6 * np.max(np.abs(fd)) + 1e-9, f"{name}: error {err:.3e}"


# ---------------------------------------------------------------------------------------------
# (f) the mask rule
# ---------------------------------------------------------------------------------------------


def test_normalize_window_values():
    assert normalize_window(False, None) == (None, None)
    assert normalize_window(True, None) == (None, 0)
    assert normalize_window(False, (3, None)) == (3, None)
    assert normalize_window(False, [None, 2]) == (None, 2)
    assert normalize_window(True, (4, 9)) == (4, 0)
    assert normalize_window(True, (None, None)) == (None, 0)
    left, right = normalize_window(False, (np.int64(5), np.uint8(1)))
    assert (left, right) == (5, 1) and type(left) is int and type(right) is int
    assert normalize_window(np.bool_(True), np.array([2, 3])) == (2, 0)


@pytest.mark.parametrize(
    "window, exc, match",
    [
        ((-1, None), ValueError, r"window\[0\].*non-negative.*-1"),
        ((2, -3), ValueError, r"window\[1\].*non-negative.*-3"),
        ((np.int32(-1), 0), ValueError, r"window\[0\]"),
        ((True, 2), TypeError, r"window\[0\].*int.*True"),
        ((1, np.bool_(False)), TypeError, r"window\[1\]"),
        ((1.0, 2), TypeError, r"window\[0\].*int.*1\.0"),
        ((1, 2.5), TypeError, r"window\[1\].*2\.5"),
        ((1,), ValueError, r"window.*length 1"),
        ((1, 2, 3), ValueError, r"window.*length 3"),
        (5, TypeError, r"window must be None or a pair.*5"),
        ("ab", TypeError, r"window must be None or a pair"),
    ],
)
def test_normalize_window_errors(window, exc, match):
    with pytest.raises(exc, match=match):
        normalize_window(False, window)


def test_normalize_window_rejects_non_bool_causal():
    with pytest.raises(TypeError, match="causal must be a bool"):
        normalize_window(1, None)


def test_allowed_drawing():
    # The drawing in reference.attention's docstring.
    np.testing.assert_array_equal(
        allowed(3, 5, None, 0).astype(int), [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    )
    np.testing.assert_array_equal(
        allowed(5, 3, None, 0).astype(int), [[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    )
    # A local window (1, 1) on a square matrix is tridiagonal.
    np.testing.assert_array_equal(allowed(4, 4, 1, 1), np.abs(np.subtract.outer(range(4), range(4))) <= 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 12), st.integers(0, 12), window_sides(15), window_sides(15))
def test_allowed_matches_rule(nq, nk, left, right):
    mask = allowed(nq, nk, left, right)
    assert mask.shape == (nq, nk) and mask.dtype == bool
    off = nk - nq
    for i in range(nq):
        for j in range(nk):
            lo_ok = left is None or j >= i + off - left
            hi_ok = right is None or j <= i + off + right
            assert mask[i, j] == (lo_ok and hi_ok), (i, j)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), window_sides(45), window_sides(45), st.data())
def test_key_range_is_exact(nq, nk, left, right, data):
    row_start = data.draw(st.integers(0, nq), label="row_start")
    row_stop = data.draw(st.integers(row_start, nq + 8), label="row_stop")  # may run past Nq
    lo, hi = key_range(row_start, row_stop, nq, nk, left, right)
    assert 0 <= lo <= nk and 0 <= hi <= nk
    cols = np.flatnonzero(allowed(nq, nk, left, right)[row_start:row_stop].any(axis=0))
    if cols.size == 0:
        assert hi <= lo
    else:
        np.testing.assert_array_equal(cols, np.arange(lo, hi))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), window_sides(45), window_sides(45), st.data())
def test_block_needs_mask_is_exact(nq, nk, left, right, data):
    row_start = data.draw(st.integers(0, nq - 1), label="row_start")
    row_stop = data.draw(st.integers(row_start + 1, nq + 8), label="row_stop")
    col_start = data.draw(st.integers(0, nk - 1), label="col_start")
    col_stop = data.draw(st.integers(col_start + 1, nk + 8), label="col_stop")
    needs = block_needs_mask(row_start, row_stop, col_start, col_stop, nq, nk, left, right)
    tile = block_allowed(row_start, min(row_stop, nq), col_start, col_stop, nq, nk, left, right)
    # Columns past Nk are never allowed, so the ragged end always needs the mask.
    assert needs == (not tile.all())
    # And the tile agrees with the full mask where they overlap.
    np.testing.assert_array_equal(
        tile[:, : max(0, min(col_stop, nk) - col_start)],
        allowed(nq, nk, left, right)[row_start:row_stop, col_start:col_stop],
    )


# ---------------------------------------------------------------------------------------------
# Head dims that are not a multiple of 8: the kernels' zero padding changes no result
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(1, 256),
    dv=st.integers(1, 256),
    nq=st.integers(1, 12),
    nk=st.integers(1, 12),
    mask=masks(6),
    broadcast=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_padded_head_dims_give_the_same_results(d, dv, nq, nk, mask, broadcast, seed):
    """What the GPU functions run for head dims that are not a multiple of 8: q, k, v (and
    dout, out) zero-padded on the last axis, the scale of the given d, the padding sliced
    off the results. The padded problem must give the same out, lse and gradients."""
    from cuflash._checks import HEAD_DIM_MULTIPLE, pad_head_dim

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 3, nq, d))
    kv_batch = (2, 1) if broadcast else (2, 3)   # broadcast k, v stay broadcast when padded
    k = np.broadcast_to(rng.standard_normal(kv_batch + (nk, d)), (2, 3, nk, d))
    v = np.broadcast_to(rng.standard_normal(kv_batch + (nk, dv)), (2, 3, nk, dv))
    dout = rng.standard_normal((2, 3, nq, dv))
    mask = dict(zip(("causal", "window"), mask))
    out, lse = reference.attention(q, k, v, return_lse=True, **mask)
    grads = reference.attention_backward(dout, q, k, v, out, lse, **mask)

    pq, pk, pv, pdout, pout = (pad_head_dim(np, x) for x in (q, k, v, dout, out))
    for x, given_x in ((pq, q), (pk, k), (pv, v)):
        assert x.shape[-1] % HEAD_DIM_MULTIPLE == 0 and x.shape[-1] - given_x.shape[-1] < HEAD_DIM_MULTIPLE
        assert np.array_equal(x[..., : given_x.shape[-1]], given_x) and not x[..., given_x.shape[-1]:].any()
    assert (pk.strides[1] == 0) == broadcast
    scale = 1 / math.sqrt(d)
    p_out, p_lse = reference.attention(pq, pk, pv, scale=scale, return_lse=True, **mask)
    p_grads = reference.attention_backward(pdout, pq, pk, pv, pout, p_lse, scale=scale, **mask)
    np.testing.assert_allclose(p_out[..., :dv], out, rtol=1e-12, atol=1e-12)
    assert not p_out[..., dv:].any()
    np.testing.assert_allclose(p_lse, lse, rtol=1e-12, atol=1e-12)
    for g, pg in zip(grads, p_grads):
        np.testing.assert_allclose(pg[..., : g.shape[-1]], g, rtol=1e-10, atol=1e-12)


def test_padding_keeps_multiples_of_eight():
    from cuflash._checks import pad_head_dim

    x = np.ones((2, 5, 16))
    assert pad_head_dim(np, x) is x


# ---------------------------------------------------------------------------------------------
# Packed variable-length sequences
# ---------------------------------------------------------------------------------------------


def packed_by_one_mask(q, k, v, dout, cu_q, cu_k, causal, window):
    """Packed attention written independently of the reference's per-sequence loop: one
    (total_q, total_k) softmax whose mask is block-diagonal, each block the sequence's own
    bottom-right band. Returns out, lse and the gradients (summed over broadcast dims)."""
    left, right = normalize_window(causal, window)
    total_q, total_k = q.shape[-2], k.shape[-2]
    mask = np.zeros((total_q, total_k), dtype=bool)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        mask[q0:q1, k0:k1] = allowed(q1 - q0, k1 - k0, left, right)
    scale = 1 / math.sqrt(q.shape[-1])
    s_full = np.where(mask, scale * (q @ np.swapaxes(k, -1, -2)), -np.inf)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    s_full = np.broadcast_to(s_full, batch + (total_q, total_k))
    seen = mask.any(axis=-1)[:, None]
    m = np.where(seen, s_full, 0).max(axis=-1, keepdims=True, initial=-np.inf)
    p = np.where(seen & mask, np.exp(s_full - np.where(seen, m, 0)), 0.0)
    l_sum = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, l_sum, out=np.zeros_like(p), where=l_sum > 0)
    out = p @ v
    lse = np.where(seen[:, 0], (m + np.log(np.where(l_sum > 0, l_sum, 1)))[..., 0], -np.inf)
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdims=True))

    def summed(g, shape):
        g = g.sum(axis=tuple(range(g.ndim - len(shape))))
        return g.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1), keepdims=True)

    grads = (summed(scale * ds @ k, q.shape), summed(scale * np.swapaxes(ds, -1, -2) @ q, k.shape),
             summed(np.swapaxes(p, -1, -2) @ dout, v.shape))
    return out, lse, grads


@st.composite
def packed_problems(draw):
    n_seq = draw(st.integers(0, 5))
    lengths_q = draw(st.lists(st.integers(0, 9), min_size=n_seq, max_size=n_seq))
    lengths_k = draw(st.lists(st.integers(0, 9), min_size=n_seq, max_size=n_seq))
    cu_q = np.concatenate([[0], np.cumsum(lengths_q, dtype=np.int64)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k, dtype=np.int64)]).astype(np.int32)
    d, dv = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))   # GQA: (Hkv, G, total, D)
    causal, window = draw(masks(6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((hkv, group, int(cu_q[-1]), d)) * draw(st.sampled_from((1.0, 4.0)))
    k = rng.standard_normal((hkv, 1, int(cu_k[-1]), d))
    v = rng.standard_normal((hkv, 1, int(cu_k[-1]), dv))
    dout = rng.standard_normal((hkv, group, int(cu_q[-1]), dv))
    return q, k, v, dout, cu_q, cu_k, causal, window


@settings(max_examples=80, deadline=None)
@given(packed_problems())
def test_packed_sequences_match_one_block_diagonal_mask(p):
    q, k, v, dout, cu_q, cu_k, causal, window = p
    mask = {"causal": causal, "window": window}
    packing = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    out, lse = reference.attention(q, k, v, return_lse=True, **mask, **packing)
    grads = reference.attention_backward(dout, q, k, v, out, lse, **mask, **packing)
    want_out, want_lse, want_grads = packed_by_one_mask(q, k, v, dout, cu_q, cu_k, causal, window)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)
    for g, want, x in zip(grads, want_grads, (q, k, v)):
        assert g.shape == x.shape
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-10)
    # check=False reads valid offsets the same way
    out2, lse2 = reference.attention(q, k, v, return_lse=True, check=False, **mask, **packing)
    assert np.array_equal(out2, out) and np.array_equal(lse2, lse)


def test_packed_sequence_without_keys_and_empty_sequences():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 3))
    cu_q = np.array([0, 0, 2, 6, 6], np.int32)   # sequence 0 empty, 3 empty
    cu_k = np.array([0, 3, 3, 5, 5], np.int32)   # sequence 1 has no keys
    out, lse = reference.attention(q, k, v, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert (out[:, 0:2] == 0).all() and np.isneginf(lse[:, 0:2]).all()
    dense = reference.attention(q[:, 2:6], k[:, 3:5], v[:, 3:5], scale=0.5)
    np.testing.assert_allclose(out[:, 2:6], dense, rtol=1e-12)


def _cu(*values):
    return np.array(values, dtype=np.int32)


@pytest.mark.parametrize(
    "given, exc, match",
    [
        ({"cu_seqlens_q": _cu(0, 4)}, ValueError, "give both or neither"),
        ({"cu_seqlens_q": _cu(1, 4), "cu_seqlens_k": _cu(0, 5)}, ValueError,
         r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
        ({"cu_seqlens_q": _cu(0, 3, 2, 4), "cu_seqlens_k": _cu(0, 1, 2, 5)}, ValueError,
         r"cu_seqlens_q must not decrease, got cu_seqlens_q\[2\] = 2 after cu_seqlens_q\[1\] = 3"),
        ({"cu_seqlens_q": _cu(0, 4), "cu_seqlens_k": _cu(0, 6)}, ValueError,
         r"cu_seqlens_k must end at k.shape\[-2\] = 5, got cu_seqlens_k\[1\] = 6"),
        ({"cu_seqlens_q": _cu(0, 4), "cu_seqlens_k": _cu(0, 2, 5)}, ValueError, "same length"),
        ({"cu_seqlens_q": np.array([0, 4], np.int64), "cu_seqlens_k": _cu(0, 5)}, TypeError,
         r"cu_seqlens_q must be a 1-dim int32 array of shape \(S \+ 1,\), got dtype int64"),
        ({"cu_seqlens_q": _cu(0, 1, 4), "cu_seqlens_k": _cu(0, 2, 5), "max_seqlen_q": 2}, ValueError,
         "max_seqlen_q = 2 is less than the length 3 of sequence 1 in cu_seqlens_q"),
        ({"cu_seqlens_q": _cu(0, 4), "cu_seqlens_k": _cu(0, 5), "max_seqlen_k": -1}, TypeError,
         "max_seqlen_k must be None or a non-negative int, got -1"),
    ],
)
def test_packed_offsets_are_checked(given, exc, match):
    q, k, v = np.ones((4, 8)), np.ones((5, 8)), np.ones((5, 8))
    with pytest.raises(exc, match=match):
        reference.attention(q, k, v, **given)


def test_unchecked_offsets_are_clamped():
    """check=False: offsets out of range are clamped to the arrays, a sequence that ends before
    it starts is empty, and rows no sequence owns give 0 and lse -inf."""
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((6, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    cu_q = _cu(0, 2, 99)   # sequence 1 runs past the end: rows 2..5
    cu_k = _cu(-7, 3, 1)   # sequence 0 from key 0, sequence 1 empty (ends before it starts)
    out, lse = reference.attention(q, k, v, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, check=False)
    np.testing.assert_allclose(out[:2], reference.attention(q[:2], k[:3], v[:3], scale=0.5), rtol=1e-12)
    assert (out[2:] == 0).all() and np.isneginf(lse[2:]).all()
    with pytest.raises(ValueError):
        reference.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# ---------------------------------------------------------------------------------------------
# KV cache and merging (docs/contract.md: KV cache, merging partial results)
# ---------------------------------------------------------------------------------------------

KV_MASKS = ({}, {"causal": True}, {"window": (5, 2)}, {"window": (None, 0)})


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    n_new=st.integers(0, 3),
    nq=st.integers(1, 4),
    group=st.sampled_from((1, 3)),
    mask=st.sampled_from(KV_MASKS),
    seed=st.integers(0, 2**32 - 1),
)
def test_kvcache_contiguous_and_paged_against_attention(lengths, n_new, nq, group, mask, seed):
    """Each sequence's rows against its cached keys plus the appended ones, contiguous and
    paged (pages in a random order, several page sizes): the same as attention over them."""
    rng = np.random.default_rng(seed)
    b, hkv, d, dv, nmax = len(lengths), 2, 8, 6, 48
    seqlens = np.array(lengths)
    q = rng.standard_normal((b, hkv, group, nq, d))
    kc, vc = rng.standard_normal((b, hkv, 1, nmax, d)), rng.standard_normal((b, hkv, 1, nmax, dv))
    kn, vn = rng.standard_normal((b, hkv, 1, n_new, d)), rng.standard_normal((b, hkv, 1, n_new, dv))
    want_k = [np.concatenate([kc[i, ..., : seqlens[i], :], kn[i]], axis=-2) for i in range(b)]
    want_v = [np.concatenate([vc[i, ..., : seqlens[i], :], vn[i]], axis=-2) for i in range(b)]
    want = np.stack([reference.attention(q[i], want_k[i], want_v[i], return_lse=True, **mask)[0] for i in range(b)])
    k_cache, v_cache = kc.copy(), vc.copy()
    out, lse = reference.attention_kvcache(q, k_cache, v_cache, k_new=kn, v_new=vn, cache_seqlens=seqlens,
                                           return_lse=True, **mask)
    np.testing.assert_allclose(out, want, atol=1e-12)
    assert out.shape == (b, hkv, group, nq, dv) and lse.shape == (b, hkv, group, nq)
    for i in range(b):   # the appends, in place, and nothing else changed
        np.testing.assert_array_equal(k_cache[i, ..., : seqlens[i] + n_new, :], want_k[i])
        np.testing.assert_array_equal(k_cache[i, ..., seqlens[i] + n_new:, :], kc[i, ..., seqlens[i] + n_new:, :])
    for page_size in (1, 5, 16):
        max_pages = -(-nmax // page_size)
        table = rng.permutation(b * max_pages).reshape(b, max_pages).astype(np.int32)
        kp = np.zeros((b * max_pages, hkv, 1, page_size, d))
        vp = np.zeros((b * max_pages, hkv, 1, page_size, dv))
        for i in range(b):
            for j in range(seqlens[i]):
                kp[table[i, j // page_size], ..., j % page_size, :] = kc[i, ..., j, :]
                vp[table[i, j // page_size], ..., j % page_size, :] = vc[i, ..., j, :]
        paged = reference.attention_kvcache(q, kp, vp, k_new=kn, v_new=vn, cache_seqlens=seqlens, block_table=table,
                                            **mask)
        np.testing.assert_allclose(paged, want, atol=1e-12)


def test_kvcache_defaults_and_int_seqlens():
    rng = np.random.default_rng(1)
    q, kc, vc = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 20, 8)), rng.standard_normal((2, 20, 8))
    full = reference.attention_kvcache(q, kc, vc, causal=True)   # every cached key
    np.testing.assert_allclose(full, reference.attention(q, kc, vc, causal=True), atol=1e-12)
    part = reference.attention_kvcache(q, kc, vc, cache_seqlens=7)
    np.testing.assert_allclose(part, reference.attention(q, kc[:, :7], vc[:, :7]), atol=1e-12)
    with pytest.raises(ValueError, match="required with block_table"):
        reference.attention_kvcache(q, kc, vc, block_table=np.zeros((2, 1), np.int32))


@pytest.mark.parametrize(
    "seqlens, table, message",
    [
        (np.array([18, 19]), None, "sequence 1 would run past its cache"),
        (np.array([-1, 0]), None, r"cache_seqlens\[0\] = -1 is negative"),
        (np.array([3, 4]), np.array([[0, 1], [1, 9]]), r"block_table\[1, 1\] = 9 is not a page"),
    ],
)
def test_kvcache_check_refuses_and_writes_nothing(seqlens, table, message):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 1, 8))
    pages = table is not None
    kc = rng.standard_normal((4, 3, 8) if pages else (2, 20, 8))
    vc = rng.standard_normal(kc.shape)
    kn, vn = rng.standard_normal((2, 2, 8)), rng.standard_normal((2, 2, 8))
    before = kc.copy(), vc.copy()
    with pytest.raises(ValueError, match=message):
        reference.attention_kvcache(q, kc, vc, k_new=kn, v_new=vn, cache_seqlens=seqlens, block_table=table)
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])
    # check=False clamps instead: no error, and keys past a cache's end are dropped
    out = reference.attention_kvcache(q, kc, vc, k_new=kn, v_new=vn, cache_seqlens=seqlens, block_table=table,
                                      check=False)
    assert out.shape == (2, 1, 8) and np.isfinite(out).all()


def test_kvcache_argument_errors():
    q, kc = np.zeros((2, 1, 8)), np.zeros((2, 5, 8))
    with pytest.raises(ValueError, match="go together"):
        reference.attention_kvcache(q, kc, kc, k_new=np.zeros((2, 1, 8)))
    with pytest.raises(TypeError, match="cache_seqlens"):
        reference.attention_kvcache(q, kc, kc, cache_seqlens=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="num_splits"):
        reference.attention_kvcache(q, kc, kc, num_splits=0)
    with pytest.raises(ValueError, match="one cache per sequence"):
        reference.attention_kvcache(q, np.zeros((3, 5, 8)), np.zeros((3, 5, 8)))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), parts=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_merge_of_disjoint_key_sets_is_attention_over_their_union(n, parts, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, n, 8)), rng.standard_normal((2, n, 4)) * 3
    owner = rng.integers(0, parts, size=n)   # each key in one part; a part may be empty
    outs, lses = [], []
    for p in range(parts):
        keys = owner == p
        o, lse = reference.attention(q, k[:, keys], v[:, keys], return_lse=True)
        outs.append(o)
        lses.append(lse)
    out, lse = reference.merge_attention(outs, lses)
    want, want_lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)
    out2, lse2 = reference.merge_attention(np.stack(outs), np.stack(lses))   # one array of parts
    np.testing.assert_array_equal(out2, out)


def test_merge_of_rows_without_keys():
    outs = np.zeros((2, 3, 4))
    lses = np.full((2, 3), -np.inf)
    lses[1, 2] = 0.5
    outs[1, 2] = 7.0
    out, lse = reference.merge_attention(outs, lses)
    assert (out[:2] == 0).all() and (lse[:2] == -np.inf).all()
    np.testing.assert_allclose(out[2], 7.0)
    assert lse[2] == 0.5


# ---------------------------------------------------------------------------------------------
# The reference refuses what the GPU functions refuse, with the same errors (cuflash._checks)
# ---------------------------------------------------------------------------------------------

_O, _L = np.zeros((2, 3, 4)), np.zeros((2, 3))

# bad merge_attention arguments, and the message both merge_attention functions give for them
MERGE_ERRORS = [
    (([], []), "outs must hold at least one part, got an empty list"),
    (([_O, _O], [_L]), "outs and lses must hold the same number of parts, got 2 and 1"),
    ((np.stack([_O, _O]), np.stack([_L, _L, _L])), "outs and lses must hold the same number of parts, got 2 and 3"),
    (([_O, _O[:, :2]], [_L, _L]),
     "every part of outs must have the shape (..., Nq, Dv) of outs[0], (2, 3, 4), got outs[1].shape = (2, 2, 4)"),
    (([_O[0, 0]], [_L[0, 0]]), "every part of outs must have the shape (..., Nq, Dv) of outs[0], (4,), got outs[0].shape = (4,)"),
    (([_O], [_L[:, :2]]), "lses[0] must have shape (2, 3), got (2, 2)"),
    (([_O, _O], [_L, _L.T]), "lses[1] must have shape (2, 3), got (3, 2)"),
    ((np.zeros((0, 3, 4)), np.zeros((0, 3))), "outs must have a first axis of parts (at least one), got shape (0, 3, 4)"),
]


@pytest.mark.parametrize("args, message", MERGE_ERRORS)
def test_merge_argument_errors_name_the_argument(args, message):
    """Bad parts raise the GPU function's ValueError naming the argument (cuflash._checks.merge_parts),
    never a NumPy broadcasting or stacking error."""
    with pytest.raises(ValueError) as err:
        reference.merge_attention(*args)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "fn",
    [reference.attention, reference.tiled_attention,
     lambda q, k, v: reference.attention_backward(np.ones(q.shape[:-1] + v.shape[-1:]), q, k, v,
                                                  np.ones(q.shape[:-1] + v.shape[-1:]), np.zeros(q.shape[:-1]))],
    ids=["attention", "tiled_attention", "attention_backward"],
)
@pytest.mark.parametrize(
    "d, dv, message",
    [(300, 8, "q has head dim (last axis) 300; cuflash supports head dims up to 256"),
     (8, 257, "v has value head dim (last axis) 257; cuflash supports head dims up to 256")],
)
def test_head_dims_over_256_are_refused_as_on_the_gpu(fn, d, dv, message):
    """The GPU functions take head dims up to 256 (docs/contract.md); the reference refuses the
    others with the same ValueError (cuflash._checks.check_shapes)."""
    with pytest.raises(ValueError) as err:
        fn(np.ones((2, 3, d)), np.ones((2, 5, d)), np.ones((2, 5, dv)))
    assert str(err.value) == message


def test_head_dim_256_is_taken():
    out = reference.attention(np.ones((3, 256)), np.ones((5, 256)), np.ones((5, 256)))
    assert out.shape == (3, 256)


@pytest.mark.parametrize(
    "q_shape, cache_shape, new_shape, message",
    [
        ((2, 1, 4), (2, 9, 4), None,
         "attention_kvcache takes head dims of whole 16-byte rows up to 256 (8, 16, ... for float16), got D = 4"),
        ((2, 1, 264), (2, 9, 264), None,
         "attention_kvcache takes head dims of whole 16-byte rows up to 256 (8, 16, ... for float16), got D = 264"),
        ((2, 2, 3, 1, 8), (2, 1, 1, 9, 8), None, "attention_kvcache groups query heads along the last dim before Nq only"),
        ((2, 1, 1, 8), (2, 4, 9, 8), None, "q's dims (1,) must hold the caches' (4,) (q is not broadcast)"),
        ((2, 1, 8), (2, 1, 9, 8), None, "q (B, ..., Nq, D) and the caches (B or pages, ..., rows, D) must have one number"),
        ((2, 4, 1, 8), (2, 4, 9, 8), (2, 1, 1, 8), "k_new and v_new must be (B, <the caches' dims>, Nnew, D / Dv)"),
    ],
    ids=["D-not-16-bytes", "D-over-256", "two-grouped-dims", "q-broadcast", "ndim", "k_new-dims"],
)
def test_kvcache_shapes_are_refused_as_on_the_gpu(q_shape, cache_shape, new_shape, message):
    """The reference's attention_kvcache applies the GPU function's shape rules (cuflash._checks.kvcache_shapes),
    head dims in rows of q's dtype, before anything is written."""
    caches = np.zeros(cache_shape, np.float16), np.zeros(cache_shape, np.float16)
    news = {} if new_shape is None else {"k_new": np.ones(new_shape, np.float16), "v_new": np.ones(new_shape, np.float16)}
    with pytest.raises(ValueError) as err:
        reference.attention_kvcache(np.ones(q_shape, np.float16), *caches, cache_seqlens=0, **news)
    assert str(err.value).startswith(message)
    assert not caches[0].any() and not caches[1].any()


def test_tiled_takes_the_keywords_of_attention():
    """docs/contract.md: tiled_attention has the arguments of attention (and its block sizes)."""
    import inspect

    params = inspect.signature(reference.tiled_attention).parameters
    for name, p in inspect.signature(reference.attention).parameters.items():
        assert name in params and params[name].kind == p.kind and params[name].default == p.default, name


@settings(max_examples=40, deadline=None)
@given(packed_problems(), st.sampled_from([1, 4, 16]), st.sampled_from([1, 4, 16]))
def test_tiled_packed_sequences_match_attention(p, block_m, block_n):
    q, k, v, _, cu_q, cu_k, causal, window = p
    keywords = {"causal": causal, "window": window, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "return_lse": True}
    out, lse = reference.tiled_attention(q, k, v, block_m=block_m, block_n=block_n, **keywords)
    want_out, want_lse = reference.attention(q, k, v, **keywords)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-10, atol=1e-12)


def test_tiled_packed_offsets_are_checked_and_clamped_as_in_attention():
    q, k, v = np.ones((4, 8)), np.ones((5, 8)), np.ones((5, 8))
    for given, match in (({"cu_seqlens_q": _cu(0, 4)}, "give both or neither"),
                         ({"cu_seqlens_q": _cu(0, 1, 4), "cu_seqlens_k": _cu(0, 2, 5), "max_seqlen_q": 2},
                          "max_seqlen_q = 2 is less than the length 3")):
        with pytest.raises(ValueError, match=match):
            reference.tiled_attention(q, k, v, **given)
    unchecked = {"cu_seqlens_q": _cu(0, 2, 99), "cu_seqlens_k": _cu(-7, 3, 1), "check": False, "return_lse": True}
    out, lse = reference.tiled_attention(q, k, v, block_m=2, block_n=2, **unchecked)
    want_out, want_lse = reference.attention(q, k, v, **unchecked)
    np.testing.assert_allclose(out, want_out, rtol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)   # -inf on rows 2 and 3 (sequence 1 has no key)


@pytest.mark.parametrize(
    "name, shape, message",
    [("out", (3, 5, 16), "out must have shape (2, 3, 5, 16) (as attention(q, k, v) returns it), got shape (3, 5, 16)"),
     ("dout", (2, 3, 5, 8), "dout must have shape (2, 3, 5, 16) (those of out), got shape (2, 3, 5, 8)"),
     ("lse", (2, 3, 5, 1),
      "lse must have shape (2, 3, 5) (as attention(q, k, v, return_lse=True) returns it), got shape (2, 3, 5, 1)")],
)
def test_backward_out_dout_lse_are_checked_as_on_the_gpu(name, shape, message):
    """The shapes of out, dout and lse are checked by the GPU function's rule (cuflash._checks.check_backward_arrays),
    against the broadcast batch; their dtypes are free (computed in float64)."""
    given = {"dout": np.ones((2, 3, 5, 16)), "out": np.ones((2, 3, 5, 16)), "lse": np.zeros((2, 3, 5)), name: np.ones(shape)}
    with pytest.raises(ValueError) as err:
        reference.attention_backward(given["dout"], np.ones((2, 3, 5, 8)), np.ones((3, 7, 8)), np.ones((3, 7, 16)),
                                     given["out"], given["lse"])
    assert str(err.value) == message
