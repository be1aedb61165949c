"""The score modifiers on the GPU (softcap, ALiBi, sinks, bias, dropout) against the float64
reference, by the accuracy criterion of docs/contract.md, forward and backward; dropout's mask
against cuflash.reference.dropout_keep, bit for bit."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
from conftest import assert_close_to_reference, assert_lse_close, poisoned_allocations, random_array, requires_gpu

from cuflash import reference

pytestmark = requires_gpu

DTYPES = ("float16", "bfloat16", "float32")
# (softcap, ALiBi, sinks) combinations, as the keywords they become
MODS = {
    "softcap": dict(softcap=20.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all": dict(softcap=30.0, alibi=True, sinks=True),
}
MASKS = {"none": {}, "causal": {"causal": True}, "window": {"window": (37, 5)}}
# Bias kinds: its dims of the scores' (B, H, Nq, Nk), "1" where it broadcasts (fewer dims: it
# starts later), and its dtype (None: the inputs'). Standard normal values, but "key padding":
# 0, and -1e4 on the last 1 to 29 keys of each batch entry.
BIASES = {
    "full": ("BHQK", None),
    "full float32": ("BHQK", "float32"),
    "shared": ("QK", None),
    "key padding": ("B11K", None),
    "per head float32": ("1HQK", "float32"),
}
# Keywords that cuflash.naive does not take: with them _naive_attention and _naive_backward run
# its chain themselves.
NOT_NAIVE = ("bias", "dropout_p", "seed")


def _dtype(name):
    import cupy

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return cupy.dtype(name)


def _seed(rng):
    """A random seed over all 64 bits."""
    return int(rng.integers(2**64, dtype=np.uint64))


def _bias(rng, kind, scores_shape, dtype):
    """A bias of `kind` (BIASES) for scores of shape (..., B, H, Nq, Nk) and inputs of `dtype` (CuPy)."""
    import cupy

    dims, bias_dtype = BIASES[kind]
    shape = tuple(1 if c == "1" else n for c, n in zip(dims, scores_shape[-len(dims):]))
    if kind == "key padding":
        padded = rng.integers(1, 30, size=shape[:-1] + (1,))
        b = np.where(np.arange(shape[-1]) >= shape[-1] - padded, np.float32(-1e4), np.float32(0))
    else:
        b = rng.standard_normal(shape, dtype=np.float32)
    return cupy.asarray(b).astype(dtype if bias_dtype is None else bias_dtype)


def _keywords(rng, mods, heads_shape, scores=None):
    """The modifiers' keywords: per-head arrays of heads_shape (CuPy, float32); the bias of the kind
    mods["bias"] names for ``scores``, the (shape, dtype) of the scores and inputs; dropout with a
    random seed."""
    import cupy

    out = {}
    if mods.get("softcap"):
        out["softcap"] = mods["softcap"]
    if mods.get("alibi"):
        out["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, heads_shape).astype(np.float32))
    if mods.get("sinks"):
        out["sinks"] = cupy.asarray(rng.normal(0, 2, heads_shape).astype(np.float32))
    if mods.get("bias"):
        out["bias"] = _bias(rng, mods["bias"], *scores)
    if mods.get("dropout_p"):
        out.update(dropout_p=mods["dropout_p"], seed=_seed(rng))
    return out


def _grad_keywords(mods):
    """attention_backward's keywords beyond the forward's: bias_grad where `mods` asks."""
    return {"bias_grad": mods["bias_grad"]} if "bias_grad" in mods else {}


def _host(keywords):
    return {k: (v.get() if hasattr(v, "get") else v) for k, v in keywords.items()}


def _dropout_keep(seed, batch, rows, keys, dropout_p):
    """cuflash.reference.dropout_keep of every batch entry (its flat index n, C order), row and key
    (positions along axis -2): shape batch + (len(rows), len(keys))."""
    n = np.arange(math.prod(batch)).reshape(tuple(batch) + (1, 1))
    return reference.dropout_keep(seed, n, np.asarray(rows)[:, None], np.asarray(keys), dropout_p)


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and bool((a.view(np.uint8) == b.view(np.uint8)).all())


# ---------------------------------------------------------------------------------------------
# The accuracy criterion's naive results, bias and dropout included
# ---------------------------------------------------------------------------------------------


def _naive_scores(q, k, mask, kw):
    """cuflash.naive's float32 scores (softcap, ALiBi, the mask) plus the bias: adding it after ALiBi
    and the mask is adding it before them."""
    import cupy

    from cuflash import naive

    s = naive._scores(q, k, mask.get("causal", False), mask.get("window"), None, kw.get("softcap"),
                      kw.get("alibi_slopes"))
    return s if "bias" not in kw else s + kw["bias"].astype(cupy.float32)


def _naive_probabilities(s, lse):
    """exp(s - lse) in float32, 0 on rows whose lse is -inf (as cuflash.naive's backward)."""
    import cupy

    return cupy.exp(s - cupy.where(cupy.isfinite(lse), lse, cupy.float32(cupy.inf))[..., None])


def _naive_lse(s, sinks):
    """Each row's logsumexp over its scores and its sink, in float32; -inf for a row with neither."""
    import cupy

    if sinks is not None:
        s = cupy.concatenate([s, cupy.broadcast_to(sinks[..., None, None], s.shape[:-1] + (1,))], axis=-1)
    m = s.max(axis=-1, keepdims=True)
    m = cupy.where(cupy.isfinite(m), m, cupy.float32(0))
    total = cupy.exp(s - m).sum(axis=-1)
    return cupy.where(total > 0, cupy.log(total) + m[..., 0], cupy.float32(-cupy.inf))


def _naive_multipliers(kw, shape):
    """Dropout's multipliers keep / (1 - p), float32 (CuPy), for the scores of a dense call of
    `shape`, batch + (Nq, Nk); None without dropout."""
    import cupy

    if not kw.get("dropout_p"):
        return None
    *batch, nq, nk = shape
    keep = _dropout_keep(kw["seed"], batch, np.arange(nq), np.arange(nk), kw["dropout_p"])
    return cupy.asarray(keep * np.float32(1 / (1 - kw["dropout_p"])))


def _naive_attention(q, k, v, mask, kw):
    """cuflash.naive.attention, the criterion's baseline; with a bias or dropout, which it does not
    take, its chain with them: the float32 scores plus the bias, the probabilities times dropout's
    multipliers, rounded to the inputs' dtype for the product with v."""
    from cuflash import naive

    if not any(name in kw for name in NOT_NAIVE):
        return naive.attention(q, k, v, **mask, **kw)
    s = _naive_scores(q, k, mask, kw)
    p = _naive_probabilities(s, _naive_lse(s, kw.get("sinks")))
    drop = _naive_multipliers(kw, s.shape)
    return naive._matmul((p if drop is None else p * drop).astype(v.dtype), v)


def _naive_backward(dout, q, k, v, out, lse, mask, kw, bias_grad=False):
    """cuflash.naive.attention_backward, dsinks summed to the shape of the sinks; with a bias or
    dropout, its chain with them (as _naive_attention), and with bias_grad dbias: dS summed to the
    bias's shape in float32, in its dtype."""
    import cupy

    from cuflash import _checks, naive

    f32 = cupy.float32
    if not any(name in kw for name in NOT_NAIVE):
        grads = list(naive.attention_backward(dout, q, k, v, out, lse, **mask, **kw))
    else:
        s = _naive_scores(q, k, mask, kw)
        p = _naive_probabilities(s, lse)
        drop = _naive_multipliers(kw, s.shape)
        dv = naive._matmul(cupy.swapaxes((p if drop is None else p * drop).astype(q.dtype), -1, -2), dout)
        dp = naive._matmul(dout, cupy.swapaxes(v, -1, -2)).astype(f32)
        delta = (dout.astype(f32) * out.astype(f32)).sum(axis=-1, keepdims=True)
        ds = p * ((dp if drop is None else dp * drop) - delta)
        dbias = [_checks.sum_to_shape(ds, kw["bias"].shape).astype(kw["bias"].dtype)] if bias_grad else []
        if kw.get("softcap"):
            th = cupy.tanh(naive._scores(q, k, False, None, None) / f32(kw["softcap"]))
            ds = ds * (1 - th * th)
        ds = (ds * f32(naive._scale(q, None))).astype(q.dtype)
        grads = [naive._matmul(ds, k), naive._matmul(cupy.swapaxes(ds, -1, -2), q), dv, *dbias]
        if "sinks" in kw:
            grads.append(-(cupy.exp(kw["sinks"][..., None] - lse) * delta[..., 0]).sum(axis=-1))
    if "sinks" in kw:   # per batch entry: summed over the dims the sinks broadcast along
        grads[-1] = _checks.sum_to_shape(grads[-1], kw["sinks"].shape)
    return grads


def _check(q, k, v, dtype, mask, mods, rng, backward=True, deterministic=True):
    """Forward and backward of `mods` (MODS; bias, bias_grad, dropout_p) against the reference."""
    import cuflash

    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    kw = _keywords(rng, mods, batch[-1:], (batch + (q.shape[-2], k.shape[-2]), q.dtype))
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **mask, **kw)
    host = [x.get().astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*host, return_lse=True, **mask, **_host(kw))
    assert_close_to_reference("out", out.get(), _naive_attention(q, k, v, mask, kw).get(), ref_out, dtype, c=2)
    assert_lse_close(lse.get(), ref_lse)
    if not backward:
        return
    grad_kw = _grad_keywords(mods)
    dout = random_array(rng, out.shape, q.dtype)
    with poisoned_allocations():
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **mask, **kw,
                                           **grad_kw)
    ref = reference.attention_backward(dout.get().astype(np.float64), *host, ref_out, ref_lse, **mask, **_host(kw),
                                       **grad_kw)
    n_grads = _naive_backward(dout, q, k, v, out, lse, mask, kw, **grad_kw)
    inputs = {"dq": q, "dk": k, "dv": v}   # each gradient has the shape and dtype of its input
    if grad_kw.get("bias_grad"):
        inputs["dbias"] = kw["bias"]
    if "sinks" in kw:
        inputs["dsinks"] = kw["sinks"]
    assert len(grads) == len(ref) == len(n_grads) == len(inputs)
    for (name, x), got, naive_grad, want in zip(inputs.items(), grads, n_grads, ref):
        assert (got.shape, got.dtype) == (x.shape, x.dtype), name
        assert_close_to_reference(name, got.get(), naive_grad.get(), want, dtype, c=3)


