"""NumPy float64 reference for cuflash: the test oracle, usable without a GPU or CuPy.

`attention` and `attention_backward` have the signatures and semantics of
`cuflash.attention` and `cuflash.attention_backward` (masks, broadcasting, fully masked rows),
but take NumPy arrays and compute everything in float64 with the full score matrix, packed
variable-length sequences (``cu_seqlens_q``, ``cu_seqlens_k``; docs/contract.md) included.

`tiled_attention` computes the same forward the way the GPU kernel does: blocks of query rows,
key blocks skipped outside the mask band, an online softmax in the log2 domain, masks applied
only on blocks that need them. It exists so the kernel's algorithm can be checked on the CPU,
separately from CUDA details.

The score modifiers (``softcap``, ``bias``, ``alibi_slopes``, ``sinks``, ``dropout_p`` with
``seed``; docs/contract.md, "Score modifiers") go through one score path, `_scores` and
`_probabilities`, in every function that takes them. `dropout_keep` is dropout's keep mask, the
pure function of (seed, batch entry, row, key) that docs/contract.md writes out for the GPU
functions and the reference alike.

User-defined ``score_mod`` and ``mask_mod`` functions (docs/contract.md, "User-defined score and
mask functions") are traced first (`cuflash._trace`: the rules and their TypeErrors), then called
on NumPy index grids in `_scores`; the backward uses the trace's symbolic derivative.
`block_mask` classifies the tiles of a mask function.

Inputs of any real dtype are accepted (including ``ml_dtypes.bfloat16``); they are converted
with ``.astype(np.float64)`` and the results are float64.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from ._checks import (
    check_backward_arrays, check_block_mask, check_dropout, check_dropout_p, check_flag, check_modifiers, check_num_splits,
    block_mask_function, check_block_mask_fits, check_per_entry, check_scale, check_shapes, check_softcap,
    host_cache_seqlens, kvcache_lengths, kvcache_shapes, merge_parts, packed_sequences, sum_to_shape,
)
from ._mask import block_allowed, block_needs_mask, key_range, normalize_window
from ._trace import HostFunction, captured_arrays, gradient_slots, index_grids

__all__ = [
    "BlockMask", "attention", "attention_backward", "attention_kvcache", "block_mask", "dropout_keep",
    "dropout_threshold", "merge_attention", "tiled_attention",
]

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


@dataclass(frozen=True)
class _ScorePath:
    """What turns q and k into probabilities in one call: the mask and the score modifiers,
    their arrays in float64 and broadcast to the batch shape."""

    batch: tuple
    scale: float
    left: int | None
    right: int | None
    softcap: float = 0.0
    bias: np.ndarray | None = None    # batch + (Nq, Nk)
    alibi: np.ndarray | None = None   # batch
    sinks: np.ndarray | None = None   # batch
    dropout_p: float = 0.0
    seed: int | None = None
    score_mod: HostFunction | None = None
    mask_mod: HostFunction | None = None


def _per_entry(name: str, x):
    """alibi_slopes or sinks as given: None, or a NumPy array (its dtype is checked later)."""
    if x is None:
        return None
    _as_host(name, x)
    return np.asarray(x)


def _score_path(q, k, batch, scale, causal, window, packed=False, *, softcap=None, bias=None, alibi_slopes=None,
                sinks=None, dropout_p=0.0, seed=None, score_mod=None, mask_mod=None, block_mask=None) -> _ScorePath:
    """Checks the mask and the score modifiers of a call (`cuflash._checks.check_modifiers`, with
    a bias of any real dtype) against float64 q and k of broadcast batch shape ``batch``, and
    traces ``score_mod`` and ``mask_mod`` (``block_mask``'s where given; the TypeErrors of their
    rules). A block mask only says which tiles a kernel may skip: here its function applies."""
    left, right = normalize_window(causal, window)
    nq, nk = q.shape[-2], k.shape[-2]
    mask_mod = block_mask_function(mask_mod, block_mask)
    check_block_mask_fits(block_mask, batch, nq, nk)
    alibi_slopes, sinks = _per_entry("alibi_slopes", alibi_slopes), _per_entry("sinks", sinks)
    if bias is not None:
        bias = _as_float64("bias", bias)
    m = check_modifiers(batch, nq, nk, None, softcap=softcap, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks,
                        dropout_p=dropout_p, seed=seed, packed=packed)

    def wide(x, shape):
        return None if x is None else np.broadcast_to(np.asarray(x, dtype=np.float64), shape)

    user = {role: None if fn is None else HostFunction(fn, role, len(batch))
            for role, fn in (("score_mod", score_mod), ("mask_mod", mask_mod))}
    return _ScorePath(batch, scale, left, right, m.softcap, wide(bias, batch + (nq, nk)), wide(alibi_slopes, batch),
                      wide(sinks, batch), m.dropout_p, m.seed, **user)


def _scores(q, k, path: _ScorePath, rows: slice, keys: slice, nq: int, nk: int, masked: bool = True, origin=(0, 0)):
    """Steps 1 to 5 of the score path (docs/contract.md, "Score modifiers") for query rows
    ``rows`` and keys ``keys`` of one problem of ``nq`` rows and ``nk`` keys (``q`` and ``k`` hold
    those rows and keys) whose first row and key are at ``origin`` along axis -2 (the positions
    score_mod and mask_mod see).

    Returns the scores, shape batch + (rows, keys), -inf where masked (``masked`` False skips
    the mask, for blocks that need none); the softcap's derivative ``1 - tanh^2`` (None without
    softcap); and score_mod's input scores, the index grids and score_mod's derivative (None
    without score_mod)."""
    s = path.scale * (q @ np.swapaxes(k, -1, -2))                                 # 1. scale q.k
    dcap, grids, modded = None, None, None
    if path.softcap:                                                              # 2. softcap
        t = np.tanh(s / path.softcap)
        s, dcap = path.softcap * t, 1.0 - t * t
    if path.bias is not None:                                                     # 3. bias
        s = s + path.bias[..., rows, keys]
    if path.alibi is not None:                                                    # 4. ALiBi
        i, j = np.arange(rows.start, rows.stop), np.arange(keys.start, keys.stop)
        s = s - path.alibi[..., None, None] * np.abs(i[:, None] + (nk - nq) - j)
    if path.score_mod is not None or path.mask_mod is not None:
        grids = index_grids(path.batch, np.arange(rows.start, rows.stop) + origin[0],
                            np.arange(keys.start, keys.stop) + origin[1])
    s = np.broadcast_to(s, path.batch + s.shape[-2:])
    if path.score_mod is not None:                                                # 4b. score_mod
        (dmod,) = path.score_mod.evaluate([path.score_mod.traced.dscore], s, grids)
        modded = s, grids, dmod
        s = np.broadcast_to(np.asarray(path.score_mod(s, *grids), dtype=np.float64), s.shape)
    if masked:                                                                    # 5. mask
        allowed = block_allowed(rows.start, rows.stop, keys.start, keys.stop, nq, nk, path.left, path.right)
        if path.mask_mod is not None:
            allowed = allowed & np.asarray(path.mask_mod(*grids), dtype=bool)
        s = np.where(allowed, s, -np.inf)
    return np.broadcast_to(s, path.batch + s.shape[-2:]), dcap, modded


def _logsumexp(s, sinks):
    """The natural-log logsumexp of each row of ``s`` and its sink (step 6): -inf for a row with
    neither a key nor a sink, the sink for a row with no key."""
    m = s.max(axis=-1, initial=-np.inf)
    if sinks is not None:
        sinks = sinks[..., None]
        m = np.maximum(m, sinks)
    base = np.where(np.isfinite(m), m, 0.0)
    total = np.exp(s - base[..., None]).sum(axis=-1)
    if sinks is not None:
        total = total + np.exp(sinks - base)
    return base + np.log(total, out=np.full(total.shape, -np.inf), where=total > 0)


def _probabilities(q, k, path: _ScorePath, rows0: int, keys0: int, lse=None):
    """Steps 1 to 7 of the score path for one whole problem: a dense call, or one packed sequence
    whose rows and keys start at ``rows0`` and ``keys0`` of axis -2 (its dropout positions).

    Returns ``p``, the probabilities of step 6 (batch + (Nq, Nk); 0 where masked and on rows
    whose lse is not finite), the ``lse`` (computed, or the one given: the backward recomputes
    ``p`` from the forward's), the derivative and score_mod's inputs of `_scores`, and dropout's
    multipliers ``keep / (1 - dropout_p)`` (or None without dropout).
    """
    nq, nk = q.shape[-2], k.shape[-2]
    s, dcap, modded = _scores(q, k, path, slice(0, nq), slice(0, nk), nq, nk, origin=(rows0, keys0))
    if lse is None:
        lse = _logsumexp(s, path.sinks)
    row_ok = np.isfinite(lse)[..., None]
    p = np.where(row_ok, np.exp(s - np.where(row_ok, lse[..., None], 0.0)), 0.0)
    return p, lse, dcap, modded, _dropout(path, rows0 + np.arange(nq), keys0 + np.arange(nk))


def _dropout(path: _ScorePath, i, j):
    """Step 7 of the score path: dropout's multipliers ``keep / (1 - dropout_p)`` of rows ``i``
    and keys ``j`` (positions along axis -2), shape batch + (len(i), len(j)); None without
    dropout."""
    if not path.dropout_p:
        return None
    n = np.arange(math.prod(path.batch)).reshape(path.batch + (1, 1))
    return dropout_keep(path.seed, n, i[:, None], j, path.dropout_p) / (1.0 - path.dropout_p)


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


def _per_sequence(forward, q, k, v, batch, packed):
    """out and lse of a packed call, ``forward(q, k, v, q0, k0)`` run on each sequence's rows
    and keys (starting at rows q0 and k0); rows that no sequence owns give 0 and -inf."""
    out = np.zeros(batch + (q.shape[-2], v.shape[-1]))
    lse = np.full(batch + (q.shape[-2],), -np.inf)
    for q0, q1, k0, k1 in packed:
        out[..., q0:q1, :], lse[..., q0:q1] = forward(q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :], q0, k0)
    return out, lse


def _as_host(name: str, x) -> None:
    if type(x).__module__.split(".")[0] == "cupy":
        raise TypeError(f"{name} must be a NumPy array, got a CuPy array; convert it with {name}.get()")


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, check=True,
              softcap=None, bias=None, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, score_mod=None,
              mask_mod=None, block_mask=None):
    """Exact attention ``softmax(scale * q @ k^T + mask) @ v`` in float64, with optional score
    modifiers.

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
    softcap : float, optional
        ``c > 0``: each score ``s = scale * q_i . k_j`` becomes ``c * tanh(s / c)``. None or 0: off.
    bias : array_like, optional
        Added to the (softcapped) scores, ``s + bias[..., i, j]``; any real dtype, a shape that
        broadcasts to ``broadcast(batch dims) + (Nq, Nk)`` without enlarging it. Not with
        packed sequences.
    alibi_slopes : float32 ndarray, optional
        ``a`` per batch entry (a shape that broadcasts to the batch dims, usually ``(H,)``):
        ``s - a * |i + off - j|``, per sequence when packed.
    sinks : float32 ndarray, optional
        A logit ``z`` per batch entry (shape as for ``alibi_slopes``) that joins each row's
        softmax with a value vector of 0: ``lse = log(exp(z) + sum_j exp(s_j))``.
    dropout_p : float in [0, 1), optional
        Each probability is kept iff `dropout_keep` says so (a pure function of ``seed``, the
        flat batch entry and the row and key positions along axis -2) and scaled by
        ``1 / (1 - dropout_p)``.
    seed : int, optional
        ``0 <= seed < 2**64``; required when ``dropout_p > 0``.
    score_mod : function, optional
        ``score_mod(score, *batch_indices, q_idx, kv_idx)``: the new score, after ALiBi and
        before the mask (docs/contract.md, "User-defined score and mask functions"); called
        on NumPy arrays: the float64 scores and int64 index grids that broadcast against them.
    mask_mod : function, optional
        ``mask_mod(*batch_indices, q_idx, kv_idx)``: a bool, True where the key may be attended;
        AND-ed with ``causal`` and ``window``.
    block_mask : BlockMask, optional
        From `block_mask` or `cuflash.block_mask` for a batch that broadcasts to the call's and
        its (Nq, Nk): its ``mask_mod`` applies (``mask_mod`` may be left out, or must be that
        same function). It tells the GPU kernels which tiles to skip; the results are those of
        its function.

    Returns
    -------
    out : ndarray of float64, shape broadcast(batch dims) + (Nq, Dv)
        A query row with no key to attend gives 0.
    lse : ndarray of float64, shape broadcast(batch dims) + (Nq,)
        Only with ``return_lse=True``: ``log(sum_j exp(s_j))`` (natural log) of the row's
        scores over the allowed keys, its sink included; before dropout. ``-inf`` for a row
        with no key to attend (its sink ``z`` with ``sinks``).

    See Also
    --------
    cuflash.attention : the same on the GPU, for CuPy arrays.
    tiled_attention : the same computed block by block, as the GPU kernel does.
    """
    q, k, v, batch, scale = _check_inputs(q, k, v, scale)
    packed = _packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check)
    path = _score_path(q, k, batch, scale, causal, window, packed is not None, softcap=softcap, bias=bias,
                       alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, seed=seed, score_mod=score_mod,
                       mask_mod=mask_mod, block_mask=block_mask)
    if packed is None:
        out, lse = _forward(q, k, v, path=path)
    else:
        out, lse = _per_sequence(functools.partial(_forward, path=path), q, k, v, batch, packed)
    return (out, lse) if return_lse else out


def _forward(q, k, v, q0=0, k0=0, *, path: _ScorePath):
    """out and lse of one problem whose rows and keys start at q0 and k0 of axis -2."""
    p, lse, _, _, drop = _probabilities(q, k, path, q0, k0)
    return (p if drop is None else p * drop) @ v, lse


def tiled_attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False,
                    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, check=True,
                    softcap=None, bias=None, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None,
                    score_mod=None, mask_mod=None, block_mask=None, block_m=64, block_n=64):
    """The forward as the GPU kernel computes it, in NumPy float64.

    For each block of ``block_m`` query rows (vectorised over the batch dims):

    1. ``lo, hi = key_range(...)``; key blocks outside ``[lo, hi)`` are never visited.
    2. Walk key blocks of ``block_n`` keys, starting at the block containing ``lo``. Scores are
       kept in the log2 domain, ``s = (scale * q @ k^T) * log2(e)`` (softcap, bias and ALiBi
       applied before the factor log2(e)); only blocks that touch a band edge or run past ``Nk``
       (`block_needs_mask`) get a mask (-inf).
    3. Online softmax with running row max ``m_i`` and running row sum ``l_i``, which start at
       -inf and 0, or with ``sinks`` at the sink ``z * log2(e)`` and 1 (the sink's own term)::

           m_new = max(m_i, rowmax(s))
           alpha = exp2(m_i - m_new)        # 1 unless the max grew
           p     = exp2(s - m_new)
           l_i   = alpha * l_i + rowsum(p)
           acc   = alpha * acc + (p * M) @ v    # M: dropout's multipliers (1 without)

       A row whose max is still -inf subtracts 0 instead of ``m_new``, so no NaN appears.
    4. ``out = acc / l_i`` and ``lse = (m_i + log2(l_i)) * ln(2)``; rows with ``l_i == 0``
       give 0 and -inf (rows with a sink but no key: 0 and the sink).

    Packed sequences (``cu_seqlens_q``, ``cu_seqlens_k``) run this on each sequence in turn, as
    in `attention`.

    Parameters
    ----------
    q, k, v, causal, window, scale, return_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check
        As in `attention`.
    softcap, bias, alibi_slopes, sinks, dropout_p, seed, score_mod, mask_mod, block_mask
        As in `attention`; with ``mask_mod`` every block is masked.
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
    q, k, v, batch, scale = _check_inputs(q, k, v, scale)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (numbers.Integral, np.integer)) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    packed = _packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check)
    path = _score_path(q, k, batch, scale, causal, window, packed is not None, softcap=softcap, bias=bias,
                       alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, seed=seed, score_mod=score_mod,
                       mask_mod=mask_mod, block_mask=block_mask)
    tiled = functools.partial(_tiled, path=path, block_m=int(block_m), block_n=int(block_n))
    out, lse = tiled(q, k, v) if packed is None else _per_sequence(tiled, q, k, v, batch, packed)
    return (out, lse) if return_lse else out


