"""Which launches a call makes: the kernels (``_tiles``), their grids and parameter
records (``_launch``), for the forward, the backward, merging and the KV cache."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import _compile, _params, _tensor_map
from ._launch import (
    DECODE_FIELDS, DKDV_FIELDS, DQ_FIELDS, FWD_FIELDS, K_TILES, Q_TILES, WS_FWD_FIELDS, KVCacheLaunches, Launch,
    Launches, TileListLaunch, blocks_per_sm, cluster_slots, one_per_sm_smem, sm_count,
)
from ._tiles import (
    ELEMENT_TYPES, FULL, KEY_RUNS, MODIFIED, PLAIN, USER, Sm90WsFwdTiles, bwd_names, bwd_tiles, decode_supported, decode_tiles,
    delta_name, fwd_name, fwd_tiles, head_dim_bucket, hopper_fwd_name, hopper_fwd_tiles, merge_name, scale_dq_sums_name,
    sm90_bwd_names, sm90_bwd_tiles, sm90_fwd_tiles, sum_parts_name, user_name,
)

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


def sum_parts(cupy, partial):
    """(before, parts, ...) partial sums of a split grouped dk/dv pass, added in float32 by one
    kernel (kernels/prefill/reduce.cuh): (before, ...)."""
    total = cupy.empty(partial.shape[:1] + partial.shape[2:], dtype=partial.dtype)
    sum_parts_at(partial.data.ptr, total.data.ptr, partial.dtype.name, partial.shape, total.size)
    return total


def sum_parts_at(partial: int, total: int, dtype_name: str, shape, size: int) -> None:
    """`sum_parts` on pointers, on the current stream: partial sums of ``shape`` (before, parts,
    ...) at ``partial`` into their ``size`` totals at ``total`` (both contiguous)."""
    if size:
        before, parts = shape[:2]
        fn = _compile.get_function(sum_parts_name(dtype_name), 0)
        blocks = min(-(-size // 512), 8 * sm_count())
        fn((blocks,), (256,), (np.uint64(partial), np.uint64(total), np.int64(before), np.int32(parts),
                               np.int64(size // before)))


def scale_dq_sums(sums, dq, scale: float) -> None:
    """dq = sums * scale in dq's type, from the float32 sums of dq's shape that the Hopper
    dk/dv pass added up in its accumulators' order (kernels/prefill/reduce.cuh), on the
    current stream."""
    scale_dq_sums_at(sums.data.ptr, dq.data.ptr, dq.dtype.name, dq.shape[-1], sums.size, scale)


def scale_dq_sums_at(sums: int, dq: int, dtype_name: str, head_dim: int, size: int, scale: float) -> None:
    """`scale_dq_sums` on pointers: ``size`` sums at ``sums``, dq of ``dtype_name`` and
    ``head_dim`` at ``dq`` (contiguous, as the kernels write both)."""
    pairs = size // 2
    if pairs:
        fn = _compile.get_function(scale_dq_sums_name(dtype_name, head_dim), 0)
        fn((min(-(-pairs // 256), 8 * sm_count()),), (256,), (np.uint64(sums), np.uint64(dq), np.float32(scale),
                                                               np.int64(pairs)))


def _dq_in_any_order(x) -> bool:
    """Whether the dk/dv pass may add dq up for this call (deterministic=False): it adds
    whole chunks of 16 rows of the head dim, so dense calls whose rows come in multiples
    of 16, with head dim 64 or 128 for q, k and v."""
    return x.packed is None and x.nq % 16 == 0 and x.d == x.dv and x.d in (64, 128)


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


def score_path(x) -> str:
    """The kernels' score path for the call's modifiers (_tiles.SCORE_PATHS, or USER with its
    own score or mask function)."""
    if x.user is not None:
        return USER
    if x.mods is None or not x.mods.modified:
        return PLAIN
    return FULL if x.mods.full else MODIFIED


def _scores_of(x) -> tuple[str, bool]:
    """(the score path of the kernels' name expressions, whether they take the call's own
    functions): USER runs FULL's kernels with UserScores."""
    scores = score_path(x)
    return (FULL, True) if scores == USER else (scores, False)


