// attn_fwd.cuh: the forward pass, out = softmax(scale * q k^T + mask) v.
//
// One block computes BLOCK_M query rows of one sequence of one batch entry (and DV_BLOCK
// output columns: a wide dv may be split over blockIdx.y). Q stays in shared
// memory; K and V blocks stream through a two-stage cp.async pipeline over
// the keys the band allows (blocks outside it are never loaded). Each warp
// owns 16 * M_TILES rows: scores, softmax state, P and the output accumulator
// all live in its registers, so the nq x nk score matrix never exists.
#pragma once

namespace cuflash {

__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// Writes a warp's rows of out (acc, already divided by l) and lse for the block of
// query rows from m0 of w's sequence. Rows from m_end on (past the sequence, or the next
// tile's) and columns past dv are not written (CHECK_COLS: some columns of the tile are past dv); lse comes from the
// first column block. SATFINITE: saturate in the conversion (Store::pair_satfinite, sm_90a).
template <bool CHECK_COLS, bool SATFINITE, class T, int M_TILES, int D_TILES>
__device__ __forceinline__ void store_rows(const AttnParams& p, const Work& w, int m0, int m_end, int col0,
                                           int warp_row0, const float (&acc)[M_TILES][D_TILES][4],
                                           const float (&lse)[M_TILES][2]) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int dv = int(p.dv) - col0;
    const index_t row0 = index_t(w.entry) * p.nq + w.q0 + m0;
    auto* g_out = static_cast<typename T::storage*>(p.out) + row0 * p.dv + col0;
    float* g_lse = p.lse + row0;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp_row0 + mt * 16 + g + 8 * h;
            if (m0 + row >= m_end) continue;
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt) {
                const int col = dt * 8 + 2 * t;
                if (!CHECK_COLS || col < dv) {
                    if constexpr (SATFINITE) {
                        Store<T>::pair_satfinite(g_out + index_t(row) * p.dv + col, acc[mt][dt][2 * h],
                                                 acc[mt][dt][2 * h + 1]);
                    } else {
                        Store<T>::pair(g_out + index_t(row) * p.dv + col, saturate<T>(acc[mt][dt][2 * h]),
                                       saturate<T>(acc[mt][dt][2 * h + 1]));
                    }
                }
            }
            if (t == 0 && col0 == 0) g_lse[row] = lse[mt][h];
        }
}

// store_rows, without a test per store when every column of the tile is stored (the common
// case). Not for tiles of more than 128 columns: the head-dim-256 forward sits at its register
// limit, where the second copy of the loop changed its registers (and its forwards ran 5 %
// slower in the grid; docs/design.md, "Hopper forward"). SATFINITE as in store_rows.
template <class T, bool SATFINITE = false, int M_TILES, int D_TILES>
__device__ __forceinline__ void store_output(const AttnParams& p, const Work& w, int m0, int m_end, int col0,
                                             int warp_row0, const float (&acc)[M_TILES][D_TILES][4],
                                             const float (&lse)[M_TILES][2]) {
    if (D_TILES <= 16 && int(p.dv) - col0 >= D_TILES * 8) {
        store_rows<false, SATFINITE, T>(p, w, m0, m_end, col0, warp_row0, acc, lse);
    } else {
        store_rows<true, SATFINITE, T>(p, w, m0, m_end, col0, warp_row0, acc, lse);
    }
}

