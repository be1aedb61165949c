"""cuflash.attention and its backward with their own score and mask functions (score_mod,
mask_mod) on the GPU, against cuflash.reference running the same functions: the gallery of
examples/score_functions.py and functions that read head indices and captured CuPy tables."""

import os
import sys

import numpy as np
import pytest
from conftest import assert_lse_close, eps, poisoned_allocations, random_array, requires_gpu

import cuflash
from cuflash import reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import score_functions as gallery  # noqa: E402

pytestmark = requires_gpu


def functions(xp, batch, heads, n, rng):
    """name: keywords of attention, the captured arrays of module ``xp`` (NumPy for the
    reference, CuPy for the GPU) drawn from ``rng`` (the same for both when seeded alike)."""
    slopes = (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
    docs = np.sort(rng.integers(0, 4, (batch, n)), axis=-1).astype(np.int32)
    table = rng.standard_normal((heads, 65)).astype(np.float32)
    prefixes = rng.integers(0, n + 1, batch).astype(np.int32)
    return {
        "causal": {"mask_mod": gallery.causal()},
        "sliding window": {"mask_mod": gallery.sliding_window(n // 4)},
        "global tokens": {"mask_mod": gallery.sliding_window_with_global_tokens(n // 8, 4)},
        "prefix-LM": {"mask_mod": gallery.prefix_lm(xp.asarray(prefixes))},
        "document": {"mask_mod": gallery.document(xp.asarray(docs))},
        "softcap": {"score_mod": gallery.softcap(20.0)},
        "ALiBi, causal": {"score_mod": gallery.alibi(xp.asarray(slopes)), "mask_mod": gallery.causal()},
        "relative position": {"score_mod": gallery.relative_position(xp.asarray(table))},
        "no key for odd heads": {"mask_mod": lambda b, h, q, k: (h % 2 == 0) & (k <= q)},
    }


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
def test_gallery_forward_matches_the_reference(dtype, d):
    """Each function's out and lse against the reference's, within twice the error of the same
    inputs without it (the accuracy criterion's plain attention), plus a few ulps; outputs
    poisoned before the kernels write them; ragged N (not a multiple of the tiles), large logits."""
    import cupy

    b, h, n = 2, 3, 200
    rng = np.random.default_rng(hash((dtype, d)) % 2**32)
    q, k, v = (random_array(rng, (b, h, n, d), dtype, scale=2.0) for _ in range(3))
    q64, k64, v64 = (cupy.asnumpy(x.astype(cupy.float32)).astype(np.float64) for x in (q, k, v))
    plain_err = np.abs(cupy.asnumpy(cuflash.attention(q, k, v)).astype(np.float64)
                       - reference.attention(q64, k64, v64)).max()
    seed = int(rng.integers(2**31))
    on_host = functions(np, b, h, n, np.random.default_rng(seed))
    on_gpu = functions(cupy, b, h, n, np.random.default_rng(seed))
    for name, fns in on_gpu.items():
        with poisoned_allocations():
            out, lse = cuflash.attention(q, k, v, return_lse=True, **fns)
        want, want_lse = reference.attention(q64, k64, v64, return_lse=True, **on_host[name])
        err = np.abs(cupy.asnumpy(out).astype(np.float64) - want).max()
        atol = 4 * eps(dtype) * max(1.0, np.abs(want).max())
        assert err <= 2 * plain_err + atol, f"{name}: error {err:.3g} > 2 x plain {plain_err:.3g} + {atol:.3g}"
        assert_lse_close(cupy.asnumpy(lse), want_lse)


def _host(*arrays):
    import cupy

    return tuple(cupy.asnumpy(x.astype(cupy.float32)).astype(np.float64) for x in arrays)


def _grad_errors(got, want):
    import cupy

    return [np.abs(cupy.asnumpy(g).astype(np.float64) - w).max() for g, w in zip(got, want)]


def _assert_grads_close(name, got, want, plain_errs, dtype):
    """Each gradient within 3 times the error of the same call without the functions (the
    accuracy criterion's plain backward), plus a few ulps at its scale; every element finite."""
    import cupy

    assert len(got) == len(want) == len(plain_errs), f"{name}: {len(got)} gradients, not {len(want)}"
    labels = ("dq", "dk", "dv") + tuple(f"gradient {i} (dbias or dsinks)" for i in range(3, len(got)))
    for label, g, w, plain in zip(labels, got, want, plain_errs):
        g = cupy.asnumpy(g).astype(np.float64)
        assert np.isfinite(g).all(), f"{name} {label}: {np.count_nonzero(~np.isfinite(g))} non-finite"
        err = np.abs(g - w).max()
        atol = 4 * eps(dtype) * max(1.0, np.abs(w).max())
        assert err <= 3 * plain + atol, f"{name} {label}: error {err:.3g} > 3 x plain {plain:.3g} + {atol:.3g}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
def test_gallery_backward_matches_the_reference(dtype, d):
    """dq, dk, dv of each function (score_mod's derivative taken symbolically) against the
    reference's, within three times the error of the same inputs without it; gradients
    poisoned before the kernels write them; ragged N (not a multiple of the tiles), large logits."""
    b, h, nq, nk = 2, 3, 200, 200
    rng = np.random.default_rng(hash(("bwd", dtype, d)) % 2**32)
    q = random_array(rng, (b, h, nq, d), dtype, scale=2.0)
    k, v = (random_array(rng, (b, h, nk, d), dtype, scale=2.0) for _ in range(2))
    dout = random_array(rng, (b, h, nq, d), dtype)
    q64, k64, v64, dout64 = _host(q, k, v, dout)
    out, vjp = cuflash.attention_vjp(q, k, v)
    want_out, want_lse = reference.attention(q64, k64, v64, return_lse=True)
    plain_errs = _grad_errors(vjp(dout), reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse))
    seed = int(rng.integers(2**31))
    import cupy

    on_host = functions(np, b, h, nq, np.random.default_rng(seed))
    on_gpu = functions(cupy, b, h, nq, np.random.default_rng(seed))
    for name, fns in on_gpu.items():
        with poisoned_allocations():
            out, vjp = cuflash.attention_vjp(q, k, v, **fns)
            grads = vjp(dout)
        want_out, want_lse = reference.attention(q64, k64, v64, return_lse=True, **on_host[name])
        want = reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse, **on_host[name])
        _assert_grads_close(name, grads, want, plain_errs, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_functions_with_the_built_in_modifiers_backward(dtype):
    """score_mod and mask_mod beside softcap, ALiBi and sinks (softcap's factor from the raw
    scores), and beside a bias with its gradient and dropout: out, dq, dk, dv, dbias and dsinks
    against the reference's."""
    import cupy

    b, h, nq, nk, d = 2, 4, 150, 190, 64
    rng = np.random.default_rng(hash(("mods", dtype)) % 2**32)
    q = random_array(rng, (b, h, nq, d), dtype, scale=2.0)
    k, v = (random_array(rng, (b, h, nk, d), dtype, scale=2.0) for _ in range(2))
    dout = random_array(rng, (b, h, nq, d), dtype)
    q64, k64, v64, dout64 = _host(q, k, v, dout)
    table = rng.standard_normal((h, 65)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.3, h).astype(np.float32)
    sinks = rng.normal(0, 2, h).astype(np.float32)
    bias = rng.standard_normal((h, nq, nk)).astype(np.float32)
    cases = {
        "softcap, ALiBi, sinks": lambda xp: {
            "softcap": 20.0, "alibi_slopes": xp.asarray(slopes), "sinks": xp.asarray(sinks),
            "score_mod": gallery.relative_position(xp.asarray(table)), "mask_mod": gallery.sliding_window(60)},
        "bias with dbias, dropout": lambda xp: {
            "bias": xp.asarray(bias), "bias_grad": True,
            "dropout_p": 0.2, "seed": 1234, "score_mod": lambda s, bb, hh, i, j: s * 0.5 + cuflash.tanh(s) * 2.0,
            "mask_mod": gallery.causal()},
    }
    for name, make in cases.items():
        kw, host_kw = make(cupy), make(np)
        if "bias" in kw:   # in the inputs' dtype, which the reference takes as it is
            kw["bias"] = kw["bias"].astype(dtype)
            (host_kw["bias"],) = _host(kw["bias"])
        plain_kw = {key: value for key, value in kw.items() if key not in ("score_mod", "mask_mod")}
        plain_host = {key: value for key, value in host_kw.items() if key not in ("score_mod", "mask_mod")}
        forward_host = {key: value for key, value in plain_host.items() if key != "bias_grad"}
        out, vjp = cuflash.attention_vjp(q, k, v, **plain_kw)
        want_out, want_lse = reference.attention(q64, k64, v64, return_lse=True, **forward_host)
        plain_errs = _grad_errors(vjp(dout), reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse,
                                                                          **plain_host))
        with poisoned_allocations():
            out, vjp = cuflash.attention_vjp(q, k, v, **kw)
            grads = vjp(dout)
        want_out, want_lse = reference.attention(q64, k64, v64, return_lse=True,
                                                 **{key: value for key, value in host_kw.items() if key != "bias_grad"})
        want = reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse, **host_kw)
        err = np.abs(cupy.asnumpy(out).astype(np.float64) - want_out).max()
        assert err <= 8 * eps(dtype) * max(1.0, np.abs(want_out).max()), f"{name} out: error {err:.3g}"
        _assert_grads_close(name, grads, want, plain_errs, dtype)


def _relative_bias(table, nq, nk, q0=0, k0=0):
    """relative_position's scores as a bias, table[h, clamp(j - i) + R] for rows and keys at
    positions q0 + i, k0 + j: (H, nq, nk), and the index into each row of the table."""
    reach = (table.shape[-1] - 1) // 2
    dist = np.clip((k0 + np.arange(nk))[None, :] - (q0 + np.arange(nq))[:, None], -reach, reach) + reach
    return table[:, dist], dist


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_a_relative_position_tables_gradient_adds_up_the_bias_gradient(dtype, d, causal):
    """score_mod_grads=[table] of the gallery's relative position: the same scores as a float32
    bias get dS from the bias kernels (bias_grad=True, from the same out and lse); those added up at each of the table's
    elements on the host, in float64, are the table's gradient to float32's rounding of the
    kernels' atomic sums (2^-13 of the sum of the terms' magnitudes, per element); the gradient is
    float32 as the table, its elements past every distance 0; dq, dk, dv against the reference;
    attention_vjp with score_mod_grads alike. Ragged N, large logits, every output poisoned before
    the kernels write it."""
    import cupy

    b, h, nq, nk = 2, 3, 197, 203
    rng = np.random.default_rng(hash(("table grads", dtype, d, causal)) % 2**32)
    q = random_array(rng, (b, h, nq, d), dtype, scale=2.0)
    k, v = (random_array(rng, (b, h, nk, d), dtype, scale=2.0) for _ in range(2))
    dout = random_array(rng, (b, h, nq, d), dtype)
    table = (rng.standard_normal((h, 2 * 300 + 1)) * 2).astype(np.float32)   # (its far ends: no distance)
    table_gpu = cupy.asarray(table)
    score_mod = gallery.relative_position(table_gpu)
    bias, dist = _relative_bias(table, nq, nk)
    out, lse = cuflash.attention(q, k, v, causal=causal, score_mod=score_mod, return_lse=True)
    with poisoned_allocations():
        *grads, dtable = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, score_mod=score_mod,
                                                    score_mod_grads=[table_gpu])
    assert dtable.dtype == cupy.float32 and dtable.shape == table.shape
    bias_gpu = cupy.asarray(bias)
    # (from the same out and lse: a forward of its own rounds out apart, which moves dS by an ulp of out)
    *_, dbias = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, bias=bias_gpu, bias_grad=True)
    dbias = cupy.asnumpy(dbias).astype(np.float64)
    want, magnitude = np.zeros(table.shape), np.zeros(table.shape)
    for head in range(h):
        np.add.at(want[head], dist, dbias[head])
        np.add.at(magnitude[head], dist, np.abs(dbias[head]))
    got = cupy.asnumpy(dtable).astype(np.float64)
    assert np.isfinite(got).all() and not got[:, magnitude.max(axis=0) == 0].any()
    np.testing.assert_array_less(np.abs(got - want), 2.0**-13 * magnitude + 1e-30)
    # attention_vjp takes score_mod_grads too: the same dq, dk, dv (deterministic), the table's
    # gradient to the atomic sums' rounding
    _, vjp = cuflash.attention_vjp(q, k, v, causal=causal, score_mod=score_mod, score_mod_grads=[table_gpu])
    *again, dtable = vjp(dout)
    assert all(bool((a == g).all()) for a, g in zip(again, grads))
    np.testing.assert_array_less(np.abs(cupy.asnumpy(dtable).astype(np.float64) - want), 2.0**-13 * magnitude + 1e-30)

    q64, k64, v64, dout64 = _host(q, k, v, dout)
    want_out, want_lse = reference.attention(q64, k64, v64, causal=causal, return_lse=True)
    plain_out, plain_lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    plain_errs = _grad_errors(cuflash.attention_backward(dout, q, k, v, plain_out, plain_lse, causal=causal),
                              reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse, causal=causal))
    host_mod = gallery.relative_position(table)
    want_out, want_lse = reference.attention(q64, k64, v64, causal=causal, score_mod=host_mod, return_lse=True)
    want = reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse, causal=causal, score_mod=host_mod)
    _assert_grads_close("relative position with its table's gradient", grads, want, plain_errs, dtype)