# ---------------------------------------------------------------------------------------------
# softcap, ALiBi and sinks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("d", [64, 128, 256, 40])
def test_modifiers_forward_and_backward(dtype, mods, mask, d):
    rng = np.random.default_rng(abs(hash((dtype, mods, mask, d))) % 2**32)
    dt = _dtype(dtype)
    nq, nk = int(rng.integers(100, 300)), int(rng.integers(100, 300))
    q, k, v = (random_array(rng, (2, 3, n, d), dt) for n in (nq, nk, nk))
    _check(q, k, v, dtype, MASKS[mask], MODS[mods], rng)


# The long-rows cases: MODS over 2048 rows and keys; a bias (without and with its gradient) and
# dropout over 1024
LONG_ROWS = {
    **{name: (mods, 2048) for name, mods in MODS.items()},
    "key padding bias": (dict(bias="key padding"), 1024),
    "bias with grad": (dict(bias="per head float32", bias_grad=True), 1024),
    "dropout": (dict(dropout_p=0.15), 1024),
}


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("mods", LONG_ROWS)
def test_modifiers_long_rows_on_the_fast_kernels(dtype, mods):
    """Rows long enough for the Hopper kernels' loading warpgroups, causal."""
    rng = np.random.default_rng(7)
    dt = _dtype(dtype)
    mods, n = LONG_ROWS[mods]
    q, k, v = (random_array(rng, (1, 2, n, 128), dt) for _ in range(3))
    _check(q, k, v, dtype, {"causal": True}, mods, rng)