template <class T, int HEAD_DIM, int DV_BLOCK, int BLOCK_M, int BLOCK_N, int WARPS, bool PACKED, class Scores>
__global__ void __launch_bounds__(WARPS * 32)
attn_fwd(const AttnParams p) {
    using Cfg = FwdConfig<T, HEAD_DIM, DV_BLOCK, BLOCK_M, BLOCK_N, WARPS>;
    using Storage = typename Cfg::Storage;
    using QTile = typename Cfg::QTile;
    using KTile = typename Cfg::KTile;
    using VTile = typename Cfg::VTile;
    constexpr int M_TILES = Cfg::M_TILES, N_TILES = Cfg::N_TILES, D_TILES = Cfg::D_TILES;
    // A bias compiled in and not packed: it may come through shared memory, a tile per K/V stage
    // after them (ScorePath::staged_bias), its loads in the pipeline's groups rather than beside
    // the products (_tiles.FwdTiles.smem_bytes: staged_bias)
    constexpr bool STAGED_BIAS = Scores::BIAS_DROPOUT && !PACKED;
    using BiasTile = SmemTile<Storage, BLOCK_M, BLOCK_N>;
    constexpr int SMEM_BYTES = Cfg::SMEM_BYTES + (STAGED_BIAS ? Cfg::STAGES * BiasTile::BYTES : 0);

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(SMEM_BYTES)) __trap();   // launch/config mismatch

    Work w;
    if (!p.template find_work<PACKED, false>(u32(p.num_m_blocks), true, w)) return;
    const int m0 = w.block * BLOCK_M;
    const int col0 = blockIdx.y * DV_BLOCK;   // first output column of this block
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv) - col0;
    const int warp_row0 = (threadIdx.x / 32) * 16 * M_TILES;   // first row of this warp in the block

    index_t q_off, k_off, v_off;
    p.batch_offsets(w.entry, q_off, k_off, v_off);
    const Storage* g_q = static_cast<const Storage*>(p.q) + q_off + index_t(w.q0 + m0) * p.q_row_stride;
    const Storage* g_k = static_cast<const Storage*>(p.k) + k_off + index_t(w.k0) * p.k_row_stride;
    const Storage* g_v = static_cast<const Storage*>(p.v) + v_off + index_t(w.k0) * p.v_row_stride + col0;

    const u32 s_q = smem_address(smem);
    const u32 s_k = s_q + QTile::BYTES;                     // + stage * KTile::BYTES
    const u32 s_v = s_k + Cfg::STAGES * KTile::BYTES;       // + stage * VTile::BYTES
    const u32 s_b = s_v + Cfg::STAGES * VTile::BYTES;       // + stage * BiasTile::BYTES (STAGED_BIAS)

    const Band band(p, w);
    const ScorePath<T, Scores, AttnParams, STAGED_BIAS> path(p, band, w.entry, w);
    bool staged = false;   // (uniform: the call's bias and the sequence)
    if constexpr (STAGED_BIAS) staged = path.staged_bias();
    const int m_end = min(m0 + BLOCK_M, nq);
    int n_lo, n_hi;
    band.key_range(m0, m_end, n_lo, n_hi);
    const int nb_begin = n_lo / BLOCK_N;
    const int nb_end = n_hi > n_lo ? ceil_div(n_hi, BLOCK_N) : nb_begin;

    // Issues the loads of key block nb into pipeline stage `stage`.
    auto load_kv = [&](int nb, int stage) {
        const int n0 = nb * BLOCK_N;
        const int rows = nk - n0;
        load_tile_async<KTile, Cfg::THREADS>(s_k + stage * KTile::BYTES, g_k + index_t(n0) * p.k_row_stride,
                                             p.k_row_stride, rows, d);
        load_tile_async<VTile, Cfg::THREADS>(s_v + stage * VTile::BYTES, g_v + index_t(n0) * p.v_row_stride,
                                             p.v_row_stride, rows, dv);
        if (STAGED_BIAS && staged) {
            load_tile_async<BiasTile, Cfg::THREADS>(s_b + stage * BiasTile::BYTES, path.bias_row(m0) + n0,
                                                    p.bias_row_stride, nq - m0, rows);
        }
    };

    float acc[M_TILES][D_TILES][4];
    fill_zero(acc);
    OnlineSoftmax<T, M_TILES> softmax(p.scale_log2_lo);
    const float scale_log2 = p.scale_log2;

    BlockWalk<Scores::USER> walk;
    if (nb_begin < nb_end) {
        load_tile_async<QTile, Cfg::THREADS>(s_q, g_q, p.q_row_stride, nq - m0, d);
        load_kv(nb_begin, 0);
        cp_async_commit();
    }
    for (int nb = nb_begin; nb < nb_end; ++nb) {
        const int stage = (nb - nb_begin) & 1;
        if (nb + 1 < nb_end) load_kv(nb + 1, stage ^ 1);
        cp_async_commit();       // possibly empty: keeps one group per step
        cp_async_wait<1>();      // block nb (and Q) have landed
        __syncthreads();
        // a key block the call's block mask leaves empty is skipped (uniform over the block: the
        // stage it leaves unread is refilled only after the next step's barrier). Its loads are
        // not: skipping them too changed the loop of every path, and the plain D 128 forward
        // spilled.
        TileKind kind = TileKind::PARTIAL;
        if constexpr (Scores::USER) {
            kind = walk.at(nb, [&](int b) {
                return b < nb_end ? path.tile(m0, m_end, b * BLOCK_N, (b + 1) * BLOCK_N) : TileKind::EMPTY;
            });
            if (kind == TileKind::EMPTY) continue;
        }

        // s = q k^T for this warp's rows and the block's keys (double for float32: common.cuh)
        typename T::dot_sum s[M_TILES][N_TILES][4];
        fill_zero(s);
        mma_rows_rows<T, QTile, KTile, HEAD_DIM, Cfg::QK_UNROLL>(s, s_q, warp_row0, s_k + stage * KTile::BYTES);
        const int n0 = nb * BLOCK_N;
        if (STAGED_BIAS && staged) {
            path.template modify_staged<BiasTile>(s, m0 + warp_row0, n0, s_b + stage * BiasTile::BYTES, warp_row0,
                                                  kind);
        } else {
            path.modify(s, m0 + warp_row0, n0, kind);
        }

        // p = exp2((s - m) * scale_log2 - P_SHIFT), with m, l and acc brought up to date;
        // only blocks that cross the band's edge are masked
        if (path.masks_anywhere() || band.cuts(m0, m_end, n0, n0 + BLOCK_N)) {
            apply_band(s, band, m0 + warp_row0, n0);
            softmax.template update<true>(s, acc, scale_log2);
        } else {
            softmax.template update<false>(s, acc, scale_log2);
        }
        path.drop(s, m0 + warp_row0, n0);

        // acc += p v
        mma_regs_cols<T, VTile>(acc, s, s_v + stage * VTile::BYTES, 0);
        __syncthreads();         // the stage just read is the next one refilled
    }

    float lse[M_TILES][2];
    path.template finish<false>(softmax, acc, lse, scale_log2, w.entry);
    store_output<T>(p, w, m0, nq, col0, warp_row0, acc, lse);
}

}  // namespace cuflash