def _tiled(q, k, v, q0=0, k0=0, *, path: _ScorePath, block_m: int, block_n: int):
    """out and lse of one problem whose rows and keys start at q0 and k0 of axis -2, block by
    block (see `tiled_attention`)."""
    batch, left, right = path.batch, path.left, path.right
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    q = np.broadcast_to(q, batch + (nq, d))
    k = np.broadcast_to(k, batch + (nk, d))
    v = np.broadcast_to(v, batch + (nk, dv))

    out = np.zeros(batch + (nq, dv))
    lse = np.full(batch + (nq,), -np.inf)

    for row_start in range(0, nq, block_m):
        row_stop = min(row_start + block_m, nq)
        rows = row_stop - row_start
        q_blk = q[..., row_start:row_stop, :]
        # A sink is a key of value 0 seen first: m_i = z * log2(e), l_i = exp2(z * log2(e) - m_i) = 1.
        m_i = np.full(batch + (rows,), -np.inf) if path.sinks is None else \
            np.broadcast_to(path.sinks[..., None] * _LOG2E, batch + (rows,))
        l_i = np.where(m_i == -np.inf, 0.0, 1.0)
        acc = np.zeros(batch + (rows, dv))

        lo, hi = key_range(row_start, row_stop, nq, nk, left, right)
        first = (lo // block_n) * block_n if hi > lo else hi
        for col_start in range(first, hi, block_n):
            col_stop = col_start + block_n
            # The kernel's last block runs past Nk and masks the keys there; here it stops at Nk.
            cols = slice(col_start, min(col_stop, nk))
            needs_mask = block_needs_mask(row_start, row_stop, col_start, col_stop, nq, nk, left, right)
            # s = scores * log2(e)   [batch, rows, keys], masked only where the block needs it
            s, *_ = _scores(q_blk, k[..., cols, :], path, slice(row_start, row_stop), cols, nq, nk,
                            masked=needs_mask or path.mask_mod is not None, origin=(q0, k0))
            s = s * _LOG2E

            # m_new = max(m_i, rowmax(s)); a row still at -inf subtracts 0 instead.
            m_new = np.maximum(m_i, s.max(axis=-1))
            base = np.where(m_new == -np.inf, 0.0, m_new)
            # alpha = exp2(m_old - m_new) rescales what was accumulated under the old max.
            alpha = np.exp2(m_i - base)
            # p = exp2(s - m_new)
            p = np.exp2(s - base[..., None])
            # l_i = alpha * l_i + rowsum(p);  acc = alpha * acc + (p M) v: dropout after the sum
            l_i = alpha * l_i + p.sum(axis=-1)
            drop = _dropout(path, q0 + np.arange(row_start, row_stop), k0 + np.arange(cols.start, cols.stop))
            acc = alpha[..., None] * acc + (p if drop is None else p * drop) @ v[..., cols, :]
            m_i = m_new

        # out = acc / l_i;  lse = (m_i + log2(l_i)) * ln 2;  rows with l_i == 0 keep 0 / -inf.
        has_keys = l_i > 0
        np.divide(acc, l_i[..., None], out=out[..., row_start:row_stop, :], where=has_keys[..., None])
        log2_l = np.log2(l_i, out=np.full(l_i.shape, -np.inf), where=has_keys)
        lse[..., row_start:row_stop] = np.where(has_keys, (m_i + log2_l) * _LN2, -np.inf)

    return out, lse


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, scale=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       check=True, deterministic=True, softcap=None, bias=None, alibi_slopes=None, sinks=None,
                       dropout_p=0.0, seed=None, bias_grad=False, score_mod=None, mask_mod=None,
                       block_mask=None, score_mod_grads=None):
    """Exact gradients of `attention` with respect to q, k and v (and bias and sinks), in float64.

    The NumPy twin of `cuflash.attention_backward`. As in FlashAttention, the probabilities
    are recomputed from q, k and the forward's ``lse``: ``P = exp(S - lse)`` on allowed
    entries, 0 elsewhere, ``S`` the scores after the softcap, bias and ALiBi; with dropout
    ``Pd = P * M``, ``M`` the kept entries times ``1 / (1 - dropout_p)`` (``Pd = P`` without);
    and then::

        dv = Pd^T dout
        dP = (dout v^T) * M
        D  = rowsum(dout * out)          # equals rowsum(P * dP)
        dS = P * (dP - D)                # dbias, summed over the dims bias was broadcast along
        dS' = dS * (1 - tanh^2(scale q k^T / softcap))   # dS without softcap
        dq = scale * dS' k
        dk = scale * dS'^T q
        dsinks = -sum_i exp(z - lse_i) * D_i

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
    softcap, bias, alibi_slopes, sinks, dropout_p, seed
        As in the forward call (the same seed regenerates the same dropout mask).
    deterministic : bool
        Taken for the GPU function's sake; this one is deterministic either way.
    bias_grad : bool
        With ``bias``, also return dbias.

    score_mod, mask_mod, block_mask
        As in the forward call; the gradients go through score_mod's derivative.
    score_mod_grads : sequence of arrays, optional
        Float arrays that ``score_mod`` reads from its global or closure variables: also return
        the gradient of each, through every read of it (docs/contract.md, "User-defined score
        and mask functions").

    Returns
    -------
    dq, dk, dv : ndarray of float64
        Shapes of ``q``, ``k`` and ``v``. The gradient of an input that was broadcast is summed
        over the broadcast dims. Rows with no key to attend contribute nothing.
    dbias : ndarray of float64
        Only with ``bias`` and ``bias_grad=True``: the shape of ``bias``, the gradient with
        respect to the biased scores summed over the dims it was broadcast along.
    dsinks : ndarray of float64
        Only with ``sinks``: the shape of ``sinks``, summed over the dims it was broadcast along.
    d(score_mod_grads) : ndarray of float64
        One per array of ``score_mod_grads``, in order, each of that array's shape.

    See Also
    --------
    cuflash.attention_backward : the same on the GPU, for CuPy arrays.
    """
    check_flag("deterministic", deterministic)
    check_flag("bias_grad", bias_grad)
    q, k, v, batch, scale = _check_inputs(q, k, v, scale)
    nq, dv_dim = q.shape[-2], v.shape[-1]
    dout = _as_float64("dout", dout)
    out = _as_float64("out", out)
    lse = _as_float64("lse", lse)
    check_backward_arrays(batch, nq, dv_dim, None, dout=(dout.shape, None), out=(out.shape, None), lse=(lse.shape, None))
    packed = _packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check)
    path = _score_path(q, k, batch, scale, causal, window, packed is not None, softcap=softcap, bias=bias,
                       alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, seed=seed, score_mod=score_mod,
                       mask_mod=mask_mod, block_mask=block_mask)
    mod_grads = _score_mod_grads(path.score_mod, score_mod_grads)
    if packed is None:
        packed = [(0, nq, 0, k.shape[-2])]
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    ds_all, dsinks = None, np.zeros(batch)
    for q0, q1, k0, k1 in packed:
        rows, keys = (..., slice(q0, q1), slice(None)), (..., slice(k0, k1), slice(None))
        *part, ds, dz = _backward(dout[rows], q[rows], k[keys], v[keys], out[rows], lse[..., q0:q1], q0, k0, path=path,
                                  mod_grads=mod_grads)
        for g, region, dg in zip(grads, (rows, keys, keys), part):
            g[region] += sum_to_shape(dg, g[region].shape)
        ds_all = ds   # bias comes without packing: one problem
        dsinks += dz
    if bias is not None and bias_grad:
        grads.append(sum_to_shape(ds_all, np.shape(bias)))
    if sinks is not None:
        grads.append(sum_to_shape(dsinks, np.shape(sinks)))
    return tuple(grads) + tuple(g for g, _ in mod_grads)


