// attn_fwd_sm90_ws.cuh: the Hopper forward with its loads on their own warps.
//
// In attn_fwd_sm90 every thread both loads and computes, and a block-wide barrier
// each step ties the two together: a tile's first loads start only when its block
// does, and with short sequences (a few key blocks per tile) that start is much of
// the time. Here warpgroup 0 only loads: it walks the block's tiles ahead
// of the others, copying Q into one of Q_BUFFERS buffers and K, V blocks into a ring of
// STAGES, each buffer guarded by a pair of mbarriers (full: the copies landed;
// empty: its last reader is done). The CONSUMERS warpgroups after it (two, or three
// at head dim 64, where a tile's exponentials weigh most against its products) only
// compute, each 64 rows of the tile, with the same products and online softmax as
// attn_fwd_sm90, but for two savings in the softmax's arithmetic (docs/design.md,
// "Hopper forward"):
// each exponent is one FMA against the row's rounded scaled max (softmax.cuh: ROUNDED_BASE),
// and a warp whose rows kept their maxima skips the accumulator's rescale. The
// block is persistent: it runs tiles in turn, drawing each next one from the launch's
// counter (tile_queue.cuh), so the loads of the next tile run under the products and
// the stores of this one, and the blocks finish together under a causal mask. Where the
// tile's rows do not divide the sequence, the short tile is its first (FwdTile's PARTIAL_FIRST).
//
// The loads go one of two ways (TMA). With tensor maps, one thread of the loading
// warpgroup issues each buffer's copies to the copy engine, a box of 64 columns per
// 128-byte-swizzled panel, and arms the buffer's "full" barrier with the bytes to
// expect; the other loading threads leave. Without (packed sequences, layouts a map
// cannot describe), all 128 loading threads copy 16-byte chunks by cp.async.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {

