"""cuflash.merge_attention on the GPU against the float64 reference (docs/contract.md: merging)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GPU_MISSING, assert_close_to_reference, assert_lse_close, poisoned_allocations, random_array, requires_gpu
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = requires_gpu

if GPU_MISSING is None:
    import cupy
    import ml_dtypes  # noqa: F401

    import cuflash
    from cuflash import naive, reference

DTYPES = ("float16", "bfloat16", "float32")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    nk=st.integers(1, 300),
    parts=st.integers(1, 5),
    dv=st.sampled_from((8, 64, 100, 256)),
    as_array=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_merge_of_disjoint_key_sets_is_attention_over_their_union(dtype, nk, parts, dv, as_array, seed):
    """Attention over each part of a random partition of the keys (parts may be empty), merged,
    against the reference's attention over all keys, under the forward's criterion."""
    rng = np.random.default_rng(seed)
    q = random_array(rng, (2, 3, 40, 64), dtype, 2.0)
    k = random_array(rng, (2, 3, nk, 64), dtype)
    v = random_array(rng, (2, 3, nk, dv), dtype)
    owner = rng.integers(0, parts, size=nk)
    outs, lses = [], []
    for p in range(parts):
        keys = cupy.asarray(np.flatnonzero(owner == p))
        o, lse = cuflash.attention(q, k[..., keys, :], v[..., keys, :], return_lse=True)
        outs.append(o)
        lses.append(lse)
    if as_array:
        outs, lses = cupy.stack(outs), cupy.stack(lses)
    with poisoned_allocations():
        out, lse = cuflash.merge_attention(outs, lses)
    host = [cupy.asnumpy(x) for x in (q, k, v)]
    ref, ref_lse = reference.attention(*host, return_lse=True)
    assert out.dtype == q.dtype and out.shape == ref.shape and lse.dtype == np.float32
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(naive.attention(q, k, v)), ref, q.dtype, c=2)
    assert_lse_close(cupy.asnumpy(lse), ref_lse)


def test_merge_against_the_reference_with_rows_without_keys():
    rng = np.random.default_rng(0)
    outs = rng.standard_normal((3, 2, 50, 32)).astype(np.float32)
    lses = (rng.standard_normal((3, 2, 50)) * 30).astype(np.float32)
    lses[:, :, :5] = -np.inf           # rows without keys in any part
    lses[1, :, 5:10] = -np.inf         # rows without keys in one part
    out, lse = cuflash.merge_attention(cupy.asarray(outs), cupy.asarray(lses))
    want, want_lse = reference.merge_attention(outs, lses)
    np.testing.assert_allclose(cupy.asnumpy(out), want, rtol=1e-5, atol=1e-5)
    assert (cupy.asnumpy(out)[:, :5] == 0).all()
    assert_lse_close(cupy.asnumpy(lse), want_lse)


def test_merge_argument_errors():
    o = cupy.zeros((2, 10, 8), dtype=cupy.float16)
    x = cupy.zeros((2, 10), dtype=cupy.float32)
    with pytest.raises(ValueError, match="at least one part"):
        cuflash.merge_attention([], [])
    with pytest.raises(ValueError, match="same number of parts"):
        cuflash.merge_attention([o, o], [x])
    with pytest.raises(ValueError, match=r"lses\[0\] must be float32"):
        cuflash.merge_attention([o], [x.astype(cupy.float16)])
    with pytest.raises(ValueError, match="shape"):
        cuflash.merge_attention([o, o[:, :5]], [x, x])
    with pytest.raises(TypeError, match="cupy.ndarray"):
        cuflash.merge_attention([np.zeros((2, 10, 8))], [x])


def test_merge_argument_errors_are_those_of_the_reference():
    """The same bad parts give the same ValueError on the GPU and in cuflash.reference (one check,
    cuflash._checks.merge_parts)."""
    from test_reference import MERGE_ERRORS

    def on_gpu(given, dtype):
        if isinstance(given, list):
            return [cupy.asarray(x, dtype=dtype) for x in given]
        return cupy.asarray(given, dtype=dtype)

    for (outs, lses), message in MERGE_ERRORS:
        for merge, args in ((reference.merge_attention, (outs, lses)),
                            (cuflash.merge_attention, (on_gpu(outs, cupy.float16), on_gpu(lses, cupy.float32)))):
            with pytest.raises(ValueError) as err:
                merge(*args)
            assert str(err.value) == message, merge
