"""Plain CuPy attention: matmul, float32 softmax, matmul, with the full score matrix.

The baseline that benchmarks time cuflash against, and the "naive" result of
the numerical criterion (an error up to twice the naive one is accepted).
"""

from __future__ import annotations

import math

from ._mask import allowed, normalize_window


def attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False):
    """Same arguments as ``cuflash.attention``; stores the (Nq, Nk) scores in device memory."""
    import cupy

    left, right = normalize_window(causal, window)
    nq, d = q.shape[-2:]
    nk = k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    s = _matmul(q, cupy.swapaxes(k, -1, -2)).astype(cupy.float32) * cupy.float32(scale)
    if left is not None or right is not None:
        s = cupy.where(cupy.asarray(allowed(nq, nk, left, right)), s, cupy.float32(-cupy.inf))
    m = s.max(axis=-1, keepdims=True)
    m = cupy.where(cupy.isfinite(m), m, cupy.float32(0))
    p = cupy.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    p = p / cupy.where(total > 0, total, cupy.float32(1))
    out = _matmul(p.astype(v.dtype), v)
    if return_lse:
        lse = cupy.where(total[..., 0] > 0, cupy.log(total[..., 0]) + m[..., 0], cupy.float32(-cupy.inf))
        return out, lse
    return out


def _matmul(a, b):
    """a @ b in the inputs' dtype. CuPy has no bfloat16 matmul: there the
    product runs in float32 on the bfloat16 values and is rounded back, as a
    bfloat16 GEMM with float32 accumulation does."""
    import cupy

    if a.dtype.name == "bfloat16":
        return cupy.matmul(a.astype(cupy.float32), b.astype(cupy.float32)).astype(a.dtype)
    return cupy.matmul(a, b)
