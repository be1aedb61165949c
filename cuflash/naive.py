"""Plain CuPy attention: matmul, float32 softmax, matmul, with the full score matrix.

The baseline that benchmarks time cuflash against, and the "naive" result of
the accuracy criterion (docs/contract.md: an error up to twice the naive one is
accepted). CuPy's matmul needs cuBLAS, which the kernels do not: the cuda12 and
cuda13 extras install it.
"""

from __future__ import annotations

import math

from ._mask import allowed, normalize_window


def attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False, softcap=None, alibi_slopes=None,
              sinks=None):
    """Same arguments as ``cuflash.attention``; stores the (Nq, Nk) scores in device memory."""
    import cupy

    s = _scores(q, k, causal, window, scale, softcap, alibi_slopes)
    m = s.max(axis=-1, keepdims=True)
    z = None if sinks is None else cupy.asarray(sinks, dtype=cupy.float32)[..., None, None]
    if z is not None:
        m = cupy.maximum(m, z)
    m = cupy.where(cupy.isfinite(m), m, cupy.float32(0))
    p = cupy.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    if z is not None:
        total = total + cupy.exp(z - m)
    p = p / cupy.where(total > 0, total, cupy.float32(1))
    out = _matmul(p.astype(v.dtype), v)
    if return_lse:
        lse = cupy.where(total[..., 0] > 0, cupy.log(total[..., 0]) + m[..., 0], cupy.float32(-cupy.inf))
        return out, lse
    return out


def _scale(q, scale):
    d = q.shape[-1]
    if scale is None:
        return 1.0 / math.sqrt(d) if d else 1.0
    return scale


def _scores(q, k, causal, window, scale, softcap=None, alibi_slopes=None):
    """scale * q k^T in float32 (the product in the inputs' dtype), through the modifiers,
    -inf where masked."""
    import cupy

    left, right = normalize_window(causal, window)
    nq, nk = q.shape[-2], k.shape[-2]
    s = _matmul(q, cupy.swapaxes(k, -1, -2)).astype(cupy.float32) * cupy.float32(_scale(q, scale))
    if softcap:
        s = cupy.float32(softcap) * cupy.tanh(s / cupy.float32(softcap))
    if alibi_slopes is not None:
        distance = cupy.abs(cupy.arange(nq)[:, None] + (nk - nq) - cupy.arange(nk)[None, :]).astype(cupy.float32)
        s = s - cupy.asarray(alibi_slopes, dtype=cupy.float32)[..., None, None] * distance
    if left is not None or right is not None:
        s = cupy.where(cupy.asarray(allowed(nq, nk, left, right)), s, cupy.float32(-cupy.inf))
    return s


def _matmul(a, b):
    """a @ b in the inputs' dtype. CuPy has no bfloat16 matmul: there the
    product runs in float32 on the bfloat16 values and is rounded back, as a
    bfloat16 GEMM with float32 accumulation does."""
    import cupy

    if a.dtype.name == "bfloat16":
        return cupy.matmul(a.astype(cupy.float32), b.astype(cupy.float32)).astype(a.dtype)
    return cupy.matmul(a, b)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, scale=None, softcap=None,
                       alibi_slopes=None, sinks=None):
    """The matmul/softmax chain differentiated by hand, in the inputs' dtype
    (softmax and its gradient in float32), with the full (Nq, Nk) matrices.
    Assumes q, k, v share their batch shape (no broadcasting). With ``sinks``, returns
    dsinks (per batch entry, not summed) after dq, dk, dv."""
    import cupy

    scale = _scale(q, scale)
    s = _scores(q, k, causal, window, scale, softcap, alibi_slopes)
    lse_ = cupy.where(cupy.isfinite(lse), lse, cupy.float32(cupy.inf))[..., None]
    p = cupy.exp(s - lse_)
    p_t = p.astype(q.dtype)
    dv = _matmul(cupy.swapaxes(p_t, -1, -2), dout)
    dp = _matmul(dout, cupy.swapaxes(v, -1, -2)).astype(cupy.float32)
    delta = (dout.astype(cupy.float32) * out.astype(cupy.float32)).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    if softcap:
        th = cupy.tanh(_scores(q, k, False, None, scale) / cupy.float32(softcap))
        ds = ds * (1 - th * th)
    ds = (ds * cupy.float32(scale)).astype(q.dtype)
    dq = _matmul(ds, k)
    dk = _matmul(cupy.swapaxes(ds, -1, -2), q)
    if sinks is None:
        return dq, dk, dv
    z = cupy.asarray(sinks, dtype=cupy.float32)[..., None]
    return dq, dk, dv, -(cupy.exp(z - lse) * delta[..., 0]).sum(axis=-1)
