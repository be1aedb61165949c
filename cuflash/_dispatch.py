"""Which kernel runs a call: the specialization table and the launch.

A specialization is one instantiation of a kernel template: element type,
head dim (d and dv padded up to the next bucket), tile shape. Tile shapes are
data, chosen per (dtype, head dim) in ``fwd_tiles``; a new dtype or head dim
is a table row here, never a new kernel.
"""

from __future__ import annotations

import math
import operator
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


def fwd_tiles(dtype_name: str, head_dim: int, packed: bool = False) -> FwdTiles:
    """Tile shape of the forward kernel for one (dtype, head-dim bucket).

    Each warp keeps 16 rows x dv_block output accumulators in registers; the
    key block shrinks as the head dim grows so that nothing spills. float32
    products run on the FMA units (kernels/arch/mma.cuh) and need more registers,
    so at head dim 256 its output columns are split over four blocks.
    """
    if dtype_name == "float32":
        block_n = {32: 64, 64: 32, 96: 32}.get(head_dim, 16)
        dv_block = 64 if head_dim == 256 else head_dim
        return FwdTiles(head_dim, dv_block, block_m=64, block_n=block_n, warps=4)
    # two 16-row tiles per warp halve the shared-memory reads of K and V per product; the
    # packed-sequence kernels hold a few more registers and take two only up to head dim 64
    block_m = 128 if head_dim <= (64 if packed else 128) else 64
    block_n = 64 if head_dim <= 128 else 32
    return FwdTiles(head_dim, head_dim, block_m=block_m, block_n=block_n, warps=4)


def _flag(packed: bool) -> str:
    """The PACKED template argument: the kernels' packed-sequence specialization or the dense one."""
    return "true" if packed else "false"


def fwd_name(dtype_name: str, tiles: FwdTiles, packed: bool = False) -> str:
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    return f"cuflash::attn_fwd<{elem}, {t.head_dim}, {t.dv_block}, {t.block_m}, {t.block_n}, {t.warps}, {_flag(packed)}>"


@dataclass(frozen=True)
class Sm90FwdTiles:
    """Tile shape of the Hopper forward kernel (kernels/prefill/attn_fwd_sm90.cuh)."""

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


def sm90_fwd_tiles(dtype_name: str, head_dim: int, keys: int | None = None) -> Sm90FwdTiles | None:
    """The Hopper forward tiles for (dtype, head-dim bucket), or None where the
    portable kernel runs instead (float32, head dims that are not whole 64-column panels).

    ``keys``: the keys per tile (of each sequence; mean over packed sequences), None when
    not known; short ones change the tiles, by measurement (bench/NOTES.md v10)."""
    if dtype_name == "float32" or head_dim % 64 or head_dim == 192:
        return None
    if head_dim == 64 and keys is not None and keys <= 128:
        # one warpgroup per block, four blocks per SM (bench/NOTES.md v14)
        return Sm90FwdTiles(64, 64, warpgroups=1, stages=2, min_blocks=4)
    # by measurement (bench/tune_tiles.py, bench/NOTES.md): a third K/V stage
    # gained nothing, and 64-key blocks beat 128 at head dim 64 (head dims 64 and 128
    # run these only where hopper_fwd_tiles picks them over the loading-warpgroup kernel)
    block_n = 128 if head_dim == 128 else 64
    return Sm90FwdTiles(head_dim, block_n, warpgroups=2, stages=2)


@dataclass(frozen=True)
class Sm90WsFwdTiles:
    """Tile shape of the Hopper forward with a loading warpgroup (kernels/prefill/attn_fwd_sm90_ws.cuh):
    128 query rows per tile over two computing warpgroups, one block per SM running tiles in turn."""

    head_dim: int  # d and dv padded up to this bucket, a multiple of 64
    block_n: int  # keys per ring buffer
    stages: int  # K and V buffers in the ring
    block_m = 128
    threads = 384

    def smem_bytes(self, itemsize: int) -> int:
        # tile_config.cuh: Sm90WsFwdConfig::SMEM_BYTES (two Q buffers, the ring, 8-byte barriers)
        return 1024 + (2 * self.block_m + 2 * self.stages * self.block_n) * self.head_dim * itemsize + 8 * (4 + 4 * self.stages)


