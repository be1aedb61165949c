"""The public GPU functions."""

from __future__ import annotations

import contextlib
import types

from . import _checks, _dispatch, _launch, _plans, _user
from . import _mods as _score_mods

_CURRENT = contextlib.nullcontext()


def _on_device(cupy, device: int):
    """A context that makes ``device`` current: nothing to enter when it already is (the
    common case, and a cost on every call otherwise)."""
    return _CURRENT if cupy.cuda.runtime.getDevice() == device else cupy.cuda.Device(device)


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check):
    """The packed-sequence keywords as one dict, or None for a dense call."""
    if cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None:
        return None
    return {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k, "check": check}


def _mods(softcap, alibi_slopes, sinks, bias=None, dropout_p=0.0):
    """The score modifiers as the plans take them: None when there are none."""
    if softcap is None and alibi_slopes is None and sinks is None and bias is None and not dropout_p:
        return None
    return softcap, alibi_slopes, sinks, bias, dropout_p


def _tile_lists(cupy, launches):
    """Fresh tile lists for a call over packed sequences, by their index in the arrays."""
    if not launches.tile_lists:
        return _NO_LISTS
    return {index: cupy.empty((capacity, 2), dtype=cupy.int32) for index, capacity in launches.tile_lists}


_NO_LISTS = types.MappingProxyType({})


