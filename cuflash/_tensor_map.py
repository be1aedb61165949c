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
import dataclasses
import functools
from dataclasses import dataclass

from . import _gpu, _params

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


def encode(tile: TileMap) -> bytes:
    """The 128 bytes of ``tile``'s tensor map, from the driver (AttentionMaps keeps a launch's
    maps per address triple, so a repeated call encodes nothing)."""
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


# kernels/prefill/attn_fwd_sm90_ws.cuh: MAP_BATCH_DIMS, and the columns of one box (a
# 128-byte-swizzled panel of 16-bit elements)
MAP_BATCH_DIMS = 3
PANEL_COLUMNS = 64
KEPT_ADDRESSES = 256   # address triples whose maps a launch keeps (a model's layers, each its own)


@dataclass(frozen=True)
class AttentionMaps:
    """The tensor maps of one launch of the loading-warpgroup forward, Q, K and V, but for
    their addresses, and the padded batch layout the launch's record takes with them.
    ``encoded`` gives a call's 384 bytes: kept per address triple, so that a call whose
    arrays sit where an earlier call's did (CuPy's pool reuses memory) encodes nothing."""

    maps: tuple[TileMap, TileMap, TileMap]   # q, k, v with address 0
    layout: _params.BatchLayout
    kept: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    def encoded(self, q_address: int, k_address: int, v_address: int) -> bytes:
        key = (q_address, k_address, v_address)
        got = self.kept.get(key)
        if got is None:
            got = b"".join(encode(dataclasses.replace(m, address=a)) for m, a in zip(self.maps, key))
            if len(self.kept) >= KEPT_ADDRESSES:
                del self.kept[next(iter(self.kept))]   # the oldest
            self.kept[key] = got
        return got


def attention_maps(x, block_m: int, block_n: int) -> AttentionMaps | None:
    """The maps of a dense forward over the inputs ``x`` (_checks.AttnInputs) with Q tiles of
    ``block_m`` rows and K/V tiles of ``block_n``, or None where maps cannot describe them
    (packed sequences, more than MAP_BATCH_DIMS batch dims, strides a map cannot take).

    Each map's dims, innermost first: the head dim, the rows, then the launch's batch dims
    padded to MAP_BATCH_DIMS with leading dims of size 1. A map has no zero strides, so a dim
    the tensor broadcasts is one wide there (the kernel reads it at 0)."""
    if x.packed is not None or x.dtype_name not in ("float16", "bfloat16"):
        return None
    shape, strides = tuple(x.kernel_batch_shape), tuple(x.kernel_batch_strides)
    pad = MAP_BATCH_DIMS - len(shape)
    if pad < 0:
        return None
    shape = (1,) * pad + shape
    strides = tuple((0,) * pad + tuple(st) for st in strides)
    item = ITEM_BYTES[x.dtype_name]
    maps = []
    for st, row_stride, cols, rows, box_rows in zip(
            strides, x.row_strides, (x.d, x.d, x.dv), (x.nq, x.nk, x.nk), (block_m, block_n, block_n)):
        if row_stride <= 0 or any(s < 0 for s in st):
            return None
        dims, byte_strides = [cols, rows], [row_stride * item]
        for n, s in zip(reversed(shape), reversed(st)):   # innermost batch dim first
            wide = n if s else 1
            # (a one-wide dim's stride is never stepped: the packed value keeps it valid)
            byte_strides.append(s * item if s else byte_strides[-1] * dims[-1])
            dims.append(wide)
        maps.append(TileMap(x.dtype_name, 0, tuple(dims), tuple(byte_strides), (PANEL_COLUMNS, box_rows) + (1,) * MAP_BATCH_DIMS))
    for tile in maps:
        try:
            dataclasses.replace(tile, address=16).check()   # (any aligned address: the call's come later)
        except ValueError:
            return None
    layout = _params.BatchLayout(shape, strides, x.batch_size)
    return AttentionMaps(tuple(maps), layout)