def _read_cases(xp, h, n, rng):
    """name: (keywords of attention, the arrays to take gradients of), of module ``xp`` (NumPy for
    the reference, CuPy for the GPU) drawn from ``rng``: reads that add, multiply and pass through
    tanh, in float32 and float16 arrays, beside a mask function and a block mask's."""
    gain = (1 + 0.25 * rng.standard_normal(h)).astype(np.float32)
    table = rng.standard_normal((h, 33)).astype(np.float16)
    cap = rng.uniform(4, 12, h).astype(np.float32)
    docs = np.sort(rng.integers(0, 3, n)).astype(np.int32)
    gain, table, cap, docs = (xp.asarray(x) for x in (gain, table, cap, docs))

    def gain_and_table(score, b, hh, q, kk):
        return score * gain[hh] + table[hh, cuflash.minimum(cuflash.maximum(kk - q, -16), 16) + 16]

    def capped(score, b, hh, q, kk):
        return cap[hh] * cuflash.tanh(score / cap[hh])

    return {"gain and table, documents": ({"score_mod": gain_and_table, "causal": True,
                                            "mask_mod": lambda b, hh, q, kk: docs[q] == docs[kk]}, [gain, table]),
            "tanh cap per head": ({"score_mod": capped, "window": (48, 0)}, [cap]),
            "table twice, gain": ({"score_mod": gain_and_table}, [table, gain, table])}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