# The grouped queries' cases: MODS; a bias over (Hkv, G, Nq, Nk), broadcast over B, with its
# gradient; dropout (n: the flat index of the query head's entry)
GQA_MODS = {**MODS, "bias": dict(bias="full", bias_grad=True), "dropout": dict(dropout_p=0.2)}


@pytest.mark.parametrize("mods", GQA_MODS)
def test_modifiers_with_grouped_queries_by_broadcasting(mods):
    """GQA: k, v (B, Hkv, 1, N, D) against q (B, Hkv, G, N, D); per query head slopes and sinks."""
    import cuflash

    rng = np.random.default_rng(3)
    dt = _dtype("bfloat16")
    q = random_array(rng, (2, 2, 4, 300, 64), dt)
    k, v = (random_array(rng, (2, 2, 1, 280, 64), dt) for _ in range(2))
    kw = _keywords(rng, GQA_MODS[mods], (2, 4), ((2, 2, 4, 300, 280), dt))
    grad_kw = _grad_keywords(GQA_MODS[mods])
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
        dout = random_array(rng, out.shape, dt)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **kw, **grad_kw)
    host = [x.get().astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*host, causal=True, return_lse=True, **_host(kw))
    ref = reference.attention_backward(dout.get().astype(np.float64), *host, ref_out, ref_lse, causal=True,
                                       **_host(kw), **grad_kw)
    assert len(grads) == len(ref)
    # (bfloat16: the criterion's naive error bounded from its rounding, 2^-8 relative)
    eps = 2.0**-8
    assert np.abs(out.get().astype(np.float64) - ref_out).max() <= 4 * eps * max(1, np.abs(ref_out).max())
    assert_lse_close(lse.get(), ref_lse)
    for got, want in zip(grads, ref):
        got = got.get().astype(np.float64)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 8 * eps * max(1, np.abs(want).max())


