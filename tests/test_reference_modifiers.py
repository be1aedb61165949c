"""CPU tests of the score modifiers in cuflash.reference (softcap, bias, alibi_slopes, sinks,
dropout_p with seed; docs/contract.md, "Score modifiers") and of their argument checks.

No GPU and no CuPy needed. The reference is checked against a straightforward formula that
builds each problem's score matrix element by element, with its own scalar Philox4x32-10 for the
dropout mask; its gradients against central finite differences; its Philox against Random123's
known answers.
"""

import functools
import math

import numpy as np
import pytest
from conftest import finite_difference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from cuflash import _checks, reference
from cuflash._mask import normalize_window

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# An independent formula: scalar Philox and one score matrix per batch entry and sequence
# ---------------------------------------------------------------------------------------------

M32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=None)
def philox_scalar(counter, key):
    """Philox4x32-10 on Python ints, written from Random123's definition."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
    return c0, c1, c2, c3


def keep_scalar(seed, n, i, j, p):
    """docs/contract.md's keep function, one element at a time."""
    counter = ((j // 16) * 4 + (j % 8) // 2, (i // 16) * 8 + i % 8, n & M32, n >> 32)
    word = philox_scalar(counter, (seed & M32, seed >> 32))[2 * ((i // 8) % 2) + (j // 8) % 2]
    return (word >> (16 * (j & 1))) & 0xFFFF >= math.floor(p * 65536)


def formula(q, k, v, *, causal=False, window=None, scale=None, softcap=None, bias=None, alibi_slopes=None,
            sinks=None, dropout_p=0.0, seed=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """out and lse from the definition: for each batch entry n (C order) and each sequence, the
    score of every allowed (i, j) through steps 1 to 4, then the softmax with the sink, then
    dropout at the global positions."""
    left, right = normalize_window(causal, window)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    per_entry = {name: None if x is None else np.broadcast_to(np.asarray(x, dtype=np.float64), batch)
                 for name, x in (("alibi", alibi_slopes), ("sinks", sinks))}
    if bias is not None:
        bias = np.broadcast_to(np.asarray(bias, dtype=np.float64), batch + (nq, nk))
    if cu_seqlens_q is None:
        seqs = [(0, nq, 0, nk)]
    else:
        seqs = [(int(a), int(b), int(c), int(e)) for a, b, c, e in
                zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:])]
    out = np.zeros(batch + (nq, dv))
    lse = np.full(batch + (nq,), -np.inf)
    for n, b in enumerate(np.ndindex(*batch)):
        a = 0.0 if per_entry["alibi"] is None else float(per_entry["alibi"][b])
        z = -math.inf if per_entry["sinks"] is None else float(per_entry["sinks"][b])
        for q0, q1, k0, k1 in seqs:
            off = (k1 - k0) - (q1 - q0)
            for i in range(q1 - q0):
                scores = {}
                for j in range(k1 - k0):
                    if (left is not None and j < i + off - left) or (right is not None and j > i + off + right):
                        continue
                    s = scale * float(np.dot(q[b][q0 + i], k[b][k0 + j]))
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if bias is not None:
                        s += float(bias[b][i, j])
                    s -= a * abs(i + off - j)
                    if s != -math.inf:
                        scores[j] = s
                m = max([z, *scores.values()])
                if m == -math.inf:
                    continue
                total = math.exp(z - m) + math.fsum(math.exp(s - m) for s in scores.values())
                lse[b + (q0 + i,)] = m + math.log(total)
                for j, s in scores.items():
                    w = math.exp(s - lse[b + (q0 + i,)])
                    if dropout_p:
                        w = w / (1 - dropout_p) if keep_scalar(seed, n, q0 + i, k0 + j, dropout_p) else 0.0
                    out[b + (q0 + i,)] += w * v[b][k0 + j]
    return out, lse


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


@st.composite
def broadcasting_to(draw, target):
    """A shape that broadcasts to ``target`` without enlarging it: leading dims dropped, some 1."""
    target = tuple(target)
    kept = target[draw(st.integers(0, len(target))):]
    return tuple(n if draw(st.booleans()) else 1 for n in kept)


@st.composite
def lengths(draw, count, max_len):
    return [draw(st.integers(0, max_len)) for _ in range(count)]


@st.composite
def modifier_problems(draw, *, max_n, max_d, packed=None, max_side=3):
    """q, k, v (GQA-like or general broadcast batch dims, Dv independent of D), a mask, a scale
    and a random subset of the score modifiers; packed sequences on some draws (never a bias)."""
    if draw(st.booleans()):
        b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
        shapes = ((b, hkv, g), (b, hkv, 1), (b, hkv, 1))
    else:
        shapes = draw(mutually_broadcastable_shapes(num_shapes=3, max_dims=2, max_side=max_side)).input_shapes
    batch = np.broadcast_shapes(*shapes)
    packed = draw(st.booleans()) if packed is None else packed
    cu = {}
    if packed:
        count = draw(st.integers(1, 3))
        lq, lk = draw(lengths(count, max_n)), draw(lengths(count, max_n))
        cu = {f"cu_seqlens_{axis}": np.cumsum([0] + n).astype(np.int32) for axis, n in (("q", lq), ("k", lk))}
        nq, nk = sum(lq), sum(lk)
    else:
        nq, nk = draw(st.integers(0, max_n)), draw(st.integers(0, max_n))
    d, dv = draw(st.integers(1, max_d)), draw(st.integers(1, max_d))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    side = st.one_of(st.none(), st.integers(0, max_n + 1))
    p = dict(
        q=rng.standard_normal(shapes[0] + (nq, d)) * draw(st.sampled_from([1.0, 3.0])),
        k=rng.standard_normal(shapes[1] + (nk, d)),
        v=rng.standard_normal(shapes[2] + (nk, dv)),
        causal=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.tuples(side, side))),
        scale=draw(st.one_of(st.none(), st.floats(0.1, 2.0))),
        **cu,
    )
    if draw(st.booleans()):
        p["softcap"] = draw(st.sampled_from([0, 0.5, 2.0, 30.0]))
    if not packed and draw(st.booleans()):
        dtype = draw(st.sampled_from([np.float64, np.float32, np.float16]))
        p["bias"] = np.asarray(rng.standard_normal(draw(broadcasting_to(batch + (nq, nk)))) * 2, dtype=dtype)
    if draw(st.booleans()):
        p["alibi_slopes"] = np.asarray(rng.uniform(0, 1, draw(broadcasting_to(batch))), dtype=np.float32)
    if draw(st.booleans()):
        p["sinks"] = np.asarray(rng.standard_normal(draw(broadcasting_to(batch))) * 2, dtype=np.float32)
    if draw(st.booleans()):
        p["dropout_p"] = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9]))
        p["seed"] = draw(st.integers(0, 2**64 - 1))
    return p