def test_gradients_of_captured_arrays_match_the_reference(dtype, d):
    """score_mod_grads through reads that add, multiply and go through tanh: each gradient in its
    array's dtype and shape, after dq, dk, dv (those as in the gallery's test), within four times
    the plain backward's relative error (its worst over dq, dk, dv) of the gradient's scale, plus a
    few ulps of the array's dtype, against the reference's backward from the kernels' out and lse;
    an array listed twice gets its gradient twice. Ragged N, every output poisoned before the
    kernels write it."""
    import cupy

    b, h, n = 2, 3, 150
    rng = np.random.default_rng(hash(("read grads", dtype, d)) % 2**32)
    q, k, v, dout = (random_array(rng, (b, h, n, d), dtype, scale=1.5) for _ in range(4))
    q64, k64, v64, dout64 = _host(q, k, v, dout)
    seed = int(rng.integers(2**31))
    on_host, on_gpu = _read_cases(np, h, n, np.random.default_rng(seed)), _read_cases(cupy, h, n, np.random.default_rng(seed))
    for name, (kw, arrays) in on_gpu.items():
        host_kw, host_arrays = on_host[name]
        plain_kw = {key: value for key, value in kw.items() if key in ("causal", "window")}
        plain_out, plain_lse = cuflash.attention(q, k, v, return_lse=True, **plain_kw)
        want_out, want_lse = reference.attention(q64, k64, v64, return_lse=True, **plain_kw)
        plain_want = reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse, **plain_kw)
        plain_errs = _grad_errors(cuflash.attention_backward(dout, q, k, v, plain_out, plain_lse, **plain_kw), plain_want)
        relative = max(e / max(np.abs(w).max(), 1e-30) for e, w in zip(plain_errs, plain_want))
        out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        with poisoned_allocations():
            got = cuflash.attention_backward(dout, q, k, v, out, lse, score_mod_grads=arrays, **kw)
        want_out, want_lse = reference.attention(q64, k64, v64, return_lse=True, **host_kw)
        want = reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse, score_mod_grads=host_arrays,
                                            **host_kw)
        assert len(got) == 3 + len(arrays), name
        _assert_grads_close(name, got[:3], want[:3], plain_errs, dtype)
        # the arrays' gradients against the reference's from the kernels' own out and lse (the
        # forward's rounding of out moves every dS by an ulp of out: the bound's ulps in bfloat16)
        want = reference.attention_backward(dout64, q64, k64, v64, *_host(out), cupy.asnumpy(lse).astype(np.float64),
                                            score_mod_grads=host_arrays, **host_kw)
        for i, (g, w, a) in enumerate(zip(got[3:], want[3:], arrays)):
            assert g.dtype == a.dtype and g.shape == a.shape, f"{name} gradient {i}"
            g = cupy.asnumpy(g).astype(np.float64)
            err = np.abs(g - w).max()
            atol = 4 * relative * np.abs(w).max() + 4 * eps(a.dtype.name) * max(1.0, np.abs(w).max())
            assert np.isfinite(g).all() and err <= atol, f"{name} gradient {i}: error {err:.3g} > {atol:.3g}"


