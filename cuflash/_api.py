"""The public GPU functions."""

from __future__ import annotations

from . import _checks, _plans


def attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False):
    """Exact attention ``softmax(scale * q @ k^T + mask) @ v`` on the GPU.

    A fused FlashAttention kernel: q, k and v stream through on-chip memory in
    tiles and the ``(Nq, Nk)`` score matrix is never stored, so memory is
    linear in sequence length.

    Parameters
    ----------
    q : cupy.ndarray, shape (..., Nq, D)
    k : cupy.ndarray, shape (..., Nk, D)
    v : cupy.ndarray, shape (..., Nk, Dv)
        One dtype for all three: float16, bfloat16 or float32. D and Dv are
        any size up to 256 and may differ (sizes that are not a multiple of 8
        are zero-padded into a copy, which changes no result). Leading dims
        broadcast as in NumPy, which is how batches, heads and grouped-query
        attention are written: k, v of shape (B, Hkv, 1, Nk, D) against q of
        shape (B, Hkv, G, Nq, D). Views with a contiguous last axis (a (B, N, H, D)
        array transposed to (B, H, N, D), slices) are read in place.
    causal : bool, optional
        Row i sees key j only if ``j <= i + Nk - Nq`` (aligned to the
        bottom-right corner, as in FlashAttention-2). For Nq = 3, Nk = 5::

            1 1 1 0 0
            1 1 1 1 0
            1 1 1 1 1

    window : (left, right), optional
        Sliding window: row i sees keys ``i + off - left <= j <= i + off + right``
        with ``off = Nk - Nq``; either side may be None (unbounded). With
        ``causal=True``, right is 0.
    scale : float, optional
        Multiplies the scores; defaults to ``1 / sqrt(D)``.
    return_lse : bool, optional
        Also return the log-sum-exp of each row's scaled, masked scores.

    Returns
    -------
    out : cupy.ndarray, shape broadcast(batch dims) + (Nq, Dv), the input dtype
    lse : cupy.ndarray, shape broadcast(batch dims) + (Nq,), float32
        Only with ``return_lse=True``. A row that sees no key gets out 0 and
        lse -inf.

    See Also
    --------
    cuflash.reference.attention : the NumPy float64 version of the same function.
    docs/contract.md : what the library promises (shapes, masks, accuracy, errors).
    """
    plan, inputs = _plans.forward(q, k, v, causal, window, scale)
    cupy = _checks.require_cupy()
    with cupy.cuda.Device(plan.device):
        out = cupy.empty(plan.shapes[0], dtype=inputs[0].dtype)
        lse = cupy.empty(plan.shapes[1], dtype=cupy.float32)
        for launch in plan.launches:
            launch.run(inputs + (out, lse))
        if out.shape[-1] != v.shape[-1]:   # dv padded for the kernels: the padding columns are 0
            out = cupy.ascontiguousarray(out[..., : v.shape[-1]])
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, scale=None):
    """Gradients of ``attention`` with respect to q, k and v.

    Recomputes the scores block by block from q, k and the forward's ``lse``;
    extra device memory is O(N). Deterministic: the same inputs give bitwise
    identical gradients.

    Parameters
    ----------
    dout : cupy.ndarray, shape broadcast(batch dims) + (Nq, Dv)
        Gradient of the loss with respect to ``out``.
    q, k, v, causal, window, scale
        As given to ``attention``.
    out, lse : cupy.ndarray
        The forward's results (``attention(..., return_lse=True)``).

    Returns
    -------
    dq, dk, dv : cupy.ndarray
        Shapes and dtypes of q, k, v; the gradient of a broadcast input is
        summed over the dims it was broadcast along.

    See Also
    --------
    cuflash.reference.attention_backward : the NumPy float64 version.
    """
    orig = (q, k, v)
    plan, (q, k, v, out, lse, dout) = _plans.backward(dout, q, k, v, out, lse, causal, window, scale)
    cupy = _checks.require_cupy()
    # With no query or no key nothing flows back: every gradient is zero (or empty) and no kernel runs.
    alloc = cupy.empty if plan.launches else cupy.zeros
    with cupy.cuda.Device(plan.device):
        dq, dk, dv = (alloc(shape, dtype=q.dtype) for shape in plan.shapes[:3])
        if plan.launches:
            delta = cupy.empty(plan.shapes[3], dtype=cupy.float32)
            for launch in plan.launches:
                launch.run((q, k, v, out, lse, dout, delta, dq, dk, dv))
        return tuple(_gradient_of(cupy, g, x) for g, x in zip((dq, dk, dv), orig))


def _gradient_of(cupy, g, x):
    """The gradient of input x from the kernels' g: the head dim's padding sliced off,
    and summed (in float32) over the dims along which x was broadcast."""
    if g.shape == x.shape:   # the usual case, at no cost
        return g
    g = g[..., : x.shape[-1]]
    if g.shape == x.shape:
        return cupy.ascontiguousarray(g)
    return _checks.sum_to_shape(g.astype(cupy.float32), x.shape).astype(g.dtype)


def attention_vjp(q, k, v, *, causal=False, window=None, scale=None):
    """Forward pass plus a closure for its vector-Jacobian product.

    For people writing their own autodiff: ``out, vjp = attention_vjp(q, k, v)``
    runs ``attention`` and keeps only what the backward needs (q, k, v, out
    and the per-row logsumexp, O(N) extra); ``dq, dk, dv = vjp(dout)`` then
    runs ``attention_backward``. The closure may be called more than once.

    Returns
    -------
    out : cupy.ndarray
        As from ``attention``.
    vjp : callable
        ``vjp(dout) -> (dq, dk, dv)``, with the shapes and dtypes of q, k, v.
    """
    mask = {"causal": causal, "window": window, "scale": scale}
    out, lse = attention(q, k, v, return_lse=True, **mask)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, **mask)

    return out, vjp
