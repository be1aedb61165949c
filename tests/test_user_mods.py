"""cuflash.attention with its own score and mask functions (score_mod, mask_mod) on the GPU,
against cuflash.reference running the same functions: the gallery of examples/score_functions.py
and functions that read head indices and captured CuPy tables."""

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


def test_bad_functions_and_arrays_raise_before_any_launch(monkeypatch):
    """A function the tracer refuses, a captured NumPy array and scale 0 raise, naming what is
    wrong, before any kernel runs."""
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