def test_sinks_on_rows_that_see_no_key():
    """Causal with Nq > Nk: the first rows see no key; with sinks they give out 0 and lse = the sink."""
    import cupy

    import cuflash

    rng = np.random.default_rng(5)
    dt = _dtype("float16")
    q = random_array(rng, (2, 3, 90, 64), dt)
    k, v = (random_array(rng, (2, 3, 40, 64), dt) for _ in range(2))
    z = cupy.asarray(rng.normal(size=3).astype(np.float32))
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, causal=True, sinks=z, return_lse=True)
    empty = 90 - 40
    assert (out[:, :, :empty].get() == 0).all()
    np.testing.assert_allclose(lse[:, :, :empty].get(), np.broadcast_to(z.get()[:, None], (2, 3, empty)), rtol=1e-6)


# The packed sequences' cases: MODS, and dropout (at positions in the packed arrays), alone and
# with the others
PACKED_MODS = {**MODS, "dropout": dict(dropout_p=0.25), "all with dropout": dict(MODS["all"], dropout_p=0.25)}


@pytest.mark.parametrize("mods", PACKED_MODS)
def test_modifiers_on_packed_sequences(mods):
    import cupy

    import cuflash

    rng = np.random.default_rng(11)
    dt = _dtype("float16")
    lengths_q, lengths_k = [70, 0, 130, 5], [90, 10, 130, 60]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32))
    q = random_array(rng, (3, sum(lengths_q), 64), dt)
    k, v = (random_array(rng, (3, sum(lengths_k), 64), dt) for _ in range(2))
    kw = _keywords(rng, PACKED_MODS[mods], (3,))
    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **packed, **kw)
        dout = random_array(rng, out.shape, dt)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **packed, **kw)
    host = [x.get().astype(np.float64) for x in (q, k, v)]
    hp = dict(cu_seqlens_q=cu_q.get(), cu_seqlens_k=cu_k.get(), causal=True)
    ref_out, ref_lse = reference.attention(*host, return_lse=True, **hp, **_host(kw))
    ref = reference.attention_backward(dout.get().astype(np.float64), *host, ref_out, ref_lse, **hp, **_host(kw))
    eps = 2.0**-11
    assert np.abs(out.get() - ref_out).max() <= 8 * eps * max(1, np.abs(ref_out).max())
    assert_lse_close(lse.get(), ref_lse)
    for got, want in zip(grads, ref):
        got = got.get().astype(np.float64)
        assert np.abs(got - want).max() <= 16 * eps * max(1, np.abs(want).max())


# dq added up in any order: all of MODS, and with a bias and dropout too (the dk/dv pass that adds
# dq draws the mask again)
ANY_ORDER = {"all": MODS["all"], "all, bias, dropout": dict(MODS["all"], bias="key padding", bias_grad=True,
                                                            dropout_p=0.1)}


