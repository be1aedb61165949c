"""NumPy float64 reference for cuflash: the test oracle, usable without a GPU or CuPy.

`attention` and `attention_backward` have the signatures and semantics of
`cuflash.attention` and `cuflash.attention_backward` (masks, broadcasting, fully masked rows),
but take NumPy arrays and compute everything in float64 with the full score matrix, packed
variable-length sequences (``cu_seqlens_q``, ``cu_seqlens_k``; docs/contract.md) included.

`tiled_attention` computes the same forward the way the GPU kernel does: blocks of query rows,
key blocks skipped outside the mask band, an online softmax in the log2 domain, masks applied
only on blocks that need them. It exists so the kernel's algorithm can be checked on the CPU,
separately from CUDA details.

Inputs of any real dtype are accepted (including ``ml_dtypes.bfloat16``); they are converted
with ``.astype(np.float64)`` and the results are float64.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ._checks import (
    check_backward_arrays, check_flag, check_num_splits, check_scale, check_shapes, host_cache_seqlens,
    kvcache_lengths, kvcache_shapes, merge_parts, packed_sequences, sum_to_shape,
)
from ._mask import block_allowed, block_needs_mask, key_range, normalize_window

__all__ = ["attention", "attention_backward", "attention_kvcache", "merge_attention", "tiled_attention"]

_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------
# Argument handling
# ---------------------------------------------------------------------------------------------


def _as_float64(name: str, x) -> np.ndarray:
    """Convert one array argument to float64, rejecting types that are not real numbers."""
    if type(x).__module__.split(".")[0] == "cupy":
        raise TypeError(
            f"{name} must be a NumPy array, got a CuPy array; convert it with {name}.get() "
            f"or cupy.asnumpy({name})"
        )
    x = np.asarray(x)
    kind = x.dtype.kind
    # ml_dtypes' bfloat16 / float8 types report kind 'V'; plain structured dtypes do too but
    # cannot be converted and fail just below.
    if kind not in "fiuV":
        raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
    try:
        return x.astype(np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}") from err


def _check_inputs(q, k, v, scale):
    """Validate q, k, v and scale; return float64 arrays, the batch shape and the scale."""
    q = _as_float64("q", q)
    k = _as_float64("k", k)
    v = _as_float64("v", v)
    batch = check_shapes(q.shape, k.shape, v.shape)
    return q, k, v, batch, check_scale(scale, q.shape[-1])


def _scores(q, k, batch, scale, left, right):
    """The scaled score matrix with disallowed entries set to -inf: shape batch + (Nq, Nk).

    ``batch`` is the broadcast batch shape of q, k and v; it may have more dims than q and k
    (when only v has them), so the scores are broadcast to it explicitly.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    s = scale * (q @ np.swapaxes(k, -1, -2))
    s = np.where(block_allowed(0, nq, 0, nk, nq, nk, left, right), s, -np.inf)
    return np.broadcast_to(s, batch + (nq, nk))


def _packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check):
    """The (q0, q1, k0, k1) row ranges of packed sequences, or None for one dense problem."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together: give both or neither")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _as_host(name, cu)
    return packed_sequences(cu_seqlens_q, cu_seqlens_k, q.shape[-2], k.shape[-2], max_seqlen_q, max_seqlen_k,
                            bool(check))


def _per_sequence(forward, q, k, v, batch, packed, **keywords):
    """out and lse of a packed call, ``forward`` (`attention` or `tiled_attention`) run on each
    sequence's rows and keys; rows that no sequence owns give 0 and -inf."""
    out = np.zeros(batch + (q.shape[-2], v.shape[-1]))
    lse = np.full(batch + (q.shape[-2],), -np.inf)
    for q0, q1, k0, k1 in packed:
        out[..., q0:q1, :], lse[..., q0:q1] = forward(
            q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :], return_lse=True, **keywords)
    return out, lse


