"""Launch plans: what a call launches, kept per call signature so that a repeated
call skips the checks and the building of its parameter records.

A signature holds everything the checks and the launches depend on except the
data pointers: each array's type, dtype, shape, strides, device and whether it
starts on a 16-byte boundary, and the mask and scale arguments with their types.
Only calls that pass the checks are kept, and only those whose arrays the kernels
read in place (no copy) and whose gradients need no sum over broadcast dims, so a
kept plan runs exactly what the checked path would. Calls over packed sequences
are kept only with ``check=False``: with ``check=True`` every call reads and
checks the offsets.
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
from dataclasses import dataclass

from . import _checks, _dispatch, _launch, _mods

MAX_PLANS = 512   # beyond this many signatures the cache starts over

_plans: dict = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Plan:
    device: int  # q's device: where the outputs live and the kernels run
    shapes: tuple[tuple[int, ...], ...]  # of the outputs: out and lse, or dq, dk, dv and delta
    launches: _launch.Launches
    # the kernels' dk and dv shapes as (before, split, after) K/V entries (grouped), or None
    dkdv_entries: tuple[int, int, int] | None = None


def _packed_key(packed):
    """The packed-sequence part of a signature: None when dense, False when not cacheable."""
    if packed is None:
        return None
    if packed.get("check", True) is not False:
        return False
    cu_q, cu_k = packed["cu_seqlens_q"], packed["cu_seqlens_k"]
    if cu_q is None or cu_k is None:
        return False
    return tuple((type(a), a.dtype, a.shape, a.strides, a.device.id) for a in (cu_q, cu_k)) + (
        type(packed["max_seqlen_q"]), packed["max_seqlen_q"], type(packed["max_seqlen_k"]), packed["max_seqlen_k"]
    )


def _array_key(a):
    """An array's part of a signature (None for an absent one)."""
    if a is None:
        return None
    memory = a.data
    return type(a), a.dtype, a.shape, a.strides, memory.device_id, memory.ptr % 16 == 0


def _signature(direction: str, arrays, causal, window, scale, packed=None, mods=None):
    """The cache key of a call, or None when an argument cannot be part of one (the checks
    then say what is wrong with it)."""
    if not (window is None or isinstance(window, (tuple, list))):
        return None
    try:
        packed = _packed_key(packed)
        if packed is False:
            return None
        mask = (
            type(causal), causal,
            None if window is None else tuple((type(w), w) for w in window),
            type(scale), scale,
        )
        key = (direction, mask, packed, mods, *map(_array_key, arrays))
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def _keep(key, plan: Plan) -> None:
    if key is None:
        return
    with _lock:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan


def clear() -> None:
    """Forgets every kept plan (after a change to the tile tables, say)."""
    with _lock:
        _plans.clear()


def _packed_arrays(x):
    """The offsets as the kernels read them: (cu_seqlens_q, cu_seqlens_k), None when dense."""
    return (None, None) if x.packed is None else (x.packed.cu_seqlens_q, x.packed.cu_seqlens_k)


def _same_offsets(x, packed) -> bool:
    return x.packed is None or (x.packed.cu_seqlens_q is packed["cu_seqlens_q"]
                                and x.packed.cu_seqlens_k is packed["cu_seqlens_k"])


def _modified(x, mods):
    """x with the call's score modifiers (``mods``: softcap, alibi_slopes, sinks, bias,
    dropout_p, or None); a pass with ALiBi slopes, a bias or dropout does not group its query
    heads (each has its own slope, bias and dropout mask). A bias joins the merging of batch
    dims, so that one set of kernel batch dims indexes q, k, v and it."""
    if mods is None:
        return x
    cupy = _checks.require_cupy()
    checked = _mods.check_all(cupy, x, *mods)
    bias = mods[3]
    if bias is not None:
        shape, strides = _checks.kernel_batch_layout(x.batch_shape, (x.q, x.k, x.v, bias))
        x = dataclasses.replace(x, kernel_batch_shape=shape, kernel_batch_strides=strides[:3])
        checked = dataclasses.replace(checked, bias=_mods.bias_layout(bias, strides[3]))
    return dataclasses.replace(x, mods=checked, group=None if checked.alibi or checked.full else x.group)