# (N 1024 with a bias and dropout: still 16 key blocks adding into each dq row, and a quarter of
# the reference's Philox draws, which took a minute at 2048)
@pytest.mark.parametrize("mods, d, n", [("all", 64, 2048), ("all", 128, 2048), ("all, bias, dropout", 64, 1024)])
def test_modifiers_with_dq_in_any_order(mods, d, n):
    rng = np.random.default_rng(13)
    dt = _dtype("bfloat16")
    q, k, v = (random_array(rng, (1, 4, n, d), dt) for _ in range(3))
    _check(q, k, v, "bfloat16", {"causal": True}, ANY_ORDER[mods], rng, deterministic=False)


def test_softcap_bounds_large_logits():
    rng = np.random.default_rng(17)
    dt = _dtype("float16")
    q, k, v = (random_array(rng, (1, 2, 200, 64), dt, scale=8.0) for _ in range(3))
    _check(q, k, v, "float16", {}, dict(softcap=10.0), rng)


def test_modifiers_repeat_bitwise():
    import cuflash

    rng = np.random.default_rng(19)
    dt = _dtype("bfloat16")
    q, k, v = (random_array(rng, (2, 4, 700, 128), dt) for _ in range(3))
    kw = _keywords(rng, MODS["all"], (4,))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
    dout = random_array(rng, out.shape, dt)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
    second = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
    for a, b in zip(first, second):
        assert _same_bits(a, b)


# ---------------------------------------------------------------------------------------------
# bias and dropout
# ---------------------------------------------------------------------------------------------


