"""Which kernel runs a call: the specialization table and the launch.

A specialization is one instantiation of a kernel template: element type,
head dim (d and dv padded up to the next bucket), tile shape. Tile shapes are
data, chosen per (dtype, head dim) in ``fwd_tiles``; a new dtype or head dim
is a table row here, never a new kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _compile, _params

# Head dims are padded (without copies: the loads zero-fill) to the next bucket.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

# dtype name -> (C++ element type, bytes per element)
ELEMENT_TYPES = {
    "float16": ("cuflash::f16", 2),
    "bfloat16": ("cuflash::bf16", 2),
    "float32": ("cuflash::f32", 4),
}


@dataclass(frozen=True)
class FwdTiles:
    head_dim: int  # d and dv padded up to this bucket
    dv_block: int  # output columns per thread block (a grid dimension when < head_dim)
    block_m: int  # query rows per thread block
    block_n: int  # keys per pipeline step
    warps: int

    def smem_bytes(self, itemsize: int) -> int:
        # Q tile + two pipeline stages of K and V (tile_config.cuh: FwdConfig::SMEM_BYTES)
        rows = self.block_m * self.head_dim + 2 * self.block_n * (self.head_dim + self.dv_block)
        return rows * itemsize


def head_dim_bucket(d: int, dv: int) -> int:
    need = max(d, dv)
    for bucket in HEAD_DIM_BUCKETS:
        if need <= bucket:
            return bucket
    raise ValueError(f"head dim {need} is above the largest supported, {MAX_HEAD_DIM}")


def fwd_tiles(dtype_name: str, head_dim: int) -> FwdTiles:
    """Tile shape of the forward kernel for one (dtype, head-dim bucket).

    Each warp keeps 16 rows x dv_block output accumulators in registers; the
    key block shrinks as the head dim grows so that nothing spills. float32
    products run on the FMA units (kernels/mma.cuh) and need more registers,
    so at head dim 256 its output columns are split over four blocks.
    """
    if dtype_name == "float32":
        block_n = {32: 64, 64: 64, 96: 32}.get(head_dim, 16)
        dv_block = 64 if head_dim == 256 else head_dim
        return FwdTiles(head_dim, dv_block, block_m=64, block_n=block_n, warps=4)
    block_n = {32: 64, 64: 64, 96: 32, 128: 64, 192: 32}.get(head_dim, 16)
    return FwdTiles(head_dim, head_dim, block_m=64, block_n=block_n, warps=4)


def fwd_name(dtype_name: str, tiles: FwdTiles) -> str:
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    return f"cuflash::attn_fwd<{elem}, {t.head_dim}, {t.dv_block}, {t.block_m}, {t.block_n}, {t.warps}>"


def all_specializations() -> list[str]:
    """Every kernel name expression the library can launch."""
    return [fwd_name(dt, fwd_tiles(dt, hd)) for dt in ELEMENT_TYPES for hd in HEAD_DIM_BUCKETS]


def launch_forward(inputs, out, lse) -> None:
    """Runs the forward kernel over the whole broadcast batch in one launch."""
    x = inputs
    tiles = fwd_tiles(x.dtype_name, head_dim_bucket(x.d, x.dv))
    smem = tiles.smem_bytes(ELEMENT_TYPES[x.dtype_name][1])
    fn = _compile.get_function(fwd_name(x.dtype_name, tiles), smem)
    params = _params.attn_params(x, out, lse, tiles.block_m)
    grid = (int(params[0]["num_m_blocks"]) * x.batch_size, max(1, -(-x.dv // tiles.dv_block)))
    fn(grid, (tiles.warps * 32,), (params,), shared_mem=smem)