def _score_mod_grads(score_mod: HostFunction | None, arrays) -> list:
    """(gradient, slot) of each array of ``score_mod_grads``: zeros of its shape, filled by
    `_backward` (`gradient_slots`' errors)."""
    if arrays is None:
        return []
    captured = None if score_mod is None else captured_arrays(score_mod.fn, score_mod.traced)
    slots = gradient_slots(None if score_mod is None else score_mod.traced, captured, arrays)
    return [(np.zeros(np.shape(x)), slot) for x, slot in zip(arrays, slots)]


def _add_score_mod_grads(path: _ScorePath, mod_grads, ds, modded):
    """Adds ``ds`` (the gradient of the scores after score_mod) times d(score_mod) / d(read) at
    each (clamped) element that each read of the arrays in ``mod_grads`` reads; a score whose ds
    is 0 (a refused key, p 0) adds nothing, whatever the derivative there."""
    s, grids, _ = modded
    for grad, slot in mod_grads:
        for r in path.score_mod.traced.reads:
            if r.slot == slot:
                d, *index = path.score_mod.evaluate([r.derivative, *r.node.args], s, grids)
                index = [np.clip(i, 0, n - 1) for i, n in zip(index, grad.shape)]
                with np.errstate(invalid="ignore"):
                    added = np.where(ds != 0, ds * d, 0.0)
                np.add.at(grad, tuple(np.broadcast_arrays(*index, ds)[:-1]), added)


