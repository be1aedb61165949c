"""A call's own score and mask functions on the GPU (docs/contract.md, "User-defined score and
mask functions"): traced (cuflash._trace), their CUDA C++ generated (_codegen.user_mods_source)
and compiled into the attention kernels' UserScores path (kernels/user/user_scores.cuh), and the
arguments each call passes them. cuflash.reference runs the same functions on NumPy arrays."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import _codegen, _trace


@dataclass(eq=False, slots=True)   # (not frozen: a frozen dataclass took 1.4 µs to make, at every call)
class UserMods:
    """The functions of a call and their traces (None where absent), the generated source the
    kernels are compiled with (its ``key`` part of the call's plan), and the arrays the functions
    read at this call (the score function's, then the mask function's, in their traces' slots);
    ``grads``: the slots of the score function's arrays whose gradients a backward adds up
    (score_mod_grads; `with_gradients`). Made per call, never changed."""

    score_mod: object
    mask_mod: object
    score: _trace.Traced | None
    mask: _trace.Traced | None
    source: _codegen.Source
    arrays: tuple = ()
    grads: tuple = ()


_sources: dict = {}   # ids of (score trace, mask trace) -> (the traces, their source), made once


def trace(score_mod, mask_mod, batch_dims: int) -> UserMods | None:
    """The call's functions traced for ``batch_dims`` batch indices (their TypeErrors), or None
    without either."""
    if score_mod is None and mask_mod is None:
        return None
    score, score_arrays = (None, []) if score_mod is None else _trace.trace_call(score_mod, "score_mod", batch_dims)
    mask, mask_arrays = (None, []) if mask_mod is None else _trace.trace_call(mask_mod, "mask_mod", batch_dims)
    key = (id(score), id(mask))   # (each entry keeps its traces, so their ids stay theirs)
    kept = _sources.get(key)
    if kept is None:
        kept = _sources[key] = (score, mask, _codegen.user_mods_source(score, mask))
    return UserMods(score_mod, mask_mod, score, mask, kept[2], (*score_arrays, *mask_arrays))


def with_gradients(user: UserMods | None, score_mod_grads) -> tuple:
    """(``user`` asking for the gradients of the arrays of ``score_mod_grads``, each slot once,
    and the slot of each of those arrays), from `_trace.gradient_slots` (its errors); (``user``,
    None) without any."""
    traced = None if user is None else user.score
    slots = _trace.gradient_slots(traced, () if traced is None else user.arrays[:len(traced.captures)],
                                  score_mod_grads)
    if not slots:
        return user, slots
    return dataclasses.replace(user, grads=tuple(dict.fromkeys(slots))), slots


def check_backward(score_mod, dbias_under_softcap: bool) -> None:
    """What the GPU backward does not take yet with the call's functions (NotImplementedError;
    cuflash.reference takes it): dbias under softcap with a score function (the kernels keep
    one factor per score, score_mod's times softcap's)."""
    if score_mod is not None and dbias_under_softcap:
        raise NotImplementedError("cuflash.attention_backward does not give dbias (bias_grad=True) with both "
                                  "softcap and score_mod yet (cuflash.reference.attention_backward does)")


# The arguments of earlier calls on the device, by their words: a call whose batch shape and
# captured arrays (pointers, shapes, strides) match an earlier one's reuses its array rather than
# copying the words again (a copy from pageable memory waits for the stream's earlier work).
# Never written once made, and never freed: an array made on one stream may be read on another,
# so one given back to CuPy's pool could be handed out while a kernel still reads it. Past
# ARGUMENTS_KEPT distinct words, a call copies its own.
ARGUMENTS_KEPT = 1024
_arguments: dict = {}


def arguments(cupy, user: UserMods, batch_shape, device: int, block_mask=None, grads=None):
    """The kernels' user_args for a call over ``batch_shape``: the shape in `_trace.MAX_DIMS`
    words, the block mask's (`block_layout`), then the descriptors of the arrays the functions
    capture (the score function's first), on the device (made once per distinct words, up to
    `ARGUMENTS_KEPT` of them); TypeError for a captured array or a block mask not on ``device``.
    ``grads``: with score_mod_grads, the float32 gradient of each slot of ``user.grads`` (contiguous,
    each of its array's shape), whose pointers follow the descriptors, one per slot of the score
    function's arrays (0 for the others); such words are made for the call alone."""
    arrays = user.arrays
    if arrays:
        scored = 0 if user.score is None else len(user.score.positions)
        for traced, captured in ((user.score, arrays[:scored]), (user.mask, arrays[scored:])):
            if traced is not None:
                _trace.check_devices(traced, captured, device)
    blocks = block_mask_layout(block_mask, device)
    if grads is not None:
        pointers = np.zeros(len(user.score.captures), dtype=np.int64)
        for slot, g in zip(user.grads, grads):
            pointers[slot] = g.data.ptr
        return cupy.asarray(np.concatenate([_words(user, batch_shape, blocks), pointers]))
    # (what the words are made of, without making them: a pointer, shape and strides per array)
    key = (device, tuple(batch_shape), blocks, *[(_codegen.data_pointer(a), a.shape, a.strides) for a in arrays])
    kept = _arguments.get(key)
    if kept is None:
        kept = cupy.asarray(_words(user, batch_shape, blocks))
        if len(_arguments) < ARGUMENTS_KEPT:   # (setdefault: one array per key, whichever thread comes first)
            kept = _arguments.setdefault(key, kept)
    return kept


def _words(user: UserMods, batch_shape, blocks) -> np.ndarray:
    """`arguments`' words on the host, up to the arrays' descriptors."""
    shape = np.zeros(_trace.MAX_DIMS, dtype=np.int64)
    shape[:len(batch_shape)] = batch_shape
    words = _NO_BLOCK_MASK if blocks is None else block_layout(*blocks, batch_shape)
    return np.concatenate([shape, words, _codegen.descriptors(user.arrays).view(np.int64)])


BLOCK_WORDS = 7 + _trace.MAX_DIMS   # kernels/user/block_tiles.cuh: cf_block_mask
_NO_BLOCK_MASK = np.zeros(BLOCK_WORDS, dtype=np.int64)   # (no block mask: the kernels read zeros)
_NO_BLOCK_MASK.flags.writeable = False


def block_mask_layout(block_mask, device: int):
    """A block mask's kinds (checked to fit the call: `_checks.check_block_mask_fits`) as
    `block_layout` takes them, (pointer, shape, strides, block); None without one. TypeError for
    kinds that are not a CuPy array on ``device``."""
    if block_mask is None:
        return None
    kinds = block_mask.kinds
    if type(kinds).__module__.split(".")[0] != "cupy":
        raise TypeError("block_mask.kinds is not a CuPy array: the GPU functions take a block mask of "
                        "cuflash.block_mask (cuflash.reference.block_mask's is for the reference)")
    if kinds.device.id != device:
        raise TypeError(f"block_mask is on device {kinds.device.id}, but q is on device {device}")
    return kinds.data.ptr, kinds.shape, kinds.strides, tuple(block_mask.block)


def block_layout(pointer: int, shape, strides, block, batch_shape) -> np.ndarray:
    """cf_block_mask's words for int8 kinds at ``pointer`` of ``shape`` and ``strides``, blocks of
    ``block`` rows and keys, read by a call over ``batch_shape``: the pointer, a block's rows and
    keys, the blocks down and across and their strides, then a stride per batch dim of the call
    (0 where the kinds broadcast: their batch dims are aligned to the call's last ones)."""
    words = np.zeros(BLOCK_WORDS, dtype=np.int64)
    words[:7] = (pointer, *block, *shape[-2:], *strides[-2:])
    own = len(shape) - 2
    for d in range(len(batch_shape)):
        mine = d - (len(batch_shape) - own)
        if mine >= 0 and shape[mine] != 1:
            words[7 + d] = strides[mine]
    return words
