// tile_config.cuh: tile shapes and the shared-memory layout they imply,
// kept apart from the algorithm. The shapes themselves are chosen per
// (dtype, head dim) in cuflash/_tiles.py and arrive as template arguments.
#pragma once

namespace cuflash {

template <class T, int HEAD_DIM_, int DV_BLOCK_, int BLOCK_M_, int BLOCK_N_, int WARPS_>
struct FwdConfig {
    using Storage = typename T::storage;
    static constexpr int HEAD_DIM = HEAD_DIM_;   // d and dv, padded up to a multiple of 16
    static constexpr int DV_BLOCK = DV_BLOCK_;   // output columns per block (blockIdx.y picks which)
    static constexpr int BLOCK_M = BLOCK_M_;     // query rows per block
    static constexpr int BLOCK_N = BLOCK_N_;     // keys per pipeline step
    static constexpr int WARPS = WARPS_;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int M_TILES = BLOCK_M / (16 * WARPS);   // 16-row MMA tiles per warp
    static constexpr int N_TILES = BLOCK_N / 8;              // 8-key score tiles
    static constexpr int D_TILES = DV_BLOCK / 8;             // 8-column output tiles
    static constexpr int STAGES = 2;                         // K/V blocks in flight
    // When score and output accumulators take 160 or more of a thread's 255
    // registers, the q k^T loop over the head dim stays rolled: no registers are
    // left for loads hoisted across iterations, and each iteration has 16 or more
    // MMAs to hide the loop.
    static constexpr int ACC_REGISTERS = M_TILES * (N_TILES + D_TILES) * 4;
    static constexpr int QK_UNROLL = ACC_REGISTERS >= 160 ? 1 : T::K_UNROLL;

    using QTile = SmemTile<Storage, BLOCK_M, HEAD_DIM>;
    using KTile = SmemTile<Storage, BLOCK_N, HEAD_DIM>;
    using VTile = SmemTile<Storage, BLOCK_N, DV_BLOCK>;
    // [Q][K stage 0][K stage 1][V stage 0][V stage 1]
    static constexpr int SMEM_BYTES = QTile::BYTES + STAGES * (KTile::BYTES + VTile::BYTES);

    static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole 16-row tiles");
    static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0 && DV_BLOCK % 16 == 0, "MMA steps are 16 wide");
};

// Backward: a block holds RESIDENT = 16 * WARPS rows (keys for dK/dV, queries
// for dQ; each warp owns 16) and streams the other side in blocks of STEP rows.
// Gradient columns [col0, col0 + DCOL) are computed per block (blockIdx.y).
template <class T, int HEAD_DIM_, int DCOL_, int STEP_, int WARPS_>
struct BwdConfig {
    using Storage = typename T::storage;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int DCOL = DCOL_;
    static constexpr int STEP = STEP_;
    static constexpr int WARPS = WARPS_;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int RESIDENT = 16 * WARPS;
    static constexpr int STAGES = 2;
    static constexpr int S_TILES = STEP / 8;       // 8-wide score tiles per warp
    static constexpr int D_TILES = DCOL / 8;       // 8-column gradient tiles per warp
    // dk and dv accumulators plus two score tiles; as in the forward, loops over
    // the head dim stay rolled when these take 160 or more registers
    static constexpr int ACC_REGISTERS = (2 * D_TILES + 2 * S_TILES) * 4;
    static constexpr int K_UNROLL = ACC_REGISTERS >= 160 ? 1 : T::K_UNROLL;

    using ResidentTile = SmemTile<Storage, RESIDENT, HEAD_DIM>;
    using StepTile = SmemTile<Storage, STEP, HEAD_DIM>;
    // [2 resident tiles][2 step tiles x STAGES][2 float rows of STEP x STAGES]
    static constexpr int ROW_STATS_BYTES = 2 * STAGES * STEP * 4;
    static constexpr int SMEM_BYTES = 2 * ResidentTile::BYTES + 2 * STAGES * StepTile::BYTES + ROW_STATS_BYTES;

    static_assert(STEP % 16 == 0 && HEAD_DIM % 16 == 0 && DCOL % 16 == 0, "MMA steps are 16 wide");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Hopper forward: WARPGROUPS warpgroups of 64 query rows each; K and V blocks of
// BLOCK_N keys. Tiles are 128-byte swizzled panels (wgmma.cuh), so the head dim
// is a multiple of 64; the block reserves 1024 bytes to align them.
template <class T, int HEAD_DIM_, int BLOCK_N_, int WARPGROUPS_>
struct Sm90FwdConfig {
    using Storage = typename T::storage;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int BLOCK_N = BLOCK_N_;
    static constexpr int WARPGROUPS = WARPGROUPS_;
    static constexpr int BLOCK_M = 64 * WARPGROUPS;
    static constexpr int THREADS = 128 * WARPGROUPS;
    // K and V blocks in flight (a third stage measured no faster; docs/design.md, "Hopper forward")
    static constexpr int STAGES = 2;