def _backward(dout, q, k, v, out, lse, q0=0, k0=0, *, path: _ScorePath, mod_grads=()):
    """dq, dk, dv (broadcast batch shape), dS of the biased scores (batch + (Nq, Nk)) and dsinks
    (batch shape, summed over rows) of one problem whose rows and keys start at q0 and k0 of
    axis -2; adds to the gradients of ``mod_grads`` (`_score_mod_grads`)."""
    p, _, dcap, modded, drop = _probabilities(q, k, path, q0, k0, lse)
    dv = np.swapaxes(p if drop is None else p * drop, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    if drop is not None:
        dp = dp * drop
    delta = np.sum(dout * out, axis=-1)
    ds = p * (dp - delta[..., None])
    dsinks = 0.0
    if path.sinks is not None:   # p_sink = exp(z - lse), 0 on rows with no lse
        row_ok = np.isfinite(lse)
        p_sink = np.where(row_ok, np.exp(path.sinks[..., None] - np.where(row_ok, lse, 0.0)), 0.0)
        dsinks = -(p_sink * delta).sum(axis=-1)
    if modded is not None:
        _add_score_mod_grads(path, mod_grads, ds, modded)
        ds = ds * modded[2]
    ds_scores = ds if dcap is None else ds * dcap
    dq = path.scale * (ds_scores @ k)
    dk = path.scale * (np.swapaxes(ds_scores, -1, -2) @ q)
    return dq, dk, dv, ds, dsinks


# ---------------------------------------------------------------------------------------------
# Dropout's keep mask
# ---------------------------------------------------------------------------------------------

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))   # Random123's Philox4x32 constants
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_LOW32 = 0xFFFFFFFF


