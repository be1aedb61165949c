"""The score modifiers on the GPU (softcap, ALiBi, sinks) against the float64 reference, by
the accuracy criterion of docs/contract.md, forward and backward."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close_to_reference, assert_lse_close, poisoned_allocations, random_array, requires_gpu

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


def _dtype(name):
    import cupy

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return cupy.dtype(name)


def _keywords(rng, mods, heads_shape):
    """The modifiers' keywords for per-head arrays of heads_shape (CuPy, float32)."""
    import cupy

    out = {}
    if mods.get("softcap"):
        out["softcap"] = mods["softcap"]
    if mods.get("alibi"):
        out["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, heads_shape).astype(np.float32))
    if mods.get("sinks"):
        out["sinks"] = cupy.asarray(rng.normal(0, 2, heads_shape).astype(np.float32))
    return out


def _host(keywords):
    return {k: (v.get() if hasattr(v, "get") else v) for k, v in keywords.items()}


def _check(q, k, v, dtype, mask, mods, rng, backward=True, deterministic=True):
    import cupy

    import cuflash
    from cuflash import naive, reference

    heads = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])[-1:]
    kw = _keywords(rng, mods, heads)
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, return_lse=True, **mask, **kw)
    host = [x.get().astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*host, return_lse=True, **mask, **_host(kw))
    n_out = naive.attention(q, k, v, **mask, **kw)
    assert_close_to_reference("out", out.get(), n_out.get(), ref_out, dtype, c=2)
    assert_lse_close(lse.get(), ref_lse)
    if not backward:
        return
    dout = random_array(rng, out.shape, q.dtype)
    with poisoned_allocations():
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **mask, **kw)
    ref = reference.attention_backward(dout.get().astype(np.float64), *host, ref_out, ref_lse, **mask, **_host(kw))
    n_grads = list(naive.attention_backward(dout, q, k, v, out, lse, **mask, **kw))
    names = ("dq", "dk", "dv") + (("dsinks",) if "sinks" in kw else ())
    assert len(grads) == len(ref) == len(names)
    if "sinks" in kw:   # the naive one per batch entry: summed over the batch, as the sinks broadcast
        n_grads[3] = cupy.asarray(n_grads[3]).reshape(-1, *kw["sinks"].shape).sum(axis=0)
        assert grads[3].dtype == np.float32 and grads[3].shape == kw["sinks"].shape
    for name, got, naive_grad, want in zip(names, grads, n_grads, ref):
        assert_close_to_reference(name, got.get(), naive_grad.get(), want, dtype, c=3)


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


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("mods", MODS)
def test_modifiers_long_rows_on_the_fast_kernels(dtype, mods):
    """Rows long enough for the Hopper kernels' loading warpgroups, causal."""
    rng = np.random.default_rng(7)
    dt = _dtype(dtype)
    q, k, v = (random_array(rng, (1, 2, 2048, 128), dt) for _ in range(3))
    _check(q, k, v, dtype, {"causal": True}, MODS[mods], rng)


@pytest.mark.parametrize("mods", MODS)
def test_modifiers_with_grouped_queries_by_broadcasting(mods):
    """GQA: k, v (B, Hkv, 1, N, D) against q (B, Hkv, G, N, D); per query head slopes and sinks."""
    import cuflash
    from cuflash import reference

    rng = np.random.default_rng(3)
    dt = _dtype("bfloat16")
    q = random_array(rng, (2, 2, 4, 300, 64), dt)
    k, v = (random_array(rng, (2, 2, 1, 280, 64), dt) for _ in range(2))
    kw = _keywords(rng, MODS[mods], (2, 4))
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
        dout = random_array(rng, out.shape, dt)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
    host = [x.get().astype(np.float64) for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*host, causal=True, return_lse=True, **_host(kw))
    ref = reference.attention_backward(dout.get().astype(np.float64), *host, ref_out, ref_lse, causal=True,
                                       **_host(kw))
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


@pytest.mark.parametrize("mods", MODS)
def test_modifiers_on_packed_sequences(mods):
    import cupy

    import cuflash
    from cuflash import reference

    rng = np.random.default_rng(11)
    dt = _dtype("float16")
    lengths_q, lengths_k = [70, 0, 130, 5], [90, 10, 130, 60]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32))
    q = random_array(rng, (3, sum(lengths_q), 64), dt)
    k, v = (random_array(rng, (3, sum(lengths_k), 64), dt) for _ in range(2))
    kw = _keywords(rng, MODS[mods], (3,))
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


@pytest.mark.parametrize("d", [64, 128])
def test_modifiers_with_dq_in_any_order(d):
    rng = np.random.default_rng(13)
    dt = _dtype("bfloat16")
    q, k, v = (random_array(rng, (1, 4, 2048, d), dt) for _ in range(3))
    _check(q, k, v, "bfloat16", {"causal": True}, MODS["all"], rng, deterministic=False)


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
        assert (a.view(np.uint8) == b.view(np.uint8)).all()


@pytest.mark.parametrize("bad, error", [
    (dict(softcap=-1.0), ValueError), (dict(softcap=float("nan")), ValueError), (dict(softcap="1"), TypeError),
    (dict(alibi_slopes="float64"), TypeError), (dict(alibi_slopes=(5,)), ValueError), (dict(sinks=(2, 2, 1)), ValueError),
    (dict(sinks="numpy"), TypeError), (dict(alibi_slopes=[0.5, 0.25, 0.125]), TypeError),
])
def test_bad_modifiers_raise_before_any_launch(bad, error):
    import cupy

    import cuflash

    rng = np.random.default_rng(23)
    q, k, v = (random_array(rng, (2, 3, 50, 64), np.float16) for _ in range(3))
    kw = {}
    for name, value in bad.items():
        if name == "softcap":
            kw[name] = value
        elif value == "float64":
            kw[name] = cupy.ones(3, dtype=cupy.float64)
        elif value == "numpy":
            kw[name] = np.ones(3, dtype=np.float32)
        elif isinstance(value, list):
            kw[name] = value
        else:
            kw[name] = cupy.ones(value, dtype=cupy.float32)
    with pytest.raises(error, match=next(iter(bad))):
        cuflash.attention(q, k, v, **kw)


def test_alibi_with_scale_zero_is_refused():
    """The kernels keep ALiBi's term in units of the scale: with scale 0 they would drop it, so
    they refuse it (NotImplementedError naming alibi_slopes) before any launch."""
    import cupy

    import cuflash

    rng = np.random.default_rng(29)
    q, k, v = (random_array(rng, (1, 2, 40, 64), np.float16) for _ in range(3))
    slopes = cupy.full((2,), 0.5, dtype=cupy.float32)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        cuflash.attention(q, k, v, scale=0.0, alibi_slopes=slopes)
    # caches (B, Hkv, 1, N, D) against one new row per head, q (B, Hkv, 1, 1, D)
    caches, row = [x[:, :, None] for x in (k, v)], cupy.ascontiguousarray(q[:, :, None, :1])
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        cuflash.attention_kvcache(row, *caches, scale=0.0, alibi_slopes=slopes[:, None])
    cuflash.attention(q, k, v, scale=0.0, softcap=5.0)   # softcap of 0 scores is 0: taken