def assert_close(actual, expected, tol, what):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected), err_msg=f"{what}: -inf pattern")
    finite = np.isfinite(expected)
    assert np.all(np.isfinite(actual[finite])), f"{what}: non-finite values"
    if finite.any():
        err = np.max(np.abs(actual[finite] - expected[finite]))
        assert err <= tol * max(1.0, np.max(np.abs(expected[finite]))), f"{what}: max error {err:.3e}"


# ---------------------------------------------------------------------------------------------
# Forward: attention and tiled_attention against the formula
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, **FAST)
@given(modifier_problems(max_n=6, max_d=4))
def test_attention_matches_the_formula(p):
    out, lse = reference.attention(**p, return_lse=True)
    want_out, want_lse = formula(**p)
    assert out.dtype == lse.dtype == np.float64
    assert_close(out, want_out, 1e-12, "out")
    assert_close(lse, want_lse, 1e-12, "lse")


@settings(max_examples=25, **FAST)
@given(modifier_problems(max_n=40, max_d=6, max_side=2), st.sampled_from([8, 16]), st.sampled_from([8, 16, 32]))
def test_tiled_matches_attention(p, block_m, block_n):
    out, lse = reference.tiled_attention(**p, block_m=block_m, block_n=block_n, return_lse=True)
    want_out, want_lse = reference.attention(**p, return_lse=True)
    assert_close(out, want_out, 1e-10, "out")
    assert_close(lse, want_lse, 1e-10, "lse")