def test_gradients_of_a_packed_batchs_table_match_the_reference():
    """score_mod_grads on packed sequences: the table's reads at positions in the packed arrays,
    each sequence's scores adding to it, against the reference (bounds as above)."""
    import cupy

    rng = np.random.default_rng(12)
    lengths = [70, 1, 0, 130, 57]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, h, d = int(cu[-1]), 2, 64
    q, k, v, dout = (random_array(rng, (h, total, d), "bfloat16", scale=1.5) for _ in range(4))
    q64, k64, v64, dout64 = _host(q, k, v, dout)
    table = rng.standard_normal((h, 41)).astype(np.float32)
    packed, host_packed = ({"cu_seqlens_q": x, "cu_seqlens_k": x, "causal": True} for x in (cupy.asarray(cu), cu))
    table_gpu = cupy.asarray(table)

    def on(t):
        return {"score_mod": lambda score, hh, qi, kj: score + t[hh, cuflash.minimum(qi - kj, 40)]}

    plain_out, plain_lse = cuflash.attention(q, k, v, return_lse=True, **packed)
    want_out, want_lse = reference.attention(q64, k64, v64, return_lse=True, **host_packed)
    plain_want = reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse, **host_packed)
    plain_errs = _grad_errors(cuflash.attention_backward(dout, q, k, v, plain_out, plain_lse, **packed), plain_want)
    relative = max(e / max(np.abs(w).max(), 1e-30) for e, w in zip(plain_errs, plain_want))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **packed, **on(table_gpu))
    with poisoned_allocations():
        *grads, dtable = cuflash.attention_backward(dout, q, k, v, out, lse, score_mod_grads=[table_gpu], **packed,
                                                    **on(table_gpu))
    want_out, want_lse = reference.attention(q64, k64, v64, return_lse=True, **host_packed, **on(table))
    *want, want_table = reference.attention_backward(dout64, q64, k64, v64, want_out, want_lse,
                                                     score_mod_grads=[table], **host_packed, **on(table))
    _assert_grads_close("packed, with the table's gradient", grads, want, plain_errs, "bfloat16")
    *_, want_table = reference.attention_backward(dout64, q64, k64, v64, *_host(out), cupy.asnumpy(lse).astype(np.float64),
                                                  score_mod_grads=[table], **host_packed, **on(table))
    err = np.abs(cupy.asnumpy(dtable).astype(np.float64) - want_table).max()
    assert err <= 4 * relative * np.abs(want_table).max() + 4 * eps("float32") * max(1.0, np.abs(want_table).max())