def sm90_ws_fwd_tiles(dtype_name: str, head_dim: int, keys: int | None = None) -> Sm90WsFwdTiles | None:
    """The loading-warpgroup forward's tiles where it runs instead of attn_fwd_sm90, by
    measurement (bench/NOTES.md v13): head dims 64 and 128, except head dim 64 with at most
    128 keys per tile (of each sequence; the mean over packed ones), where blocks of one
    warpgroup, four per SM, stay ahead. None elsewhere."""
    if dtype_name == "float32" or head_dim not in (64, 128):
        return None
    if head_dim == 64 and keys is not None and keys <= 128:
        return None
    return Sm90WsFwdTiles(head_dim, 128, stages=2)


def hopper_fwd_tiles(dtype_name: str, head_dim: int, keys: int | None):
    """The Hopper forward's kernel for a call: loading-warpgroup tiles (Sm90WsFwdTiles),
    attn_fwd_sm90 tiles (Sm90FwdTiles), or None where the portable kernel runs."""
    ws = sm90_ws_fwd_tiles(dtype_name, head_dim, keys)
    return ws if ws is not None else sm90_fwd_tiles(dtype_name, head_dim, keys)


def hopper_fwd_name(dtype_name: str, tiles, packed: bool = False) -> str:
    if isinstance(tiles, Sm90WsFwdTiles):
        return sm90_ws_fwd_name(dtype_name, tiles, packed)
    return sm90_fwd_name(dtype_name, tiles, packed)


# Keys per tile on either side of where the Hopper forward's choice of kernel changes
# (hopper_fwd_tiles), for the list of specializations
HOPPER_FWD_KEYS = (128, 2048)


def sm90_ws_fwd_name(dtype_name: str, tiles: Sm90WsFwdTiles, packed: bool = False) -> str:
    elem = ELEMENT_TYPES[dtype_name][0]
    t = tiles
    return f"cuflash::attn_fwd_sm90_ws<{elem}, {t.head_dim}, {t.block_n}, {t.stages}, {_flag(packed)}>"


def sm90_fwd_name(dtype_name: str, tiles: Sm90FwdTiles, packed: bool = False) -> str:
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    rest = f"{t.warpgroups}, {t.stages}, {t.min_blocks}, {_flag(packed)}"
    return f"cuflash::attn_fwd_sm90<{elem}, {t.head_dim}, {t.block_n}, {rest}>"


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


def bwd_names(dtype_name: str, tiles: BwdTiles, packed: bool = False) -> tuple[str, str, str]:
    """(delta, dk/dv, dq) kernel name expressions."""
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    args = f"{elem}, {t.head_dim}, {t.dcol}, {t.step}, {t.warps}, {_flag(packed)}"
    return (f"cuflash::attn_bwd_delta<{elem}>", f"cuflash::attn_bwd_dkdv<{args}>", f"cuflash::attn_bwd_dq<{args}>")


@dataclass(frozen=True)
class Sm90BwdTiles:
    """Tile shape of the Hopper backward kernels (kernels/prefill/attn_bwd_sm90.cuh)."""

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


def sm90_bwd_names(dtype_name: str, tiles: Sm90BwdTiles, packed: bool = False) -> tuple[str, str]:
    """(dk/dv, dq) kernel name expressions."""
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    flag = _flag(packed)
    if t.wide_dkdv:
        dkdv = f"cuflash::attn_bwd_dkdv_wide_sm90<{elem}, {t.head_dim}, {t.step}, {t.stages}, {flag}>"
    else:
        rest = f"{t.step}, {t.warpgroups}, {t.stages}, {t.min_blocks}, {flag}"
        dkdv = f"cuflash::attn_bwd_dkdv_sm90<{elem}, {t.head_dim}, {t.dkdv_dcol}, {rest}>"
    dq_step, dq_stages = t.dq_pipeline
    dq_rest = f"{dq_step}, {t.warpgroups}, {dq_stages}, {t.min_blocks}, {flag}"
    return dkdv, f"cuflash::attn_bwd_dq_sm90<{elem}, {t.head_dim}, {t.dq_dcol}, {dq_rest}>"