def _with_user(x, user):
    """x with the call's score and mask functions (_user.UserMods, or None), which see each
    query entry of the broadcast batch (no grouping); the kernels take them with a scale other
    than 0 (they keep scores in raw units, 1 / scale of the functions')."""
    if user is None:
        return x
    _check_user_scale(x.scale)
    return dataclasses.replace(x, user=user, group=None)


def _check_user_scale(scale: float) -> None:
    if scale == 0:
        raise NotImplementedError("cuflash's kernels take score_mod and mask_mod with a scale other than 0, got "
                                  "scale=0 (cuflash.reference takes it)")


def forward(q, k, v, causal, window, scale, packed=None, mods=None, user=None):
    """(plan, (q, k, v, cu_seqlens_q, cu_seqlens_k) as the kernels read them) of a forward
    call; raises as the checks do. ``packed``: the packed-sequence keywords, or None;
    ``mods``: (softcap, alibi_slopes, sinks, bias, dropout_p), or None; ``user``: the call's
    score and mask functions (_user.UserMods), or None."""
    key = _signature("fwd", (q, k, v), causal, window, scale, packed,
                     (mods and _mods.key(*mods), user and user.source.key))
    plan = _plans.get(key)
    if plan is not None:
        return plan, (q, k, v) + ((packed["cu_seqlens_q"], packed["cu_seqlens_k"]) if packed else (None, None))
    x = _with_user(_modified(_checks.attention_inputs(q, k, v, causal, window, scale, packed), mods), user)
    with x.q.device:
        launches = _dispatch.forward_launches(x) if x.batch_size and x.nq else _launch.Launches(())
    plan = Plan(x.q.device.id, (x.batch_shape + (x.nq, x.dv), x.batch_shape + (x.nq,)), launches)
    if x.q is q and x.k is k and x.v is v and _same_offsets(x, packed):
        _keep(key, plan)
    return plan, (x.q, x.k, x.v) + _packed_arrays(x)


def backward(dout, q, k, v, out, lse, causal, window, scale, packed=None, deterministic=True, mods=None, user=None):
    """(plan, (q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k) as the kernels read them)
    of a backward call. A plan without launches (no query or no key) stands for zero gradients."""
    arrays = (q, k, v, out, lse, dout)
    key = _signature("bwd" if deterministic else "bwd, any order", arrays, causal, window, scale, packed,
                     (mods and _mods.key(*mods), user and (user.source.key, user.grads)))
    plan = _plans.get(key)
    if plan is not None:
        return plan, arrays + ((packed["cu_seqlens_q"], packed["cu_seqlens_k"]) if packed else (None, None))
    x = _checks.attention_inputs(q, k, v, causal, window, scale, packed, dout=dout, out=out, lse=lse)
    x = _with_user(_modified(x, mods), user)
    cupy = _checks.require_cupy()
    out2, dout2, lse2 = _checks.backward_arrays(cupy, x, out=out, dout=dout, lse=lse)
    with x.q.device:
        launches = (_dispatch.backward_launches(x, deterministic) if x.batch_size and x.nq and x.nk
                    else _launch.Launches(()))
    shape, entries = x.batch_shape, launches.dkdv_entries
    if entries is None:
        k_rows, v_rows = shape, shape
    elif entries[1] == 1:   # grouped: dk, dv have the shapes of k, v
        k_rows, v_rows = x.k.shape[:-2], x.v.shape[:-2]
    else:                   # grouped, in partial sums over `split` parts of each group
        k_rows = v_rows = entries
    shapes = (shape + (x.nq, x.d), k_rows + (x.nk, x.d), v_rows + (x.nk, x.dv), shape + (x.nq,))
    plan = Plan(x.q.device.id, shapes, launches, entries)
    checked = (x.q, x.k, x.v, out2, lse2, dout2)
    # the gradients as the call returns them (a split group's parts added up) need no slicing or sum
    grads = shapes[:3] if entries is None else (shapes[0], x.k.shape[:-2] + shapes[1][-2:], x.v.shape[:-2] + shapes[2][-2:])
    if (launches.runs and all(a is b for a, b in zip(checked, arrays)) and _same_offsets(x, packed)
            and grads == (q.shape, k.shape, v.shape)):
        _keep(key, plan)
    return plan, checked + _packed_arrays(x)