def test_a_bias_of_minus_infinity_removes_keys():
    # A key-padding bias (B, 1, 1, Nk) of 0 and -inf equals attending only the kept keys.
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 2))
    bias = np.zeros((2, 1, 1, 6))
    bias[..., 4:] = -np.inf
    out, lse = reference.attention(q, k, v, bias=bias, return_lse=True)
    want_out, want_lse = reference.attention(q, k[..., :4, :], v[..., :4, :], return_lse=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)


@pytest.mark.parametrize("function", [reference.attention, reference.tiled_attention])
def test_rows_without_keys_give_the_sink(function):
    # Nq = 5, Nk = 2, causal: off = -3, rows 0..2 see no key; the packed call's second
    # sequence has no key at all.
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2, 3))
    sinks = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    out, lse = function(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert np.all(out[:, :3] == 0)
    np.testing.assert_array_equal(lse[:, :3], np.broadcast_to(sinks[:, None].astype(np.float64), (3, 3)))
    assert np.all(lse[:, 3:] > sinks[:, None])
    cu_q, cu_k = np.array([0, 2, 5], dtype=np.int32), np.array([0, 2, 2], dtype=np.int32)
    out, lse = function(q, k, v, sinks=sinks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    assert np.all(out[:, 2:] == 0)
    np.testing.assert_array_equal(lse[:, 2:], np.broadcast_to(sinks[:, None].astype(np.float64), (3, 3)))
    # Their gradients: nothing for q, and nothing into dsinks (out = 0 there, so D_i = 0).
    out, lse = reference.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    dout = rng.standard_normal(out.shape)
    dq, _, _, dsinks = reference.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks)
    assert np.all(dq[:, :3] == 0)
    *_, dsinks_rest = reference.attention_backward(dout[:, 3:], q[:, 3:], k, v, out[:, 3:], lse[:, 3:],
                                                   causal=True, sinks=sinks)
    np.testing.assert_allclose(dsinks, dsinks_rest, rtol=1e-14)


def test_kvcache_takes_softcap_alibi_and_sinks():
    # q (B, Hkv, G, Nq, D) against contiguous caches (B, Hkv, 1, Nmax, D); the second sequence
    # is empty (its rows give out 0 and lse = its sink).
    rng = np.random.default_rng(3)
    b, hkv, g, nq, nmax, d, dv = 2, 2, 2, 3, 7, 4, 4
    q = rng.standard_normal((b, hkv, g, nq, d)).astype(np.float32)
    k_cache = rng.standard_normal((b, hkv, 1, nmax, d)).astype(np.float32)
    v_cache = rng.standard_normal((b, hkv, 1, nmax, dv)).astype(np.float32)
    alibi = rng.uniform(0, 1, (hkv, g)).astype(np.float32)
    sinks = rng.standard_normal((b, 1, 1)).astype(np.float32)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=alibi, sinks=sinks)
    seqlens = np.array([5, 0], dtype=np.int32)
    out, lse = reference.attention_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, return_lse=True, **kw)
    for s in range(b):
        want_out, want_lse = formula(q[s], k_cache[s, ..., :seqlens[s], :], v_cache[s, ..., :seqlens[s], :],
                                     causal=True, softcap=3.0, alibi_slopes=alibi,
                                     sinks=np.broadcast_to(sinks, (b, hkv, g))[s])
        assert_close(out[s], want_out, 1e-12, "out")
        assert_close(lse[s], want_lse, 1e-12, "lse")
    assert np.all(out[1] == 0)
    np.testing.assert_array_equal(lse[1], np.broadcast_to(sinks[1, ..., None], (hkv, g, nq)))