// The block's barriers, after its buffers: Q full/empty per buffer, then K and V
// full/empty per stage.
template <int Q_BUFFERS, int STAGES>
struct FwdBarriers {
    u32 base;
    __device__ __forceinline__ u32 q_full(int b) const { return base + 8u * u32(b); }
    __device__ __forceinline__ u32 q_empty(int b) const { return base + 8u * u32(Q_BUFFERS + b); }
    __device__ __forceinline__ u32 k_full(int s) const { return base + 8u * u32(2 * Q_BUFFERS + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return base + 8u * u32(2 * Q_BUFFERS + STAGES + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return base + 8u * u32(2 * Q_BUFFERS + 2 * STAGES + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return base + 8u * u32(2 * Q_BUFFERS + 3 * STAGES + s); }
};

// The kernel's record: AttnParams, then the maps the copy engine reads Q, K and V
// through (TMA; unused otherwise), then the counter the blocks draw their tiles from.
// Each map's dims, innermost first: columns, rows, then MAP_BATCH_DIMS batch dims (the
// host pads the launch's batch to that many), one wide where the tensor broadcasts
// (cuflash/_tensor_map.py: attention_maps).
constexpr int MAP_BATCH_DIMS = 3;
struct WsFwdParams {
    AttnParams attn;
    TensorMap q_map, k_map, v_map;
    u32* tile_counter;   // two words, zero before the launch and after it (TileQueue)
};

#ifdef CUFLASH_WS_PARAMS_BYTES
static_assert(sizeof(WsFwdParams) == CUFLASH_WS_PARAMS_BYTES, "WsFwdParams differs from cuflash/_params.py");
#endif

// A batch entry's coordinates in the three maps, innermost first: its index along each
// batch dim, or 0 along one the tensor broadcasts (stride 0: a map dim one wide).
struct MapEntry {
    int q[MAP_BATCH_DIMS], k[MAP_BATCH_DIMS], v[MAP_BATCH_DIMS];

    __device__ __forceinline__ MapEntry(const AttnParams& p, u32 b) {
#pragma unroll
        for (int j = 0; j < MAP_BATCH_DIMS; ++j) {
            const int i = MAP_BATCH_DIMS - 1 - j;   // innermost dim first
            const u32 n = u32(p.batch_shape[i]);
            const u32 quotient = fast_div(b, p.batch_div[i]);
            const int idx = int(b - quotient * n);
            b = quotient;
            q[j] = p.q_batch_stride[i] ? idx : 0;
            k[j] = p.k_batch_stride[i] ? idx : 0;
            v[j] = p.v_batch_stride[i] ? idx : 0;
        }
    }
};

// Arms `bar` with a whole tile's bytes and copies the tile whose first row is `row`
// through `map`, a box per 64-column panel (columns past the tensor's read zeros, as
// do rows past its end).
template <class Tile>
__device__ __forceinline__ void tma_load_tile(u32 dst, const TensorMap& map, u32 bar, int row, const int (&entry)[MAP_BATCH_DIMS]) {
    constexpr int PANELS = Tile::BYTES / Tile::PANEL_BYTES;
    mbarrier_arrive_expect_bytes(bar, u32(Tile::BYTES));
#pragma unroll
    for (int panel = 0; panel < PANELS; ++panel)
        tma_load(dst + panel * Tile::PANEL_BYTES, map, bar, panel * 64, row, entry[0], entry[1], entry[2]);
}

enum class Source { Q, K, V };   // what a loader's copy brings

template <class T, int HEAD_DIM, int BLOCK_N, int STAGES, int Q_BUFFERS, int CONSUMERS, bool PACKED, bool TMA,
          class Scores>
__global__ void __launch_bounds__(128 * (1 + CONSUMERS), 1)
attn_fwd_sm90_ws(const __grid_constant__ WsFwdParams params) {
    static_assert(!(TMA && PACKED), "packed sequences load by cp.async: a box would run into the next sequence");
    const AttnParams& p = params.attn;
    using Cfg = Sm90WsFwdConfig<T, HEAD_DIM, BLOCK_N, STAGES, Q_BUFFERS, TMA, CONSUMERS, Scores::USER>;
    using QTile = typename Cfg::QTile;
    using KTile = typename Cfg::KTile;
    using VTile = typename Cfg::VTile;
    using Tile = FwdTile<Cfg, true, true>;   // (the short tile first)
    using Slot = RingSlot<STAGES>;
    using QSlot = RingSlot<Q_BUFFERS>;
    constexpr int N_TILES = BLOCK_N / 8, D_TILES = HEAD_DIM / 8;

    extern __shared__ __align__(1024) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(Cfg::SMEM_BYTES)) __trap();   // launch/config mismatch

    // [Q x Q_BUFFERS][K x STAGES][V x STAGES][barriers], from a 1024-byte boundary (swizzle atoms)
    const u32 s_q = (smem_address(smem) + 1023u) & ~1023u;
    const u32 s_k = s_q + Q_BUFFERS * QTile::BYTES;
    const u32 s_v = s_k + STAGES * KTile::BYTES;
    const FwdBarriers<Q_BUFFERS, STAGES> bar{s_v + STAGES * VTile::BYTES};
    const TileQueue<Cfg::TILE_SLOTS> queue{bar.base + 8u * Cfg::BARRIERS, params.tile_counter};
    static_assert(decltype(queue)::BYTES == 24 * Cfg::TILE_SLOTS, "Sm90WsFwdConfig::SMEM_BYTES counts the queue so");
    // a "full" barrier takes one arrival per loading thread (TMA: the one that arms it)
    constexpr u32 LOADERS = TMA ? 1u : u32(Cfg::PRODUCER_THREADS);
    // thread 0 draws the tiles; the computing threads and the other loaders read them
    constexpr u32 READERS = Cfg::CONSUMER_THREADS + (TMA ? 0u : LOADERS - 1u);
    if (threadIdx.x == 0) {
        queue.init(READERS);
        for (int b = 0; b < Q_BUFFERS; ++b) {
            mbarrier_init(bar.q_full(b), LOADERS);
            mbarrier_init(bar.q_empty(b), Cfg::CONSUMER_THREADS);
        }
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(bar.k_full(s), LOADERS);
            mbarrier_init(bar.k_empty(s), Cfg::CONSUMER_THREADS);
            mbarrier_init(bar.v_full(s), LOADERS);
            mbarrier_init(bar.v_empty(s), Cfg::CONSUMER_THREADS);
        }
        if constexpr (TMA) mbarrier_init_fence();   // the copy engine sees the barriers initialized
    }
    __syncthreads();

    const u32 num_m_blocks = u32(p.num_m_blocks), num_tiles = u32(p.num_tiles);
    const int d = int(p.d), dv = int(p.dv);

    if (threadIdx.x < Cfg::PRODUCER_THREADS) {
        registers_release<Cfg::PRODUCER_REGS>();
        // One tile of Q, K or V from its first row `row` into `dst`, landing on barrier `full`.
        // TMA: one thread arms the barrier with the bytes its copies bring. cp.async: every
        // loader thread's copies count towards the barrier as they land.
        auto copy = [&](const Tile& t, Source source, int row, u32 dst, u32 full) {
            if constexpr (TMA) {
                const MapEntry at(p, t.w.entry);
                if (source == Source::Q) tma_load_tile<QTile>(dst, params.q_map, full, row, at.q);
                if (source == Source::K) tma_load_tile<KTile>(dst, params.k_map, full, row, at.k);
                if (source == Source::V) tma_load_tile<VTile>(dst, params.v_map, full, row, at.v);
            } else {
                if (source == Source::Q)
                    load_tile_async<QTile, Cfg::PRODUCER_THREADS, true>(dst, t.g_q, p.q_row_stride, t.w.nq - row, d);
                if (source == Source::K)
                    load_tile_async<KTile, Cfg::PRODUCER_THREADS, true>(dst, t.g_k + index_t(row) * p.k_row_stride,
                                                                        p.k_row_stride, t.w.nk - row, d);
                if (source == Source::V)
                    load_tile_async<VTile, Cfg::PRODUCER_THREADS, true>(dst, t.g_v + index_t(row) * p.v_row_stride,
                                                                        p.v_row_stride, t.w.nk - row, dv);
                mbarrier_arrive_after_copies(full);
            }
        };
        if (!TMA || threadIdx.x == 0) {   // (TMA: the other loader threads leave at once)
            if constexpr (TMA) {
                tma_prefetch(params.q_map);
                tma_prefetch(params.k_map);
                tma_prefetch(params.v_map);
            }
            // Q of each tile with keys, then its K and V blocks in the order they are read,
            // each copy once its buffer's last reader is done; the next tile drawn once
            // this one's copies are issued (a tile ahead of the computing warpgroups)
            const bool draws = threadIdx.x == 0;
            u32 q_uses = 0, kv_uses = 0, index = queue.first();
            for (u32 n = 0;; ++n) {
                if (draws) {
                    queue.publish(n, index);
                } else {
                    index = queue.take(n);
                }
                Work w;
                if (index >= num_tiles || !p.template work_at<PACKED, true, true>(index, num_m_blocks, true, w)) break;
                const Tile t(p, w);
                if (t.nb_begin < t.nb_end) {
                    const QSlot qs(q_uses++);
                    mbarrier_wait(bar.q_empty(qs.stage), qs.parity ^ 1u);
                    copy(t, Source::Q, t.m0, s_q + qs.stage * QTile::BYTES, bar.q_full(qs.stage));
                    // (the key blocks the call's block mask leaves empty: neither loaded nor computed)
                    const BlockRowKinds<Scores> kinds(p, w, t.m0, t.m_end);
                    for (int nb = t.nb_begin; nb < t.nb_end; ++nb) {
                        if (kinds.at(nb * BLOCK_N, (nb + 1) * BLOCK_N) == TileKind::EMPTY) continue;
                        const Slot slot(kv_uses);
                        mbarrier_wait(bar.k_empty(slot.stage), slot.parity ^ 1u);
                        copy(t, Source::K, nb * BLOCK_N, s_k + slot.stage * KTile::BYTES, bar.k_full(slot.stage));
                        mbarrier_wait(bar.v_empty(slot.stage), slot.parity ^ 1u);
                        copy(t, Source::V, nb * BLOCK_N, s_v + slot.stage * VTile::BYTES, bar.v_full(slot.stage));
                        ++kv_uses;
                    }
                }
                if (draws) index = queue.draw();
            }
            if (draws) queue.retire();
        }
        if constexpr (!TMA) cp_async_wait<0>();   // no copy outlives its thread (TMA's complete on the barriers)
        return;
    }

    // Compute: the order of attn_fwd_sm90's step (scores of block i, then block i-1's
    // p v behind them, softmax while that product runs), with barrier waits in place
    // of the block-wide sync. With cp.async the fence after each wait makes the loaders'
    // copies (generic proxy) visible to wgmma's reads (async proxy); the copy engine's
    // writes are in the async proxy already.
    auto copies_visible = [] {
        if constexpr (!TMA) fence_async_shared();
    };
    registers_claim<Cfg::CONSUMER_REGS>();
    const int consumer = int(threadIdx.x) / 128 - 1;                    // 0 .. CONSUMERS - 1
    const int group_row0 = consumer * 64;                               // this warpgroup's rows
    const int warp_row0 = group_row0 + (int(threadIdx.x) / 32 % 4) * 16;   // this warp's rows
    const float scale_log2 = p.scale_log2;
    const bool vanish = masked_p_vanish<T>(p.scale_log2);   // masked blocks may skip the test
    u32 pa[N_TILES / 2][4];   // p of the previous block, as wgmma A fragments
    float acc[1][D_TILES][4];
    u32 q_uses = 0, kv_uses = 0;
    // acc += p v for the block whose V sits in slot's stage (waited for beforehand: a
    // wait between two products' issue would serialize them); not waited for.
    auto issue_pv = [&](const Slot& slot) {
        pin_registers(acc);
        wgmma_fence();
        wgmma_regs_cols<T, VTile, HEAD_DIM>(acc[0], pa, s_v + slot.stage * VTile::BYTES);
        wgmma_commit();
    };

    for (u32 n = 0;; ++n) {
        const u32 index = queue.take(n);
        Work w;
        if (index >= num_tiles || !p.template work_at<PACKED, true, true>(index, num_m_blocks, true, w)) break;
        const Tile t(p, w);
        const ScorePath<T, Scores> path(p, t.band, w.entry, w);
        fill_zero(acc);
        OnlineSoftmax<T, 1, Cfg::SOFTMAX_CHAINS> softmax(p.scale_log2_lo);
        const int steps = t.nb_end - t.nb_begin;
        if (steps > 0) {
            const QSlot qs(q_uses);
            mbarrier_wait(bar.q_full(qs.stage), qs.parity);
            copies_visible();
            ++q_uses;
            const u32 s_q_rows = s_q + qs.stage * QTile::BYTES + group_row0 * 128;
            // Step i computes key block nb, a use of the ring. On the user path the key blocks the
            // call's block mask leaves empty are skipped (as the loader skips them), so the
            // steps may end early: `computed` of them.
            BlockWalk<Scores::USER> walk;
            int computed = steps, nb = t.nb_begin;
            for (int i = 0; i < steps; ++i, ++nb) {
                TileKind kind = TileKind::PARTIAL;
                if constexpr (Scores::USER) {
                    auto kind_of = [&](int b) {
                        return b < t.nb_end ? path.tile(t.m0, t.m_end, b * BLOCK_N, (b + 1) * BLOCK_N) : TileKind::EMPTY;
                    };
                    kind = walk.at(nb, kind_of);
                    while (kind == TileKind::EMPTY && ++nb < t.nb_end) kind = walk.at(nb, kind_of);
                    if (kind == TileKind::EMPTY) {
                        computed = i;
                        break;
                    }
                }
                const Slot slot(kv_uses + u32(i)), prev(kv_uses + u32(i) - 1u);
                mbarrier_wait(bar.k_full(slot.stage), slot.parity);
                if (i > 0) mbarrier_wait(bar.v_full(prev.stage), prev.parity);
                copies_visible();
                float s[1][N_TILES][4];
                wgmma_fence();
                wgmma_rows_rows<T, QTile, KTile, HEAD_DIM, BLOCK_N>(s[0], s_q_rows, s_k + slot.stage * KTile::BYTES);
                wgmma_commit();
                if (i > 0) {
                    issue_pv(prev);
                    wgmma_wait<1>();
                } else {
                    wgmma_wait<0>();
                }
                pin_registers(s);
                mbarrier_arrive(bar.k_empty(slot.stage));

                float alpha[1][2];
                const int n0 = (Scores::USER ? nb : t.nb_begin + i) * BLOCK_N;
                path.modify(s, t.m0 + warp_row0, n0, kind);
                const bool cut = t.band.cuts(t.m0, t.m_end, n0, n0 + BLOCK_N);
                if (cut) apply_band_rows(s, t.band, t.m_end, t.m0 + warp_row0, n0);
                if ((cut || path.masks_anywhere()) && !vanish) {
                    softmax.template probabilities<true, true>(s, scale_log2, alpha);
                } else {
                    softmax.template probabilities<false, true>(s, scale_log2, alpha);
                }
                path.drop(s, t.m0 + warp_row0, n0);
                wgmma_wait<0>();   // (unconditional: ptxas pairs waits with issues only so)
                pin_registers(acc);
                if (i > 0) mbarrier_arrive(bar.v_empty(prev.stage));
                // (once the maxima settle most blocks move none: alpha is exactly 1)
                if (softmax.any_moved(alpha)) softmax.rescale(acc, alpha);
                to_a_fragments<T>(pa, s);
            }
            mbarrier_arrive(bar.q_empty(qs.stage));   // every score product of the tile is done
            if (computed > 0) {   // (the user path: unless the block mask left every key block empty)
                const Slot last(kv_uses + u32(computed) - 1u);
                mbarrier_wait(bar.v_full(last.stage), last.parity);
                copies_visible();
                issue_pv(last);
                wgmma_wait<0>();
                pin_registers(acc);
                mbarrier_arrive(bar.v_empty(last.stage));
            }
            kv_uses += u32(computed);
        }
        float lse[1][2];
        path.template finish<true>(softmax, acc, lse, scale_log2, w.entry);
        store_output<T, true>(p, t.w, t.m0, t.m_end, 0, warp_row0, acc, lse);
    }
}

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