def all_specializations(arch: str = "sm_80") -> list[str]:
    """Every kernel name expression the library can launch on a target such as ``"sm_90a"``."""
    names = []
    for dt in ELEMENT_TYPES:
        for hd in HEAD_DIM_BUCKETS:
            for packed in (False, True):
                sm90 = sm90_fwd_tiles(dt, hd) if arch == "sm_90a" else None
                if sm90 is not None:   # then the portable kernels never run there
                    for keys in HOPPER_FWD_KEYS:
                        name = hopper_fwd_name(dt, hopper_fwd_tiles(dt, hd, keys), packed)
                        if name not in names:
                            names.append(name)
                    names.extend(sm90_bwd_names(dt, sm90_bwd_tiles(dt, hd), packed))
                else:
                    names.append(fwd_name(dt, fwd_tiles(dt, hd, packed), packed))
                    names.extend(n for n in bwd_names(dt, bwd_tiles(dt, hd), packed) if n not in names)
    return (names + ["cuflash::build_tile_list"] + [f(dt) for f in (sum_parts_name, merge_name) for dt in ELEMENT_TYPES]
            + decode_specializations())


def merge_name(dtype_name: str) -> str:
    return f"cuflash::merge_attention<{ELEMENT_TYPES[dtype_name][0]}>"


MERGE_THREADS = 256   # kernels/decode/merge.cuh: one block of MergeTiles::WARPS warps per row


def merge_launch(cupy, outs, lses, out, lse) -> None:
    """cuflash.merge_attention's kernel (kernels/decode/merge.cuh) over contiguous parts of one shape."""
    rows = lse.size
    if not rows:
        return
    if rows >= 2**31:
        raise ValueError(f"merge_attention takes fewer than 2**31 rows (one block each), got {rows}")
    table = cupy.asarray(np.array([[o.data.ptr for o in outs], [x.data.ptr for x in lses]], dtype=np.uint64))
    fn = _compile.get_function(merge_name(out.dtype.name), 0)
    fn((rows,), (MERGE_THREADS,),
       (table[0], table[1], np.int32(len(outs)), np.int64(rows), np.int32(out.shape[-1]), out, lse))


def sum_parts_name(dtype_name: str) -> str:
    return f"cuflash::sum_parts<{ELEMENT_TYPES[dtype_name][0]}>"


