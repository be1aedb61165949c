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
    s = cupy.matmul(q, cupy.swapaxes(k, -1, -2)).astype(cupy.float32) * cupy.float32(scale)
    if left is not None or right is not None:
        s = cupy.where(cupy.asarray(allowed(nq, nk, left, right)), s, cupy.float32(-cupy.inf))
    m = s.max(axis=-1, keepdims=True)
    m = cupy.where(cupy.isfinite(m), m, cupy.float32(0))
    p = cupy.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    p = p / cupy.where(total > 0, total, cupy.float32(1))
    out = cupy.matmul(p.astype(v.dtype), v)
    if return_lse:
        lse = cupy.where(total[..., 0] > 0, cupy.log(total[..., 0]) + m[..., 0], cupy.float32(-cupy.inf))
        return out, lse
    return out