@dataclass(frozen=True)
class KVCachePlan:
    device: int
    launches: _launch.KVCacheLaunches


def _device_lengths(cache_seqlens) -> bool:
    """Whether the lengths are an array (read by the kernels) rather than None or an int."""
    return not (cache_seqlens is None or type(cache_seqlens) is int or isinstance(cache_seqlens, numbers.Integral))


def _kvcache_signature(arrays, cache_seqlens, device_lengths, block_table, causal, window, scale, num_splits, check,
                       mods=None):
    """The cache key of an attention_kvcache call, or None when it must be checked every
    time: with ``check=True``, lengths or pages that live in arrays (their values are read);
    lengths or tables the kernels cannot read in place (NumPy, or not contiguous int32)."""
    if not (window is None or isinstance(window, (tuple, list))):
        return None
    if check is not False and (device_lengths or block_table is not None):
        return None
    try:
        index_arrays = []
        for a in (cache_seqlens if device_lengths else None, block_table):
            if a is not None and not (a.dtype == "int32" and a.flags.c_contiguous):
                return None
            index_arrays.append(_array_key(a))
        mask = (type(causal), causal, None if window is None else tuple((type(w), w) for w in window),
                type(scale), scale, type(num_splits), num_splits, type(check), check)
        lengths = None if device_lengths else (type(cache_seqlens), cache_seqlens)
        return ("kvcache", mask, mods, lengths, *index_arrays, *map(_array_key, arrays))
    except AttributeError:
        return None


def kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, causal, window, scale, num_splits, check,
            mods=None, user=None):
    """(plan, (q, k, v, seqlens, block_table, k_new, v_new) as the kernels read them) of an
    attention_kvcache call; raises as the checks do, before anything is written. ``mods``:
    (softcap, alibi_slopes, sinks), or None; ``user``: the call's score and mask functions
    (_user.UserMods), or None."""
    device_lengths = _device_lengths(cache_seqlens)
    key = _kvcache_signature((q, k_cache, v_cache, k_new, v_new), cache_seqlens, device_lengths, block_table, causal,
                             window, scale, num_splits, check, (mods and _mods.key(*mods), user and user.source.key))
    try:
        plan = _plans.get(key)
    except TypeError:   # an argument that cannot be part of a key: the checks say what is wrong with it
        key = plan = None
    if plan is not None:
        return plan, (q, k_cache, v_cache, cache_seqlens if device_lengths else None, block_table, k_new, v_new)
    cupy = _checks.require_cupy()
    x = _checks.kvcache_inputs(cupy, q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, causal, window,
                               scale, num_splits, check)
    if mods is not None:   # (one slope and sink per query head: q's dims before Nq)
        x.mods = _mods.check(cupy, *mods[:3], x.out_shape[:-2], q.device.id, x.scale)
    if user is not None:   # (each row's functions see its own query head: no grouping to undo)
        _check_user_scale(x.scale)
        x.user = user
    with cupy.cuda.Device(q.device.id):
        plan = KVCachePlan(q.device.id, _dispatch.kvcache_launches(x))
    arrays = (x.q, x.k, x.v, x.seqlens, x.block_table, x.k_new, x.v_new)
    given = (q, k_cache, v_cache, cache_seqlens if x.seqlens is not None else None, block_table, k_new, v_new)
    if key is not None and all((a is None) == (b is None) and (a is None or a.data.ptr == b.data.ptr)
                               for a, b in zip(arrays, given)):
        _keep(key, plan)   # the kernels read the call's own arrays: a repeat can pass them as they are
    return plan, arrays
