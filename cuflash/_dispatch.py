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
        block_n = {32: 64, 64: 32, 96: 32}.get(head_dim, 16)
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
class Sm90FwdTiles:
    """Tile shape of the Hopper forward kernel (kernels/attn_fwd_sm90.cuh)."""

    head_dim: int  # d and dv padded up to this bucket, a multiple of 64
    block_n: int  # keys per pipeline step
    warpgroups: int  # each owns 64 query rows
    stages: int = 2  # K and V blocks in flight
    min_blocks: int = 1  # blocks per SM the registers are budgeted for

    @property
    def block_m(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    def smem_bytes(self, itemsize: int) -> int:
        # tile_config.cuh: Sm90FwdConfig::SMEM_BYTES (1024 bytes to align the swizzle atoms)
        return 1024 + (self.block_m + 2 * self.stages * self.block_n) * self.head_dim * itemsize


def sm90_fwd_tiles(dtype_name: str, head_dim: int) -> Sm90FwdTiles | None:
    """The Hopper forward tiles for (dtype, head-dim bucket), or None where the
    portable kernel runs instead (float32, head dims that are not whole 64-column panels)."""
    if dtype_name == "float32" or head_dim % 64 or head_dim == 192:
        return None
    # by measurement (bench/tune_tiles.py, bench/NOTES.md): a third K/V stage
    # gained nothing, and 64-key blocks beat 128 at head dim 64
    block_n = 128 if head_dim == 128 else 64
    return Sm90FwdTiles(head_dim, block_n, warpgroups=2, stages=2)


def sm90_fwd_name(dtype_name: str, tiles: Sm90FwdTiles) -> str:
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    return f"cuflash::attn_fwd_sm90<{elem}, {t.head_dim}, {t.block_n}, {t.warpgroups}, {t.stages}, {t.min_blocks}>"


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


@dataclass(frozen=True)
class Sm90BwdTiles:
    """Tile shape of the Hopper backward kernels (kernels/attn_bwd_sm90.cuh)."""

    head_dim: int  # d and dv padded up to this bucket, a multiple of 64
    dkdv_dcol: int  # dk/dv columns per block (a grid dimension when < head_dim)
    dq_dcol: int  # dq columns per block
    step: int  # rows of the streamed side per pipeline step
    warpgroups: int  # each owns 64 resident rows
    stages: int = 2  # steps in flight
    min_blocks: int = 1  # blocks per SM the registers are budgeted for
    # dk/dv by attn_bwd_dkdv_wide_sm90: both warpgroups on the same 64 keys, one
    # accumulating dv, the other dk, over all columns (dkdv_dcol = head_dim)
    wide_dkdv: bool = False
    # the dq pass's own step and stages; 0: those of dk/dv
    dq_step: int = 0
    dq_stages: int = 0

    @property
    def resident(self) -> int:
        return 64 * self.warpgroups

    @property
    def dkdv_resident(self) -> int:
        return 64 if self.wide_dkdv else self.resident

    @property
    def dq_pipeline(self) -> tuple[int, int]:
        """(step, stages) of the dq pass."""
        return self.dq_step or self.step, self.dq_stages or self.stages

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    def dkdv_smem_bytes(self, itemsize: int) -> int:
        if not self.wide_dkdv:
            return self._smem_bytes(self.resident, self.step, self.stages, itemsize)
        # one warpgroup's rows, plus one step of p^T as float32
        return self._smem_bytes(64, self.step, self.stages, itemsize) + 64 * self.step * 4

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of the dq pass."""
        return self._smem_bytes(self.resident, *self.dq_pipeline, itemsize)

    def _smem_bytes(self, resident: int, step: int, stages: int, itemsize: int) -> int:
        # tile_config.cuh: Sm90BwdConfig::SMEM_BYTES
        tiles = 2 * resident + 2 * stages * step
        return 1024 + tiles * self.head_dim * itemsize + 2 * stages * step * 4


def sm90_bwd_tiles(dtype_name: str, head_dim: int) -> Sm90BwdTiles | None:
    """The Hopper backward tiles for (dtype, head-dim bucket), or None (as sm90_fwd_tiles).

    At head dim 256 a warpgroup can hold one 64 x 256 gradient accumulator but not
    two: dk/dv runs the wide kernel (dv in one warpgroup, dk in the other)."""
    if dtype_name == "float32" or head_dim % 64 or head_dim == 192:
        return None
    if head_dim == 256:
        return Sm90BwdTiles(256, 256, 256, step=32, warpgroups=2, stages=3, wide_dkdv=True)
    if head_dim == 64:
        # by measurement (bench/NOTES.md v8): one warpgroup per block and two blocks
        # per SM, with no barrier between them, so one block's exponentials run
        # during the other's products; dk/dv's gradient products overlapping the
        # next step (3 stages); dq over 128 keys per step
        return Sm90BwdTiles(64, 64, 64, step=64, warpgroups=1, stages=3, min_blocks=2, dq_step=128, dq_stages=2)
    # three stages spill at head dim 128
    return Sm90BwdTiles(head_dim, head_dim, head_dim, step=64, warpgroups=2, stages=2)


def sm90_bwd_names(dtype_name: str, tiles: Sm90BwdTiles) -> tuple[str, str]:
    """(dk/dv, dq) kernel name expressions."""
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    if t.wide_dkdv:
        dkdv = f"cuflash::attn_bwd_dkdv_wide_sm90<{elem}, {t.head_dim}, {t.step}, {t.stages}>"
    else:
        rest = f"{t.step}, {t.warpgroups}, {t.stages}, {t.min_blocks}"
        dkdv = f"cuflash::attn_bwd_dkdv_sm90<{elem}, {t.head_dim}, {t.dkdv_dcol}, {rest}>"
    dq_step, dq_stages = t.dq_pipeline
    dq_rest = f"{dq_step}, {t.warpgroups}, {dq_stages}, {t.min_blocks}"
    return dkdv, f"cuflash::attn_bwd_dq_sm90<{elem}, {t.head_dim}, {t.dq_dcol}, {dq_rest}>"


def all_specializations(arch: str = "sm_80") -> list[str]:
    """Every kernel name expression the library can launch on a target such as ``"sm_90a"``."""
    names = []
    for dt in ELEMENT_TYPES:
        for hd in HEAD_DIM_BUCKETS:
            names.append(fwd_name(dt, fwd_tiles(dt, hd)))
            names.extend(n for n in bwd_names(dt, bwd_tiles(dt, hd)) if n not in names)
            sm90 = sm90_fwd_tiles(dt, hd) if arch == "sm_90a" else None
            if sm90 is not None:
                names.append(sm90_fwd_name(dt, sm90))
                names.extend(sm90_bwd_names(dt, sm90_bwd_tiles(dt, hd)))
    return names


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: everything but the data pointers, which
    ``run`` fills into a copy of the parameter record."""

    fn: object
    grid: tuple[int, ...]
    threads: int
    smem: int
    params: np.ndarray  # AttnParams or BwdParams, pointers 0

    def run(self, arrays) -> None:
        self.fn(self.grid, (self.threads,), (_params.with_pointers(self.params, arrays),), shared_mem=self.smem)


def forward_launches(x) -> tuple[Launch, ...]:
    """The forward over the whole broadcast batch: one launch (with at least one query)."""
    head_dim = head_dim_bucket(x.d, x.dv)
    itemsize = ELEMENT_TYPES[x.dtype_name][1]
    sm90 = sm90_fwd_tiles(x.dtype_name, head_dim) if _compile.current_arch() == "sm_90a" else None
    if sm90 is not None:
        smem = sm90.smem_bytes(itemsize)
        fn = _compile.get_function(sm90_fwd_name(x.dtype_name, sm90), smem)
        params = _params.attn_params(x, sm90.block_m)
        return (Launch(fn, (int(params[0]["num_m_blocks"]) * x.batch_size,), sm90.threads, smem, params),)
    tiles = fwd_tiles(x.dtype_name, head_dim)
    smem = tiles.smem_bytes(itemsize)
    fn = _compile.get_function(fwd_name(x.dtype_name, tiles), smem)
    params = _params.attn_params(x, tiles.block_m)
    grid = (int(params[0]["num_m_blocks"]) * x.batch_size, max(1, -(-x.dv // tiles.dv_block)))
    return (Launch(fn, grid, tiles.warps * 32, smem, params),)


def backward_launches(x) -> tuple[Launch, ...]:
    """delta = rowsum(dout * out), then dk/dv over key blocks, then dq over query blocks
    (on sm_90a: dq with delta, then dk/dv). With at least one query and one key."""
    head_dim = head_dim_bucket(x.d, x.dv)
    itemsize = ELEMENT_TYPES[x.dtype_name][1]
    width = max(x.d, x.dv)
    sm90 = sm90_bwd_tiles(x.dtype_name, head_dim) if _compile.current_arch() == "sm_90a" else None
    if sm90 is not None:
        dkdv_name, dq_name = sm90_bwd_names(x.dtype_name, sm90)
        params = _params.bwd_params(x, sm90.resident)
        dkdv_params = _params.bwd_params(x, sm90.dkdv_resident)
        dq_smem, dkdv_smem = sm90.smem_bytes(itemsize), sm90.dkdv_smem_bytes(itemsize)
        m_blocks, n_blocks = int(params[0]["num_m_blocks"]), int(dkdv_params[0]["num_n_blocks"])
        return (
            Launch(_compile.get_function(dq_name, dq_smem), (m_blocks * x.batch_size, -(-width // sm90.dq_dcol)),
                   sm90.threads, dq_smem, params),
            Launch(_compile.get_function(dkdv_name, dkdv_smem), (n_blocks * x.batch_size, -(-width // sm90.dkdv_dcol)),
                   sm90.threads, dkdv_smem, dkdv_params),
        )
    tiles = bwd_tiles(x.dtype_name, head_dim)
    params = _params.bwd_params(x, tiles.resident)
    delta_name, dkdv_name, dq_name = bwd_names(x.dtype_name, tiles)
    smem = tiles.smem_bytes(itemsize)
    col_blocks = max(1, -(-width // tiles.dcol))
    m_blocks, n_blocks = int(params[0]["num_m_blocks"]), int(params[0]["num_n_blocks"])
    return (
        Launch(_compile.get_function(delta_name, 0), (-(-x.batch_size * x.nq // 4),), 128, 0, params),
        Launch(_compile.get_function(dkdv_name, smem), (n_blocks * x.batch_size, col_blocks), tiles.warps * 32, smem, params),
        Launch(_compile.get_function(dq_name, smem), (m_blocks * x.batch_size, col_blocks), tiles.warps * 32, smem, params),
    )