# ---------------------------------------------------------------------------------------------
# Backward against central finite differences
# ---------------------------------------------------------------------------------------------


@settings(max_examples=30, **FAST)
@given(modifier_problems(max_n=4, max_d=3, max_side=2))
def test_gradients_match_finite_differences(p):
    p = {name: np.array(x) if isinstance(x, np.ndarray) else x for name, x in p.items()}   # own copies
    if "bias" in p:
        p["bias"] = p["bias"].astype(np.float64)   # a float64 bias for a fine step
    out, lse = reference.attention(**p, return_lse=True)
    dout = np.random.default_rng(0).standard_normal(out.shape)
    grads = reference.attention_backward(dout, out=out, lse=lse, bias_grad=True, **p)
    names = ["q", "k", "v"] + [name for name in ("bias", "sinks") if name in p]
    assert len(grads) == len(names)

    def loss():
        return float(np.sum(reference.attention(**p) * dout))

    for name, g in zip(names, grads):
        x = p[name]
        assert g.shape == x.shape and g.dtype == np.float64, name
        fd = finite_difference(loss, x, 2.0**-14 if x.dtype == np.float32 else 1e-5)
        err = np.max(np.abs(g - fd), initial=0.0)
        assert err <= 1e-6 * max(1.0, np.max(np.abs(fd), initial=0.0)), f"d{name}: error {err:.3e}"


def test_backward_return_order_and_bias_grad():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 1, 6, 5)), rng.standard_normal((2, 1, 6, 3))
    bias = rng.standard_normal((4, 6)).astype(np.float32)
    sinks = rng.standard_normal((3,)).astype(np.float32)
    kw = dict(bias=bias, sinks=sinks, softcap=5.0, dropout_p=0.2, seed=7)
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv, dbias, dsinks = reference.attention_backward(dout, q, k, v, out, lse, bias_grad=True, **kw)
    assert (dq.shape, dk.shape, dv.shape, dbias.shape, dsinks.shape) == (q.shape, k.shape, v.shape, (4, 6), (3,))
    # Without bias_grad: no dbias, the same rest.
    rest = reference.attention_backward(dout, q, k, v, out, lse, **kw)
    assert len(rest) == 4
    for a, b in zip(rest, (dq, dk, dv, dsinks)):
        np.testing.assert_array_equal(a, b)
    # dbias is dS summed over the batch: the gradient w.r.t. a bias given at full size, summed.
    full = np.broadcast_to(bias, (2, 3, 4, 6)).copy()
    *_, dfull, _ = reference.attention_backward(dout, q, k, v, out, lse, **{**kw, "bias": full}, bias_grad=True)
    np.testing.assert_allclose(dbias, dfull.sum(axis=(0, 1)), rtol=1e-12, atol=1e-15)
    # Dropout really drops: another seed gives another output.
    assert np.max(np.abs(reference.attention(q, k, v, **{**kw, "seed": 8}) - out)) > 1e-3


# ---------------------------------------------------------------------------------------------
# Dropout's keep mask
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("counter, key, want", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, want):
    """Random123's known-answer vectors for philox4x32-10 (its kat_vectors)."""
    got = reference._philox4x32_10(counter, key)
    assert all(w.dtype == np.uint32 for w in got)
    assert tuple(int(w) for w in got) == want
    assert philox_scalar(counter, key) == want


