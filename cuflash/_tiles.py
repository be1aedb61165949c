"""Which specialization runs a call: tile shapes per (dtype, head dim), and the kernels' names.

A specialization is one instantiation of a kernel template: element type,
head dim (d and dv padded up to the next bucket), tile shape. Tile shapes are
data, chosen per (dtype, head dim) here (``fwd_tiles`` and its siblings); a new
dtype or head dim is a table row, never a new kernel.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

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

    def smem_bytes(self, itemsize: int, staged_bias: bool = False) -> int:
        # Q tile + two pipeline stages of K and V (tile_config.cuh: FwdConfig::SMEM_BYTES), and
        # with staged_bias (FULL, not packed) a bias tile per stage (attn_fwd.cuh: STAGED_BIAS)
        rows = self.block_m * self.head_dim + 2 * self.block_n * (self.head_dim + self.dv_block)
        return (rows + (2 * self.block_m * self.block_n if staged_bias else 0)) * itemsize


# The score paths (kernels/attention/score_path.cuh), every attention kernel's last template
# argument: plain scores, scores through softcap and ALiBi (sinks on every path), or through a
# bias and dropout besides (FULL: the portable prefill kernels, and on Hopper the forward with a
# loading warpgroup).
PLAIN, MODIFIED, FULL = "plain", "modified", "full"
SCORE_PATHS = {PLAIN: "cuflash::PlainScores", MODIFIED: "cuflash::ModifiedScores", FULL: "cuflash::FullScores"}
# A call's own score and mask functions: FULL's kernels and tiles with UserScores, compiled after
# the functions (kernels/user/user_scores.cuh), so not among the specializations built ahead.
USER = "user"


def user_name(full_name: str, bias_dropout: bool = False, grads: bool = False) -> str:
    """The UserScores kernel of a FULL kernel's name expression; ``bias_dropout``: with the bias's
    and dropout's code (a call that has either); ``grads``: adding the gradients of the arrays the
    score function reads (a dq pass's, for score_mod_grads)."""
    path = f"{_flag(bias_dropout)}, true" if grads else _flag(bias_dropout)
    return full_name.replace(SCORE_PATHS[FULL], f"cuflash::UserScores<{path}>")
DECODE_SCORE_PATHS = (PLAIN, MODIFIED)


def head_dim_bucket(d: int, dv: int) -> int:
    need = max(d, dv)
    for bucket in HEAD_DIM_BUCKETS:
        if need <= bucket:
            return bucket
    raise ValueError(f"head dim {need} is above the largest supported, {MAX_HEAD_DIM}")


def fwd_tiles(dtype_name: str, head_dim: int, packed: bool = False, scores: str = PLAIN) -> FwdTiles:
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
    # packed-sequence and modified-score kernels hold a few more registers and take two only
    # up to head dim 64 (at 128 the modified one spilled 28 bytes), the FULL ones up to 32
    # (64 spilled 4-28 bytes), and at 256 16 keys a block (32 spilled 8-48 bytes)
    modified = scores != PLAIN
    block_m = 128 if head_dim <= (32 if scores == FULL else 64 if packed or modified else 128) else 64
    block_n = 64 if head_dim <= 128 and not (head_dim == 96 and modified) else 32   # (96: spilled 24 bytes)
    if head_dim == 256 and scores == FULL:
        block_n = 16
    return FwdTiles(head_dim, head_dim, block_m=block_m, block_n=block_n, warps=4)


def _flag(packed: bool) -> str:
    """The PACKED template argument: the kernels' packed-sequence specialization or the dense one."""
    return "true" if packed else "false"



def fwd_name(dtype_name: str, tiles: FwdTiles, packed: bool = False, scores: str = PLAIN) -> str:
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    return (f"cuflash::attn_fwd<{elem}, {t.head_dim}, {t.dv_block}, {t.block_m}, {t.block_n}, {t.warps}, "
            f"{_flag(packed)}, {SCORE_PATHS[scores]}>")


@dataclass(frozen=True)
class Sm90FwdTiles:
    """Tile shape of the Hopper forward kernel (kernels/prefill/attn_fwd_sm90.cuh)."""

    head_dim: int  # d and dv padded up to this bucket, a multiple of 64
    block_n: int  # keys per pipeline step
    warpgroups: int  # each owns 64 query rows
    min_blocks: int = 1  # blocks per SM the registers are budgeted for
    stages = 2  # K and V blocks in flight (tile_config.cuh: Sm90FwdConfig::STAGES)

    @property
    def block_m(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    def smem_bytes(self, itemsize: int) -> int:
        # tile_config.cuh: Sm90FwdConfig::SMEM_BYTES (1024 bytes to align the swizzle atoms)
        return 1024 + (self.block_m + 2 * self.stages * self.block_n) * self.head_dim * itemsize


def sm90_fwd_tiles(dtype_name: str, head_dim: int, keys: int | None = None, scores: str = PLAIN) -> Sm90FwdTiles | None:
    """The Hopper forward tiles for (dtype, head-dim bucket), or None where the
    portable kernel runs instead (float32, head dims that are not whole 64-column panels, the
    FULL score path).

    ``keys``: the keys per tile (of each sequence; mean over packed sequences), None when
    not known; short ones change the tiles, by measurement (docs/design.md, "Hopper forward")."""
    if dtype_name == "float32" or head_dim % 64 or head_dim == 192 or scores == FULL:
        return None
    if head_dim == 64 and keys is not None and keys <= 128:
        # one warpgroup per block, four blocks per SM (docs/design.md, "Hopper forward")
        return Sm90FwdTiles(64, 64, warpgroups=1, min_blocks=4)
    # by measurement (bench/tune_tiles.py; docs/design.md, "Hopper forward"): a third K/V stage gained
    # nothing, and 64-key blocks beat 128 at head dim 64. (hopper_fwd_tiles runs these only
    # where no tensor map describes a head-dim-256 call, and for the short tiles above.)
    block_n = 128 if head_dim == 128 else 64
    if head_dim == 256 and scores == MODIFIED:
        block_n = 32   # (64 keys spilled 8-24 bytes beside the modifiers)
    return Sm90FwdTiles(head_dim, block_n, warpgroups=2)


@dataclass(frozen=True)
class Sm90WsFwdTiles:
    """Tile shape of the Hopper forward with a loading warpgroup (kernels/prefill/attn_fwd_sm90_ws.cuh):
    64 query rows per computing warpgroup (two, or three), one block per SM running tiles in turn."""

    head_dim: int  # d and dv padded up to this bucket, a multiple of 64
    block_n: int  # keys per ring buffer
    stages: int  # K and V buffers in the ring
    tma: bool = False  # loads by the copy engine through tensor maps (_tensor_map.attention_maps), else cp.async
    q_buffers: int = 2  # Q tiles in flight: the next tile's loads under this one's products
    consumers: int = 2  # computing warpgroups

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    @property
    def maps_only(self) -> bool:
        """Whether the tiles run only through tensor maps: with one Q buffer the cp.async
        loader ran at 0.5-0.8x attn_fwd_sm90 (docs/design.md, "Hopper forward")."""
        return self.q_buffers == 1

    def without_maps(self) -> Sm90WsFwdTiles | None:
        """These tiles where no tensor map describes the inputs (packed sequences, strides a
        map cannot hold): loaded by cp.async with two computing warpgroups (three would
        spill beside that loader's registers) on two K/V stages. Tiles that run through maps
        only take the 128-key blocks with two Q buffers instead, or None at head dim 256, where
        attn_fwd_sm90 runs then."""
        if self.maps_only:
            return None if self.head_dim > 128 else Sm90WsFwdTiles(self.head_dim, 128, stages=2)
        return dataclasses.replace(self, tma=False, consumers=2, stages=2)

    def smem_bytes(self, itemsize: int) -> int:
        # tile_config.cuh: Sm90WsFwdConfig::SMEM_BYTES (the Q buffers, the ring, 8-byte barriers,
        # the tile queue's two 24-byte slots)
        tiles = (self.q_buffers * self.block_m + 2 * self.stages * self.block_n) * self.head_dim * itemsize
        return 1024 + tiles + 8 * (2 * self.q_buffers + 4 * self.stages) + 24 * 2


SM90_WS_FWD_D64_THREE_FROM_KEYS = 2048
# 176-key blocks at head dim 128 from this many keys per tile, by mask (MASKS)
SM90_WS_FWD_D128_WIDE_FROM_KEYS = {"none": 2048, "causal": 8192}

# What a call's mask is to the choice of tiles: "none" (every row sees every key),
# "causal" (each row sees its whole past, its future cut) or "window" (anything else).
MASKS = ("none", "causal", "window")


def sm90_ws_fwd_tiles(dtype_name: str, head_dim: int, keys: int | None = None,
                      mask: str = "window", scores: str = PLAIN) -> Sm90WsFwdTiles | None:
    """The loading-warpgroup forward's tiles where it runs instead of attn_fwd_sm90, by
    measurement (docs/design.md, "Hopper forward"): head dims 64 and 128, except head dim 64
    with at most 128 keys per tile (of each sequence; the mean over packed ones), where blocks
    of one warpgroup, four per SM, stay ahead; at head dim 64 from 2048 keys three computing
    warpgroups (1.01-1.12x two, through maps; shorter, the 192-row tiles lost up to 11 %
    under a causal mask), without a mask on a ring of three K/V stages (0.99-1.04x two;
    0.98-1.01x under a causal mask); at head dim 128, 176-key blocks with one Q buffer
    without a mask from 2048 keys (0.99-1.08x the 128-key blocks, 1.03-1.08x from 4096)
    and under a causal mask from 8192 (1.01-1.08x in six processes); and head dim
    256, 80-key blocks with one Q buffer and through tensor maps only (``maps_only``; 1.02-1.11x
    64-key blocks, which ran at 1.2-1.4x attn_fwd_sm90). None elsewhere. These are the
    tiles through maps; ``without_maps`` gives the others. The modified scores' kernels
    (``scores``) hold a few more registers: 64-key blocks at head dim 256, two computing
    warpgroups at 64 (80 keys and three warpgroups spilled 4-16 bytes) and 128-key blocks at
    128 (176 keys spilled 24-32 bytes). The FULL ones (a bias, dropout, a call's own functions)
    run 64-key blocks at head dims 64 and 128 (128 keys spilled 4-248 bytes), and none at 256
    (32-key blocks spilled 4-148 bytes beside the functions)."""
    if dtype_name == "float32":
        return None
    if scores == FULL:
        return Sm90WsFwdTiles(head_dim, 64, stages=2) if head_dim in (64, 128) else None
    modified = scores == MODIFIED
    if head_dim == 256:
        return Sm90WsFwdTiles(256, 64 if modified else 80, stages=2, q_buffers=1)
    if head_dim not in (64, 128):
        return None
    if head_dim == 64 and keys is not None and keys <= 128:
        return None
    wide_from = SM90_WS_FWD_D128_WIDE_FROM_KEYS.get(mask)
    if head_dim == 128 and wide_from is not None and keys is not None and keys >= wide_from and not modified:
        return Sm90WsFwdTiles(128, 176, stages=2, q_buffers=1)
    three = head_dim == 64 and (keys is None or keys >= SM90_WS_FWD_D64_THREE_FROM_KEYS) and not modified
    stages = 3 if three and mask == "none" else 2
    return Sm90WsFwdTiles(head_dim, 128, stages=stages, consumers=3 if three else 2)


def hopper_fwd_tiles(dtype_name: str, head_dim: int, keys: int | None, mask: str = "window", scores: str = PLAIN):
    """The Hopper forward's kernel for a call: loading-warpgroup tiles (Sm90WsFwdTiles),
    attn_fwd_sm90 tiles (Sm90FwdTiles), or None where the portable kernel runs."""
    ws = sm90_ws_fwd_tiles(dtype_name, head_dim, keys, mask, scores)
    return ws if ws is not None else sm90_fwd_tiles(dtype_name, head_dim, keys, scores)


def hopper_fwd_name(dtype_name: str, tiles, packed: bool = False, scores: str = PLAIN) -> str:
    """The kernel name of hopper_fwd_tiles' choice (either kernel)."""
    if isinstance(tiles, Sm90WsFwdTiles):
        return sm90_ws_fwd_name(dtype_name, tiles, packed, scores)
    return sm90_fwd_name(dtype_name, tiles, packed, scores)


# Keys per tile on either side of where the Hopper forward's choice of kernel changes
# (hopper_fwd_tiles), for the list of specializations
HOPPER_FWD_KEYS = (128, SM90_WS_FWD_D64_THREE_FROM_KEYS // 2, SM90_WS_FWD_D64_THREE_FROM_KEYS,
                   *SM90_WS_FWD_D128_WIDE_FROM_KEYS.values())


def sm90_ws_fwd_name(dtype_name: str, tiles: Sm90WsFwdTiles, packed: bool = False, scores: str = PLAIN) -> str:
    elem = ELEMENT_TYPES[dtype_name][0]
    t = tiles
    return (f"cuflash::attn_fwd_sm90_ws<{elem}, {t.head_dim}, {t.block_n}, {t.stages}, {t.q_buffers}, {t.consumers}, "
            f"{_flag(packed)}, {_flag(t.tma)}, {SCORE_PATHS[scores]}>")


def sm90_fwd_name(dtype_name: str, tiles: Sm90FwdTiles, packed: bool = False, scores: str = PLAIN) -> str:
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    rest = f"{t.warpgroups}, {t.min_blocks}, {_flag(packed)}, {SCORE_PATHS[scores]}"
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


def bwd_tiles(dtype_name: str, head_dim: int, scores: str = PLAIN, packed: bool = False) -> BwdTiles:
    """Tile shape of the backward kernels for one (dtype, head-dim bucket).

    A warp keeps 16 rows x dcol accumulators of dk and dv (or of dq) plus two
    16 x step score tiles in registers; wide head dims split the gradient
    columns over blocks (each recomputing the scores) so that nothing spills.
    """
    if dtype_name == "float32":
        # (the modified dk/dv pass at head dim 32 spilled 8 bytes with 32 columns)
        return BwdTiles(head_dim, 16 if head_dim == 32 and scores != PLAIN else 32, 16, warps=4)
    dcol = {192: 96, 256: 128}.get(head_dim, head_dim)
    step = {32: 64, 64: 64, 256: 16}.get(head_dim, 32)
    if scores == FULL:   # (bias and dropout beside: these spilled 4-24 bytes wider, packed or at 64)
        dcol = {96: 48, 256: 64}.get(head_dim, dcol) if packed else dcol
        step = 32 if head_dim == 64 else step
    return BwdTiles(head_dim, dcol, step, warps=4)


def bwd_names(dtype_name: str, tiles: BwdTiles, packed: bool = False, scores: str = PLAIN) -> tuple[str, str, str]:
    """(delta, dk/dv, dq) kernel name expressions."""
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    args = f"{elem}, {t.head_dim}, {t.dcol}, {t.step}, {t.warps}, {_flag(packed)}, {SCORE_PATHS[scores]}"
    return (delta_name(dtype_name), f"cuflash::attn_bwd_dkdv<{args}>", f"cuflash::attn_bwd_dq<{args}>")


@dataclass(frozen=True)
class Sm90BwdTiles:
    """Tile shape of the Hopper backward kernels (kernels/prefill/attn_bwd_sm90.cuh)."""

    head_dim: int  # d and dv padded up to this bucket, a multiple of 64 (every column in one block)
    step: int  # rows of the streamed side per pipeline step
    warpgroups: int  # each owns 64 resident rows
    stages: int = 2  # steps in flight
    min_blocks: int = 1  # blocks per SM the registers are budgeted for
    # dk/dv by attn_bwd_dkdv_wide_sm90: both warpgroups on the same 64 keys, one
    # accumulating dv, the other dk
    wide_dkdv: bool = False
    # the dq pass's own step and stages; 0: those of dk/dv
    dq_step: int = 0
    dq_stages: int = 0
    # dk/dv by attn_bwd_dkdv_sm90_ws, a loading warpgroup and two computing ones (64
    # keys each), with this many stages of queries in flight; 0: the kernels without a
    # loading warpgroup (and with wide_dkdv)
    dkdv_ws_stages: int = 0
    # the same for the dq pass (attn_bwd_dq_sm90_ws: 128 queries, steps of the dq step)
    dq_ws_stages: int = 0
    # dq added up in float32 by the dk/dv pass on a loading warpgroup, in any order
    # (deterministic=False; no dq pass): head dims 64 and 128
    dkdv_adds_dq: bool = False

    def __post_init__(self):
        if self.wide_dkdv and self.dkdv_ws_stages:
            raise ValueError("the wide dk/dv pass runs without a loading warpgroup")

    @property
    def resident(self) -> int:
        return 64 * self.warpgroups

    @property
    def dkdv_resident(self) -> int:
        return 64 if self.wide_dkdv else 128 if self.dkdv_ws_stages else self.resident

    @property
    def dq_resident(self) -> int:
        return 128 if self.dq_ws_stages else self.resident

    @property
    def dq_threads(self) -> int:
        return 384 if self.dq_ws_stages else self.threads

    @property
    def dq_pipeline(self) -> tuple[int, int]:
        """(step, stages) of the dq pass."""
        return self.dq_step or self.step, self.dq_ws_stages or self.dq_stages or self.stages

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def dkdv_threads(self) -> int:
        return 384 if self.dkdv_ws_stages else self.threads

    @property
    def dkdv_blocks_per_sm(self) -> int:
        return 1 if self.dkdv_ws_stages else self.min_blocks

    def dkdv_smem_bytes(self, itemsize: int) -> int:
        if self.dkdv_ws_stages:   # steps of 64 queries with their lse and delta (adding dq up: four 64 x 64
            # tiles of ds^T, and a float32 chunk of 16 dq rows per computing warp)
            ds = (4 * 64 * 64 * itemsize + 8 * 16 * self.head_dim * 4) if self.dkdv_adds_dq else 0
            return self._ws_smem_bytes(128, 64, self.dkdv_ws_stages, itemsize, row_stats=True) + ds
        if not self.wide_dkdv:
            return self._smem_bytes(self.resident, self.step, self.stages, itemsize)
        # one warpgroup's rows, plus one step of p^T as float32
        return self._smem_bytes(64, self.step, self.stages, itemsize) + 64 * self.step * 4

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of the dq pass."""
        if self.dq_ws_stages:
            return self._ws_smem_bytes(128, *self.dq_pipeline, itemsize, row_stats=False)
        return self._smem_bytes(self.resident, *self.dq_pipeline, itemsize)

    def _ws_smem_bytes(self, resident: int, step: int, stages: int, itemsize: int, row_stats: bool) -> int:
        # tile_config.cuh: Sm90WsBwdConfig::SMEM_BYTES (1 + 2 STAGES barriers)
        tiles = (2 * resident + 2 * stages * step) * self.head_dim * itemsize
        return 1024 + tiles + (2 * stages * step * 4 if row_stats else 0) + 8 * (1 + 2 * stages)

    def _smem_bytes(self, resident: int, step: int, stages: int, itemsize: int) -> int:
        # tile_config.cuh: Sm90BwdConfig::SMEM_BYTES
        tiles = 2 * resident + 2 * stages * step
        return 1024 + tiles * self.head_dim * itemsize + 2 * stages * step * 4


# Query rows from which the dk/dv pass at head dim 64 takes the loading warpgroup, and from
# which (deterministic=False) the pass adds dq up at head dims 64 and 128
SM90_WS_BWD_MIN_QUERIES_D64 = 2048


def sm90_bwd_tiles(dtype_name: str, head_dim: int, queries: float = SM90_WS_BWD_MIN_QUERIES_D64,
                   deterministic: bool = True, scores: str = PLAIN, packed: bool = False,
                   score_grads: bool = False) -> Sm90BwdTiles | None:
    """The Hopper backward tiles for (dtype, head-dim bucket, query rows per sequence), or
    None (as sm90_fwd_tiles), by measurement (docs/design.md, "Backward").

    At head dim 256 a warpgroup can hold one 64 x 256 gradient accumulator but not two:
    dk/dv runs the wide kernel (dv in one warpgroup, dk in the other). At 128 both passes
    run on a loading warpgroup (1.08-1.19x the passes without one), dq over 128 keys a step
    (1.00-1.10x 64); at 64 the dk/dv pass does from 2048 queries (1.01-1.10x; below, its
    fewer and longer blocks lose, and the dq pass on one gains nothing). Not deterministic:
    from 2048 query rows at head dims 64 and 128, the dk/dv pass on a loading warpgroup adds
    dq up too (no dq pass); elsewhere the same tiles. The modified scores' kernels (``scores``)
    step over 64 keys in the dq pass at 64 and run dk/dv without a loading warpgroup at 128,
    over 32 keys a step with packed sequences (the others spilled 4-24 bytes beside softcap's
    gradient). The FULL ones (a bias, dropout, a call's own functions) run both passes without a
    loading warpgroup on two stages, at head dims 64 and 128 only: they skip the steps a block mask
    leaves empty, which a gradient product carried into the next step (three stages) would not
    survive. Adding the gradients of a score function's arrays (``score_grads``), the dq pass at
    64 spilled 216 bytes (packed 108): those calls run the portable passes there."""
    modified = scores == MODIFIED
    if dtype_name == "float32" or head_dim % 64 or head_dim == 192:
        return None
    if scores == FULL:
        if head_dim == 256 or (head_dim == 64 and score_grads):
            return None
        if head_dim == 64:
            return Sm90BwdTiles(64, step=64, warpgroups=1, stages=2, min_blocks=2)
        return Sm90BwdTiles(128, step=32, warpgroups=2, stages=2)   # (steps of 64 spilled 56 bytes, packed)
    if head_dim == 256:
        return Sm90BwdTiles(256, step=32, warpgroups=2, stages=3, wide_dkdv=True)
    adds_dq = not deterministic and queries >= SM90_WS_BWD_MIN_QUERIES_D64
    if head_dim == 64:
        # one warpgroup per block and two blocks per SM, with no barrier between them, so one
        # block's exponentials run during the other's products; dk/dv's gradient products
        # overlapping the next step (3 stages); dq over 128 keys per step
        ws = 4 if queries >= SM90_WS_BWD_MIN_QUERIES_D64 else 0
        return Sm90BwdTiles(64, step=64, warpgroups=1, stages=3, min_blocks=2, dq_step=64 if modified else 128,
                            dq_stages=2, dkdv_ws_stages=ws, dkdv_adds_dq=adds_dq)
    # both passes on a loading warpgroup, two stages each (three spill in attn_bwd_dkdv_sm90,
    # and gain nothing on a loading warpgroup; adding dq up, a third does not fit beside the
    # dq chunks); at head dim 128 the dq pass over 128 keys a step
    on_loader = not (modified and head_dim == 128)
    return Sm90BwdTiles(head_dim, step=32 if packed and not on_loader else 64, warpgroups=2, stages=2, dkdv_ws_stages=2 if on_loader else 0,
                        dq_ws_stages=2, dq_step=128 if head_dim == 128 else 0, dkdv_adds_dq=adds_dq and on_loader)


def sm90_bwd_names(dtype_name: str, tiles: Sm90BwdTiles, packed: bool = False,
                   scores: str = PLAIN) -> tuple[str, str]:
    """(dk/dv, dq) kernel name expressions."""
    t = tiles
    elem = ELEMENT_TYPES[dtype_name][0]
    flag = f"{_flag(packed)}, {SCORE_PATHS[scores]}"
    if t.wide_dkdv:
        dkdv = f"cuflash::attn_bwd_dkdv_wide_sm90<{elem}, {t.head_dim}, {t.step}, {t.stages}, {flag}>"
    elif t.dkdv_ws_stages:
        adds = _flag(t.dkdv_adds_dq)
        dkdv = (f"cuflash::attn_bwd_dkdv_sm90_ws<{elem}, {t.head_dim}, {t.dkdv_ws_stages}, {_flag(packed)}, {adds}, "
                f"{SCORE_PATHS[scores]}>")
    else:
        rest = f"{t.step}, {t.warpgroups}, {t.stages}, {t.min_blocks}, {flag}"
        dkdv = f"cuflash::attn_bwd_dkdv_sm90<{elem}, {t.head_dim}, {rest}>"
    dq_step, dq_stages = t.dq_pipeline
    if t.dq_ws_stages:
        return dkdv, f"cuflash::attn_bwd_dq_sm90_ws<{elem}, {t.head_dim}, {dq_step}, {dq_stages}, {flag}>"
    dq_rest = f"{dq_step}, {t.warpgroups}, {dq_stages}, {t.min_blocks}, {flag}"
    return dkdv, f"cuflash::attn_bwd_dq_sm90<{elem}, {t.head_dim}, {dq_rest}>"


def all_specializations(arch: str = "sm_80") -> list[str]:
    """Every kernel name expression the library can launch on a target such as ``"sm_90a"``."""
    names = []
    for dt, hd, packed, scores in itertools.product(ELEMENT_TYPES, HEAD_DIM_BUCKETS, (False, True), SCORE_PATHS):
        portable_fwd = fwd_name(dt, fwd_tiles(dt, hd, packed, scores), packed, scores)
        if arch == "sm_90a":
            for keys, mask in itertools.product(HOPPER_FWD_KEYS, MASKS):
                tiles = hopper_fwd_tiles(dt, hd, keys, mask, scores)
                variants = [tiles]
                if isinstance(tiles, Sm90WsFwdTiles):   # dense: through tensor maps where they fit
                    variants = [dataclasses.replace(tiles, tma=True)] if not packed else []
                    # (where no maps fit: by cp.async, or attn_fwd_sm90)
                    variants.append(tiles.without_maps() or sm90_fwd_tiles(dt, hd, keys, scores))
                for t in variants:   # (None: the portable kernel)
                    name = portable_fwd if t is None else hopper_fwd_name(dt, t, packed, scores)
                    if name not in names:
                        names.append(name)
        else:
            names.append(portable_fwd)
        if arch == "sm_90a" and sm90_bwd_tiles(dt, hd, scores=scores) is not None:
            # (dq added up in any order: dense calls only, _dispatch._dq_in_any_order)
            for queries, deterministic in ((1, True), (SM90_WS_BWD_MIN_QUERIES_D64, True),
                                           (SM90_WS_BWD_MIN_QUERIES_D64, packed)):
                tiles = sm90_bwd_tiles(dt, hd, queries, deterministic, scores, packed)
                bwd = sm90_bwd_names(dt, tiles, packed, scores)
                if tiles.dkdv_adds_dq:   # then delta runs first, and the sums are scaled and rounded
                    bwd = (delta_name(dt), bwd[0], scale_dq_sums_name(dt, hd))
                names.extend(n for n in bwd if n not in names)
        if arch != "sm_90a" or sm90_bwd_tiles(dt, hd, scores=scores, packed=packed, score_grads=True) is None:
            # (the portable passes; on sm_90a also the FULL ones where a call adds the gradients of its
            # score function's arrays and the Hopper passes do not take it: sm90_bwd_tiles)
            names.extend(n for n in bwd_names(dt, bwd_tiles(dt, hd, scores, packed), packed, scores) if n not in names)
    return (names + ["cuflash::build_tile_list"] + [f(dt) for f in (sum_parts_name, merge_name) for dt in ELEMENT_TYPES]
            + decode_specializations(arch))


# Tile shapes besides the table's choices: the ones bench/tune_tiles.py times (16-bit types,
# dense inputs). The tests run each against the reference, and CI compiles each
# (candidate_specializations), so that a shape the tuner may pick has been checked already.
SM90_WS_FWD_CANDIDATES = {
    64: (Sm90WsFwdTiles(64, 128, 2), Sm90WsFwdTiles(64, 128, 2, consumers=3), Sm90WsFwdTiles(64, 128, 3, consumers=3)),
    128: (Sm90WsFwdTiles(128, 128, 2), Sm90WsFwdTiles(128, 176, 2, q_buffers=1)),
    256: (Sm90WsFwdTiles(256, 64, 2, q_buffers=1), Sm90WsFwdTiles(256, 80, 2, q_buffers=1)),
}
# (attn_fwd_sm90: one warpgroup per block and 2-4 blocks per SM overlap each other's
# prologues and softmaxes with products, with no barrier between them)
SM90_FWD_CANDIDATES = {
    64: (Sm90FwdTiles(64, 64, 2), Sm90FwdTiles(64, 64, 1, 3), Sm90FwdTiles(64, 64, 1, 4), Sm90FwdTiles(64, 128, 1, 2)),
    128: (Sm90FwdTiles(128, 128, 2), Sm90FwdTiles(128, 64, 2), Sm90FwdTiles(128, 64, 1, 2)),
    256: (Sm90FwdTiles(256, 64, 2),),
}
# (three or more stages: a step's gradient products run during the next step; ws stages: the
# passes on a loading warpgroup)
SM90_BWD_CANDIDATES = {
    64: (Sm90BwdTiles(64, 64, 2, 3, dq_step=128, dq_stages=3), Sm90BwdTiles(64, 64, 2, 4, dq_step=128, dq_stages=3),
         Sm90BwdTiles(64, 64, 1, 3, 2, dq_step=128, dq_stages=2), Sm90BwdTiles(64, 64, 1, 3, 2, dq_stages=3),
         Sm90BwdTiles(64, 64, 1, 4, 2, dq_stages=4),
         Sm90BwdTiles(64, 64, 1, 3, 2, dq_step=128, dq_stages=2, dkdv_ws_stages=4),
         Sm90BwdTiles(64, 64, 1, 3, 2, dq_step=128, dq_stages=2, dkdv_ws_stages=2, dq_ws_stages=3)),
    128: (Sm90BwdTiles(128, 64, 2), Sm90BwdTiles(128, 64, 2, dkdv_ws_stages=2),
          Sm90BwdTiles(128, 64, 2, dkdv_ws_stages=2, dq_ws_stages=2),
          Sm90BwdTiles(128, 64, 2, dkdv_ws_stages=2, dq_ws_stages=3),
          Sm90BwdTiles(128, 64, 2, dkdv_ws_stages=3, dq_ws_stages=2),
          Sm90BwdTiles(128, 64, 2, dq_step=128, dkdv_ws_stages=2, dq_ws_stages=2)),
    256: (Sm90BwdTiles(256, 32, 2, 3, wide_dkdv=True), Sm90BwdTiles(256, 32, 2, 3, wide_dkdv=True, dq_ws_stages=3)),
}
# the portable kernels, (block_m, block_n, warps) and BwdTiles
FWD_CANDIDATES = {
    64: (FwdTiles(64, 64, 64, 64, 4), FwdTiles(64, 64, 128, 64, 4), FwdTiles(64, 64, 128, 32, 4)),
    128: (FwdTiles(128, 128, 128, 32, 4), FwdTiles(128, 128, 128, 64, 4)),
    256: (FwdTiles(256, 256, 64, 32, 4), FwdTiles(256, 256, 64, 64, 4)),
}
BWD_CANDIDATES = {
    64: (BwdTiles(64, 64, 64, 4), BwdTiles(64, 64, 32, 4)),
    128: (BwdTiles(128, 128, 16, 4), BwdTiles(128, 128, 32, 4)),
    256: (BwdTiles(256, 128, 16, 4),),   # (steps of 32 spill the dq pass)
}


def ws_fwd_loaders(tiles: Sm90WsFwdTiles) -> tuple[bool, ...]:
    """The loaders a loading-warpgroup candidate runs with (``tma``): through tensor maps, and
    by cp.async but with three computing warpgroups (which spill beside that loader)."""
    return (True,) if tiles.consumers == 3 else (True, False)


def candidate_specializations(arch: str = "sm_80") -> list[str]:
    """The kernel name expressions of the tuning candidates above on a target."""
    names = []
    for dt in ("float16", "bfloat16"):
        if arch == "sm_90a":
            for ws in itertools.chain(*SM90_WS_FWD_CANDIDATES.values()):
                names += [sm90_ws_fwd_name(dt, dataclasses.replace(ws, tma=tma)) for tma in ws_fwd_loaders(ws)]
            names += [sm90_fwd_name(dt, t) for t in itertools.chain(*SM90_FWD_CANDIDATES.values())]
            for t in itertools.chain(*SM90_BWD_CANDIDATES.values()):
                names += sm90_bwd_names(dt, t)
        # (the portable ones run on Hopper too where forced, as the tests do)
        names += [fwd_name(dt, t) for t in itertools.chain(*FWD_CANDIDATES.values())]
        for t in itertools.chain(*BWD_CANDIDATES.values()):
            names += bwd_names(dt, t)
    return list(dict.fromkeys(names))


def merge_name(dtype_name: str) -> str:
    return f"cuflash::merge_attention<{ELEMENT_TYPES[dtype_name][0]}>"


def sum_parts_name(dtype_name: str) -> str:
    return f"cuflash::sum_parts<{ELEMENT_TYPES[dtype_name][0]}>"


def scale_dq_sums_name(dtype_name: str, head_dim: int) -> str:
    return f"cuflash::scale_dq_sums<{ELEMENT_TYPES[dtype_name][0]}, {head_dim}>"


def delta_name(dtype_name: str) -> str:
    return f"cuflash::attn_bwd_delta<{ELEMENT_TYPES[dtype_name][0]}>"


# How the decoding kernel finds a block's keys (kernels/decode/decode.cuh: KeyLayout)
KEY_BLOCKS, KEY_RUNS, KEY_ROWS = 0, 1, 2
DECODE_RUN = 16   # rows of one run of a paged cache read run by run


@dataclass(frozen=True)
class DecodeTiles:
    """The decoding kernel's shape (kernels/decode/decode.cuh): query rows per block (16 or
    32: M_TILES 1 or 2), keys per pipeline stage (64 or 128), stages in flight, and how it
    finds a block's keys (``layout``): as one strided block (a contiguous cache, or pages
    that hold whole blocks), run by run of 16 rows, or row by row."""

    block_rows: int
    block_n: int
    stages: int
    layout: int = KEY_BLOCKS

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        # Q, then the K/V stages, which the warps' merge reuses afterwards, and after it the
        # block's float32 part (out, lse) where a cluster's blocks merge their splits
        stages = self.stages * 2 * self.block_n * head_dim * itemsize
        merge = 4 * self.block_rows * (head_dim + 2) * 4 + self.block_rows * (head_dim + 1) * 4
        return self.block_rows * head_dim * itemsize + max(stages, merge)

    def streams_alone(self, head_dim: int, itemsize: int) -> bool:
        """Whether split decoding plans one block per multiprocessor rather than as many as
        fit: for 16 rows whose stages are whole blocks of at least 32 KB, a block streams as
        fast alone as beside a second, which would only add splits to merge. With 32 rows
        (four times the products), smaller stages, or pages read run by run (a table read
        before each run's copy), more blocks hide more (docs/design.md, "KV cache and decoding")."""
        return (self.block_rows == 16 and self.layout == KEY_BLOCKS
                and 2 * self.block_n * head_dim * itemsize >= 32 * 1024)

    def name(self, dtype_name: str, head_dim: int, two_level: bool = False, scores: str = PLAIN) -> str:
        """The kernel; ``two_level``: the one for splits in several clusters per row group
        (Hopper), whose parts then merge through global memory; ``scores``: its score path."""
        return (f"cuflash::attn_decode<{ELEMENT_TYPES[dtype_name][0]}, {head_dim}, {self.block_rows // 16}, "
                f"{self.stages}, {self.block_n}, {self.layout}, {_flag(two_level)}, {SCORE_PATHS[scores]}>")


def decode_tiles(head_dim: int, rows: int, itemsize: int, page_size: int | None = None) -> DecodeTiles:
    """The decoding kernel's shape for ``rows`` query rows per K/V entry, over a contiguous
    cache (``page_size`` None) or pages of ``page_size`` rows.

    - 32 rows per block only for 16-bit types up to head dim 128 (registers).
    - 128 keys per stage for 16-bit heads up to 64 wide, so that a stage moves as many bytes
      as at head dim 128 (by measurement, docs/design.md, "KV cache and decoding"), over pages
      too when they hold whole blocks of 128 or are read run by run (pages of 64 among them,
      since each run is copied by threads of its own); 64 over pages read row by row.
    - three stages where they fit in 100 KB (two blocks per SM), two for float32 (registers).
    - keys found block by block where pages hold whole blocks, else run by run where pages
      hold whole runs of 16 rows (heads up to 128 wide: wider, the runs' offsets spill), else
      row by row.
    """
    block_rows = 32 if rows > 16 and head_dim <= 128 and itemsize == 2 else 16
    by_runs = page_size is not None and page_size % DECODE_RUN == 0 and head_dim <= 128
    wide_stages = head_dim <= 64 and itemsize == 2 and (page_size is None or by_runs)
    block_n = 128 if wide_stages else 64
    stages = 3 if itemsize == 2 and 3 * 2 * block_n * head_dim * itemsize <= 100 * 1024 else 2
    if page_size is None or page_size % block_n == 0:
        layout = KEY_BLOCKS
    elif by_runs:
        layout = KEY_RUNS
    else:
        layout = KEY_ROWS
    return DecodeTiles(block_rows, block_n, stages, layout)


def decode_supported(head_dim: int, itemsize: int) -> bool:
    """float32 takes head dims up to 128 (its emulated products need the registers)."""
    return itemsize == 2 or head_dim <= 128


def decode_specializations(arch: str = "sm_80") -> list[str]:
    """The KV-cache kernels, for every dtype and head-dim bucket they take, with either score
    path (on sm_90a also those for splits in several clusters per row group)."""
    names = []
    for dt, (elem, itemsize) in ELEMENT_TYPES.items():
        names.append(f"cuflash::kvcache_append<{elem}>")
        for hd in HEAD_DIM_BUCKETS:
            if not decode_supported(hd, itemsize):
                continue
            # every (block_n, layout) pair: contiguous, pages of whole 64-key blocks, runs, rows
            shapes = {decode_tiles(hd, rows, itemsize, page) for rows in (1, 32) for page in (None, 64, 16, 8)}
            for tiles in sorted(shapes, key=lambda t: (t.block_rows, t.block_n, t.layout)):
                if tiles.smem_bytes(hd, itemsize) <= 227 * 1024:
                    for scores in DECODE_SCORE_PATHS:
                        names.append(tiles.name(dt, hd, scores=scores))
                        if arch == "sm_90a":
                            names.append(tiles.name(dt, hd, two_level=True, scores=scores))
    return names