def _as_host(name: str, x) -> None:
    if type(x).__module__.split(".")[0] == "cupy":
        raise TypeError(f"{name} must be a NumPy array, got a CuPy array; convert it with {name}.get()")


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, check=True):
    """Exact attention ``softmax(scale * q @ k^T + mask) @ v`` in float64.

    The NumPy twin of `cuflash.attention`, used as its test oracle.

    Parameters
    ----------
    q : array_like, shape (..., Nq, D)
        Queries.
    k : array_like, shape (..., Nk, D)
        Keys.
    v : array_like, shape (..., Nk, Dv)
        Values. ``Dv`` may differ from ``D``.

        The leading (batch) dims of q, k and v broadcast NumPy-style: k and v of shape
        ``(B, Hkv, 1, Nk, D)`` against q of shape ``(B, Hkv, G, Nq, D)`` is grouped-query
        attention. Any real dtype is accepted and converted to float64.
    causal : bool, optional
        Mask keys in each query's future, aligned to the bottom-right corner of the score
        matrix (FlashAttention-2 convention). With ``off = Nk - Nq``, row ``i`` may attend
        key ``j`` iff ``j <= i + off``. For ``Nq = 3, Nk = 5`` and ``Nq = 5, Nk = 3``::

            Nq=3, Nk=5      Nq=5, Nk=3
            1 1 1 0 0       0 0 0
            1 1 1 1 0       0 0 0
            1 1 1 1 1       1 0 0
                            1 1 0
                            1 1 1

    window : None or (left, right), optional
        Sliding window: row ``i`` may attend key ``j`` iff
        ``i + off - left <= j <= i + off + right``; either side may be ``None`` (unbounded).
        Combined with ``causal=True``, ``right`` is 0.
    scale : float, optional
        Multiplier of the scores; defaults to ``1 / sqrt(D)``.
    return_lse : bool, optional
        Also return the logsumexp of each row's scaled, masked scores.
    cu_seqlens_q, cu_seqlens_k : int32 ndarray of shape (S + 1,), optional (both or neither)
        Packed variable-length sequences along axis -2: sequence ``s`` owns query rows
        ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``
        and attends only its own keys; masks apply per sequence, with
        ``off_s = Nk_s - Nq_s``. Rows of an empty key range give 0 and lse ``-inf``.
    max_seqlen_q, max_seqlen_k : int, optional
        Upper bounds on the sequences' lengths (checked with ``check=True``).
    check : bool, optional
        Validate the offsets (start at 0, never decrease, end at the arrays' lengths), raising
        ValueError at the first bad position. ``check=False`` clamps every offset to
        ``[0, total]`` instead; rows no sequence owns give 0 and lse ``-inf``.

    Returns
    -------
    out : ndarray of float64, shape broadcast(batch dims) + (Nq, Dv)
        A query row with no key to attend gives 0.
    lse : ndarray of float64, shape broadcast(batch dims) + (Nq,)
        Only with ``return_lse=True``: ``log(sum_j exp(scale * q_i . k_j))`` (natural log)
        over the allowed keys; ``-inf`` for a row with no key to attend.

    See Also
    --------
    cuflash.attention : the same on the GPU, for CuPy arrays.
    tiled_attention : the same computed block by block, as the GPU kernel does.
    """
    left, right = normalize_window(causal, window)
    q, k, v, batch, scale = _check_inputs(q, k, v, scale)
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    packed = _packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check)
    if packed is not None:
        out, lse = _per_sequence(attention, q, k, v, batch, packed, causal=causal, window=window, scale=scale)
        return (out, lse) if return_lse else out

    if nk == 0:
        out = np.zeros(batch + (nq, dv))
        lse = np.full(batch + (nq,), -np.inf)
        return (out, lse) if return_lse else out

    s = _scores(q, k, batch, scale, left, right)
    # Stable softmax: subtract the row max; a fully masked row has max -inf and uses 0 instead,
    # so that all its exp() are exp(-inf) = 0 rather than NaN.
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    has_keys = l > 0
    out = np.divide(p @ v, l, out=np.zeros(batch + (nq, dv)), where=has_keys)
    if not return_lse:
        return out
    log_l = np.log(l, out=np.full(l.shape, -np.inf), where=has_keys)
    lse = (m + log_l)[..., 0]
    return out, lse