def test_packed_sequences_see_positions_in_the_packed_arrays():
    """With cu_seqlens the functions get positions along the packed axis, as the reference
    gives them: a document mask over the packed arrays equals the same sequences run apart."""
    import cupy

    rng = np.random.default_rng(5)
    lengths = [70, 1, 130, 57]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, h, d = int(cu[-1]), 2, 64
    q, k, v = (random_array(rng, (h, total, d), "bfloat16") for _ in range(3))
    docs = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    tables = {"gpu": cupy.asarray(docs), "host": docs}
    masks = {where: (lambda t: lambda hh, qi, kj: (t[qi] == t[kj]) & (kj <= qi))(t) for where, t in tables.items()}
    cu_gpu = cupy.asarray(cu)
    with poisoned_allocations():
        out = cuflash.attention(q, k, v, cu_seqlens_q=cu_gpu, cu_seqlens_k=cu_gpu, mask_mod=masks["gpu"])
    q64, k64, v64 = (cupy.asnumpy(x.astype(cupy.float32)).astype(np.float64) for x in (q, k, v))
    want = reference.attention(q64, k64, v64, cu_seqlens_q=cu, cu_seqlens_k=cu, mask_mod=masks["host"])
    apart = reference.attention(q64, k64, v64, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    np.testing.assert_allclose(want, apart, atol=1e-12)
    plain = cuflash.attention(q, k, v, cu_seqlens_q=cu_gpu, cu_seqlens_k=cu_gpu, causal=True)
    plain_err = np.abs(cupy.asnumpy(plain).astype(np.float64) - apart).max()
    err = np.abs(cupy.asnumpy(out).astype(np.float64) - want).max()
    assert err <= 2 * plain_err + 4 * eps("bfloat16") * max(1.0, np.abs(want).max())
    # and the backward: the document mask's gradients against the sequences' own
    dout = random_array(rng, (h, total, d), "bfloat16")
    (dout64,) = _host(dout)
    packed = {"cu_seqlens_q": cu_gpu, "cu_seqlens_k": cu_gpu}
    _, plain_lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **packed)
    plain_grads = cuflash.attention_backward(dout, q, k, v, plain, plain_lse, causal=True, **packed)
    _, lse = cuflash.attention(q, k, v, mask_mod=masks["gpu"], return_lse=True, **packed)
    with poisoned_allocations():
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=masks["gpu"], **packed)
    want_lse = reference.attention(q64, k64, v64, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, return_lse=True)[1]
    want = reference.attention_backward(dout64, q64, k64, v64, apart, want_lse, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        causal=True)
    _assert_grads_close("document mask, packed", grads, want, _grad_errors(plain_grads, want), "bfloat16")


