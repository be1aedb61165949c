"""Tensor maps: the 128-byte descriptors that Hopper's bulk tensor copy engine (TMA,
``cp.async.bulk.tensor``, kernels/arch/tma.cuh) reads a tile of global memory through.

The driver encodes them (``cuTensorMapEncodeTiled``), called through ctypes on the driver
library CuPy itself runs on, so cuflash needs no other binding. A map holds a base address,
the tensor's sizes and byte strides, the box (the tile one copy moves) and the swizzle of
the box in shared memory; kernels receive it by value inside their parameter record. The
maps of a call signature are made once and kept, like its launch plan: a repeated call
encodes nothing.

Dimensions are listed innermost first, as the driver takes them: a (B, H, N, D) array with
row-major strides is dims (D, N, H, B), byte strides (N, H, B)'s.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from . import _gpu

MAP_BYTES = 128        # sizeof(CUtensorMap); 64-byte aligned where a kernel holds it
MAX_RANK = 5
MAX_BOX = 256          # elements per box dimension
MAX_STRIDE = 1 << 40   # bytes

# CUtensorMapDataType, by cuflash's dtype names
DATA_TYPES = {"float16": 6, "float32": 7, "bfloat16": 9}
ITEM_BYTES = {"float16": 2, "float32": 4, "bfloat16": 2}
# CUtensorMapSwizzle, by the bytes one swizzled row of the box spans (0: none)
SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
_INTERLEAVE_NONE = 0
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0     # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: boxes past the tensor's ends read zeros


@dataclass(frozen=True)
class TileMap:
    """What a tensor map describes (everything but the encoded bytes)."""

    dtype_name: str
    address: int                    # the tensor's first element, 16-byte aligned
    dims: tuple[int, ...]           # elements per dimension, innermost first
    strides: tuple[int, ...]        # bytes between consecutive indices of dims[1:]
    box: tuple[int, ...]            # elements one copy moves per dimension
    swizzle: int = 128              # bytes of a swizzled box row in shared memory (0: none)

    def check(self) -> None:
        """Raises ValueError where the driver would refuse the map (its documented limits)."""
        if self.dtype_name not in DATA_TYPES:
            raise ValueError(f"tensor maps take {', '.join(DATA_TYPES)}, not {self.dtype_name}")
        rank = len(self.dims)
        if not 1 <= rank <= MAX_RANK or len(self.box) != rank or len(self.strides) != rank - 1:
            raise ValueError(f"a tensor map has 1 to {MAX_RANK} dims, a box entry per dim and a stride per "
                             f"dim but the first: dims {self.dims}, strides {self.strides}, box {self.box}")
        if self.address % 16:
            raise ValueError(f"a tensor map's base address must be 16-byte aligned, got {self.address:#x}")
        if any(not 0 < d < 2**32 for d in self.dims):
            raise ValueError(f"tensor map dims must be in [1, 2^32), got {self.dims}")
        if any(s % 16 or not 0 < s < MAX_STRIDE for s in self.strides):
            raise ValueError(f"tensor map strides must be positive multiples of 16 bytes under 2^40, got {self.strides}")
        if any(not 0 < b <= MAX_BOX for b in self.box):
            raise ValueError(f"a tensor map's box takes 1 to {MAX_BOX} elements per dim, got {self.box}")
        row_bytes = self.box[0] * ITEM_BYTES[self.dtype_name]
        if row_bytes % 16:
            raise ValueError(f"a box row must be a multiple of 16 bytes, got {row_bytes}")
        if self.swizzle not in SWIZZLES:
            raise ValueError(f"swizzle spans {sorted(SWIZZLES)} bytes, not {self.swizzle}")
        if self.swizzle and row_bytes > self.swizzle:
            raise ValueError(f"a box row of {row_bytes} bytes does not fit a {self.swizzle}-byte swizzle")


class TensorMapError(RuntimeError):
    """The driver refused to encode a tensor map."""


@functools.lru_cache(maxsize=1)
def _encoder():
    driver = ctypes.CDLL(_gpu.DRIVER_LIBRARY)
    encode = driver.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    encode.restype = ctypes.c_int
    return encode


@functools.lru_cache(maxsize=4096)
def encode(tile: TileMap) -> bytes:
    """The 128 bytes of ``tile``'s tensor map, from the driver (kept per map: a call
    signature's maps are encoded once)."""
    tile.check()
    rank = len(tile.dims)
    out = (ctypes.c_uint64 * (MAP_BYTES // 8))()
    dims = (ctypes.c_uint64 * rank)(*tile.dims)
    strides = (ctypes.c_uint64 * max(1, rank - 1))(*tile.strides)
    box = (ctypes.c_uint32 * rank)(*tile.box)
    steps = (ctypes.c_uint32 * rank)(*([1] * rank))
    status = _encoder()(ctypes.addressof(out), DATA_TYPES[tile.dtype_name], rank, tile.address, dims, strides, box,
                        steps, _INTERLEAVE_NONE, SWIZZLES[tile.swizzle], _L2_PROMOTION_256B, _OOB_FILL_ZERO)
    if status != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled refused {tile} (CUresult {status})")
    return bytes(out)