def _philox4x32_10(counter, key):
    """Random123's Philox4x32-10: ``counter`` four arrays of uint32 values (broadcast together),
    ``key`` two Python ints below 2**32; returns the four output words as uint32 arrays.

    The words are held in uint64 so that each product ``M * c`` of two 32-bit values is exact
    (its high and low halves are mulhilo's results).
    """
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint64) for c in counter))
    k0, k1 = key
    low, shift = np.uint64(_LOW32), np.uint64(32)
    for r in range(10):
        if r:   # the key is bumped before every round but the first
            k0, k1 = (k0 + _PHILOX_W[0]) & _LOW32, (k1 + _PHILOX_W[1]) & _LOW32
        p0, p1 = c0 * _PHILOX_M[0], c2 * _PHILOX_M[1]
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ np.uint64(k0), p1 & low, (p0 >> shift) ^ c3 ^ np.uint64(k1), p0 & low
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def _dropout_slots(n, i, j):
    """Where element (n, i, j) finds its 16 random bits (docs/contract.md): the Philox counter
    (four uint64 arrays of 32-bit values), the output word (0 to 3) and the bit shift (0 or 16).
    One Philox call covers 8 elements of a 16 x 16 tile (4 words of 2 halves): 32 calls a tile."""
    n, i, j = (x.astype(np.uint64) for x in np.broadcast_arrays(n, i, j))
    low = np.uint64(_LOW32)   # 32-bit words, mod 2**32 (which only positions from 2**33 on reach)
    c0 = ((j // 16) * 4 + (j % 8) // 2) & low
    c1 = ((i // 16) * 8 + i % 8) & low
    counter = (c0, c1, n & low, n >> np.uint64(32))
    word = 2 * ((i // 8) % 2) + (j // 8) % 2
    return counter, word.astype(np.intp), 16 * (j & np.uint64(1))


def _index_array(name: str, x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a non-negative int or integer array, got dtype {x.dtype}")
    if x.dtype.kind == "i" and (x < 0).any():
        raise ValueError(f"{name} must be non-negative, got {x.min()}")
    return x


def dropout_threshold(dropout_p) -> int:
    """``floor(dropout_p * 65536)``: an element is dropped iff its 16 random bits are below it."""
    return math.floor(check_dropout_p(dropout_p) * 65536)


def dropout_keep(seed, n, i, j, dropout_p):
    """Whether dropout keeps the probability of batch entry ``n``, row ``i``, key ``j``.

    The mask of every cuflash function, GPU and reference (docs/contract.md, "Score
    modifiers"): a pure function of its arguments. ``n`` is the flat index (C order) of the
    entry of the broadcast batch dims, ``i`` and ``j`` the positions of the row and the key along
    axis -2 (global positions with packed sequences). With ``key = (seed mod 2**32,
    seed // 2**32)`` and Philox4x32-10::

        counter = ((j // 16) * 4 + (j % 8) // 2, (i // 16) * 8 + i % 8, n mod 2**32, n // 2**32)
        word    = philox(counter, key)[2 * ((i // 8) % 2) + (j // 8) % 2]
        bits    = (word >> (16 * (j % 2))) & 0xFFFF
        kept    = bits >= floor(dropout_p * 65536)

    Parameters
    ----------
    seed : int
        ``0 <= seed < 2**64`` (may be None when ``dropout_p`` is 0).
    n, i, j : int or integer array_like
        Non-negative; broadcast together.
    dropout_p : float in [0, 1)

    Returns
    -------
    ndarray of bool, the broadcast shape of n, i and j.
    """
    dropout_p, seed = check_dropout(dropout_p, seed)
    n, i, j = np.broadcast_arrays(*(_index_array(name, x) for name, x in (("n", n), ("i", i), ("j", j))))
    if dropout_p == 0:
        return np.ones(n.shape, dtype=bool)
    counter, word, shift = _dropout_slots(n, i, j)
    words = _philox4x32_10(counter, (seed & _LOW32, seed >> 32))
    bits = (np.choose(word, words).astype(np.uint64) >> shift) & np.uint64(0xFFFF)
    return bits >= dropout_threshold(dropout_p)


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
                      causal=False, window=None, scale=None, num_splits=None, check=True, return_lse=False,
                      softcap=None, alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None):
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
    softcap, alibi_slopes, sinks
        As in `attention`, per sequence: ``alibi_slopes`` and ``sinks`` broadcast to q's dims
        before Nq, ``(B, ...)``, and ALiBi's offset is ``Nk_b - Nq``. A sequence with no key
        gives out 0 and lse its sink.
    score_mod, mask_mod
        As in `attention` (docs/contract.md, "User-defined score and mask functions"), with one
        index per dim of q before Nq (the sequence ``b`` first), and the positions in the
        sequence: ``q_idx`` of row i is ``Nk_b - Nq + i`` (the new rows are the sequence's last),
        ``kv_idx`` the key's place in the sequence, so that ``q_idx >= kv_idx`` is causal.

    Returns
    -------
    out : ndarray, shape (B, ...) + (Nq, Dv), float64
    lse : ndarray, shape (B, ...) + (Nq,), only with ``return_lse=True``
    """
    for role, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):   # (their TypeErrors, before any write)
        if fn is not None:
            HostFunction(fn, role, np.ndim(q) - 2)
    left, right = normalize_window(causal, window)
    check_softcap(softcap)
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
    per_entry = {}   # alibi_slopes and sinks, as float32 arrays of q's dims before Nq
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            x = _per_entry(name, x)
            check_per_entry(name, x, q.shape[:-2])
            per_entry[name] = np.broadcast_to(x, q.shape[:-2])

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
        functions = _in_sequence(b, int(lengths[b]) - q.shape[-2], score_mod, mask_mod)
        out, lse = attention(q[b], k, v, window=(left, right), scale=scale, return_lse=True, softcap=softcap,
                             **functions, **{name: x[b] for name, x in per_entry.items()})
        outs.append(out)
        lses.append(lse)
    out, lse = np.stack(outs), np.stack(lses)
    return (out, lse) if return_lse else out


def _in_sequence(b: int, offset: int, score_mod, mask_mod) -> dict:
    """``attention_kvcache``'s functions as ``attention`` over sequence ``b`` alone calls them:
    with the sequence's index first, and rows at ``offset`` (Nk_b - Nq) past their place."""
    functions = {}
    if score_mod is not None:
        functions["score_mod"] = lambda score, *idx: score_mod(score, b, *idx[:-2], idx[-2] + offset, idx[-1])
    if mask_mod is not None:
        functions["mask_mod"] = lambda *idx: mask_mod(b, *idx[:-2], idx[-2] + offset, idx[-1])
    return functions


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


# ---------------------------------------------------------------------------------------------
# Block masks of mask functions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockMask:
    """What a mask function allows in each tile of ``block = (rows, keys)``: ``kinds[..., m, n]``
    is `EMPTY` (no element of tile (m, n) allowed: a kernel skips it), `FULL` (every element
    allowed: no mask needed) or `PARTIAL`, for each entry of the batch dims. Only elements
    inside ``shape = (Nq, Nk)`` count: a ragged last tile is full when all of its elements
    inside are allowed. ``mask_mod``: the function it was built from, which a call given the
    block mask (``block_mask=``) applies."""

    EMPTY = 0
    PARTIAL = 1
    FULL = 2

    kinds: np.ndarray   # int8, batch_shape + (ceil(Nq / rows), ceil(Nk / keys))
    block: tuple
    shape: tuple
    mask_mod: object = field(default=None, compare=False)


def block_mask(mask_mod, batch_shape, nq, nk, block=(128, 128)) -> BlockMask:
    """The `BlockMask` of ``mask_mod`` (as for `attention`: ``mask_mod(*batch_indices, q_idx,
    kv_idx)``, rows and keys at positions ``0 .. Nq - 1`` and ``0 .. Nk - 1``) over tiles of
    ``block = (rows, keys)``, evaluated on the host one row of tiles at a time."""
    batch_shape, nq, nk, (bm, bn) = check_block_mask(batch_shape, nq, nk, block)
    fn = HostFunction(mask_mod, "mask_mod", len(batch_shape))
    rows_of_tiles, cols = -(-nq // bm), -(-nk // bn)
    kinds = np.zeros(batch_shape + (rows_of_tiles, cols), dtype=np.int8)
    pad = cols * bn - nk
    for m in range(rows_of_tiles):
        rows = np.arange(m * bm, min((m + 1) * bm, nq))
        allowed = np.broadcast_to(np.asarray(fn(*index_grids(batch_shape, rows, np.arange(nk))), dtype=bool),
                                  batch_shape + (len(rows), nk))
        # A ragged last tile is padded with True for `all` and with False for `any`.
        widths = [(0, 0)] * (allowed.ndim - 1) + [(0, pad)]
        full, some = (np.pad(allowed, widths, constant_values=fill).reshape(batch_shape + (len(rows), cols, bn))
                      for fill in (True, False))
        kinds[..., m, :] = np.where(full.all(axis=(-3, -1)), BlockMask.FULL,
                                    np.where(some.any(axis=(-3, -1)), BlockMask.PARTIAL, BlockMask.EMPTY))
    return BlockMask(kinds, (bm, bn), (int(nq), int(nk)), mask_mod)