def test_bad_functions_and_arrays_raise_before_any_launch(monkeypatch):
    """A function the tracer refuses, a captured NumPy array, scale 0 and score_mod_grads of
    arrays with no gradient (not read by score_mod, not float, no score_mod) raise, naming what
    is wrong, before any kernel runs."""
    import cupy

    from cuflash import _launch

    rng = np.random.default_rng(9)
    q, k, v = (random_array(rng, (1, 2, 40, 64), "float16") for _ in range(3))
    monkeypatch.setattr(_launch.Launch, "run", lambda *a, **kw: pytest.fail("a kernel was launched"))
    with pytest.raises(TypeError, match="if"):
        cuflash.attention(q, k, v, mask_mod=lambda b, h, qi, kj: qi >= kj if qi > 3 else qi < kj)
    table = np.zeros((2, 65), dtype=np.float32)
    with pytest.raises(TypeError, match="NumPy"):
        cuflash.attention(q, k, v, score_mod=gallery.relative_position(table))
    with pytest.raises(NotImplementedError, match="scale"):
        cuflash.attention(q, k, v, scale=0.0, score_mod=gallery.relative_position(cupy.asarray(table)))
    out, lse = q, q[..., 0].astype(cupy.float32)   # (refused before anything reads them)
    score_mod = gallery.relative_position(cupy.asarray(table))
    with pytest.raises(TypeError, match=r"score_mod_grads\[0\] is not an array that score_mod reads"):
        cuflash.attention_backward(q, q, k, v, out, lse, score_mod=score_mod, score_mod_grads=[cupy.asarray(table)])
    ids = cupy.zeros(4, dtype=cupy.int32)
    with pytest.raises(TypeError, match=r"score_mod_grads\[0\] .* has dtype int32"):
        cuflash.attention_backward(q, q, k, v, out, lse, score_mod=lambda s, b, h, i, j: s + ids[i % 4],
                                   score_mod_grads=[ids])
    with pytest.raises(ValueError, match="needs a score_mod"):
        cuflash.attention_backward(q, q, k, v, out, lse, mask_mod=lambda b, h, i, j: i >= j, score_mod_grads=[ids])
    with pytest.raises(NotImplementedError, match="softcap"):
        cuflash.attention_backward(q, q, k, v, out, lse, score_mod=score_mod, softcap=5.0,
                                   bias=cupy.zeros((40, 40), q.dtype), bias_grad=True)
    with pytest.raises(NotImplementedError, match="softcap"):
        cuflash.attention_vjp(q, k, v, score_mod=score_mod, softcap=5.0, bias=cupy.zeros((40, 40), q.dtype),
                              bias_grad=True)