def _function(name: str, smem: int, x, user: bool, grads: bool = False):
    """The compiled kernel of name expression ``name``; with ``user`` (a FULL name), its
    UserScores twin compiled after the call's functions (``grads``: the dq pass's that adds the
    gradients of the score function's arrays)."""
    if not user:
        return _compile.get_function(name, smem)
    return _compile.get_function(_user_name(name, x, grads), smem, x.user.source)


def _user_name(name: str, x, grads: bool = False) -> str:
    """The UserScores twin of FULL kernel ``name`` for call ``x`` (`user_kernel_name`)."""
    packed = getattr(x, "packed", None) is not None   # (the KV cache: never packed)
    return user_kernel_name(name, packed, x.mods is not None and x.mods.full, grads)


def user_kernel_name(name: str, packed: bool, bias_dropout: bool, grads: bool = False) -> str:
    """The UserScores twin of FULL kernel ``name``: with the bias's and dropout's code where the
    call has either, and for packed sequences (without dropout's code the sm_80 forward spilled 8
    bytes); ``grads``: a dq pass adding the gradients of the arrays the score function reads."""
    return user_name(name, packed or bias_dropout, grads)


def compile_user_backward_soon(dtype_name: str, d: int, dv: int, packed: bool, source, bias_dropout: bool,
                               grads: bool = False) -> None:
    """Starts compiling the dk/dv and dq kernels of a backward with the generated functions
    ``source`` on other threads (`_compile.compile_soon`), the names `backward_launches` takes
    (``bias_dropout``: for a call with a bias or dropout; ``grads``: with score_mod_grads)."""
    head_dim = head_dim_bucket(d, dv)
    sm90 = (sm90_bwd_tiles(dtype_name, head_dim, scores=FULL, packed=packed, score_grads=grads)
            if _compile.current_arch() == "sm_90a" else None)
    if sm90 is not None:   # (FULL's Hopper tiles depend on neither the queries nor determinism)
        dkdv, dq = sm90_bwd_names(dtype_name, sm90, packed, FULL)
    else:
        dkdv, dq = bwd_names(dtype_name, bwd_tiles(dtype_name, head_dim, FULL, packed), packed, FULL)[1:]
    _compile.compile_soon([user_kernel_name(dkdv, packed, bias_dropout),
                           user_kernel_name(dq, packed, bias_dropout, grads)], source)


