"""Edge cases on the GPU.

Numerics: logits of +-1e4 in float32; inputs at float16's and bfloat16's largest values;
rows that see no key (exact zeros, -inf, zero gradients); NaN propagation.
Sizes: more than 2**31 elements (64-bit offsets), batch * heads above 65535 (the CUDA
grid's y/z limit), N = 1, one query against a million keys, N = 2**20 self-attention.

Host-side checks are plain NumPy functions (the ``_check_*`` helpers), so they can be
exercised without a GPU on simulated kernel outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    GPU_MISSING,
    assert_close_to_reference,
    assert_lse_close,
    eps,
    poisoned_allocations,
    random_array,
    requires_gpu,
)

from cuflash._mask import allowed, normalize_window

pytestmark = requires_gpu

if GPU_MISSING is None:
    import cupy
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    import cuflash
    from cuflash import naive, reference

DTYPES = ("float16", "bfloat16", "float32")
F32_EPS = 2.0**-23


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _finfo_max(dtype) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(dtype).max)


def _default_scale(d: int) -> float:
    return 1.0 / np.sqrt(d)


def _bits(x):
    """The raw bits of a CuPy float array, for bitwise comparisons (NaN included)."""
    return x.view(cupy.uint32 if x.dtype.itemsize == 4 else cupy.uint16)


def _host_bits(x) -> np.ndarray:
    return cupy.asnumpy(_bits(x))


def _f64(x) -> np.ndarray:
    """A CuPy (or NumPy) array of any float dtype as a float64 NumPy array."""
    if GPU_MISSING is None and isinstance(x, cupy.ndarray):
        x = cupy.asnumpy(x)
    return np.asarray(x).astype(np.float64)


def _gpu_random(rng, shape, dtype, scale=1.0, chunk=2**26):
    """Standard-normal CuPy array of `dtype` times `scale`, drawn on the GPU from the
    cupy.random.Generator `rng` in float32 and cast, chunk by chunk (so that arrays of
    billions of elements need no float32 copy of their own size)."""
    out = cupy.empty(shape, dtype=dtype)
    flat = out.reshape(-1)
    for start in range(0, flat.size, chunk):
        stop = min(start + chunk, flat.size)
        x = rng.standard_normal(stop - start, dtype=cupy.float32)
        if scale != 1.0:
            x *= cupy.float32(scale)
        flat[start:stop] = x.astype(dtype)
        del x
    return out


def _forward(q, k, v, **mask):
    """cuflash's forward with every allocation poisoned (an unwritten element is NaN)."""
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **mask)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    return out, lse


def _backward(dout, q, k, v, out, lse, **mask):
    with poisoned_allocations():
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **mask)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    return grads


def _check_forward(out, lse, q, k, v, **mask):
    """the accuracy criterion (docs/contract.md) for cuflash's `out`, `lse` on q, k, v (CuPy arrays of one batch shape):
    out against c = 2 times the naive CuPy error, lse within 1e-3. Returns the reference."""
    n_out = naive.attention(q, k, v, **mask)
    r_out, r_lse = reference.attention(*(cupy.asnumpy(x) for x in (q, k, v)), return_lse=True, **mask)
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(n_out), r_out, q.dtype, c=2)
    assert_lse_close(cupy.asnumpy(lse), r_lse)
    return r_out, r_lse


def _check_backward(grads, dout, q, k, v, out, lse, **mask):
    """the accuracy criterion (docs/contract.md, c = 3) for cuflash's gradients, as in tests/test_backward.py: the
    naive chain runs on cuflash's out and lse, the reference on its own. q, k, v share
    their batch shape."""
    host = [cupy.asnumpy(x) for x in (q, k, v, dout)]
    r_out, r_lse = reference.attention(*host[:3], return_lse=True, **mask)
    refs = reference.attention_backward(host[3], *host[:3], r_out, r_lse, **mask)
    naive_grads = naive.attention_backward(dout, q, k, v, out, lse, **mask)
    hq, hk, hv, hdo = (np.asarray(x, dtype=np.float64) for x in host)
    scale = mask.get("scale", _default_scale(q.shape[-1]))
    # ds = p (dp - delta): dp and delta cancel, so dq and dk carry rounding at the scale of
    # |dp| + |delta|, times the scale and the k or q rows they are summed over
    cancel = scale * (
        np.abs(hdo @ np.swapaxes(hv, -1, -2)).max(initial=0) + np.abs((hdo * r_out).sum(-1)).max(initial=0)
    )
    term_scales = (cancel * np.abs(hk).max(initial=0), cancel * np.abs(hq).max(initial=0), 0.0)
    for name, got, nv, ref, ts in zip(("dq", "dk", "dv"), grads, naive_grads, refs, term_scales):
        assert_close_to_reference(name, cupy.asnumpy(got), cupy.asnumpy(nv), ref, q.dtype, c=3, term_scale=ts)