def _block_mask_cases(xp, b, h, n, rng):
    """name: (mask function, the batch shape its block mask is built for); the functions of
    `functions` that take no score function, with the batch dims each depends on."""
    fns = functions(xp, b, h, n, rng)
    whole, per_batch = (b, h), (b, 1)
    return {"causal": (fns["causal"]["mask_mod"], (1, 1)),
            "sliding window": (fns["sliding window"]["mask_mod"], per_batch),
            "global tokens": (fns["global tokens"]["mask_mod"], (h,)),   # (fewer dims than the call)
            "prefix-LM": (fns["prefix-LM"]["mask_mod"], per_batch),
            "document": (fns["document"]["mask_mod"], per_batch),
            "no key for odd heads": (fns["no key for odd heads"]["mask_mod"], whole)}


@pytest.mark.parametrize("dtype, d", [("float16", 64), ("bfloat16", 128)])
@pytest.mark.parametrize("block", [(128, 128), (64, 32), (48, 80)])
def test_block_masks_skip_tiles_and_change_no_bit(dtype, d, block):
    """With block_mask= (cuflash.block_mask of the call's mask function) the kernels skip the
    tiles it leaves empty and test none in the full ones: out, lse, dq, dk and dv bit for bit
    those of the same call with mask_mod alone (an empty tile adds exact zeros), and out against
    the reference; blocks that do not line up with the kernels' tiles, ragged Nq != Nk, a block
    mask broadcast over batch dims, heads that see no key at all; outputs poisoned."""
    import cupy

    b, h, nq, nk = 2, 3, 333, 290
    rng = np.random.default_rng(hash(("block", dtype, d, block)) % 2**32)
    q = random_array(rng, (b, h, nq, d), dtype, scale=2.0)
    k, v = (random_array(rng, (b, h, nk, d), dtype, scale=2.0) for _ in range(2))
    dout = random_array(rng, (b, h, nq, d), dtype)
    q64, k64, v64 = _host(q, k, v)
    seed = int(rng.integers(2**31))
    on_host = _block_mask_cases(np, b, h, max(nq, nk), np.random.default_rng(seed))
    for name, (mask_mod, batch) in _block_mask_cases(cupy, b, h, max(nq, nk), np.random.default_rng(seed)).items():
        blocks = cuflash.block_mask(mask_mod, batch, nq, nk, block=block)
        kinds = blocks.kinds.get()
        out, lse = cuflash.attention(q, k, v, mask_mod=mask_mod, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=mask_mod)
        with poisoned_allocations():
            got, got_lse = cuflash.attention(q, k, v, block_mask=blocks, return_lse=True)
            got_grads = cuflash.attention_backward(dout, q, k, v, got, got_lse, block_mask=blocks)
        for label, x, y in zip(("out", "lse", "dq", "dk", "dv"), (got, got_lse, *got_grads), (out, lse, *grads)):
            assert cupy.array_equal(x, y, equal_nan=True), f"{name} {block}: {label} differs ({kinds.min()}..{kinds.max()})"
        want = reference.attention(q64, k64, v64, mask_mod=on_host[name][0])
        err = np.abs(cupy.asnumpy(got).astype(np.float64) - want).max()
        assert err <= 8 * eps(dtype) * max(1.0, np.abs(want).max()), f"{name} {block}: error {err:.3g}"


