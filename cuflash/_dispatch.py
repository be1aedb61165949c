"""Which kernel runs a call: the specialization table and the launch.

A specialization is one instantiation of a kernel template: element type,
head dim (d and dv padded up to the next bucket), tile shape. Tile shapes are
data, chosen per (dtype, head dim) in ``fwd_tiles``; a new dtype or head dim
is a table row here, never a new kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # two 16-row tiles per warp halve the shared-memory reads of K and V per product
    block_m = 128 if head_dim <= 128 else 64
    block_n = 64 if head_dim <= 128 else 32
    return FwdTiles(head_dim, head_dim, block_m=block_m, block_n=block_n, warps=4)


def fwd_name(dtype_name: str, tiles: FwdTiles) -> str:
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    return f"cuflash::attn_fwd<{elem}, {t.head_dim}, {t.dv_block}, {t.block_m}, {t.block_n}, {t.warps}>"


@dataclass(frozen=True)
class BwdTiles:
    head_dim: int  # d and dv padded up to this bucket
    dcol: int  # gradient columns per thread block (a grid dimension when < head_dim)
    step: int  # rows of the streamed side per pipeline step
    warps: int  # each owns 16 resident rows

    @property
    def resident(self) -> int:
        return 16 * self.warps

    def smem_bytes(self, itemsize: int) -> int:
        # tile_config.cuh: BwdConfig::SMEM_BYTES
        tiles = 2 * self.resident + 4 * self.step
        return tiles * self.head_dim * itemsize + 4 * self.step * 4


def bwd_tiles(dtype_name: str, head_dim: int) -> BwdTiles:
    """Tile shape of the backward kernels for one (dtype, head-dim bucket).

    A warp keeps 16 rows x dcol accumulators of dk and dv (or of dq) plus two
    16 x step score tiles in registers; wide head dims split the gradient
    columns over blocks (each recomputing the scores) so that nothing spills.
    """
    if dtype_name == "float32":
        return BwdTiles(head_dim, 32, 16, warps=4)
    dcol = {192: 96, 256: 128}.get(head_dim, head_dim)
    step = {32: 64, 64: 64, 256: 16}.get(head_dim, 32)
    return BwdTiles(head_dim, dcol, step, warps=4)


def bwd_names(dtype_name: str, tiles: BwdTiles) -> tuple[str, str, str]:
    """(delta, dk/dv, dq) kernel name expressions."""
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    args = f"{elem}, {t.head_dim}, {t.dcol}, {t.step}, {t.warps}"
    return (f"cuflash::attn_bwd_delta<{elem}>", f"cuflash::attn_bwd_dkdv<{args}>", f"cuflash::attn_bwd_dq<{args}>")


def all_specializations() -> list[str]:
    """Every kernel name expression the library can launch."""
    names = []
    for dt in ELEMENT_TYPES:
        for hd in HEAD_DIM_BUCKETS:
            names.append(fwd_name(dt, fwd_tiles(dt, hd)))
            names.extend(n for n in bwd_names(dt, bwd_tiles(dt, hd)) if n not in names)
    return names


def launch_forward(inputs, out, lse) -> None:
    """Runs the forward kernel over the whole broadcast batch in one launch."""
    x = inputs
    tiles = fwd_tiles(x.dtype_name, head_dim_bucket(x.d, x.dv))
    smem = tiles.smem_bytes(ELEMENT_TYPES[x.dtype_name][1])
    fn = _compile.get_function(fwd_name(x.dtype_name, tiles), smem)
    params = _params.attn_params(x, out, lse, tiles.block_m)
    grid = (int(params[0]["num_m_blocks"]) * x.batch_size, max(1, -(-x.dv // tiles.dv_block)))
    fn(grid, (tiles.warps * 32,), (params,), shared_mem=smem)


def launch_backward(inputs, out, lse, dout, delta, dq, dk, dv) -> None:
    """delta = rowsum(dout * out), then dk/dv over key blocks, then dq over query blocks."""
    x = inputs
    tiles = bwd_tiles(x.dtype_name, head_dim_bucket(x.d, x.dv))
    smem = tiles.smem_bytes(ELEMENT_TYPES[x.dtype_name][1])
    delta_name, dkdv_name, dq_name = bwd_names(x.dtype_name, tiles)
    params = _params.bwd_params(x, out, lse, dout, delta, dq, dk, dv, tiles.resident)
    record = params[0]
    rows = x.batch_size * x.nq
    if rows:
        _compile.get_function(delta_name, 0)((-(-rows // 4),), (128,), (params,))
    threads = (tiles.warps * 32,)
    col_blocks = max(1, -(-max(x.d, x.dv) // tiles.dcol))
    if x.nk:
        fn = _compile.get_function(dkdv_name, smem)
        fn((int(record["num_n_blocks"]) * x.batch_size, col_blocks), threads, (params,), shared_mem=smem)
    if x.nq:
        fn = _compile.get_function(dq_name, smem)
        fn((int(record["num_m_blocks"]) * x.batch_size, col_blocks), threads, (params,), shared_mem=smem)