def _score_error_bound(hq, hk, scale, d):
    """A bound on |computed - exact| of every scaled float32 score scale * q.k, per row:
    (d + 8) * 2^-22 * scale * max_j sum_d |q_id k_jd|, four times the classic bound
    d * 2^-24 * sum |q k| of a float32 dot product in any order (slack for tensor cores,
    which may truncate rather than round, and for the scaling)."""
    gamma = (d + 8) * 2.0**-22
    return gamma * scale * (np.abs(hq) @ np.swapaxes(np.abs(hk), -1, -2)).max(axis=-1)


def _check_lse_float32(lse, r_lse, hq, hk, scale):
    """lse of float32 inputs with logits of 1e4: |lse - ref| <= 1e-3 + 4 eps32 |ref| + the
    scores' own float32 rounding. The contract's 1e-3 alone cannot hold there: float32's spacing
    near 1e4 is 1e-3, and the products q.k themselves round at that scale."""
    lse = np.asarray(lse, dtype=np.float64)
    assert lse.shape == r_lse.shape
    assert np.isfinite(lse).all(), f"lse: {np.count_nonzero(~np.isfinite(lse))} non-finite elements"
    tol = 1e-3 + 4 * F32_EPS * np.abs(r_lse) + _score_error_bound(hq, hk, scale, hq.shape[-1])
    err = np.abs(lse - r_lse)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert (err <= tol).all(), f"lse error {err[worst]:.3g} > tolerance {tol[worst]:.3g} at {worst}"


def _check_huge_logits(out, lse, hq, hk, hv, r_out, r_lse, dtype, scale, causal=False, window=None):
    """out and lse (NumPy) for logits far beyond 1 (1e10 and more), where float32 scores carry
    absolute errors far above 1 and so decide between keys whose exact scores nearly tie.

    - Every row: out lies in the hull of the values of its near-top keys (those within twice
      the score-error bound plus 64 of the row's exact max: every other key has weight below
      e^-64), give or take tol = 8 eps(dtype) max|v|.
    - Rows whose near-top set is one key (well-conditioned): |out - ref| <= tol. At least
      80% of rows must be so, or the inputs do not test what they claim to.
    - lse within 1e-3 relative of the reference (it is huge; float32 rounds it at 1e-7).
    """
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    assert np.isfinite(out).all(), f"out: {np.count_nonzero(~np.isfinite(out))} non-finite elements"
    assert np.isfinite(lse).all(), f"lse: {np.count_nonzero(~np.isfinite(lse))} non-finite elements"
    tol = 8 * eps(dtype) * np.abs(hv).max()
    nq, nk, d = hq.shape[-2], hk.shape[-2], hq.shape[-1]
    band = allowed(nq, nk, *normalize_window(causal, window))
    s = np.where(band, scale * (hq @ np.swapaxes(hk, -1, -2)), -np.inf)
    err_bound = _score_error_bound(hq, hk, scale, d)
    near = s >= (s.max(axis=-1) - 2 * err_bound - 64)[..., None]
    well = near.sum(axis=-1) == 1
    assert well.mean() >= 0.8, f"only {well.mean():.0%} of rows are well-conditioned: the inputs are too tied"
    for b in np.ndindex(out.shape[:-2]):
        sel = near[b][:, :, None]
        lo = np.where(sel, hv[b][None], np.inf).min(axis=1)
        hi = np.where(sel, hv[b][None], -np.inf).max(axis=1)
        bad = (out[b] < lo - tol) | (out[b] > hi + tol)
        assert not bad.any(), (
            f"out[{b}]: {np.count_nonzero(bad)} elements outside the values of their near-top keys (+-{tol:.3g})"
        )
    err = np.abs(out - r_out)[well]
    assert err.max(initial=0) <= tol, f"out: max error {err.max():.3g} > {tol:.3g} on well-conditioned rows"
    rel = np.abs(lse - r_lse) / np.maximum(1.0, np.abs(r_lse))
    assert rel.max() <= 1e-3, f"lse: max relative error {rel.max():.3g} > 1e-3"


# ---------------------------------------------------------------------------------------------
# Inputs of the numerics tests (host NumPy, float32 values exactly representable in the dtype)
# ---------------------------------------------------------------------------------------------