def test_block_masks_over_packed_sequences():
    """A document mask's block mask over packed arrays (positions along the packed axis): the
    same bits as the call with mask_mod alone, forward and backward."""
    import cupy

    rng = np.random.default_rng(8)
    lengths = [170, 1, 230, 57, 300]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    total, h, d = int(cu[-1]), 2, 64
    q, k, v, dout = (random_array(rng, (h, total, d), "float16") for _ in range(4))
    docs = cupy.asarray(np.repeat(np.arange(len(lengths)), lengths).astype(np.int32))

    def mask_mod(hh, qi, kj):
        return (docs[qi] == docs[kj]) & (kj <= qi)

    packed = {"cu_seqlens_q": cu, "cu_seqlens_k": cu}
    blocks = cuflash.block_mask(mask_mod, (1,), total, total, block=(64, 64))
    assert {0, 1, 2} <= set(np.unique(blocks.kinds.get()).tolist())
    out, lse = cuflash.attention(q, k, v, mask_mod=mask_mod, return_lse=True, **packed)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=mask_mod, **packed)
    with poisoned_allocations():
        got, got_lse = cuflash.attention(q, k, v, block_mask=blocks, return_lse=True, **packed)
        got_grads = cuflash.attention_backward(dout, q, k, v, got, got_lse, block_mask=blocks, **packed)
    for label, x, y in zip(("out", "lse", "dq", "dk", "dv"), (got, got_lse, *got_grads), (out, lse, *grads)):
        assert cupy.array_equal(x, y, equal_nan=True), label


def test_a_block_mask_that_does_not_fit_raises_before_any_launch(monkeypatch):
    """A block mask for other sizes or a batch that does not broadcast, the reference's (NumPy)
    block mask, a different mask_mod beside it: refused before any kernel runs."""
    import cupy

    from cuflash import _launch

    rng = np.random.default_rng(10)
    q, k, v = (random_array(rng, (2, 2, 40, 64), "float16") for _ in range(3))

    def mask_mod(b, h, qi, kj):
        return kj <= qi

    good = cuflash.block_mask(mask_mod, (2, 2), 40, 40)
    cupy.cuda.get_current_stream().synchronize()
    monkeypatch.setattr(_launch.Launch, "run", lambda *a, **kw: pytest.fail("a kernel was launched"))
    out, lse = q, q[..., 0].astype(cupy.float32)   # (refused before anything reads them)
    refused = [
        (ValueError, "built for", {"block_mask": reference.block_mask(mask_mod, (2, 2), 40, 48)}),
        (ValueError, "does not broadcast", {"block_mask": reference.block_mask(mask_mod, (3, 2), 40, 40)}),
        (TypeError, "not a CuPy array", {"block_mask": reference.block_mask(mask_mod, (2, 2), 40, 40)}),
        (ValueError, "not the function", {"block_mask": good, "mask_mod": lambda b, h, qi, kj: kj <= qi}),
    ]
    for error, message, kw in refused:
        with pytest.raises(error, match=message):
            cuflash.attention(q, k, v, **kw)
        with pytest.raises(error, match=message):
            cuflash.attention_backward(q, q, k, v, out, lse, **kw)


def test_attention_vjp_starts_the_backward_compiles_before_the_forward_runs(monkeypatch):
    """With a function new to the process, attention_vjp has the backward's dk/dv and dq kernels
    compiling (or compiled) on other threads when its forward starts, those the backward then
    takes; its gradients those of attention_backward."""
    import cupy

    from cuflash import _compile

    offset = float(np.random.default_rng().integers(1, 2**20))   # a new function: a new source
    score_mod = lambda s, b, h, q, k: s - (q - k) * (1.0 / offset)   # noqa: E731
    rng = np.random.default_rng(7)
    q, k, v, dout = (random_array(rng, (1, 2, 160, 64), "bfloat16") for _ in range(4))
    asked = []
    monkeypatch.setattr(_compile, "compile_soon", lambda names, user, soon=_compile.compile_soon:
                        (asked.append(tuple(names)), soon(names, user))[1])
    forward = []
    get_function = _compile.get_function
    monkeypatch.setattr(_compile, "get_function", lambda name, smem, user=None:
                        (forward.append((name, len(asked))), get_function(name, smem, user))[1])
    out, vjp = cuflash.attention_vjp(q, k, v, score_mod=score_mod)
    assert len(asked) == 1 and len(asked[0]) == 2, asked
    assert forward and all(n == 1 for _, n in forward)   # (the forward's kernel asked after them)
    forward.clear()
    grads = vjp(dout)
    backward_names = {name for name, _ in forward if "UserScores" in name}
    assert backward_names == set(asked[0])
    _, lse = cuflash.attention(q, k, v, score_mod=score_mod, return_lse=True)
    want = cuflash.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod)
    for got, ref in zip(grads, want):
        cupy.testing.assert_array_equal(got, ref)