def test_dropout_keep_matches_the_scalar_definition():
    rng = np.random.default_rng(5)
    size = 300
    n = rng.integers(0, 2**40, size, dtype=np.int64)    # above 2**32: the counter's last word
    i = rng.integers(0, 2**30, size, dtype=np.int64)
    j = rng.integers(0, 2**30, size, dtype=np.int64)
    n[:50], i[:50], j[:50] = rng.integers(0, 4, 50), rng.integers(0, 40, 50), rng.integers(0, 40, 50)
    for seed, p in ((0, 0.5), (2**64 - 1, 0.1), (0x123456789ABCDEF, 0.9)):
        got = reference.dropout_keep(seed, n, i, j, p)
        want = [keep_scalar(seed, int(a), int(b), int(c), p) for a, b, c in zip(n, i, j)]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_kept_fraction(p):
    i, j = np.arange(256)[:, None], np.arange(256)
    keep = reference.dropout_keep(12345, np.arange(4)[:, None, None], i, j, p)
    assert keep.shape == (4, 256, 256) and keep.dtype == bool
    expected = 1 - reference.dropout_threshold(p) / 65536
    sigma = math.sqrt(expected * (1 - expected) / keep.size)
    assert abs(keep.mean() - expected) <= 5 * sigma + 1e-12
    assert abs(expected - (1 - p)) < 2**-16


def test_each_tile_element_has_its_own_bits():
    """Each (i, j) of a 16 x 16 tile reads its own (Philox call, word, half); tiles use separate calls."""
    for ti, tj in ((0, 0), (1, 0), (3, 5)):
        i, j = np.meshgrid(np.arange(16) + 16 * ti, np.arange(16) + 16 * tj, indexing="ij")
        counter, word, shift = reference._dropout_slots(np.zeros_like(i), i, j)
        slots = set(zip(*(c.ravel().tolist() for c in (*counter, word, shift))))
        assert len(slots) == 256
        calls = {s[:4] for s in slots}
        assert len(calls) == 32
        assert {c[:2] for c in calls} == {(4 * tj + a, 8 * ti + b) for a in range(4) for b in range(8)}


def test_dropout_threshold():
    assert reference.dropout_threshold(0) == 0
    assert reference.dropout_threshold(0.5) == 32768
    assert reference.dropout_threshold(0.1) == 6553
    assert reference.dropout_threshold(1 - 2**-20) == 65535
    # p = 0 keeps everything and needs no seed.
    assert reference.dropout_keep(None, 3, np.arange(5), 2, 0.0).all()


# ---------------------------------------------------------------------------------------------
# Errors: the checks and the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, error, match", [
    ("1", TypeError, r"softcap must be None or a real number .* got '1' of type str"),
    (True, TypeError, "softcap must be None or a real number"),
    (-1.0, ValueError, r"softcap must be None, 0 \(off\) or a finite number > 0, got -1.0"),
    (math.nan, ValueError, "softcap .* got nan"),
    (math.inf, ValueError, "softcap .* got inf"),
])
def test_bad_softcap(value, error, match):
    with pytest.raises(error, match=match):
        _checks.check_softcap(value)
    with pytest.raises(error, match=match):
        reference.attention(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)), softcap=value)


def test_softcap_off():
    assert _checks.check_softcap(None) == 0.0 and _checks.check_softcap(0) == 0.0
    assert _checks.check_softcap(np.float32(2.5)) == 2.5


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
def test_bad_per_entry_arrays(name):
    q, k, v = np.ones((2, 3, 5, 4)), np.ones((2, 1, 6, 4)), np.ones((2, 1, 6, 4))   # batch (2, 3)
    with pytest.raises(TypeError, match=rf"{name} must be a float32 array, got dtype float64"):
        reference.attention(q, k, v, **{name: np.ones(3)})
    for shape in ((2,), (4, 2, 3), (1, 2, 3)):
        with pytest.raises(ValueError, match=rf"{name} must have a shape that broadcasts to the batch dims \(2, 3\).*"
                                             rf"got shape \({shape[0]},"):
            reference.attention(q, k, v, **{name: np.ones(shape, np.float32)})
    for shape in ((), (3,), (2, 1), (2, 3)):
        _checks.check_per_entry(name, np.ones(shape, np.float32), (2, 3))
    with pytest.raises(TypeError, match=name):
        reference.attention_kvcache(np.ones((2, 3, 1, 4), np.float32), np.ones((2, 3, 5, 4), np.float32),
                                    np.ones((2, 3, 5, 4), np.float32), **{name: np.ones(3)})
    with pytest.raises(ValueError, match=name):
        reference.attention_kvcache(np.ones((2, 3, 1, 4), np.float32), np.ones((2, 3, 5, 4), np.float32),
                                    np.ones((2, 3, 5, 4), np.float32), **{name: np.ones(2, np.float32)})