def attention(q, k, v, *, causal=False, window=None, scale=None, return_lse=False,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, check=True,
              softcap=None, bias=None, alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None,
              score_mod=None, mask_mod=None, block_mask=None):
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
    cu_seqlens_q, cu_seqlens_k : cupy.ndarray of int32, shape (S + 1,), optional
        Packed variable-length sequences (both or neither): sequence s owns query rows
        ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``
        of axis -2 and attends only its own keys, with masks aligned per sequence. One
        launch covers every sequence, longest first. A ``(total, H, D)`` array transposed
        to ``(H, total, D)`` is read in place.
    max_seqlen_q, max_seqlen_k : int, optional
        Upper bounds on the lengths (checked with ``check=True``; not needed for speed).
    check : bool, optional
        With packed sequences: copy the offsets to the host (one synchronization) and raise
        ValueError at the first bad one. ``check=False`` reads nothing back (CUDA graphs,
        the fast path); bad offsets then give wrong rows, never a read or write outside
        the arrays.
    softcap : float, optional
        Caps the scaled scores: ``s = softcap * tanh(s / softcap)`` (Gemma 2, Grok). None
        or 0: no cap.
    bias : cupy.ndarray, optional
        Added to the scores after the cap: ``s = s + bias[..., i, j]``. The inputs' dtype or
        float32, of a shape that broadcasts to the batch dims + (Nq, Nk) without enlarging
        it, such as (Nq, Nk), (B, 1, 1, Nk) or (1, H, Nq, Nk); any strides. Not with packed
        sequences.
    alibi_slopes : cupy.ndarray of float32, optional
        ALiBi: ``s = s - slope * |i + Nk - Nq - j|`` (per sequence when packed), one slope
        per batch entry: a shape that broadcasts to the batch dims, usually (H,).
    sinks : cupy.ndarray of float32, optional
        One extra logit per batch entry (shape as ``alibi_slopes``) that joins each row's
        softmax with a value vector of 0 (gpt-oss): ``lse`` counts it, and a row that sees
        no key gets out 0 and lse equal to its sink.

    dropout_p : float, optional
        Attention dropout: each probability is kept with probability ``1 - dropout_p`` and
        scaled by ``1 / (1 - dropout_p)``, by a mask that is a pure function of ``seed``,
        the batch entry, the row and the key (``cuflash.reference.dropout_keep``), whatever
        the GPU or the tiles. ``lse`` is that of the probabilities before dropout.
    seed : int, optional
        ``0 <= seed < 2**64``; required when ``dropout_p > 0``. The backward takes the same.

    score_mod : callable, optional
        ``score_mod(score, *batch_indices, q_idx, kv_idx)``: the score (scaled, after the
        modifiers above) of row ``q_idx`` and key ``kv_idx`` of a batch entry, as a new score,
        traced and compiled into the kernels once per function and signature
        (docs/contract.md, "User-defined score and mask functions").
    mask_mod : callable, optional
        ``mask_mod(*batch_indices, q_idx, kv_idx)``: whether the row may see the key, with the
        mask above. With packed sequences both see positions in the packed arrays.
    block_mask : BlockMask, optional
        ``cuflash.block_mask(mask_mod, batch_shape, Nq, Nk)`` for a batch shape that broadcasts
        to the call's: its ``mask_mod`` applies (leave ``mask_mod`` out, or pass that same
        function), and the kernels skip the tiles it leaves empty and evaluate no mask function
        in those it leaves full.

    The modifiers apply in the order scale, softcap, bias, ALiBi, score_mod, mask (with
    mask_mod), sinks, dropout (docs/contract.md).

    Returns
    -------
    out : cupy.ndarray, shape broadcast(batch dims) + (Nq, Dv), the input dtype
    lse : cupy.ndarray, shape broadcast(batch dims) + (Nq,), float32
        Only with ``return_lse=True``. A row that sees no key gets out 0 and
        lse -inf (its sink's logit with ``sinks``).

    See Also
    --------
    cuflash.reference.attention : the NumPy float64 version of the same function.
    docs/contract.md : what the library promises (shapes, masks, accuracy, errors).
    """
    packed = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check)
    dropout_p, seed = _checks.check_dropout(dropout_p, seed)
    mods = _mods(softcap, alibi_slopes, sinks, bias, dropout_p)
    user = _user_functions(score_mod, mask_mod, block_mask, q, k, v)
    plan, (q_, k_, v_, cu_q, cu_k) = _plans.forward(q, k, v, causal, window, scale, packed, mods, user)
    _checks.check_block_mask_fits(block_mask, plan.shapes[1][:-1], plan.shapes[1][-1], k.shape[-2])
    cupy = _checks.require_cupy()
    with _on_device(cupy, plan.device):
        out = cupy.empty(plan.shapes[0], dtype=q_.dtype)
        # without return_lse the kernels write lse where nobody reads it (no allocation)
        lse = (cupy.empty(plan.shapes[1], dtype=cupy.float32) if return_lse
               else _launch.lse_sink(cupy, plan.device, out))
        lists = _tile_lists(cupy, plan.launches)
        counter = _launch.tile_counter(cupy, plan.device) if plan.launches.counted else None
        entries = _per_entry(cupy, mods, plan.shapes[1][:-1])
        user_args = None if user is None else _user.arguments(cupy, user, plan.shapes[1][:-1], plan.device,
                                                               block_mask)
        arrays = (q_, k_, v_, out, lse, cu_q, cu_k, lists.get(_launch.Q_TILES), *entries, bias, seed or 0, user_args,
                  counter)
        for launch in plan.launches.runs:
            launch.run(arrays)
        if out.shape[-1] != v.shape[-1]:   # dv padded for the kernels: the padding columns are 0
            out = cupy.ascontiguousarray(out[..., : v.shape[-1]])
    return (out, lse) if return_lse else out


def _user_functions(score_mod, mask_mod, block_mask, q, k, v):
    """The call's score and mask functions traced (`_user.trace`; the block mask's function
    where given), or None without either."""
    mask_mod = _checks.block_mask_function(mask_mod, block_mask)
    batch_dims = max(getattr(q, "ndim", 2), getattr(k, "ndim", 2), getattr(v, "ndim", 2)) - 2
    return _user.trace(score_mod, mask_mod, batch_dims)


def _per_entry(cupy, mods, batch_shape):
    """(ALiBi slopes, sinks) as the kernels read them, None where absent."""
    if mods is None:
        return None, None
    return tuple(_score_mods.per_entry(cupy, x, batch_shape) for x in mods[1:3])


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, scale=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, check=True,
                       deterministic=True, softcap=None, bias=None, alibi_slopes=None, sinks=None, dropout_p=0.0,
                       seed=None, bias_grad=False, score_mod=None, mask_mod=None, block_mask=None,
                       score_mod_grads=None):
    """Gradients of ``attention`` with respect to q, k and v.

    Recomputes the scores block by block from q, k and the forward's ``lse``;
    extra device memory is O(N). Deterministic by default: the same inputs give
    bitwise identical gradients (all but those of ``score_mod_grads``).

    Parameters
    ----------
    dout : cupy.ndarray, shape broadcast(batch dims) + (Nq, Dv)
        Gradient of the loss with respect to ``out``.
    q, k, v, causal, window, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check
    softcap, bias, alibi_slopes, sinks, dropout_p, seed, score_mod, mask_mod, block_mask
        As given to ``attention`` (dropout's mask is made again from the seed). ``score_mod``'s
        derivative with respect to the score is taken symbolically (docs/contract.md).
    score_mod_grads : sequence of cupy.ndarray, optional
        Float arrays that ``score_mod`` reads from its global or closure variables: also return
        the gradient of each, through every read of it (added up in float32 by atomic adds, so
        their last bits may differ between calls, ``deterministic`` or not).
    bias_grad : bool
        With ``bias``, also return its gradient ``dbias``.
    out, lse : cupy.ndarray
        The forward's results (``attention(..., return_lse=True)``).
    deterministic : bool
        False lets the dk/dv kernel add dq up in float32 in whatever order its
        blocks finish, which saves the dq pass: on Hopper (sm_90a), head dim 64
        or 128 (the same for q, k and v), from 2048 query rows, a multiple of
        16, without packed sequences. dq may then differ between calls in its
        last bits; dk and dv do not. Elsewhere the deterministic kernels run.

    Returns
    -------
    dq, dk, dv : cupy.ndarray
        Shapes and dtypes of q, k, v; the gradient of a broadcast input is
        summed over the dims it was broadcast along. Where k and v are broadcast
        along one dim of q (grouped-query attention), the kernels sum dk and dv over
        each group as they go, with no temporary of the broadcast size (not with
        ``alibi_slopes``, ``bias`` or dropout: then summed afterwards).
    dbias : cupy.ndarray, the shape and dtype of bias
        Only with ``bias`` and ``bias_grad=True``: the gradient with respect to the biased
        scores, summed over the dims the bias was broadcast along (in float32, in a fixed
        order). It takes a float32 buffer of broadcast(batch dims) + (Nq, Nk).
    dsinks : cupy.ndarray, float32, the shape of sinks
        Only with ``sinks``: summed over the dims they were broadcast along.
    d(score_mod_grads) : cupy.ndarray
        One per array of ``score_mod_grads``, in order, each of that array's shape and dtype.

    See Also
    --------
    cuflash.reference.attention_backward : the NumPy float64 version.
    """
    orig = (q, k, v)
    _checks.check_flag("deterministic", deterministic)
    _checks.check_flag("bias_grad", bias_grad)
    packed = _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check)
    dropout_p, seed = _checks.check_dropout(dropout_p, seed)
    mods = _mods(softcap, alibi_slopes, sinks, bias, dropout_p)
    want_dbias = bias is not None and bias_grad
    user, grad_slots = _user.with_gradients(_user_functions(score_mod, mask_mod, block_mask, q, k, v), score_mod_grads)
    _user.check_backward(score_mod, want_dbias and softcap is not None)
    plan, (q, k, v, out, lse, dout, cu_q, cu_k) = _plans.backward(dout, q, k, v, out, lse, causal, window, scale,
                                                                   packed, bool(deterministic), mods, user)
    _checks.check_block_mask_fits(block_mask, plan.shapes[3][:-1], plan.shapes[3][-1], orig[1].shape[-2])
    cupy = _checks.require_cupy()
    # With no query or no key nothing flows back: every gradient is zero (or empty) and no kernel runs.
    alloc = cupy.empty if plan.launches.runs else cupy.zeros
    with _on_device(cupy, plan.device):
        dq, dk, dv = (alloc(shape, dtype=q.dtype) for shape in plan.shapes[:3])
        if plan.launches.runs:
            delta = cupy.empty(plan.shapes[3], dtype=cupy.float32)
            lists = _tile_lists(cupy, plan.launches)
            tiles = (lists.get(_launch.Q_TILES), lists.get(_launch.K_TILES))
            sums = None if plan.launches.dq_sums is None else cupy.zeros(plan.shapes[0], dtype=cupy.float32)
            entries = _per_entry(cupy, mods, plan.shapes[3][:-1])
            # (the dq pass writes dS where the band reaches; 0 elsewhere)
            dbias = cupy.zeros(plan.shapes[3] + plan.shapes[1][-2:-1], dtype=cupy.float32) if want_dbias else None
            read_grads = [cupy.zeros(user.arrays[slot].shape, dtype=cupy.float32) for slot in user.grads] if user else []
            user_args = None if user is None else _user.arguments(cupy, user, plan.shapes[3][:-1], plan.device,
                                                                   block_mask, read_grads if read_grads else None)
            arrays = (q, k, v, out, lse, cu_q, cu_k, tiles[0], *entries, bias, seed or 0, user_args, tiles[1], dout,
                      delta, dq if sums is None else sums, dk, dv, dbias)
            for launch in plan.launches.runs:
                launch.run(arrays)
            if sums is not None:
                _dispatch.scale_dq_sums(sums, dq, plan.launches.dq_sums)
        if plan.dkdv_entries is not None and plan.dkdv_entries[1] > 1:
            dk, dv = (_sum_split(cupy, g, x) for g, x in ((dk, k), (dv, v)))
        grads = tuple(_gradient_of(cupy, g, x) for g, x in zip((dq, dk, dv), orig))
        if want_dbias:
            grads += (_checks.sum_to_shape(dbias, bias.shape).astype(bias.dtype) if plan.launches.runs
                      else cupy.zeros(bias.shape, dtype=bias.dtype),)
        if sinks is not None:
            if plan.launches.runs:
                grads += (_score_mods.dsinks(cupy, entries[1], sinks.shape, lse, delta),)
            else:   # no query, or no key: every row's out is 0, so nothing reaches the sinks
                grads += (cupy.zeros(sinks.shape, dtype=cupy.float32),)
        if grad_slots is not None:   # (nothing reaches them without a launch)
            by_slot = dict(zip(user.grads, read_grads)) if plan.launches.runs else {}
            arrays = user.arrays
            grads += tuple(by_slot[slot].astype(arrays[slot].dtype) if slot in by_slot
                           else cupy.zeros(arrays[slot].shape, dtype=arrays[slot].dtype) for slot in grad_slots)
        return grads


def _sum_split(cupy, g, x):
    """The grouped dk or dv from the kernels' partial sums over parts of each query group,
    (before, split, after, nk, d): added in float32 by one kernel, in the shape of x as the
    kernels read it."""
    return _dispatch.sum_parts(cupy, g).reshape(x.shape[:-2] + g.shape[-2:])


def _gradient_of(cupy, g, x):
    """The gradient of input x from the kernels' g: the head dim's padding sliced off,
    and summed (in float32) over the dims along which x was broadcast."""
    if g.shape == x.shape:   # the usual case, at no cost
        return g
    g = g[..., : x.shape[-1]]
    if g.shape == x.shape:
        return cupy.ascontiguousarray(g)
    return _checks.sum_to_shape(g.astype(cupy.float32), x.shape).astype(g.dtype)


def attention_vjp(q, k, v, *, causal=False, window=None, scale=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, check=True,
                  deterministic=True, softcap=None, bias=None, alibi_slopes=None, sinks=None, dropout_p=0.0,
                  seed=None, bias_grad=False, score_mod=None, mask_mod=None, block_mask=None, score_mod_grads=None):
    """Forward pass plus a closure for its vector-Jacobian product.

    For people writing their own autodiff: ``out, vjp = attention_vjp(q, k, v)``
    runs ``attention`` and keeps only what the backward needs (q, k, v, out
    and the per-row logsumexp, O(N) extra); ``dq, dk, dv = vjp(dout)`` then
    runs ``attention_backward``. The closure may be called more than once. The
    keywords are those of ``attention``, and ``deterministic``, ``bias_grad`` and
    ``score_mod_grads`` those of ``attention_backward``.

    Returns
    -------
    out : cupy.ndarray
        As from ``attention``.
    vjp : callable
        ``vjp(dout) -> (dq, dk, dv)``, with the shapes and dtypes of q, k, v (and dbias,
        dsinks and the gradients of score_mod_grads after them, as ``attention_backward``
        returns them).
    """
    mask = {"causal": causal, "window": window, "scale": scale, "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k,
            "check": check, "softcap": softcap, "bias": bias, "alibi_slopes": alibi_slopes, "sinks": sinks,
            "dropout_p": dropout_p, "seed": seed, "score_mod": score_mod, "mask_mod": mask_mod,
            "block_mask": block_mask}
    _checks.check_flag("bias_grad", bias_grad)
    _user.check_backward(score_mod, bias is not None and bias_grad and softcap is not None)
    if score_mod_grads is not None:   # (its errors before the forward's launch)
        _user.with_gradients(_user_functions(score_mod, mask_mod, block_mask, q, k, v), score_mod_grads)
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        _compile_backward_soon(q, k, v, score_mod, mask_mod, block_mask, cu_seqlens_q is not None,
                               bias is not None or bool(dropout_p), bool(score_mod_grads))
    out, lse = attention(q, k, v, return_lse=True, **mask)

    def vjp(dout):
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, bias_grad=bias_grad,
                                  score_mod_grads=score_mod_grads, **mask)

    return out, vjp


# What _compile_backward_soon has started: (device, dtype, head dims, packed, the functions' source
# key); a repeat call starts nothing (its kernels are compiled or compiling), so it skips the
# names' lookup. Past BACKWARDS_ASKED of them it starts over.
BACKWARDS_ASKED = 4096
_backwards_asked: set = set()


def _compile_backward_soon(q, k, v, score_mod, mask_mod, block_mask, packed: bool, bias_dropout: bool,
                           grads: bool) -> None:
    """Starts compiling the backward's kernels with the call's functions on other threads, so
    that a first forward and backward takes about the longest of the three compiles rather than
    their sum (``grads``: the backward adds the gradients of the score function's arrays).
    Inputs or functions that `attention` refuses are left to it (it raises)."""
    try:
        user = _user_functions(score_mod, mask_mod, block_mask, q, k, v)
        device = q.device
        key = (device.id, q.dtype, q.shape[-1], v.shape[-1], packed, bias_dropout, grads, user.source.key)
        if key in _backwards_asked:
            return
        with device:
            _dispatch.compile_user_backward_soon(q.dtype.name, q.shape[-1], v.shape[-1], packed, user.source,
                                                 bias_dropout, grads)
    except (AttributeError, KeyError, TypeError, ValueError):
        return
    if len(_backwards_asked) >= BACKWARDS_ASKED:
        _backwards_asked.clear()
    _backwards_asked.add(key)


def merge_attention(outs, lses):
    """The attention over the union of disjoint key sets, from the attentions over each.

    ``out = sum_s exp(lse_s - lse) * out_s`` and ``lse = log sum_s exp(lse_s)``, computed in
    float32 by one kernel: the primitive of split-KV decoding, cascade and context-parallel
    (ring) attention. Rows where every ``lse_s`` is -inf give out 0 and lse -inf.

    Parameters
    ----------
    outs : sequence of cupy.ndarray, or one cupy.ndarray whose first axis indexes the parts
        Each part ``(..., Nq, Dv)``, one shape and dtype (float16, bfloat16 or float32), as
        ``attention`` returns them.
    lses : the same, each ``(..., Nq)`` float32 (``attention(..., return_lse=True)``).

    Returns
    -------
    out : cupy.ndarray, shape (..., Nq, Dv), the parts' dtype
    lse : cupy.ndarray, shape (..., Nq), float32

    See Also
    --------
    cuflash.reference.merge_attention : the NumPy float64 version.
    """
    cupy = _checks.require_cupy()
    outs, lses = _checks.merge_inputs(cupy, outs, lses)
    with _on_device(cupy, outs[0].device.id):
        out = cupy.empty(outs[0].shape, dtype=outs[0].dtype)
        lse = cupy.empty(lses[0].shape, dtype=cupy.float32)
        _dispatch.merge_launch(cupy, outs, lses, out, lse)
    return out, lse


def attention_kvcache(q, k_cache, v_cache, *, k_new=None, v_new=None, cache_seqlens=None, block_table=None,
                      causal=False, window=None, scale=None, num_splits=None, check=True, return_lse=False,
                      softcap=None, alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None):
    """Attention of a few new query rows per sequence against a KV cache (decoding).

    Parameters
    ----------
    q : cupy.ndarray, shape (B, ..., Nq, D)
        B sequences, Nq new rows each (1 when decoding one token). The dims between
        broadcast against the caches' along their last one: q (B, Hkv, G, Nq, D) against
        caches (., Hkv, 1, rows, D) is grouped-query attention, each K/V head read once for
        its G query heads.
    k_cache, v_cache : cupy.ndarray
        Contiguous: (B, ..., Nmax, D) and (B, ..., Nmax, Dv). Paged (with ``block_table``):
        (P, ..., page_size, D / Dv); key j of sequence b is row ``j % page_size`` of page
        ``block_table[b, j // page_size]``. Rows contiguous, on 16-byte boundaries; read and
        written in place.
    k_new, v_new : cupy.ndarray, shape (B, <the caches' dims>, Nnew, D / Dv), optional
        Written into the caches at keys ``cache_seqlens[b] ... cache_seqlens[b] + Nnew - 1``
        before the attention, which then sees the first ``cache_seqlens[b] + Nnew`` keys.
    cache_seqlens : int, or NumPy or CuPy int array of shape (B,), optional
        Keys already in each sequence's cache (default Nmax; required with ``block_table``).
        Not changed: the caller advances it.
    block_table : NumPy or CuPy int32 array of shape (B, max_pages), optional
    causal, window, scale
        As in ``attention``, per sequence, aligned to the bottom-right corner:
        ``cache_seqlens[b] + Nnew`` keys against Nq rows.
    num_splits : int, optional
        The keys of each sequence split over this many blocks, merged by their logsumexp;
        None chooses from the batch, the heads, the length and the GPU.
    check : bool, optional
        Read the lengths and pages to the host and raise ValueError, before anything is
        written, for a sequence that would run past its cache or a page outside it.
        ``check=False`` reads nothing back (CUDA graphs); out-of-range positions are then
        clamped, never read or written outside the arrays.
    return_lse : bool, optional
    softcap, alibi_slopes, sinks
        As in ``attention``, per sequence: ``alibi_slopes`` and ``sinks`` one float32 per query
        head, of a shape that broadcasts to q's dims before Nq, ``(B, ...)`` (with grouped
        queries, usually ``(Hkv, G)``); ALiBi's distance is ``|cache_seqlens[b] + Nnew - Nq + i - j|``
        for new row i and key j. Each row's sink joins its softmax once, whatever ``num_splits``.
    score_mod, mask_mod
        As in ``attention``, with one index per dim of q before Nq (the sequence first), then
        the positions in the sequence: ``q_idx`` of new row i is ``cache_seqlens[b] + Nnew -
        Nq + i`` (the new rows are the sequence's last), ``kv_idx`` the key's place in it, so
        that ``q_idx >= kv_idx`` is causal. Compiled into the decoding kernel (a mask function
        is evaluated at every key: the cache takes no block mask).

    Returns
    -------
    out : cupy.ndarray, shape (B, ...) + (Nq, Dv)
    lse : cupy.ndarray, shape (B, ...) + (Nq,), float32, with ``return_lse=True``. A row that
        sees no key gets out 0 and lse -inf (its sink's logit with ``sinks``).

    See Also
    --------
    cuflash.reference.attention_kvcache : the NumPy float64 version.
    """
    mods = _mods(softcap, alibi_slopes, sinks)
    user = _user.trace(score_mod, mask_mod, getattr(q, "ndim", 2) - 2)
    plan, (q_, k_, v_, seqlens, table, k_new_, v_new_) = _plans.kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, causal, window, scale, num_splits, check, mods,
        user)
    cupy = _checks.require_cupy()
    with _on_device(cupy, plan.device):
        batch_shape = plan.launches.out_shape[:-2]
        entries = _per_entry(cupy, mods, batch_shape)
        user_args = None if user is None else _user.arguments(cupy, user, batch_shape, plan.device)
        out, lse = plan.launches.run(cupy, plan.device, q_.dtype, return_lse, q_, k_, v_, seqlens, table, k_new_,
                                     v_new_, *entries, user_args)
    return (out, lse) if return_lse else out