def sum_parts(cupy, partial):
    """(before, parts, ...) partial sums of a split grouped dk/dv pass, added in float32 by one
    kernel (kernels/prefill/reduce.cuh): (before, ...)."""
    before, parts = partial.shape[:2]
    total = cupy.empty((before,) + partial.shape[2:], dtype=partial.dtype)
    if total.size:
        fn = _compile.get_function(sum_parts_name(partial.dtype.name), 0)
        blocks = min(-(-total.size // 512), 8 * sm_count())
        fn((blocks,), (256,), (partial, total, np.int64(before), np.int32(parts), np.int64(total.size // before)))
    return total


# The arrays of a call, in the order the launches' ``fields`` index them: a record's
# pointer fields are filled from these (kernels/attention/params.cuh), None giving a null pointer.
FWD_ARRAYS = ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "q_tiles")
BWD_ARRAYS = FWD_ARRAYS + ("k_tiles", "dout", "delta", "dq", "dk", "dv")
_FWD_FIELDS = tuple(range(8))
_DQ_FIELDS = tuple(range(8)) + tuple(range(9, 14))
_DKDV_FIELDS = tuple(range(7)) + tuple(range(8, 14))
Q_TILES, K_TILES = FWD_ARRAYS.index("q_tiles"), BWD_ARRAYS.index("k_tiles")
CU_SEQLENS_Q, CU_SEQLENS_K = FWD_ARRAYS.index("cu_seqlens_q"), FWD_ARRAYS.index("cu_seqlens_k")


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: everything but the data pointers, which ``run``
    writes into the kept parameter record from the call's arrays before launching
    through the driver (cuLaunchKernel, with the record as its one parameter)."""

    fn: object
    grid: tuple[int, ...]
    threads: int
    smem: int
    params: np.ndarray  # AttnParams, BwdParams or DecodeParams, pointers 0
    fields: tuple[int, ...] = _FWD_FIELDS  # the record's pointers, as indices into the arrays

    def __post_init__(self):
        # the record as launches read it, built once per plan rather than per call
        object.__setattr__(self, "_record", _params.Record(self.params))
        object.__setattr__(self, "_function", self.fn.kernel.ptr)
        object.__setattr__(self, "_grid", tuple(self.grid) + (1,) * (3 - len(self.grid)))
        pick = operator.itemgetter(*self.fields)
        object.__setattr__(self, "_pick", pick if len(self.fields) > 1 else lambda arrays: (pick(arrays),))

    def run(self, arrays) -> None:
        """Launches on the current stream; ``arrays`` holds CuPy arrays, raw pointers (int)
        or None (a null pointer)."""
        cupy, driver = _launch_modules()
        pointers = [0 if a is None else a if type(a) is int else a.data.ptr for a in self._pick(arrays)]
        record, (gx, gy, gz) = self._record, self._grid
        stream = cupy.cuda.get_current_stream().ptr
        with record.lock:
            record.fill(pointers)
            driver.launchKernel(self._function, gx, gy, gz, self.threads, 1, 1, self.smem, stream,
                                record.kernel_params, 0)


_modules: tuple = ()


def _launch_modules():
    """(cupy, CuPy's driver bindings), imported once: a launch is on every call's path."""
    global _modules
    if not _modules:
        import cupy
        from cupy_backends.cuda.api import driver

        _modules = (cupy, driver)
    return _modules


@dataclass(frozen=True)
class TileListLaunch:
    """Builds the tile list ``arrays[index]`` of a launch over packed sequences
    (kernels/attention/schedule.cuh), from the offsets alone: no host synchronization."""

    fn: object
    args: tuple  # num_seqs, total_q, total_k, block, by_keys, heavy_last (int32)
    index: int
    capacity: int

    def run(self, arrays) -> None:
        cu_q, cu_k = arrays[CU_SEQLENS_Q], arrays[CU_SEQLENS_K]
        self.fn((1,), (_params.SCHEDULE_THREADS,), (cu_q, cu_k, *self.args, arrays[self.index], np.int32(self.capacity)))


@dataclass(frozen=True)
class Launches:
    """What a call runs, in order, and the tile lists to allocate for it
    (rows of two int32: sequence, block), as (index into the arrays, capacity)."""

    runs: tuple
    tile_lists: tuple[tuple[int, int], ...] = ()
    # grouped dk/dv: the kernels' dk and dv are (before, split, after, nk, d) over the
    # K/V entries, summed over `split` partial groups when split > 1; None: not grouped
    dkdv_entries: tuple[int, int, int] | None = None


_occupancy: dict = {}


def blocks_per_sm(fn, threads: int, smem: int) -> int:
    """How many blocks of ``fn`` fit on one multiprocessor at once, by its registers, its
    shared memory and its threads (the occupancy rules of compute capability 8.0 and 9.0:
    registers in units of 256 per warp, 1 KB of shared memory reserved per block)."""
    key = (fn.num_regs, threads, smem)
    n = _occupancy.get(key)
    if n is None:
        import cupy

        attrs = cupy.cuda.Device().attributes
        warps = -(-threads // 32)
        regs_per_warp = -(-fn.num_regs * 32 // 256) * 256
        n = min(
            attrs["MaxRegistersPerMultiprocessor"] // max(1, warps * regs_per_warp),
            attrs["MaxSharedMemoryPerMultiprocessor"] // (smem + 1024),
            attrs["MaxThreadsPerMultiProcessor"] // threads,
        )
        n = _occupancy[key] = max(1, n)
    return n


_sm_counts: dict = {}


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    n = _sm_counts.get(device)
    if n is None:
        n = _sm_counts[device] = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    return n


def _row_blocks(x, block: int, by_keys: bool, entries: int):
    """(grid.x, tile-list capacity) of a launch over blocks of ``block`` query (or key) rows:
    every block of every entry when dense (capacity 0); when packed, a list long enough for
    any valid offsets, ceil(total / block) + S tiles, times the entries."""
    rows = x.nk if by_keys else x.nq
    if x.packed is None:
        return -(-rows // block) * entries, 0
    capacity = -(-rows // block) + x.packed.num_seqs
    return capacity * entries, capacity


def _tile_list(x, block: int, by_keys: bool, index: int, capacity: int) -> TileListLaunch:
    fn = _compile.get_function("cuflash::build_tile_list", 0)
    args = tuple(np.int32(a) for a in (x.packed.num_seqs, x.nq, x.nk, block, by_keys, not by_keys))
    return TileListLaunch(fn, args, index, capacity)


def forward_launches(x) -> Launches:
    """The forward over the whole broadcast batch: one launch (with at least one query),
    after the one that lists its tiles when the sequences are packed."""
    head_dim = head_dim_bucket(x.d, x.dv)
    itemsize = ELEMENT_TYPES[x.dtype_name][1]
    packed = x.packed is not None
    keys = x.nk / x.packed.num_seqs if packed and x.packed.num_seqs else x.nk
    hopper = hopper_fwd_tiles(x.dtype_name, head_dim, keys) if _compile.current_arch() == "sm_90a" else None
    if hopper is not None:
        smem, block_m, threads, cols = hopper.smem_bytes(itemsize), hopper.block_m, hopper.threads, 1
        fn = _compile.get_function(hopper_fwd_name(x.dtype_name, hopper, packed), smem)
    else:
        tiles = fwd_tiles(x.dtype_name, head_dim, packed)
        smem, block_m, threads, cols = tiles.smem_bytes(itemsize), tiles.block_m, tiles.warps * 32, -(-x.dv // tiles.dv_block)
        fn = _compile.get_function(fwd_name(x.dtype_name, tiles, packed), smem)
    params = _params.attn_params(x, block_m)
    blocks, capacity = _row_blocks(x, block_m, False, x.batch_size)
    params[0]["num_tiles"] = blocks
    if isinstance(hopper, Sm90WsFwdTiles):
        # a grid that fits the GPU at once, each block running tiles in turn
        blocks = min(blocks, sm_count() * blocks_per_sm(fn, threads, smem))
    main = Launch(fn, (blocks, max(1, cols)), threads, smem, params)
    if not capacity:
        return Launches((main,))
    return Launches((_tile_list(x, block_m, False, Q_TILES, capacity), main), ((Q_TILES, capacity),))


def dkdv_layout(x, key_blocks: int, slots: int):
    """The batch layout of the dk/dv pass and its K/V entries' shape (before, split, after),
    or (the common layout, None) when it does not group.

    Grouped, each block sums dk and dv over the query heads of its K/V head, so there are
    G times fewer blocks. When that leaves fewer blocks than fit the GPU at once, each
    group is split in `split` parts (the smallest divisor of G that fills it, at most G / 2)
    whose partial sums the call adds afterwards (by measurement, bench/NOTES.md v10: more
    parts cost more than the balance they add)."""
    layout = _params.batch_layout(x)
    if x.group is None:
        return layout, None
    dim, size, q_stride = x.group
    shape, strides = list(layout.shape), [list(st) for st in layout.strides]
    entries = x.batch_size // size
    split = 1
    if entries * key_blocks < slots and len(shape) < _params.MAX_BATCH_DIMS:
        divisors = [r for r in range(2, size // 2 + 1) if size % r == 0]
        enough = [r for r in divisors if entries * r * key_blocks >= slots]
        split = enough[0] if enough else (divisors[-1] if divisors else 1)
    before, after = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    if split > 1:
        shape[dim:dim + 1] = [split, size // split]
        for st, moving in zip(strides, (q_stride, 0, 0)):
            st[dim:dim + 1] = [moving * (size // split), moving]
        dim += 1
    grouped = _params.BatchLayout(
        tuple(shape), tuple(tuple(st) for st in strides), entries * split, size // split, after, q_stride
    )
    return grouped, (before, split, after)


def backward_launches(x) -> Launches:
    """delta = rowsum(dout * out), then dk/dv over key blocks, then dq over query blocks
    (on sm_90a: dq with delta, then dk/dv); with packed sequences, after the launches that
    list their tiles. With at least one query and one key."""
    head_dim = head_dim_bucket(x.d, x.dv)
    itemsize = ELEMENT_TYPES[x.dtype_name][1]
    width = max(x.d, x.dv)
    sm90 = sm90_bwd_tiles(x.dtype_name, head_dim) if _compile.current_arch() == "sm_90a" else None
    if sm90 is not None:
        dkdv_name, dq_name = sm90_bwd_names(x.dtype_name, sm90, x.packed is not None)
        dq_res, dkdv_res, threads = sm90.resident, sm90.dkdv_resident, sm90.threads
        dq_smem, dkdv_smem = sm90.smem_bytes(itemsize), sm90.dkdv_smem_bytes(itemsize)
        dq_cols, dkdv_cols = -(-width // sm90.dq_dcol), -(-width // sm90.dkdv_dcol)
        per_sm = sm90.min_blocks
    else:
        tiles = bwd_tiles(x.dtype_name, head_dim)
        delta_name, dkdv_name, dq_name = bwd_names(x.dtype_name, tiles, x.packed is not None)
        dq_res = dkdv_res = tiles.resident
        dq_smem = dkdv_smem = tiles.smem_bytes(itemsize)
        dq_cols = dkdv_cols = max(1, -(-width // tiles.dcol))
        threads, per_sm = tiles.warps * 32, 2
    key_blocks = -(-x.nk // dkdv_res) + (x.packed.num_seqs // 2 if x.packed else 0)
    layout, entries = dkdv_layout(x, key_blocks, per_sm * sm_count())
    dq_params = _params.bwd_params(x, dq_res)
    dkdv_params = _params.bwd_params(x, dkdv_res, layout)
    dq_blocks, q_capacity = _row_blocks(x, dq_res, False, x.batch_size)
    dkdv_blocks, k_capacity = _row_blocks(x, dkdv_res, True, layout.entries)
    dq = Launch(_compile.get_function(dq_name, dq_smem), (dq_blocks, dq_cols), threads, dq_smem, dq_params, _DQ_FIELDS)
    dkdv = Launch(_compile.get_function(dkdv_name, dkdv_smem), (dkdv_blocks, dkdv_cols), threads, dkdv_smem,
                  dkdv_params, _DKDV_FIELDS)
    if sm90 is not None:
        runs = (dq, dkdv)
    else:
        delta = Launch(_compile.get_function(delta_name, 0), (-(-x.batch_size * x.nq // 4),), 128, 0, dq_params,
                       _DQ_FIELDS)
        runs = (delta, dkdv, dq)
    if x.packed is None:
        return Launches(runs, (), entries)
    lists = (_tile_list(x, dq_res, False, Q_TILES, q_capacity), _tile_list(x, dkdv_res, True, K_TILES, k_capacity))
    return Launches(lists + runs, ((Q_TILES, q_capacity), (K_TILES, k_capacity)), entries)


DECODE_BLOCK_N = 64   # kernels/decode/decode.cuh: keys per pipeline stage


def decode_rows(head_dim: int, rows: int, itemsize: int = 2) -> int:
    """Query rows per block of the decoding kernel: 16 or 32 (M_TILES 1 or 2; 32 only for
    16-bit types up to head dim 128, by registers)."""
    return 32 if rows > 16 and head_dim <= 128 and itemsize == 2 else 16


def decode_stages(head_dim: int, itemsize: int) -> int:
    """K/V stages in flight: three where they fit in 100 KB (two for float32, by registers)."""
    return 3 if itemsize == 2 and 3 * 2 * DECODE_BLOCK_N * head_dim * itemsize <= 100 * 1024 else 2


def decode_supported(head_dim: int, itemsize: int) -> bool:
    """float32 takes head dims up to 128 (its emulated products need the registers)."""
    return itemsize == 2 or head_dim <= 128


def decode_smem(head_dim: int, block_rows: int, itemsize: int) -> int:
    # kernels/decode/decode.cuh: Q, then the K/V stages, which the warps' merge reuses afterwards
    stages = decode_stages(head_dim, itemsize) * 2 * DECODE_BLOCK_N * head_dim * itemsize
    return block_rows * head_dim * itemsize + max(stages, 4 * block_rows * (head_dim + 2) * 4)


def decode_name(dtype_name: str, head_dim: int, block_rows: int, stages: int) -> str:
    return f"cuflash::attn_decode<{ELEMENT_TYPES[dtype_name][0]}, {head_dim}, {block_rows // 16}, {stages}>"


def decode_slots(fn, smem: int) -> int:
    """Blocks of the decoding kernel ``fn`` resident on the whole GPU at once (the driver's
    occupancy at 128 threads and ``smem`` bytes, times the SMs)."""
    key = (id(fn), smem)
    slots = _decode_slots.get(key)
    if slots is None:
        from cupy_backends.cuda.api import driver

        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, 128, smem)
        slots = _decode_slots[key] = max(1, per_sm) * sm_count()
    return slots


_decode_slots: dict = {}
DECODE_SPLIT_COST = 2   # key blocks' worth of time a block spends starting and ending (and the merge)


def decode_splits(blocks: int, longest: int, forced: int | None, slots: int) -> tuple[int, int]:
    """(splits, keys per split) of the keys of each (sequence, entry): forced, or the count
    with the shortest modelled time, in waves of ``slots`` resident blocks times the key
    blocks each block reads plus its fixed cost (flash-decoding; a split keeps at least
    four key blocks)."""
    key_blocks = max(1, -(-longest // DECODE_BLOCK_N))
    if forced is None:
        blocks = max(blocks, 1)

        def time(s):
            return -(-blocks * s // slots) * (-(-key_blocks // s) + DECODE_SPLIT_COST) + (DECODE_SPLIT_COST if s > 1 else 0)

        forced = min(range(1, max(1, min(128, key_blocks // 4)) + 1), key=time)
    per_split = -(-key_blocks // forced) * DECODE_BLOCK_N
    return -(-max(longest, 1) // per_split), per_split


@dataclass(frozen=True)
class KVCacheLaunches:
    """What an attention_kvcache call runs: the append (if any), the decoding kernel and
    the merge of its splits (if any), over the arrays of DECODE_POINTERS; and what to
    allocate: out (the call's shape, whose memory is the kernels' (B, E, G * Nq, Dv)),
    lse, and the float32 partials of the splits."""

    runs: tuple
    out_shape: tuple[int, ...]
    parts: tuple[int, int, int] | None   # (splits, rows, dv)

    def run(self, cupy, dtype, q, k, v, seqlens, block_table, k_new, v_new):
        out = cupy.empty(self.out_shape, dtype=dtype)
        lse = cupy.empty(self.out_shape[:-1], dtype=cupy.float32)
        parts = part_out = part_lse = None
        if self.parts is not None:   # one allocation: the float32 partial outputs, then their lse
            splits, rows, dv = self.parts
            parts = cupy.cuda.alloc(splits * rows * (dv + 1) * 4)
            part_out, part_lse = parts.ptr, parts.ptr + splits * rows * dv * 4
        arrays = (q, k, v, out, lse, seqlens, block_table, part_out, part_lse, k_new, v_new)
        for launch in self.runs:
            launch.run(arrays)
        return out, lse


_DECODE_FIELDS = tuple(range(len(_params.DECODE_POINTERS)))


def kvcache_launches(x) -> KVCacheLaunches:
    """The launches of a checked attention_kvcache call (kernels/decode/decode.cuh)."""
    itemsize = ELEMENT_TYPES[x.dtype_name][1]
    elem = ELEMENT_TYPES[x.dtype_name][0]
    head_dim = head_dim_bucket(x.d, x.dv)
    rows = x.group * x.nq
    block_rows = decode_rows(head_dim, rows, itemsize)
    stages = decode_stages(head_dim, itemsize)
    smem = decode_smem(head_dim, block_rows, itemsize)
    if smem > 227 * 1024 or not decode_supported(head_dim, itemsize):
        raise ValueError(f"attention_kvcache does not take {x.dtype_name} with head dims above 128 "
                         f"(D = {x.d}, Dv = {x.dv}); use float16 or bfloat16")
    row_groups = -(-rows // block_rows)
    decode = _compile.get_function(decode_name(x.dtype_name, head_dim, block_rows, stages), smem)
    blocks = x.batch * x.entries * row_groups
    splits, split_keys = decode_splits(blocks, x.longest, x.num_splits, decode_slots(decode, smem))
    unbounded = x.capacity + x.nq
    ks, vs = x.k_strides, x.v_strides
    kn = (0, 0, 0) if x.k_new is None else tuple(st // itemsize for st in x.k_new.strides[:3])
    vn = (0, 0, 0) if x.v_new is None else tuple(st // itemsize for st in x.v_new.strides[:3])
    params = _params.decode_params(
        q_stride_b=x.q.strides[0] // itemsize, q_stride_e=x.q.strides[1] // itemsize, q_stride_row=x.q.strides[2] // itemsize,
        k_stride_b=ks[0], k_stride_e=ks[1], k_stride_row=ks[2], v_stride_b=vs[0], v_stride_e=vs[1], v_stride_row=vs[2],
        kn_stride_b=kn[0], kn_stride_e=kn[1], kn_stride_row=kn[2], vn_stride_b=vn[0], vn_stride_e=vn[1], vn_stride_row=vn[2],
        batch=x.batch, entries=x.entries, rows=rows, nq=x.nq, d=x.d, dv=x.dv, n_new=x.n_new,
        seqlen_all=x.seqlen_all, capacity=x.capacity, page_size=x.page_size, num_pages=x.num_pages,
        max_pages=0 if x.block_table is None else x.block_table.shape[1],
        window_left=unbounded if x.left is None else min(x.left, unbounded),
        window_right=unbounded if x.right is None else min(x.right, unbounded),
        scale_log2=x.scale * math.log2(math.e), splits=splits, split_keys=split_keys,
    )
    runs = []
    if x.n_new and x.batch * x.entries:
        append = _compile.get_function(f"cuflash::kvcache_append<{elem}>", 0)
        runs.append(Launch(append, (x.batch * x.entries * x.n_new,), 128, 0, params, _DECODE_FIELDS))
    if rows and x.batch * x.entries:
        runs.append(Launch(decode, (x.batch * x.entries, splits, row_groups), 128, smem, params, _DECODE_FIELDS))
        if splits > 1:
            combine = _compile.get_function(f"cuflash::combine_splits<{elem}>", 0)
            runs.append(Launch(combine, (x.batch * x.entries * rows,), MERGE_THREADS, 0, params, _DECODE_FIELDS))
    parts = (splits, x.batch * x.entries * rows, x.dv) if splits > 1 else None
    return KVCacheLaunches(tuple(runs), x.out_shape, parts)


def decode_specializations() -> list[str]:
    """The KV-cache kernels, for every dtype and head-dim bucket they take."""
    names = []
    for dt, (elem, itemsize) in ELEMENT_TYPES.items():
        names += [f"cuflash::kvcache_append<{elem}>", f"cuflash::combine_splits<{elem}>"]
        for hd in HEAD_DIM_BUCKETS:
            for block_rows in sorted({decode_rows(hd, 16, itemsize), decode_rows(hd, 32, itemsize)}):
                if decode_smem(hd, block_rows, itemsize) <= 227 * 1024 and decode_supported(hd, itemsize):
                    names.append(decode_name(dt, hd, block_rows, decode_stages(hd, itemsize)))
    return names