def _lengths(rng):
    """Nq != Nk, each in [100, 300)."""
    return (int(n) for n in rng.choice(np.arange(100, 300), 2, replace=False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("bias", BIASES)
def test_bias_forward_and_backward(dtype, mask, bias):
    """Each kind of bias (BIASES) and its gradient, dbias, summed over the dims it broadcasts along."""
    rng = np.random.default_rng(abs(hash(("bias", dtype, mask, bias))) % 2**32)
    dt = _dtype(dtype)
    nq, nk = _lengths(rng)
    q, k, v = (random_array(rng, (2, 3, n, 64), dt) for n in (nq, nk, nk))
    _check(q, k, v, dtype, MASKS[mask], dict(bias=bias, bias_grad=True), rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("d", [64, 128])
def test_bias_through_shared_memory(dtype, bias, d):
    """Keys a multiple of 8 (16 bytes of a 16-bit bias), so that a bias in the inputs' dtype,
    its rows aligned, comes through shared memory with the K/V blocks (attn_fwd.cuh:
    STAGED_BIAS); float32 ones in 16-bit calls still read it per pair. Queries not a multiple
    of the row blocks, causal (the band's edge across a staged tile)."""
    rng = np.random.default_rng(abs(hash(("staged", dtype, bias, d))) % 2**32)
    dt = _dtype(dtype)
    nq, nk = 8 * int(rng.integers(13, 37)) + 3, 8 * int(rng.integers(13, 37))
    q, k, v = (random_array(rng, (2, 3, n, d), dt) for n in (nq, nk, nk))
    _check(q, k, v, dtype, MASKS["causal"], dict(bias=bias, bias_grad=True), rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 40])
def test_bias_and_dropout_with_all_modifiers(dtype, d):
    """A bias with its gradient (returned between dv and dsinks) and dropout, with softcap, ALiBi
    and sinks, causal."""
    rng = np.random.default_rng(abs(hash(("all", dtype, d))) % 2**32)
    dt = _dtype(dtype)
    nq, nk = _lengths(rng)
    q, k, v = (random_array(rng, (2, 3, n, d), dt) for n in (nq, nk, nk))
    mods = dict(MODS["all"], bias="full", bias_grad=True, dropout_p=0.2)
    _check(q, k, v, dtype, MASKS["causal"], mods, rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ("none", "causal"))
@pytest.mark.parametrize("p", (0.1, 0.5))
def test_dropout_forward_and_backward(dtype, mask, p):
    """Against the reference with the same seed, which draws the same mask."""
    rng = np.random.default_rng(abs(hash(("dropout", dtype, mask, p))) % 2**32)
    dt = _dtype(dtype)
    nq, nk = _lengths(rng)
    q, k, v = (random_array(rng, (2, 3, n, 64), dt) for n in (nq, nk, nk))
    _check(q, k, v, dtype, MASKS[mask], dict(dropout_p=p), rng)


def _assert_nonzero_where(name, x, kept):
    """x (host) is finite, and nonzero exactly where `kept`."""
    x = np.asarray(x, dtype=np.float32)
    assert np.isfinite(x).all(), f"{name}: {np.count_nonzero(~np.isfinite(x))} non-finite elements"
    wrong = (x != 0) != kept
    assert not wrong.any(), (f"{name}: {np.count_nonzero(wrong)} of {wrong.size} elements disagree with the keep "
                             f"function, the first at {tuple(int(i) for i in np.argwhere(wrong)[0])}")


def _one_hot(batch, n, width, dtype):
    """The identity (n, width) in every batch entry: a CuPy array batch + (n, width)."""
    import cupy

    return cupy.asarray(np.ascontiguousarray(np.broadcast_to(np.eye(n, width, dtype=np.float32),
                                                             tuple(batch) + (n, width)))).astype(dtype)


# Dropout's mask seen exactly: batch dims, the query and key lengths of the sequences (one: a
# dense call), dropout_p
KEEP_CASES = {
    "64x64": ((1,), [64], [64], 0.5),
    "77x93 batch of 6": ((2, 3), [77], [93], 0.1),
    "200x131 batch of 5": ((5,), [200], [131], 0.3),
    "packed": ((3,), [30, 0, 50, 5, 21], [40, 10, 60, 0, 27], 0.2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", KEEP_CASES)
def test_dropout_drops_where_the_keep_function_says(dtype, case):
    """v = I, one value column per key: out[..., i, j] = p_ij / (1 - p) where
    cuflash.reference.dropout_keep(seed, n, i, j) keeps and exactly 0 where it drops (or where key
    j is another sequence's). dout = I, one column per row: dv[..., j, i] the same. i and j are
    positions along axis -2, in the packed arrays when packed."""
    import cupy

    import cuflash

    batch, lengths_q, lengths_k, p = KEEP_CASES[case]
    rng = np.random.default_rng(29)
    dt = _dtype(dtype)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    nq, nk = int(cu_q[-1]), int(cu_k[-1])
    width = max(nq, nk)
    packed = {} if len(lengths_q) == 1 else {"cu_seqlens_q": cupy.asarray(cu_q), "cu_seqlens_k": cupy.asarray(cu_k)}
    # small scores: every probability far from rounding to 0
    q, k = (random_array(rng, tuple(batch) + (n, 64), dt, scale=0.3) for n in (nq, nk))
    v, dout = _one_hot(batch, nk, width, dt), _one_hot(batch, nq, width, dt)
    seed = _seed(rng)
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, dropout_p=p, seed=seed, **packed)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, dropout_p=p, seed=seed, **packed)
    allowed = np.zeros((nq, nk), dtype=bool)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        allowed[q0:q1, k0:k1] = True
    kept = allowed & _dropout_keep(seed, batch, np.arange(nq), np.arange(nk), p)
    out = out.get()
    _assert_nonzero_where("out", out[..., :nk], kept)
    _assert_nonzero_where("out past Nk", out[..., nk:], False)
    dv = grads[2].get()
    _assert_nonzero_where("dv", np.swapaxes(dv[..., :nq], -1, -2), kept)
    _assert_nonzero_where("dv past Nq", dv[..., nq:], False)
    for name, g in zip(("dq", "dk"), grads[:2]):
        assert np.isfinite(g.get().astype(np.float32)).all(), name


@pytest.mark.parametrize("p", (0.1, 0.5))
def test_dropout_keeps_one_minus_p(p):
    """Over 64 entries of 256 x 256 probabilities (v = I, as above), the fraction kept is
    1 - floor(65536 p) / 65536 within 4 standard errors."""
    import cupy

    import cuflash

    rng = np.random.default_rng(41)
    dt = _dtype("float16")
    q, k = (random_array(rng, (8, 8, 256, 64), dt, scale=0.3) for _ in range(2))
    out = cuflash.attention(q, k, _one_hot((8, 8), 256, 256, dt), dropout_p=p, seed=_seed(rng))
    kept = int(cupy.count_nonzero(out)) / out.size
    want = 1 - reference.dropout_threshold(p) / 65536
    assert abs(kept - want) <= 4 * math.sqrt(want * (1 - want) / out.size), (kept, want)


def test_dropout_repeats_bitwise_and_follows_the_seed():
    """The same seed twice: the same bits (out, lse, gradients). A seed that differs in its high
    32 bits only: another out and other gradients, the same lse (taken before dropout).
    dropout_p = 0 with a seed: the bits of no dropout."""
    import cuflash

    rng = np.random.default_rng(31)
    dt = _dtype("bfloat16")
    q, k, v, dout = (random_array(rng, (2, 4, 300, 128), dt) for _ in range(4))
    seed = _seed(rng)

    def run(**kw):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
        return (out, lse, *cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **kw))

    first, again, other = (run(dropout_p=0.2, seed=s) for s in (seed, seed, seed ^ 1 << 40))
    assert all(_same_bits(a, b) for a, b in zip(first, again))
    assert _same_bits(first[1], other[1])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, other):
        if name != "lse":
            differ = np.mean(a.get().astype(np.float32) != b.get().astype(np.float32))
            assert differ > 0.5, f"{name}: only {differ:.1%} of the elements differ between the seeds"
    assert all(_same_bits(a, b) for a, b in zip(run(), run(dropout_p=0.0, seed=seed)))