def _f32_large_logit_inputs(flavor, seed):
    """q, k, v (float32, NumPy) whose scaled logits q.k / 8 reach +-1e4:
    - gaussian: q ~ 100 N(0, 1), k ~ 22 N(0, 1): logits N(0, 2200^2), extremes near +-1e4;
    - integers: integers in [-80, 80], so that every product and partial sum is exact in
      float32 (in any order) and only the softmax rounds: logits N(0, 2150^2);
    - shifted: every logit of a row near +1e4 or near -1e4 (spread +-125), so that a row's
      max is far from 0 on either side.
    """
    rng = np.random.default_rng(seed)
    # Errors here come from the rounding of q.k on the few rows whose top scores nearly tie:
    # 8192 rows hold enough of them that the largest error, cuflash's as naive's, is stable
    # (with a few hundred rows the ratio of the two swung from 1 to 9 with the summation order).
    shape_q = shape_kv = (4, 4, 512, 64)
    if flavor == "gaussian":
        q = rng.standard_normal(shape_q) * 100
        k = rng.standard_normal(shape_kv) * 22
    elif flavor == "integers":
        q = rng.integers(-80, 81, shape_q).astype(np.float64)
        k = rng.integers(-80, 81, shape_kv).astype(np.float64)
    else:
        sign = rng.choice([-1.0, 1.0], size=shape_q[:-1] + (1,))
        q = rng.standard_normal(shape_q) + 125 * sign
        k = rng.standard_normal(shape_kv) + 10
    v = rng.standard_normal(shape_kv)
    return tuple(x.astype(np.float32) for x in (q, k, v))


def _near_max(rng, shape, dtype):
    """float32 values representable in `dtype`: random signs, magnitude the dtype's largest
    finite value for half the elements, uniform in [0.75, 1] times it for the others."""
    import ml_dtypes  # noqa: F401

    big = _finfo_max(dtype)
    mag = np.where(rng.random(shape) < 0.5, 1.0, rng.uniform(0.75, 1.0, shape)) * big
    x = (rng.choice([-1.0, 1.0], size=shape) * mag).astype(np.float32)
    return x.astype(dtype).astype(np.float32)  # round to the dtype (never beyond its max)


def _float16_max_inputs(d, seed, nk=300):
    """(At most nk queries, so that under a causal mask every row sees a key.)"""
    rng = np.random.default_rng(seed)
    nq = min(130, nk)
    return tuple(_near_max(rng, shape, "float16") for shape in ((2, nq, d), (2, nk, d), (2, nk, d)))


def _bfloat16_max_v_inputs(seed, nk=300):
    """Moderate q, k; v at bfloat16's largest values, with one column all +max and one all -max
    (out must come out at +-max there: rounding must not push it to inf). At most nk queries."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, min(130, nk), 64)).astype(np.float32)
    k = rng.standard_normal((2, nk, 64)).astype(np.float32)
    v = _near_max(rng, (2, nk, 64), "bfloat16")
    big = np.float32(_finfo_max("bfloat16"))
    v[..., 0] = big
    v[..., 1] = -big
    import ml_dtypes

    return tuple(x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, k, v))


def _bfloat16_huge_qk_inputs(seed):
    """q, k of ~1e15 per element: products 1e30, q.k up to ~1e33, logits ~1e30 to 1e32, all
    inside float32's range; v moderate."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 130, 64)) * 1e15
    k = rng.standard_normal((2, 300, 64)) * 1e15
    v = rng.standard_normal((2, 300, 64))
    return tuple(x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, k, v))


def _to_gpu(x, dtype):
    return cupy.asarray(x).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["gaussian", "integers", "shifted"])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_logits_of_1e4(flavor, causal):
    """float32 with scale * q.k up to +-1e4: out and lse finite; out within the accuracy criterion (docs/contract.md),
    lse within 1e-3 plus float32's own resolution at 1e4 (see `_check_lse_float32`)."""
    hq, hk, hv = _f32_large_logit_inputs(flavor, seed=10 + causal)
    q, k, v = (_to_gpu(x, "float32") for x in (hq, hk, hv))
    out, lse = _forward(q, k, v, causal=causal)
    n_out = naive.attention(q, k, v, causal=causal)
    r_out, r_lse = reference.attention(hq, hk, hv, causal=causal, return_lse=True)
    scale = _default_scale(64)
    logits = scale * (hq.astype(np.float64) @ np.swapaxes(hk.astype(np.float64), -1, -2))
    assert np.abs(logits).max() > 8e3, "the inputs do not reach logits of 1e4"
    assert np.isfinite(cupy.asnumpy(out)).all() and np.isfinite(cupy.asnumpy(lse)).all()
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(n_out), r_out, "float32", c=2)
    _check_lse_float32(cupy.asnumpy(lse), r_lse, hq.astype(np.float64), hk.astype(np.float64), scale)


# nk 100: head dim 64 with at most 128 keys runs its own tiles on Hopper
@pytest.mark.parametrize("d, nk", [(64, 300), (256, 300), (64, 100)])
@pytest.mark.parametrize("causal", [False, True])
def test_float16_at_its_largest_values(d, nk, causal):
    """q, k and v at +-65504 (and within 25% below), random signs: q.k reaches ~1e11 (at most
    d * 65504^2 = 1.1e12 at d = 256), logits ~1.5e10, far inside float32. out and lse must be
    finite and out within 8 eps max|v| of the reference (out must saturate, not round past
    65504 to inf).

    The naive CuPy version computes q k^T in float16, which overflows to inf here, so the
    c * naive criterion would be vacuous: the tolerance is absolute instead. At logits of
    1e10 float32 scores carry errors of ~1e5, so rows whose top keys nearly tie are checked
    against the hull of those keys' values (see `_check_huge_logits`)."""
    hq, hk, hv = _float16_max_inputs(d, seed=20 + d + nk + causal, nk=nk)
    q, k, v = (_to_gpu(x, "float16") for x in (hq, hk, hv))
    out, lse = _forward(q, k, v, causal=causal)
    hq, hk, hv = (x.astype(np.float64) for x in (hq, hk, hv))
    r_out, r_lse = reference.attention(hq, hk, hv, causal=causal, return_lse=True)
    _check_huge_logits(
        _f64(out), _f64(lse), hq, hk, hv, r_out, r_lse, "float16", _default_scale(d), causal=causal
    )