    using QTile = PanelTile<Storage, BLOCK_M, HEAD_DIM>;
    using KTile = PanelTile<Storage, BLOCK_N, HEAD_DIM>;
    using VTile = PanelTile<Storage, BLOCK_N, HEAD_DIM>;
    static constexpr int SMEM_BYTES = 1024 + QTile::BYTES + STAGES * (KTile::BYTES + VTile::BYTES);
};

// A block of one loading warpgroup (0) and CONSUMER_WARPGROUPS computing ones (1, ...).
// The loaders keep PRODUCER_REGS registers and give the rest to the computing
// warpgroups (setmaxnreg): all of them together stay within what the block was
// launched with, 65536 / THREADS per thread rounded down to the allocation unit of 8
// (168 with two computing warpgroups, 128 with three), or the computing warpgroups'
// claim waits for registers that never come. So CONSUMER_REGS is what is left: 240
// beside 24-register loaders with two, 160 with three.
template <int PRODUCER_REGS_, int CONSUMER_WARPGROUPS = 2>
struct LoadingWarpgroupBlock {
    static constexpr int THREADS = 128 * (1 + CONSUMER_WARPGROUPS);
    static constexpr int PRODUCER_THREADS = 128;
    static constexpr int CONSUMER_THREADS = 128 * CONSUMER_WARPGROUPS;
    static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
    static constexpr int PRODUCER_REGS = PRODUCER_REGS_;
    static constexpr int CONSUMER_REGS =
        (THREADS * LAUNCH_REGS - PRODUCER_THREADS * PRODUCER_REGS) / CONSUMER_THREADS / 8 * 8;
    static_assert(CONSUMER_REGS <= 256 && PRODUCER_REGS % 8 == 0 && PRODUCER_REGS >= 24, "setmaxnreg's range");
};

// Hopper forward with a loading warpgroup (attn_fwd_sm90_ws.cuh): warpgroup 0 copies,
// CONSUMERS warpgroups (two or three) compute 64 query rows each of a 64 * CONSUMERS-row
// tile. Q has Q_BUFFERS buffers (two: the next tile's loads while the current one
// computes; one where two do not fit, head dim 256), K and V a ring of STAGES. Loading
// through the copy engine (TMA_LOADS), the one loading thread needs 24 registers; by
// cp.async, with its address arithmetic, 56; looking up a call's block mask besides
// (BLOCK_LOOKUPS: the user path's), 80 (with 56 it spilled 8-48 bytes). (Head dim 256 keeps 56
// either way: its computing warpgroups ran 4 % slower with the 16 more registers;
// docs/design.md, "Tiles and dispatch".)
template <class T, int HEAD_DIM_, int BLOCK_N_, int STAGES_, int Q_BUFFERS_, bool TMA_LOADS, int CONSUMERS,
          bool BLOCK_LOOKUPS = false>
struct Sm90WsFwdConfig
    : LoadingWarpgroupBlock<BLOCK_LOOKUPS ? 80 : TMA_LOADS && HEAD_DIM_ <= 128 ? 24 : 56, CONSUMERS> {
    using Storage = typename T::storage;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int BLOCK_N = BLOCK_N_;
    static constexpr int STAGES = STAGES_;
    static constexpr int Q_BUFFERS = Q_BUFFERS_;
    static constexpr int BLOCK_M = 64 * CONSUMERS;
    // a row's maxima and sums in four chains: a computing warp's softmax runs while the other
    // warpgroup's products do, with no other warp of its own to hide each step's latency
    // (1.00-1.10x one chain at head dims 64 and 128; at 256, 0.95-1.04x: one there;
    // docs/design.md, "Hopper forward")
    static constexpr int SOFTMAX_CHAINS = HEAD_DIM_ == 256 ? 1 : 4;

    using QTile = PanelTile<Storage, BLOCK_M, HEAD_DIM>;
    using KTile = PanelTile<Storage, BLOCK_N, HEAD_DIM>;
    using VTile = PanelTile<Storage, BLOCK_N, HEAD_DIM>;
    // barriers: q full/empty x Q_BUFFERS, k full/empty x STAGES, v full/empty x STAGES;
    // then the tile queue's slots, 24 bytes each (tile_queue.cuh: the next tile drawn
    // while this one runs)
    static constexpr int BARRIERS = 2 * Q_BUFFERS + 4 * STAGES;
    static constexpr int TILE_SLOTS = 2;
    static constexpr int SMEM_BYTES = 1024 + Q_BUFFERS * QTile::BYTES + STAGES * (KTile::BYTES + VTile::BYTES) +
                                      8 * BARRIERS + 24 * TILE_SLOTS;
};

// Hopper backward passes with a loading warpgroup (attn_bwd_sm90_ws.cuh): warpgroup 0
// copies, warpgroups 1 and 2 own a block of RESIDENT rows (keys for dk/dv, queries for
// dq; 64 each of 128); the other side streams in steps of STEP rows through a ring of
// STAGES, each stage guarded by a full
// and an empty mbarrier. ROW_STATS: each stage also holds its query rows' lse and
// delta (the dk/dv passes). The D 128 dk/dv pass needs 240 registers per computing
// thread (it spills at 216). ADDS_DQ: a dk/dv pass that adds dq up as well, with four
// 64 x 64 tiles of ds^T (one per computing warpgroup and step parity) and a float32 chunk
// of 16 dq rows per computing warp, which the copy engine adds into global memory (at head
// dim 128 with two stages: 226 KB in all).
template <class T, int HEAD_DIM_, int RESIDENT_, int STEP_, int STAGES_, bool ROW_STATS, bool ADDS_DQ = false>
struct Sm90WsBwdConfig : LoadingWarpgroupBlock<24> {
    using Storage = typename T::storage;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int STEP = STEP_;
    static constexpr int RESIDENT = RESIDENT_;
    static constexpr int STAGES = STAGES_;

