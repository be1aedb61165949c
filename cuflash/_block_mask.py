"""`block_mask` on the GPU: a mask function's tiles classified by kernels/user/block_mask.cuh,
the function compiled from its trace (cuflash._codegen). cuflash.reference.block_mask is the
NumPy twin."""

from __future__ import annotations

import numpy as np

from . import _checks, _codegen, _compile, _trace
from .reference import BlockMask

THREADS = 256       # a tile's elements shared among them
MAX_BLOCKS = 1 << 16   # the grid strides over the tiles past this many


def block_mask(mask_mod, batch_shape, nq, nk, block=(128, 128)) -> BlockMask:
    """What ``mask_mod`` allows in each tile of ``block = (rows, keys)``, computed on the current
    GPU: a `cuflash.reference.BlockMask` whose ``kinds`` (int8, ``batch_shape + (ceil(nq / rows),
    ceil(nk / keys))``) is a CuPy array, EMPTY, PARTIAL or FULL per tile.

    ``mask_mod(*batch_indices, q_idx, kv_idx)`` is a mask function as `cuflash.attention` takes
    it (one index per batch dim, then the row and the key), traced and compiled once per function
    and signature; the CuPy arrays it captures are read on the GPU and must be on the current
    device. Build it once for the shapes and reuse it across layers and steps, as
    FlexAttention's ``create_block_mask``; `cuflash.attention` and its backward take it as
    ``block_mask`` (with its ``mask_mod``) and skip the tiles it leaves empty. Raises ValueError for sizes that are not
    non-negative ints, and the tracing's TypeError for a function it cannot compile.
    """
    batch_shape, nq, nk, (rows, keys) = _checks.check_block_mask(batch_shape, nq, nk, block)
    traced = _trace.trace(mask_mod, "mask_mod", len(batch_shape))
    cupy = _checks.require_cupy()
    arrays = _trace.captured_arrays(mask_mod, traced)
    _trace.check_devices(traced, arrays, cupy.cuda.runtime.getDevice())
    tiles_m, tiles_n = -(-nq // rows), -(-nk // keys)
    kinds = cupy.empty(batch_shape + (tiles_m, tiles_n), dtype=cupy.int8)
    if kinds.size:
        tiling = np.zeros(_trace.MAX_DIMS + 6, dtype=np.int64)   # block_mask.cuh's cf_tiling
        tiling[:len(batch_shape)] = batch_shape
        tiling[_trace.MAX_DIMS:] = (nq, nk, rows, keys, tiles_m, tiles_n)
        descriptors = _codegen.descriptors(arrays).view(np.uint8)
        fn = _compile.get_user_function("cuflash_block_mask", "user/block_mask.cuh", _codegen.mask_mod_source(traced))
        fn((min(kinds.size, MAX_BLOCKS),), (THREADS,),
           (cupy.asarray(tiling), cupy.asarray(descriptors), kinds, np.int64(kinds.size)))
    return BlockMask(kinds, (rows, keys), (nq, nk), mask_mod)