@pytest.mark.parametrize("nk", [300, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_v_at_its_largest_values(nk, causal):
    """v at bfloat16's largest values (3.39e38, near float32's own limit) with moderate q, k:
    the float32 sums of p * v must not overflow and out must saturate at +-max, not round
    to inf. out within 8 eps max|v| of the reference; lse (moderate here) within 1e-3.
    (The naive version, whose p is rounded to bfloat16 before p @ v, can itself overflow
    here, so the tolerance is absolute.)"""
    hq, hk, hv = _bfloat16_max_v_inputs(seed=30 + nk + causal, nk=nk)
    q, k, v = (_to_gpu(x, "bfloat16") for x in (hq, hk, hv))
    out, lse = _forward(q, k, v, causal=causal)
    r_out, r_lse = reference.attention(
        *(x.astype(np.float64) for x in (hq, hk, hv)), causal=causal, return_lse=True
    )
    out = _f64(out)
    assert np.isfinite(out).all(), f"out: {np.count_nonzero(~np.isfinite(out))} non-finite elements"
    tol = 8 * eps("bfloat16") * np.abs(hv.astype(np.float64)).max()
    err = np.abs(out - r_out).max()
    assert err <= tol, f"out: max error {err:.3g} > {tol:.3g}"
    assert_lse_close(cupy.asnumpy(lse), r_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_huge_logits(causal):
    """bfloat16 q, k of ~1e15 per element: logits ~1e30 to 1e32, q.k still inside float32.
    out and lse finite, out within 8 eps max|v| of the reference (hull check on near-tied
    rows, see `_check_huge_logits`), lse within 1e-3 relative.

    Outside the guarantee: bfloat16 q, k whose products q_d k_d (or their sums) exceed
    float32's range (~3.4e38) overflow the float32 accumulator of q k^T, as in every
    attention kernel that accumulates in float32; such scores are inf or NaN."""
    hq, hk, hv = _bfloat16_huge_qk_inputs(seed=40 + causal)
    q, k, v = (_to_gpu(x, "bfloat16") for x in (hq, hk, hv))
    out, lse = _forward(q, k, v, causal=causal)
    hq, hk, hv = (x.astype(np.float64) for x in (hq, hk, hv))
    r_out, r_lse = reference.attention(hq, hk, hv, causal=causal, return_lse=True)
    _check_huge_logits(_f64(out), _f64(lse), hq, hk, hv, r_out, r_lse, "bfloat16", _default_scale(64), causal=causal)


def _float16_row_summing_to(total: int, d: int) -> np.ndarray:
    """A float16 row of d values whose sum is the integer ``total`` exactly, as is every
    partial sum in any order (integers below 2^24): 65504s, then integers up to 2048."""
    sign, left, parts = (1 if total >= 0 else -1), abs(total), []
    while left:
        part = 65504 if left >= 65504 else min(left, 2048)
        parts.append(part)
        left -= part
    assert len(parts) <= d
    return sign * np.array(parts + [0] * (d - len(parts)), dtype=np.float16)


@pytest.mark.parametrize("direction", ["into", "out of"])
def test_float16_row_maxima_crossing_2_20_over_the_scale(direction):
    """Rows whose scaled max m * scale * log2(e) crosses +-2^20 between two key blocks, with
    both blocks weighing about the same: the 16-bit forward on Hopper computes a row's
    exponents against the rounded c = fl(m * scale_log2) while |c| < 2^20 and exactly past
    it, so the first block's sums must be carried over across the switch with c's rounding
    error. Scores are integers near 2.9e6 (exact in float32), picked so that the first
    block's c rounds by nearly half a unit in the last place (0.03 in the exponent), which
    carried over wrongly would move out by 0.0106. v is +1 on the first block and -1 on the
    second; out within 4 eps (0.0039) of the reference, lse within 4 float32 eps relative."""
    d, scale, nq = 128, 0.25, 64
    s = float(np.float32(scale * np.log2(np.e)))
    crossing = 2.0**20 / s
    # the top score inside whose c rounds furthest (exact in float64: 24-bit s times a
    # 22-bit integer), and one just past the crossing
    inside = max(range(int(crossing) - 8, int(crossing) + 1), key=lambda t: abs(float(np.float32(t * s)) - t * s))
    past = int(crossing) + 1
    # "out of": the first block's top inside, the second's past; "into": the first block's
    # top -past (beyond -2^20), the second's -inside
    first, second = (inside, past) if direction == "out of" else (-past, -inside)
    rng = np.random.default_rng(50)
    scores = first - rng.integers(0, 4, 256)
    scores[0], scores[128 + rng.integers(0, 128)] = first, second
    hk = np.stack([_float16_row_summing_to(int(t), d) for t in scores])[None]
    hq = np.ones((1, nq, d), dtype=np.float16)
    hv = np.concatenate([np.ones((128, d)), -np.ones((128, d))]).astype(np.float16)[None]
    q, k, v = (_to_gpu(x, "float16") for x in (hq, hk, hv))
    out, lse = _forward(q, k, v, scale=scale)
    r_out, r_lse = reference.attention(*(x.astype(np.float64) for x in (hq, hk, hv)), scale=scale, return_lse=True)
    err = np.abs(_f64(out) - r_out).max()
    assert np.abs(r_out).max() < 0.5, "both blocks should weigh in"
    assert err <= 4 * eps("float16"), f"out: max error {err:.3g}"
    # lse near 7e5, where float32's unit in the last place is 0.0625
    lse_err = np.abs(_f64(lse) - r_lse).max()
    assert lse_err <= 4 * F32_EPS * np.abs(r_lse).max(), f"lse: max error {lse_err:.3g}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_each_rows_max_at_every_key_position(dtype, d):
    """Row i's largest score at key i, 120 or more above the row's others: k_i of norm sqrt(d)
    and q_i = (320 / sqrt(d)) k_i give row i the scaled score 320 at key i and 320 / sqrt(d)
    times standard normals elsewhere. Over 2048 keys the rows' maxima sit at every position
    of every key block, whatever the tile shapes, and so in each of the chains a thread
    reduces its share of a row in. A max that missed one would leave p = exp(120) against
    the row's base: past float16's range where p is rounded for the p v product, past
    float32's (with bfloat16's shift of 2^-32) in the row's sum; out or lse not finite.
    out within the accuracy criterion; lse within 1e-3 (the scores are kept near 320: at
    1280, from float32 sums of q k, the kernel's lse was 2.2e-3 from float64's, the 1e-3 of
    small lse no longer applying there)."""
    n = 2048
    rng = np.random.default_rng(60 + d)
    g = rng.standard_normal((1, n, d))
    hk = (g * np.sqrt(d) / np.linalg.norm(g, axis=-1, keepdims=True)).astype(dtype)
    hq = (320 / np.sqrt(d) * hk.astype(np.float32)).astype(dtype)
    hv = rng.standard_normal((1, n, d)).astype(dtype)
    q, k, v = (_to_gpu(x, dtype) for x in (hq, hk, hv))
    out, lse = _forward(q, k, v)
    scores = hq[0].astype(np.float64) @ hk[0].astype(np.float64).T / np.sqrt(d)
    top, second = np.sort(scores, axis=1)[:, -1], np.sort(scores, axis=1)[:, -2]
    assert (top == np.diagonal(scores)).all() and (top - second).min() > 120, "the inputs' premise"
    _check_forward(out, lse, q, k, v)


# Nq = 300 queries against Nk = 130 keys: off = -170, so the first rows see nothing.
NO_KEY_MASKS = {
    "causal": ({"causal": True}, 170),  # row i sees j <= i - 170
    "window": ({"window": (40, 25)}, 145),  # row i sees i - 210 <= j <= i - 145
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", list(NO_KEY_MASKS))
def test_rows_that_see_no_key_are_exact(dtype, mask_name):
    """Rows with no key to attend: out exactly 0, lse exactly -inf, dq exactly 0, and they
    contribute nothing to dk, dv (other q and dout on those rows change no other output or
    gradient value, and no lse bit)."""
    mask, n_empty = NO_KEY_MASKS[mask_name]
    rng = np.random.default_rng(50 + DTYPES.index(dtype))
    q = random_array(rng, (2, 300, 64), dtype)
    k = random_array(rng, (2, 130, 64), dtype)
    v = random_array(rng, (2, 130, 64), dtype)
    dout = random_array(rng, (2, 300, 64), dtype)

    out, lse = _forward(q, k, v, **mask)
    _, r_lse = _check_forward(out, lse, q, k, v, **mask)
    empty = np.isneginf(r_lse)
    assert (empty.sum(axis=-1) == n_empty).all() and empty[..., :n_empty].all()
    h_out, h_lse = _f64(out), cupy.asnumpy(lse)
    assert (h_out[:, :n_empty] == 0).all(), "out must be exactly 0 on rows that see no key"
    assert np.isneginf(h_lse[:, :n_empty]).all(), "lse must be exactly -inf on rows that see no key"

    grads = _backward(dout, q, k, v, out, lse, **mask)
    _check_backward(grads, dout, q, k, v, out, lse, **mask)
    assert (_f64(grads[0])[:, :n_empty] == 0).all(), "dq must be exactly 0 on rows that see no key"

    # other q and dout on the empty rows: nothing else may change
    q2, dout2 = q.copy(), dout.copy()
    q2[:, :n_empty] = random_array(rng, (2, n_empty, 64), dtype, 3.0)
    dout2[:, :n_empty] = random_array(rng, (2, n_empty, 64), dtype, 3.0)
    out2, lse2 = _forward(q2, k, v, **mask)
    assert bool((out2.astype(cupy.float32) == out.astype(cupy.float32)).all()), "out changed"
    assert cupy.array_equal(_bits(lse2), _bits(lse)), "lse changed"
    grads2 = _backward(dout2, q2, k, v, out2, lse2, **mask)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads2):
        # values, not bits: +0 and -0 are both "nothing"
        assert bool((a.astype(cupy.float32) == b.astype(cupy.float32)).all()), (
            f"{name} changed when only rows that see no key changed"
        )


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_propagates_forward(dtype, causal, where):
    """A NaN in the inputs reaches exactly the outputs that depend on it; every other element
    is finite and bitwise what it is without the NaN (the kernel is deterministic).

    q (3, 200, 64), k, v (3, 300, 64): off = 100, so under causal row i sees keys j <= i + 100.
    - NaN in q[1, 57]: out[1, 57] and lse[1, 57] are NaN, nothing else changes.
    - NaN in k[1, 180]: out and lse are NaN on the rows of batch 1 that attend key 180
      (all of them; causal: i >= 80), nothing else changes.
    - NaN in v[1, 180] (the whole row): out is NaN on the rows of batch 1 that attend key
      180; lse does not depend on v and is unchanged; other batch entries are unchanged.
      Under causal, rows of batch 1 that do not attend key 180 may be NaN (the kernel
      multiplies masked probabilities, exactly 0, by v inside a tile, and 0 * NaN is NaN):
      nothing is asserted on them.
    """
    rng = np.random.default_rng(60 + causal)
    q = random_array(rng, (3, 200, 64), dtype)
    k = random_array(rng, (3, 300, 64), dtype)
    v = random_array(rng, (3, 300, 64), dtype)
    clean_out, clean_lse = _forward(q, k, v, causal=causal)
    assert np.isfinite(_f64(clean_out)).all() and np.isfinite(cupy.asnumpy(clean_lse)).all()

    b, i, j, off = 1, 57, 180, 100
    args = {"q": q, "k": k, "v": v}
    x = args[where].copy()
    if where == "q":
        x[b, i, 5] = np.nan
    elif where == "k":
        x[b, j, 7] = np.nan
    else:
        x[b, j, :] = np.nan
    args[where] = x
    out, lse = _forward(args["q"], args["k"], args["v"], causal=causal)

    rows = np.arange(200)
    if where == "q":
        hit = rows == i
    else:
        hit = j <= rows + off if causal else np.ones(200, dtype=bool)
    ob, cb = _host_bits(out), _host_bits(clean_out)
    lb, clb = _host_bits(lse), _host_bits(clean_lse)
    others = [0, 2]
    assert np.array_equal(ob[others], cb[others]), "out changed in a batch entry without the NaN"
    assert np.array_equal(lb[others], clb[others]), "lse changed in a batch entry without the NaN"
    h_out, h_lse = _f64(out)[b], cupy.asnumpy(lse)[b]
    assert np.isnan(h_out[hit]).all(), f"out: {np.count_nonzero(~np.isnan(h_out[hit]))} elements not NaN"
    if where == "v":
        assert np.array_equal(lb, clb), "lse changed though it does not depend on v"
        if not causal:
            assert hit.all()
    else:
        assert np.isnan(h_lse[hit]).all(), f"lse: {np.count_nonzero(~np.isnan(h_lse[hit]))} rows not NaN"
        assert np.array_equal(ob[b][~hit], cb[b][~hit]), "out changed on rows that do not depend on the NaN"
        assert np.array_equal(lb[b][~hit], clb[b][~hit]), "lse changed on rows that do not depend on the NaN"


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def free_gpu_memory():
    """Releases the memory pool's cached blocks before and after a test with big arrays."""
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    yield
    pool.free_all_blocks()


def _assert_all_finite(name, x):
    """Every element finite, checked on the GPU in slices of the first axis of at most 2**28
    elements (float16/float32 directly, others via float32)."""
    step = max(1, 2**28 // max(1, x[:1].size))
    bad = 0
    for start in range(0, x.shape[0], step):
        y = x[start : start + step]
        y = y if y.dtype in (np.float16, np.float32) else y.astype(cupy.float32)
        bad += int((~cupy.isfinite(y)).sum())
    assert bad == 0, f"{name}: {bad} non-finite elements (unwritten elements are NaN)"


def _take(x, entries):
    """x[entries] along the first axis, gathered by basic indexing (views), then stacked."""
    return cupy.stack([x[e] for e in entries])


def _check_entries(entries, q, k, v, dout, out, lse, grads, **mask):
    """Forward and backward criteria on the batch entries `entries` (of a 1-D batch) alone:
    batch entries are independent, so the naive version and the reference run on them only."""
    sq, sk, sv, sdo, sout, slse = (_take(x, entries) for x in (q, k, v, dout, out, lse))
    _check_forward(sout, slse, sq, sk, sv, **mask)
    _check_backward(tuple(_take(g, entries) for g in grads), sdo, sq, sk, sv, sout, slse, **mask)


def _run_more_than_2_31_elements(a, shape, entries):
    rng = cupy.random.default_rng(70)
    for name in ("q", "k", "v", "dout"):
        a[name] = _gpu_random(rng, shape, "float16")
    a["out"], a["lse"] = _forward(a["q"], a["k"], a["v"])
    a["grads"] = _backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"])
    for name in ("out", "lse"):
        _assert_all_finite(name, a[name])
    for name, g in zip(("dq", "dk", "dv"), a["grads"]):
        _assert_all_finite(name, g)
    _check_entries(entries, a["q"], a["k"], a["v"], a["dout"], a["out"], a["lse"], a["grads"])


def test_more_than_2_31_elements(free_gpu_memory):
    """float16 q, k, v of shape (131073, 256, 64): 2,147,500,032 elements each (4.3 GB),
    above 2**31, so element offsets need 64 bits; batch 131073 is also above 65535. Forward
    and backward (8 such arrays: 34 GB); every output element finite (written), and the
    criteria on entries at both ends and around 2**16 (entry 131072 ends past 2**31)."""
    shape = (131073, 256, 64)
    assert np.prod(shape) > 2**31
    entries = [0, 1, 65535, 65536, 100000, shape[0] - 1]
    arrays, failure = {}, None
    try:
        _run_more_than_2_31_elements(arrays, shape, entries)
    except Exception as err:  # noqa: BLE001  (keep no traceback: its frames would hold 34 GB)
        failure = f"{type(err).__name__}: {err}"
    finally:
        arrays.clear()
        cupy.get_default_memory_pool().free_all_blocks()
    if failure is not None:
        pytest.fail(failure, pytrace=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_above_65535(dtype, free_gpu_memory):
    """70000 batch entries of N = 16, D = 64: more blocks than a grid's y or z dimension
    allows. Forward and backward: every element finite (written), and the criteria on
    entries around 2**16 and at both ends."""
    shape = (70000, 16, 64)
    rng = cupy.random.default_rng(80 + DTYPES.index(dtype))
    q, k, v, dout = (_gpu_random(rng, shape, dtype) for _ in range(4))
    out, lse = _forward(q, k, v)
    grads = _backward(dout, q, k, v, out, lse)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads)):
        _assert_all_finite(name, x)
    _check_entries([0, 1, 65535, 65536, 69999], q, k, v, dout, out, lse, grads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_single_query_single_key(dtype, causal):
    """Nq = Nk = 1: out = v, lse = the one score; forward and backward against the reference."""
    rng = np.random.default_rng(90 + DTYPES.index(dtype))
    q, k, v, dout = (random_array(rng, (3, 2, 1, 64), dtype) for _ in range(4))
    out, lse = _forward(q, k, v, causal=causal)
    _check_forward(out, lse, q, k, v, causal=causal)
    grads = _backward(dout, q, k, v, out, lse, causal=causal)
    _check_backward(grads, dout, q, k, v, out, lse, causal=causal)


ONE_QUERY_MASKS = {
    "none": {},
    "causal": {"causal": True},  # bottom-right aligned: the one row sees every key
    "window": {"window": (1000, None)},  # off = 999999: keys 998999 .. 999999
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mask_name", list(ONE_QUERY_MASKS))
def test_one_query_against_a_million_keys(dtype, mask_name, free_gpu_memory):
    """Nq = 1, Nk = 1,000,000, D = 64: forward and backward against the reference in full.
    q has logits of standard deviation 4, so that a few keys anywhere in the million carry
    most of the weight and a missed or misplaced key block shows."""
    mask = ONE_QUERY_MASKS[mask_name]
    rng = cupy.random.default_rng(100 + DTYPES.index(dtype))
    q = _gpu_random(rng, (1, 1, 64), dtype, 4.0)
    k, v = (_gpu_random(rng, (1, 1_000_000, 64), dtype) for _ in range(2))
    dout = _gpu_random(rng, (1, 1, 64), dtype)
    out, lse = _forward(q, k, v, **mask)
    _check_forward(out, lse, q, k, v, **mask)
    grads = _backward(dout, q, k, v, out, lse, **mask)
    _check_backward(grads, dout, q, k, v, out, lse, **mask)
    if mask_name == "window":  # keys no row attends get exactly no gradient
        for name, g in zip(("dk", "dv"), grads[1:]):
            assert not bool((g[:, :998999].astype(cupy.float32) != 0).any()), f"{name} nonzero outside the window"


def _sample_rows(n, count, seed):
    fixed = [0, 1, 63, 64, 127, 128, 65535, 65536, n // 2, n - 129, n - 128, n - 1]
    rng = np.random.default_rng(seed)
    extra = rng.choice(np.arange(129, n - 129), size=count - len(fixed), replace=False)
    return sorted(set(fixed) | {int(x) for x in extra})


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_of_2_20(causal, free_gpu_memory):
    """Nq = Nk = 2**20, one head, D = 64, float16: the forward on 16 sampled query rows against
    the reference on those rows alone (non-causal: all keys; causal: row i sees keys 0..i).
    Causal also runs the backward: every element of dq, dk, dv finite (written, and not
    overflowed), and dq of six sampled rows against the reference (a row's dq needs only
    that row and its keys)."""
    n, d = 2**20, 64
    rng = cupy.random.default_rng(110 + causal)
    q = _gpu_random(rng, (n, d), "float16", 4.0)  # logits with standard deviation 4
    k, v, dout = (_gpu_random(rng, (n, d), "float16") for _ in range(3))
    out, lse = _forward(q[None], k[None], v[None], causal=causal)
    _assert_all_finite("out", out)
    _assert_all_finite("lse", lse)
    out, lse = out[0], lse[0]
    rows = _sample_rows(n, 16, seed=int(causal))
    if not causal:
        sel = cupy.asarray(rows)
        _check_forward(out[sel], lse[sel], q[sel], k, v)
        return

    hk, hv = cupy.asnumpy(k), cupy.asnumpy(v)
    refs = {}
    for i in rows:  # row i alone against keys 0..i is the same row, unmasked
        refs[i] = reference.attention(cupy.asnumpy(q[i : i + 1]), hk[: i + 1], hv[: i + 1], return_lse=True)
        n_out = naive.attention(q[i : i + 1], k[: i + 1], v[: i + 1])
        r_out, r_lse = refs[i]
        assert_close_to_reference(
            f"out[{i}]", cupy.asnumpy(out[i : i + 1]), cupy.asnumpy(n_out), r_out, "float16", c=2
        )
        assert_lse_close(cupy.asnumpy(lse[i : i + 1]), r_lse)

    dq, dk, dv = _backward(dout[None], q[None], k[None], v[None], out[None], lse[None], causal=True)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        _assert_all_finite(name, g)
    scale = _default_scale(d)
    for i in (0, 1, 64, 65536, n // 2, n - 1):
        hq, hdo = cupy.asnumpy(q[i : i + 1]), cupy.asnumpy(dout[i : i + 1])
        r_out, r_lse = refs[i]
        r_dq, _, _ = reference.attention_backward(hdo, hq, hk[: i + 1], hv[: i + 1], r_out, r_lse)
        n_dq, _, _ = naive.attention_backward(
            dout[i : i + 1], q[i : i + 1], k[: i + 1], v[: i + 1], out[i : i + 1], lse[i : i + 1]
        )
        h64 = hdo.astype(np.float64)
        cancel = scale * (
            np.abs(h64 @ hv[: i + 1].astype(np.float64).T).max() + np.abs((h64 * r_out).sum(-1)).max()
        )
        term = cancel * np.abs(hk[: i + 1].astype(np.float64)).max()
        assert_close_to_reference(
            f"dq[{i}]", cupy.asnumpy(dq[0, i : i + 1]), cupy.asnumpy(n_dq), r_dq, "float16", c=3, term_scale=term
        )


def _off_boundary(x, elements):
    """A contiguous copy of x that starts `elements` elements past a 16-byte boundary."""
    flat = cupy.empty(x.size + elements, dtype=x.dtype)
    view = flat[elements:].reshape(x.shape)
    view[...] = x
    assert view.flags.c_contiguous and view.data.ptr % 16 == elements * x.itemsize
    return view


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 40])
def test_contiguous_views_off_a_16_byte_boundary(dtype, d):
    """Contiguous inputs that start mid-way into a 16-byte chunk (the kernels move 16-byte
    chunks) give bitwise the results of the same values in fresh, aligned arrays: q, k, v
    in the forward; out and dout too in the backward."""
    rng = np.random.default_rng(130 + d + DTYPES.index(dtype))
    q, k, v, dout = (random_array(rng, (2, 3, 77, d), dtype) for _ in range(4))
    out, lse = _forward(q, k, v, causal=True)
    grads = _backward(dout, q, k, v, out, lse, causal=True)
    shifted = [_off_boundary(x, 1) for x in (q, k, v, dout, out)]
    out2, lse2 = _forward(*shifted[:3], causal=True)
    grads2 = _backward(shifted[3], *shifted[:3], shifted[4], lse, causal=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (out2, lse2, *grads2)):
        assert cupy.array_equal(_bits(a), _bits(b)), name
    _check_backward(grads, dout, q, k, v, out, lse, causal=True)