    using ResidentTile = PanelTile<Storage, RESIDENT, HEAD_DIM>;
    using StepTile = PanelTile<Storage, STEP, HEAD_DIM>;
    using DsTile = PanelTile<Storage, 64, 64>;
    static constexpr int DS_BYTES = ADDS_DQ ? 4 * DsTile::BYTES : 0;
    static constexpr int DQ_CHUNK_BYTES = 16 * HEAD_DIM * 4;
    static constexpr int DQ_CHUNKS = ADDS_DQ ? 8 : 0;
    // barriers: the resident tiles full; per stage, step full and empty
    static constexpr int BARRIERS = 1 + 2 * STAGES;
    static constexpr int ROW_STATS_BYTES = ROW_STATS ? 2 * STAGES * STEP * 4 : 0;
    // [2 resident tiles][2 step tiles x STAGES][ds tiles][dq chunks][lse x STAGES][delta x STAGES][barriers]
    static constexpr int SMEM_BYTES = 1024 + 2 * ResidentTile::BYTES + 2 * STAGES * StepTile::BYTES + DS_BYTES +
                                      DQ_CHUNKS * DQ_CHUNK_BYTES + ROW_STATS_BYTES + 8 * BARRIERS;
};

// Hopper backward: each warpgroup owns 64 resident rows; the other side streams
// in steps of STEP rows.
template <class T, int HEAD_DIM_, int STEP_, int WARPGROUPS_, int STAGES_>
struct Sm90BwdConfig {
    using Storage = typename T::storage;
    static constexpr int HEAD_DIM = HEAD_DIM_;
    static constexpr int STEP = STEP_;
    static constexpr int RESIDENT = 64 * WARPGROUPS_;
    static constexpr int THREADS = 128 * WARPGROUPS_;
    static constexpr int STAGES = STAGES_;
    static_assert(STAGES >= 2, "a step reads one stage while the next one fills");
    // With three or more stages a step's last gradient product runs on into the
    // next step, so loads run STAGES - 2 steps ahead instead of STAGES - 1: the
    // stage a step refills was last read two steps back, by a product since waited for.
    static constexpr bool OVERLAP = STAGES >= 3;
    static constexpr int AHEAD = OVERLAP ? STAGES - 2 : STAGES - 1;
    // The dk/dv passes fetch a step's lse and delta into registers a step before
    // storing them (QueryRowStats). Not with two stages: those tiles (D = 128) sit
    // at the register limit, where the two live registers cost more than the
    // load latency they hide (measured).
    static constexpr bool PREFETCH_ROW_STATS = OVERLAP;

    using ResidentTile = PanelTile<Storage, RESIDENT, HEAD_DIM>;
    using StepTile = PanelTile<Storage, STEP, HEAD_DIM>;
    // [2 resident tiles][2 step tiles x STAGES][2 float rows of STEP x STAGES], after 1024 for alignment
    static constexpr int SMEM_BYTES = 1024 + 2 * ResidentTile::BYTES + 2 * STAGES * StepTile::BYTES + 2 * STAGES * STEP * 4;
};
#endif

}  // namespace cuflash