def forward_launches(x) -> Launches:
    """The forward over the whole broadcast batch: one launch (with at least one query),
    after the one that lists its tiles when the sequences are packed."""
    head_dim = head_dim_bucket(x.d, x.dv)
    itemsize = ELEMENT_TYPES[x.dtype_name][1]
    packed = x.packed is not None
    keys = x.nk / x.packed.num_seqs if packed and x.packed.num_seqs else x.nk
    mask = "window" if x.left is not None else "causal" if x.right is not None else "none"   # (_tiles.MASKS)
    scores, user = _scores_of(x)
    hopper = hopper_fwd_tiles(x.dtype_name, head_dim, keys, mask, scores) if _compile.current_arch() == "sm_90a" else None
    maps = None
    if isinstance(hopper, Sm90WsFwdTiles):   # through the copy engine where maps describe the inputs
        maps = _tensor_map.attention_maps(x, hopper.block_m, hopper.block_n)
        if maps is None:
            hopper = hopper.without_maps() or sm90_fwd_tiles(x.dtype_name, head_dim, keys, scores)
        else:
            hopper = dataclasses.replace(hopper, tma=True)
    if hopper is not None:
        smem, block_m, threads, cols = hopper.smem_bytes(itemsize), hopper.block_m, hopper.threads, 1
        fn = _function(hopper_fwd_name(x.dtype_name, hopper, packed, scores), smem, x, user)
    else:
        tiles = fwd_tiles(x.dtype_name, head_dim, packed, scores)
        staged_bias = scores == FULL and not packed and (not user or x.mods is not None and x.mods.full)
        smem = tiles.smem_bytes(itemsize, staged_bias=staged_bias)
        block_m, threads, cols = tiles.block_m, tiles.warps * 32, -(-x.dv // tiles.dv_block)
        fn = _function(fwd_name(x.dtype_name, tiles, packed, scores), smem, x, user)
    ws = isinstance(hopper, Sm90WsFwdTiles)
    if ws:
        params = _params.ws_params(x, block_m, maps.layout if maps else None)
    else:
        params = _params.attn_params(x, block_m)
    blocks, capacity = _row_blocks(x, block_m, False, x.batch_size)
    params[0]["num_tiles"] = blocks
    if ws:
        # a grid that fits the GPU at once, each block running tiles in turn
        blocks = min(blocks, sm_count() * blocks_per_sm(fn, threads, smem))
    main = Launch(fn, (blocks, max(1, cols)), threads, smem, params, WS_FWD_FIELDS if ws else FWD_FIELDS, maps)
    if not capacity:
        return Launches((main,), counted=ws)
    return Launches((_tile_list(x, block_m, False, Q_TILES, capacity), main), ((Q_TILES, capacity),), counted=ws)


def dkdv_layout(x, key_blocks: int, slots: int):
    """The batch layout of the dk/dv pass and its K/V entries' shape (before, split, after),
    or (the common layout, None) when it does not group.

    Grouped, each block sums dk and dv over the query heads of its K/V head, so there are
    G times fewer blocks. When that leaves fewer blocks than fit the GPU at once, each
    group is split in `split` parts (the smallest divisor of G that fills it, at most G / 2)
    whose partial sums the call adds afterwards (by measurement, docs/design.md, "Packed
    sequences and grouped queries": more parts cost more than the balance they add)."""
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


def backward_launches(x, deterministic: bool = True) -> Launches:
    """delta = rowsum(dout * out), then dk/dv over key blocks, then dq over query blocks
    (on sm_90a: dq with delta, then dk/dv; or, not deterministic where the tiles allow,
    delta, then dk/dv adding dq up in float32); with packed sequences, after the launches
    that list their tiles. With at least one query and one key."""
    head_dim = head_dim_bucket(x.d, x.dv)
    itemsize = ELEMENT_TYPES[x.dtype_name][1]
    width = max(x.d, x.dv)
    queries = x.nq / x.packed.num_seqs if x.packed and x.packed.num_seqs else x.nq   # per sequence (the mean)
    in_order = deterministic or not _dq_in_any_order(x)
    scores, user = _scores_of(x)
    grads = user and bool(x.user.grads)   # (score_mod_grads: the dq pass adds them)
    sm90 = (sm90_bwd_tiles(x.dtype_name, head_dim, queries, in_order, scores, x.packed is not None, grads)
            if _compile.current_arch() == "sm_90a" else None)
    if sm90 is not None:
        dkdv_name, dq_name = sm90_bwd_names(x.dtype_name, sm90, x.packed is not None, scores)
        dq_res, dkdv_res = sm90.dq_resident, sm90.dkdv_resident
        threads, dkdv_threads = sm90.dq_threads, sm90.dkdv_threads
        dq_smem, dkdv_smem = sm90.smem_bytes(itemsize), sm90.dkdv_smem_bytes(itemsize)
        dq_cols = dkdv_cols = 1   # a block holds gradients of every column
        per_sm = sm90.dkdv_blocks_per_sm
    else:
        tiles = bwd_tiles(x.dtype_name, head_dim, scores, x.packed is not None)
        _, dkdv_name, dq_name = bwd_names(x.dtype_name, tiles, x.packed is not None, scores)
        dq_res = dkdv_res = tiles.resident
        dq_smem = dkdv_smem = tiles.smem_bytes(itemsize)
        dq_cols = dkdv_cols = max(1, -(-width // tiles.dcol))
        threads, per_sm = tiles.warps * 32, 2
        dkdv_threads = threads
    key_blocks = -(-x.nk // dkdv_res) + (x.packed.num_seqs // 2 if x.packed else 0)
    layout, entries = dkdv_layout(x, key_blocks, per_sm * sm_count())
    dq_params = _params.bwd_params(x, dq_res)
    dkdv_params = _params.bwd_params(x, dkdv_res, layout)
    dq_blocks, q_capacity = _row_blocks(x, dq_res, False, x.batch_size)
    dkdv_blocks, k_capacity = _row_blocks(x, dkdv_res, True, layout.entries)
    if user:   # (dq compiles on another thread while dk/dv compiles here)
        _compile.compile_soon((_user_name(dq_name, x, grads),), x.user.source)
    dkdv = Launch(_function(dkdv_name, dkdv_smem, x, user), (dkdv_blocks, dkdv_cols), dkdv_threads, dkdv_smem,
                  dkdv_params, DKDV_FIELDS)
    adds_dq = sm90 is not None and sm90.dkdv_adds_dq   # then no dq pass: delta first, and dq in float32 sums
    if not adds_dq:
        dq = Launch(_function(dq_name, dq_smem, x, user, grads), (dq_blocks, dq_cols), threads, dq_smem, dq_params,
                    DQ_FIELDS)
    if sm90 is None or adds_dq:
        delta = Launch(_compile.get_function(delta_name(x.dtype_name), 0), (-(-x.batch_size * x.nq // 4),), 128, 0,
                       dq_params, DQ_FIELDS)
        runs = (delta, dkdv) if adds_dq else (delta, dkdv, dq)
    else:
        runs = (dq, dkdv)
    dq_sums = float(x.scale) if adds_dq else None
    if x.packed is None:
        return Launches(runs, (), entries, dq_sums=dq_sums)
    lists = (_tile_list(x, dq_res, False, Q_TILES, q_capacity), _tile_list(x, dkdv_res, True, K_TILES, k_capacity))
    return Launches(lists + runs, ((Q_TILES, q_capacity), (K_TILES, k_capacity)), entries, dq_sums=dq_sums)


DECODE_SPLIT_COST = 2      # key blocks' worth of time a block spends starting and ending
DECODE_MERGE_ROUND = 0.5   # key blocks' worth of one round trip to L2 in the merge of the splits
DECODE_CLUSTER_MERGE = 0.5   # key blocks' worth of a cluster's merge on chip (two barriers, one round trip)
DECODE_MAX_CLUSTER = 16    # the most splits merged in a cluster (kernels/decode/decode.cuh: DecodeTiles)
DECODE_GROUP_BATCH = 4     # clusters' parts loaded at once in a two-level merge (DecodeTiles::GROUP_BATCH)
DECODE_RUNS_MIN_SPLIT_KEYS = 256   # keys a split keeps at least over pages read run by run
DECODE_SHARED_GAIN = 0.15  # rate a second block on a multiprocessor adds to the first's reading


def decode_splits(blocks: int, longest: int, forced: int | None, slots: int, block_n: int,
                  rows: int = 1, min_keys: int = 0, cluster_slots=None, sms: int | None = None) -> tuple[int, int, int]:
    """(splits, keys per split, cluster) of the keys of each (sequence, entry): the count
    forced, or the one with the shortest modelled time (flash-decoding; a split keeps at least
    two key blocks and ``min_keys`` keys), and how its splits merge:
    waves of ``slots`` blocks, each reading its key blocks plus a fixed cost, then the merge.
    Where a wave puts several blocks on each of the ``sms`` multiprocessors (default: one
    each), they share its reading, each gaining DECODE_SHARED_GAIN of a block's rate per
    block beside it.
    Cluster 1: through global memory, by the last block of each row group, whose four warps
    take its ``rows`` rows two at a time (kernels/decode/merge.cuh, merge_rows_by_warp: rows
    r and r + 4 side by side, then r + 8 and r + 12...), ceil(rows / 8) rounds of an L2 round
    trip for the parts' lse and one per eight parts (at head dim 128; 16 at 64, 4 at 256). The
    model's merge term still counts ceil(rows / 4) rounds, one row per warp at a time, as
    before the pairs (not measured since): up to twice the kernel's (8 rows, as G = 8 at
    Nq = 1: 2 rounds for 1).
    Or, where ``cluster_slots(c, two_level)`` (blocks that run at once in clusters of
    c, of the kernel that merges in one level or two; 0: none fit) is given, in clusters of c
    splits (c dividing the count): at most that many blocks at once, merged on chip; with
    fewer splits per cluster than the count (two levels), the clusters' parts then through
    global memory, by the last block of each rank, its rows' columns at once."""
    key_blocks = max(1, -(-longest // block_n))
    blocks = max(blocks, 1)

    def time(s, c):
        room = min(slots, cluster_slots(c, c < s)) if c > 1 else slots
        per_sm = -(-min(blocks * s, room) // (sms or room))   # (blocks that share a multiprocessor)
        streaming = -(-key_blocks // s) * per_sm / (1 + DECODE_SHARED_GAIN * (per_sm - 1))
        waves = -(-blocks * s // room) * (streaming + DECODE_SPLIT_COST)
        if s == 1:
            return waves
        if c == 1:
            return waves + DECODE_SPLIT_COST + -(-rows // 4) * (1 + -(-s // 8)) * DECODE_MERGE_ROUND
        if c == s:
            return waves + DECODE_CLUSTER_MERGE
        return waves + DECODE_CLUSTER_MERGE + DECODE_SPLIT_COST + -(-(s // c) // DECODE_GROUP_BATCH) * DECODE_MERGE_ROUND

    def clusters(s):   # the merges open to s splits
        if cluster_slots is None or s == 1:
            return (1,)
        return (1,) + tuple(c for c in range(2, min(s, DECODE_MAX_CLUSTER) + 1) if s % c == 0 and cluster_slots(c, c < s) > 0)

    def best(s):
        return min((time(s, c), c) for c in clusters(s))

    if forced is None:
        least = max(2, -(-min_keys // block_n))   # key blocks a split keeps
        counts = range(1, max(1, min(128, key_blocks // least)) + 1)
    else:
        counts = (forced,)
    per_split = -(-key_blocks // min(counts, key=lambda s: best(s)[0])) * block_n
    splits = -(-max(longest, 1) // per_split)   # (as many as the keys fill, which a forced count may exceed)
    return splits, per_split, best(splits)[1]


def kvcache_launches(x) -> KVCacheLaunches:
    """The launches of a checked attention_kvcache call (kernels/decode/decode.cuh)."""
    itemsize = ELEMENT_TYPES[x.dtype_name][1]
    elem = ELEMENT_TYPES[x.dtype_name][0]
    head_dim = head_dim_bucket(x.d, x.dv)
    rows = x.group * x.nq
    tiles = decode_tiles(head_dim, rows, itemsize, None if x.block_table is None else x.page_size)
    smem = tiles.smem_bytes(head_dim, itemsize)
    if smem > 227 * 1024 or not decode_supported(head_dim, itemsize):
        raise ValueError(f"attention_kvcache does not take {x.dtype_name} with head dims above 128 "
                         f"(D = {x.d}, Dv = {x.dv}); use float16 or bfloat16")
    row_groups = -(-rows // tiles.block_rows)
    scores, user = _scores_of(x)
    decode = _function(tiles.name(x.dtype_name, head_dim, scores=scores), smem, x, user)
    blocks = x.batch * x.entries * row_groups
    hopper = _compile.current_arch() == "sm_90a"
    alone = tiles.streams_alone(head_dim, itemsize)
    per_sm = 1 if alone else blocks_per_sm(decode, 128, smem)
    # (launched in clusters, a block that streams alone, or that reads pages for 16 rows, asks
    # for shared memory enough to keep a multiprocessor to itself: a cluster's blocks may
    # otherwise be placed two to one, each then streaming at half the rate; docs/design.md,
    # "KV cache and decoding". The global merge's blocks of pages still plan two per SM, whose
    # table reads hide each other's; 32 rows, four times the products, want two per SM in clusters too.)
    pad = alone or (x.block_table is not None and tiles.block_rows == 16)
    cluster_smem = one_per_sm_smem(smem) if hopper and pad else smem
    if cluster_smem > smem:
        _function(tiles.name(x.dtype_name, head_dim, scores=scores), cluster_smem, x, user)
    # (pages read run by run pack two blocks per SM, and splits of two 64-key blocks there
    # spend more on their fixed costs than the model counts: docs/design.md, "KV cache and decoding")
    min_keys = DECODE_RUNS_MIN_SPLIT_KEYS if tiles.layout == KEY_RUNS else 0

    def kernel(two_level):   # (several clusters per row group: the kernel of two-level merges)
        return _function(tiles.name(x.dtype_name, head_dim, two_level, scores), cluster_smem, x, user) if two_level \
            else decode

    def clusters(c, two_level):   # (Hopper: blocks at once in clusters of c splits of a row group, merged on chip)
        return cluster_slots(kernel(two_level), 128, cluster_smem, c)

    sms = sm_count()
    splits, split_keys, cluster = decode_splits(blocks, x.longest, x.num_splits, per_sm * sms,
                                                tiles.block_n, min(rows, tiles.block_rows), min_keys,
                                                clusters if hopper else None, sms)
    decode = kernel(1 < cluster < splits)
    left, right = _params.window_sides(x.left, x.right, x.nq, x.capacity)
    ks, vs = x.k_strides, x.v_strides
    kn = (0, 0, 0) if x.k_new is None else tuple(st // itemsize for st in x.k_new.strides[:3])
    vn = (0, 0, 0) if x.v_new is None else tuple(st // itemsize for st in x.v_new.strides[:3])
    scale_log2, scale_log2_lo = _params.scale_log2_parts(x.scale)
    cap, cap_inv, unscale, slope_unit = _params.score_units(x.mods, x.scale)
    params = _params.decode_params(
        q_stride_b=x.q.strides[0] // itemsize, q_stride_e=x.q.strides[1] // itemsize, q_stride_row=x.q.strides[2] // itemsize,
        k_stride_b=ks[0], k_stride_e=ks[1], k_stride_row=ks[2], v_stride_b=vs[0], v_stride_e=vs[1], v_stride_row=vs[2],
        kn_stride_b=kn[0], kn_stride_e=kn[1], kn_stride_row=kn[2], vn_stride_b=vn[0], vn_stride_e=vn[1], vn_stride_row=vn[2],
        batch=x.batch, entries=x.entries, rows=rows, nq=x.nq, d=x.d, dv=x.dv, n_new=x.n_new,
        seqlen_all=x.seqlen_all, capacity=x.capacity, page_size=x.page_size,
        page_div=_params.fast_divisor(x.page_size), num_pages=x.num_pages,
        max_pages=0 if x.block_table is None else x.block_table.shape[1],
        window_left=left, window_right=right,
        scale_log2=scale_log2, scale_log2_lo=scale_log2_lo, splits=splits, split_keys=split_keys,
        cap=cap, cap_inv=cap_inv, unscale=unscale, slope_unit=slope_unit,
    )
    runs = []
    # (programmatic on Hopper: each kernel starts under the tail of the one before; docs/design.md,
    # "KV cache and decoding")
    if x.n_new and x.batch * x.entries:
        append = _compile.get_function(f"cuflash::kvcache_append<{elem}>", 0)
        runs.append(Launch(append, (x.batch * x.entries * x.n_new,), 128, 0, params, DECODE_FIELDS,
                           programmatic=hopper))
    if rows and x.batch * x.entries:
        runs.append(Launch(decode, (x.batch * x.entries, splits, row_groups), 128, cluster_smem if cluster > 1 else smem,
                           params, DECODE_FIELDS, programmatic=hopper, cluster=cluster))
    # (the partials through global memory, and a counter per row group, or per row group and
    # rank for the clusters' parts; a row group's splits in one cluster need neither)
    parts = (splits // cluster, x.batch * x.entries * rows, x.dv, x.batch * x.entries * row_groups * cluster) \
        if cluster < splits else None
    return KVCacheLaunches(tuple(runs), x.out_shape, parts)