def tiled_attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False,
                    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, check=True,
                    block_m=64, block_n=64):
    """The forward as the GPU kernel computes it, in NumPy float64.

    For each block of ``block_m`` query rows (vectorised over the batch dims):

    1. ``lo, hi = key_range(...)``; key blocks outside ``[lo, hi)`` are never visited.
    2. Walk key blocks of ``block_n`` keys, starting at the block containing ``lo``. Scores are
       kept in the log2 domain, ``s = (q @ k^T) * scale * log2(e)``; only blocks that touch a
       band edge or run past ``Nk`` (`block_needs_mask`) get a mask (-inf).
    3. Online softmax with running row max ``m_i`` and running row sum ``l_i``::

           m_new = max(m_i, rowmax(s))
           alpha = exp2(m_i - m_new)        # 1 unless the max grew
           p     = exp2(s - m_new)
           l_i   = alpha * l_i + rowsum(p)
           acc   = alpha * acc + p @ v

       A row whose max is still -inf subtracts 0 instead of ``m_new``, so no NaN appears.
    4. ``out = acc / l_i`` and ``lse = (m_i + log2(l_i)) * ln(2)``; rows with ``l_i == 0``
       give 0 and -inf.

    Packed sequences (``cu_seqlens_q``, ``cu_seqlens_k``) run this on each sequence in turn, as
    in `attention`.

    Parameters
    ----------
    q, k, v, causal, window, scale, return_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check
        As in `attention`.
    block_m : int, optional
        Query rows per block.
    block_n : int, optional
        Keys per block.

    Returns
    -------
    out : ndarray of float64, shape broadcast(batch dims) + (Nq, Dv)
    lse : ndarray of float64, shape broadcast(batch dims) + (Nq,)
        Only with ``return_lse=True``.

    See Also
    --------
    attention : the direct computation this must agree with.
    """
    left, right = normalize_window(causal, window)
    q, k, v, batch, scale = _check_inputs(q, k, v, scale)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (numbers.Integral, np.integer)) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    block_m, block_n = int(block_m), int(block_n)
    packed = _packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check)
    if packed is not None:
        out, lse = _per_sequence(tiled_attention, q, k, v, batch, packed, causal=causal, window=window, scale=scale,
                                 block_m=block_m, block_n=block_n)
        return (out, lse) if return_lse else out

    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    q = np.broadcast_to(q, batch + (nq, d))
    k = np.broadcast_to(k, batch + (nk, d))
    v = np.broadcast_to(v, batch + (nk, dv))
    scale_log2 = scale * _LOG2E

    out = np.zeros(batch + (nq, dv))
    lse = np.full(batch + (nq,), -np.inf)

    for row_start in range(0, nq, block_m):
        row_stop = min(row_start + block_m, nq)
        rows = row_stop - row_start
        q_blk = q[..., row_start:row_stop, :]
        m_i = np.full(batch + (rows,), -np.inf)
        l_i = np.zeros(batch + (rows,))
        acc = np.zeros(batch + (rows, dv))

        lo, hi = key_range(row_start, row_stop, nq, nk, left, right)
        first = (lo // block_n) * block_n if hi > lo else hi
        for col_start in range(first, hi, block_n):
            col_stop = col_start + block_n
            # Like the kernel, a block always holds block_n keys; those past Nk are padding
            # (zeros here) that the mask removes.
            k_blk = np.zeros(batch + (block_n, d))
            v_blk = np.zeros(batch + (block_n, dv))
            valid = min(col_stop, nk) - col_start
            k_blk[..., :valid, :] = k[..., col_start:col_start + valid, :]
            v_blk[..., :valid, :] = v[..., col_start:col_start + valid, :]

            # s = q k^T * scale * log2(e)   [batch, rows, block_n]
            s = (q_blk @ np.swapaxes(k_blk, -1, -2)) * scale_log2
            if block_needs_mask(row_start, row_stop, col_start, col_stop, nq, nk, left, right):
                mask = block_allowed(row_start, row_stop, col_start, col_stop, nq, nk, left, right)
                s = np.where(mask, s, -np.inf)

            # m_new = max(m_i, rowmax(s)); a row still at -inf subtracts 0 instead.
            m_new = np.maximum(m_i, s.max(axis=-1))
            base = np.where(m_new == -np.inf, 0.0, m_new)
            # alpha = exp2(m_old - m_new) rescales what was accumulated under the old max.
            alpha = np.exp2(m_i - base)
            # p = exp2(s - m_new)
            p = np.exp2(s - base[..., None])
            # l_i = alpha * l_i + rowsum(p);  acc = alpha * acc + p v
            l_i = alpha * l_i + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ v_blk
            m_i = m_new

        # out = acc / l_i;  lse = (m_i + log2(l_i)) * ln 2;  rows with l_i == 0 keep 0 / -inf.
        has_keys = l_i > 0
        np.divide(acc, l_i[..., None], out=out[..., row_start:row_stop, :], where=has_keys[..., None])
        log2_l = np.log2(l_i, out=np.full(l_i.shape, -np.inf), where=has_keys)
        lse[..., row_start:row_stop] = np.where(has_keys, (m_i + log2_l) * _LN2, -np.inf)

    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, scale=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       check=True, deterministic=True):
    """Exact gradients of `attention` with respect to q, k and v, in float64.

    The NumPy twin of `cuflash.attention_backward`. As in FlashAttention, the probabilities
    are recomputed from q, k and the forward's ``lse``: ``P = exp(scale * q k^T - lse)`` on
    allowed entries, 0 elsewhere, and then::

        dv = P^T dout
        dP = dout v^T
        D  = rowsum(dout * out)          # equals rowsum(P * dP)
        dS = P * (dP - D)
        dq = scale * dS k
        dk = scale * dS^T q

    Parameters
    ----------
    dout : array_like, shape broadcast(batch dims) + (Nq, Dv)
        Gradient of the loss with respect to ``out``.
    q, k, v : array_like
        The forward's inputs, shapes as in `attention`.
    out : array_like, shape broadcast(batch dims) + (Nq, Dv)
        The forward's output.
    lse : array_like, shape broadcast(batch dims) + (Nq,)
        The forward's logsumexp (``return_lse=True``); ``-inf`` marks a row with no key.
    causal, window, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check
        As in the forward call that produced ``out`` and ``lse``.
    deterministic : bool
        Taken for the GPU function's sake; this one is deterministic either way.

    Returns
    -------
    dq, dk, dv : ndarray of float64
        Shapes of ``q``, ``k`` and ``v``. The gradient of an input that was broadcast is summed
        over the broadcast dims. Rows with no key to attend contribute nothing.

    See Also
    --------
    cuflash.attention_backward : the same on the GPU, for CuPy arrays.
    """
    check_flag("deterministic", deterministic)
    left, right = normalize_window(causal, window)
    q, k, v, batch, scale = _check_inputs(q, k, v, scale)
    nq, dv_dim = q.shape[-2], v.shape[-1]
    dout = _as_float64("dout", dout)
    out = _as_float64("out", out)
    lse = _as_float64("lse", lse)
    check_backward_arrays(batch, nq, dv_dim, None, dout=(dout.shape, None), out=(out.shape, None), lse=(lse.shape, None))
    packed = _packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check)
    if packed is not None:
        grads = [np.zeros(x.shape) for x in (q, k, v)]
        for q0, q1, k0, k1 in packed:
            rows, keys = (..., slice(q0, q1), slice(None)), (..., slice(k0, k1), slice(None))
            part = attention_backward(
                dout[rows], q[rows], k[keys], v[keys], out[rows], lse[..., q0:q1],
                causal=causal, window=window, scale=scale,
            )
            for g, region, dg in zip(grads, (rows, keys, keys), part):
                g[region] += dg
        return tuple(grads)

    # P = exp(S - lse) on allowed entries. Disallowed entries have S = -inf and give 0; rows
    # whose lse is not finite (no key to attend) are zeroed explicitly.
    s = _scores(q, k, batch, scale, left, right)
    row_ok = np.isfinite(lse)[..., None]
    p = np.where(row_ok, np.exp(s - np.where(row_ok, lse[..., None], 0.0)), 0.0)

    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    delta = np.sum(dout * out, axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = scale * (ds @ k)
    dk = scale * (np.swapaxes(ds, -1, -2) @ q)

    return (
        sum_to_shape(dq, q.shape),
        sum_to_shape(dk, k.shape),
        sum_to_shape(dv, v.shape),
    )


# ---------------------------------------------------------------------------------------------
# KV cache and merging partial results
# ---------------------------------------------------------------------------------------------


def _host_dtype(name: str, x) -> np.dtype:
    """The dtype of an array argument as given, before `_as_float64`."""
    _as_host(name, x)
    return np.asarray(x).dtype


def _host_cache(name: str, x) -> np.ndarray:
    """A cache argument: a writable NumPy array of a real floating dtype (written in place)."""
    _as_host(name, x)
    if not isinstance(x, np.ndarray) or x.ndim < 3:
        raise TypeError(f"{name} must be a NumPy array of at least 3 dims (B or pages, ..., N, D), got {type(x).__name__}")
    _as_float64(name, x[:0])   # the dtype check, without a copy
    return x


def attention_kvcache(q, k_cache, v_cache, *, k_new=None, v_new=None, cache_seqlens=None, block_table=None,
                      causal=False, window=None, scale=None, num_splits=None, check=True, return_lse=False):
    """Attention of a few new query rows per sequence against a KV cache, in float64; the
    NumPy twin of `cuflash.attention_kvcache` (docs/contract.md), whose shape rules it applies
    (`cuflash._checks.kvcache_shapes`): D and Dv whole 16-byte rows of q's dtype up to 256, query
    heads grouped along the last dim before Nq only, k_new and v_new of the caches' dims.

    Parameters
    ----------
    q : array_like, shape (B, ..., Nq, D)
        B sequences, Nq new query rows each; the dims between broadcast against the cache's.
    k_cache, v_cache : ndarray
        Contiguous: (B, ..., Nmax, D) and (B, ..., Nmax, Dv). Paged (with ``block_table``):
        (P, ..., page_size, D / Dv); key j of sequence b is row ``j % page_size`` of page
        ``block_table[b, j // page_size]``. Written in place when ``k_new`` is given.
    k_new, v_new : array_like, shape (B, ..., Nnew, D / Dv), optional (both or neither)
        Written into the caches at positions ``cache_seqlens[b] ... cache_seqlens[b] + Nnew - 1``
        before the attention, which then sees the first ``cache_seqlens[b] + Nnew`` keys.
    cache_seqlens : int or integer ndarray of shape (B,), optional
        Keys already in each sequence's cache; default Nmax (contiguous), required when paged.
        Not changed: the caller advances it.
    block_table : integer ndarray of shape (B, max_pages), optional
        The pages of each sequence (a paged cache).
    causal, window, scale
        As in `attention`, per sequence, bottom-right aligned: Nk_b = cache_seqlens[b] + Nnew
        keys against Nq rows.
    num_splits : None or positive int
        Checked only: the GPU function's split of the keys; the result does not depend on it.
    check : bool
        Raise ValueError, before anything is written, for a sequence that would run past its
        cache, a negative ``cache_seqlens`` or a page outside the cache. ``check=False`` clamps
        instead: new keys outside the cache are dropped, pages are clamped.
    return_lse : bool

    Returns
    -------
    out : ndarray, shape (B, ...) + (Nq, Dv), float64
    lse : ndarray, shape (B, ...) + (Nq,), only with ``return_lse=True``
    """
    left, right = normalize_window(causal, window)
    q_dtype = _host_dtype("q", q)   # the GPU function's rules on head dims are in its rows of this dtype
    q = _as_float64("q", q)
    k_cache, v_cache = _host_cache("k_cache", k_cache), _host_cache("v_cache", v_cache)
    check_num_splits(num_splits)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: give both or neither")
    if k_new is not None:
        k_new, v_new = _as_float64("k_new", k_new), _as_float64("v_new", v_new)
    if block_table is not None:
        _as_host("block_table", block_table)
        block_table = np.asarray(block_table)
    shapes = kvcache_shapes(q.shape, k_cache.shape, v_cache.shape, None if k_new is None else (k_new.shape, v_new.shape),
                            block_table, q_dtype.itemsize, q_dtype.name)
    batch, rows, capacity, n_new = q.shape[0], shapes.rows, shapes.capacity, shapes.n_new
    _as_host("cache_seqlens", cache_seqlens)
    seqlens = host_cache_seqlens(cache_seqlens, batch, None if block_table is not None else rows)
    lengths, pages = kvcache_lengths(seqlens, n_new, capacity, block_table, shapes.num_pages, rows, bool(check))

    def place(b, j):   # the cache index of key j of sequence b
        return (int(pages[b, j // rows]), j % rows) if pages is not None else (b, j)

    for b in range(batch):                       # the appends, after every check
        for i in range(n_new):
            j = int(seqlens[b]) + i
            if 0 <= j < capacity:
                page, row = place(b, j)
                k_cache[page, ..., row, :] = k_new[b, ..., i, :]
                v_cache[page, ..., row, :] = v_new[b, ..., i, :]
    outs, lses = [], []
    for b in range(batch):
        keys = [place(b, j) for j in range(int(lengths[b]))]
        k = np.stack([k_cache[page, ..., row, :] for page, row in keys], axis=-2) if keys else \
            np.zeros(k_cache.shape[1:-2] + (0, k_cache.shape[-1]))
        v = np.stack([v_cache[page, ..., row, :] for page, row in keys], axis=-2) if keys else \
            np.zeros(v_cache.shape[1:-2] + (0, v_cache.shape[-1]))
        out, lse = attention(q[b], k, v, window=(left, right), scale=scale, return_lse=True)
        outs.append(out)
        lses.append(lse)
    out, lse = np.stack(outs), np.stack(lses)
    return (out, lse) if return_lse else out


def merge_attention(outs, lses):
    """The attention over the union of disjoint key sets from the attentions over each, in
    float64; the NumPy twin of `cuflash.merge_attention` (docs/contract.md).

    ``outs``: a sequence of arrays (or one array whose first axis indexes the parts), each
    ``(..., Nq, Dv)``; ``lses`` likewise, ``(..., Nq)``. Returns ``out = sum_s exp(lse_s - lse)
    out_s`` and ``lse = log sum_s exp(lse_s)``; rows where every ``lse_s`` is -inf give out 0 and
    lse -inf.
    """
    outs, lses = (np.stack(parts) for parts in merge_parts(outs, lses, _as_float64))
    lse = np.logaddexp.reduce(lses, axis=0)
    seen = np.isfinite(lse)
    weights = np.where(seen, np.exp(lses - np.where(seen, lse, 0.0)), 0.0)
    return (weights[..., None] * outs).sum(axis=0), np.where(seen, lse, -np.inf)