def test_vjp_takes_bias_and_dropout():
    """attention_vjp passes bias, bias_grad, dropout_p and seed on: its out and vjp(dout) are the
    bits of attention and attention_backward (dq, dk, dv, dbias, dsinks)."""
    import cuflash

    rng = np.random.default_rng(37)
    dt = _dtype("float16")
    q = random_array(rng, (2, 3, 150, 64), dt)
    k, v = (random_array(rng, (2, 3, 170, 64), dt) for _ in range(2))
    kw = _keywords(rng, dict(MODS["all"], bias="key padding", dropout_p=0.3), (3,), ((2, 3, 150, 170), dt))
    out, vjp = cuflash.attention_vjp(q, k, v, causal=True, bias_grad=True, **kw)
    dout = random_array(rng, out.shape, dt)
    grads = vjp(dout)
    want_out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
    want = cuflash.attention_backward(dout, q, k, v, want_out, lse, causal=True, bias_grad=True, **kw)
    assert len(grads) == len(want) == 5
    assert all(_same_bits(a, b) for a, b in zip((out, *grads), (want_out, *want)))


@pytest.mark.parametrize("keyword", ["bias", "dropout_p"])
def test_kvcache_takes_neither_bias_nor_dropout(keyword):
    """Not among attention_kvcache's keywords: a TypeError naming it."""
    import cuflash

    rng = np.random.default_rng(43)
    q = random_array(rng, (2, 3, 1, 64), np.float16)
    k, v = (random_array(rng, (2, 3, 40, 64), np.float16) for _ in range(2))
    given = {"bias": dict(bias=random_array(rng, (2, 3, 1, 40), np.float16)), "dropout_p": dict(dropout_p=0.1, seed=1)}
    with pytest.raises(TypeError, match=keyword):
        cuflash.attention_kvcache(q, k, v, **given[keyword])


# ---------------------------------------------------------------------------------------------
# bad modifiers
# ---------------------------------------------------------------------------------------------


class Array(NamedTuple):
    """An array argument of test_bad_modifiers_raise_before_any_launch, made there: `values`
    broadcast to `shape`, of `dtype`, a CuPy array or (host) a NumPy one."""

    shape: object
    dtype: str = "float32"
    host: bool = False
    values: object = 1

    def make(self):
        import cupy

        x = np.array(np.broadcast_to(np.asarray(self.values, dtype=np.float32), self.shape))
        return (x if self.host else cupy.asarray(x)).astype(_dtype(self.dtype))


OFFSETS = Array(3, "int32", values=[0, 20, 50])   # two packed sequences of the 50 rows


def _no_launch(*args, **kwargs):
    raise AssertionError("a kernel was launched")