def test_bad_bias():
    q, k, v = np.ones((2, 5, 4)), np.ones((2, 6, 4)), np.ones((2, 6, 4))
    for shape in ((5, 7), (3, 5, 6), (1, 2, 5, 6), (6, 5)):
        with pytest.raises(ValueError, match=r"bias must have a shape that broadcasts to the batch dims \+ \(Nq, Nk\), "
                                             r"\(2, 5, 6\)"):
            reference.attention(q, k, v, bias=np.ones(shape))
    with pytest.raises(TypeError, match="bias must have a real floating dtype"):
        reference.attention(q, k, v, bias=np.ones((5, 6), dtype=complex))
    # The GPU functions' rule: the inputs' dtype or float32.
    _checks.check_bias(np.ones((1, 6), np.float16), (2,), 5, 6, "float16")
    _checks.check_bias(np.ones((1, 6), np.float32), (2,), 5, 6, "float16")
    with pytest.raises(TypeError, match=r"bias must have the inputs' dtype \(float16\) or float32, got dtype float64"):
        _checks.check_bias(np.ones((1, 6)), (2,), 5, 6, "float16")
    cu = np.array([0, 5], dtype=np.int32), np.array([0, 6], dtype=np.int32)
    with pytest.raises(ValueError, match="bias is not taken with packed sequences"):
        reference.attention(q, k, v, bias=np.ones((5, 6)), cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])


@pytest.mark.parametrize("dropout_p, seed, error, match", [
    (1.0, 0, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    (-0.1, 0, ValueError, r"dropout_p must be in \[0, 1\), got -0.1"),
    (math.nan, 0, ValueError, "dropout_p must be in"),
    ("0.1", 0, TypeError, "dropout_p must be a real number"),
    (True, 0, TypeError, "dropout_p must be a real number"),
    (0.1, None, ValueError, "seed is required when dropout_p > 0"),
    (0.1, 1.5, TypeError, r"seed must be None or an int .* got 1.5 of type float"),
    (0.1, True, TypeError, "seed must be None or an int"),
    (0.0, "7", TypeError, "seed must be None or an int"),
    (0.1, -1, ValueError, r"seed must be an int with 0 <= seed < 2\*\*64, got -1"),
    (0.0, 2**64, ValueError, r"seed must be an int with 0 <= seed < 2\*\*64"),
])
def test_bad_dropout(dropout_p, seed, error, match):
    with pytest.raises(error, match=match):
        _checks.check_dropout(dropout_p, seed)
    with pytest.raises(error, match=match):
        reference.attention(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)), dropout_p=dropout_p, seed=seed)
    with pytest.raises(error, match=match):
        reference.dropout_keep(seed, 0, 0, 0, dropout_p)


def test_good_dropout_arguments():
    assert _checks.check_dropout(0, None) == (0.0, None)
    assert _checks.check_dropout(0.0, np.uint64(2**64 - 1)) == (0.0, 2**64 - 1)
    assert _checks.check_dropout(np.float32(0.5), np.int64(3)) == (0.5, 3)


def test_bias_grad_must_be_a_bool():
    x = np.ones((2, 4))
    with pytest.raises(TypeError, match="bias_grad must be True or False"):
        reference.attention_backward(x, x, x, x, x, np.zeros(2), bias_grad=1)


def test_dropout_keep_rejects_bad_indices():
    with pytest.raises(ValueError, match="i must be non-negative"):
        reference.dropout_keep(1, 0, -1, 0, 0.5)
    with pytest.raises(TypeError, match="j must be a non-negative int"):
        reference.dropout_keep(1, 0, 0, 0.5, 0.5)