BAD_MODIFIERS = [
    (dict(softcap=-1.0), ValueError), (dict(softcap=float("nan")), ValueError), (dict(softcap="1"), TypeError),
    (dict(alibi_slopes=Array(3, "float64")), TypeError), (dict(alibi_slopes=Array(5)), ValueError),
    (dict(sinks=Array((2, 2, 1))), ValueError), (dict(sinks=Array(3, host=True)), TypeError),
    (dict(alibi_slopes=[0.5, 0.25, 0.125]), TypeError),
    (dict(bias=Array((2, 3, 50, 49), "float16")), ValueError), (dict(bias=Array((4, 50, 50), "float16")), ValueError),
    (dict(bias=Array((2, 2, 3, 50, 50), "float16")), ValueError),   # it would enlarge the batch dims
    (dict(bias=Array((50, 50), "float64")), TypeError), (dict(bias=Array((50, 50), "int32")), TypeError),
    (dict(bias=Array((50, 50), "bfloat16")), TypeError), (dict(bias=Array((50, 50), "float16", host=True)), TypeError),
    (dict(bias=Array((50, 50), "float16"), cu_seqlens_q=OFFSETS, cu_seqlens_k=OFFSETS), ValueError),
    (dict(dropout_p=1.0, seed=1), ValueError), (dict(dropout_p=-0.1, seed=1), ValueError),
    (dict(dropout_p=float("nan"), seed=1), ValueError), (dict(dropout_p="0.1", seed=1), TypeError),
    (dict(seed=None, dropout_p=0.1), ValueError), (dict(seed=True, dropout_p=0.1), TypeError),
    (dict(seed=1.0, dropout_p=0.1), TypeError), (dict(seed=-1, dropout_p=0.1), ValueError),
    (dict(seed=2**64, dropout_p=0.1), ValueError),
    (dict(bias_grad=1, bias=Array((50, 50), "float16")), TypeError), (dict(bias_grad="yes"), TypeError),
]
# the functions that take the modifiers, and the arrays they get before them (out as dout too)
FUNCTIONS = {"attention": ("q", "k", "v"), "attention_backward": ("out", "q", "k", "v", "out", "lse"),
             "attention_vjp": ("q", "k", "v")}


@pytest.mark.parametrize("bad, error, function", [(bad, error, function) for bad, error in BAD_MODIFIERS
                                                  for function in FUNCTIONS if function != "attention" or
                                                  "bias_grad" not in bad])   # attention has no bias_grad
def test_bad_modifiers_raise_before_any_launch(bad, error, function, monkeypatch):
    """Naming the argument, before any kernel runs."""
    import cuflash
    from cuflash import _launch

    rng = np.random.default_rng(23)
    q, k, v = (random_array(rng, (2, 3, 50, 64), np.float16) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    given = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    kw = {name: value.make() if isinstance(value, Array) else value for name, value in bad.items()}
    monkeypatch.setattr(_launch.Launch, "run", _no_launch)
    with pytest.raises(error, match=next(iter(bad))):
        getattr(cuflash, function)(*(given[x] for x in FUNCTIONS[function]), **kw)


def test_alibi_and_bias_with_scale_zero_are_refused():
    """The kernels keep ALiBi's and the bias's terms in units of the scale: with scale 0 they
    would drop them, so they refuse them (NotImplementedError naming the argument) before any
    launch."""
    import cupy

    import cuflash

    rng = np.random.default_rng(29)
    q, k, v = (random_array(rng, (1, 2, 40, 64), np.float16) for _ in range(3))
    slopes = cupy.full((2,), 0.5, dtype=cupy.float32)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        cuflash.attention(q, k, v, scale=0.0, alibi_slopes=slopes)
    with pytest.raises(NotImplementedError, match="bias"):
        cuflash.attention(q, k, v, scale=0.0, bias=cupy.ones((40, 40), dtype=cupy.float32))
    # caches (B, Hkv, 1, N, D) against one new row per head, q (B, Hkv, 1, 1, D)
    caches, row = [x[:, :, None] for x in (k, v)], cupy.ascontiguousarray(q[:, :, None, :1])
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        cuflash.attention_kvcache(row, *caches, scale=0.0, alibi_slopes=slopes[:, None])
    cuflash.attention(q, k, v, scale=0.0, softcap=5.0)   # softcap of 0 scores is 0: taken
