// attn_fwd_sm90.cuh: the forward pass on Hopper (sm_90a), with warpgroup MMAs.
//
// The algorithm is attn_fwd's: Q resident, K and V blocks through multi-stage
// cp.async buffers, online softmax in registers. What changes is the product:
// each warpgroup owns 64 query rows and computes s = q k^T with wgmma reading
// Q and K straight from shared memory, and acc += p v with P from registers
// and V from shared memory; one instruction covers a 64 x BLOCK_N (or
// 64 x HEAD_DIM) tile. The products are asynchronous, so a step issues its
// scores and then the previous block's p v, and computes its softmax while
// that p v occupies the tensor cores. One block per tile of BLOCK_M query rows.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {

// One tile of the forward: a block of BLOCK_M query rows and the key blocks its band allows.
// FAST_DIV: the batch offsets by fast_div (params.cuh). PARTIAL_FIRST: where BLOCK_M does not
// divide the rows, the short tile is the first one (rows [0, nq % BLOCK_M)) rather than the
// last: under a causal mask the first rows see the fewest keys, so the rows it computes and
// drops (it reads and computes a whole tile; the rows past m_end belong to the next one) cost
// little, where at the bottom they would cost the most (6 % of the work at 2048 rows in
// 192-row tiles). The rows of the other tiles start at m0 = nq % BLOCK_M + (block - 1) * BLOCK_M.
template <class Cfg, bool FAST_DIV, bool PARTIAL_FIRST = false>
struct FwdTile {
    using Storage = typename Cfg::Storage;
    Work w;
    int m0, m_end, nb_begin, nb_end;
    Band band;
    const Storage* g_q;
    const Storage* g_k;
    const Storage* g_v;

    __device__ __forceinline__ FwdTile(const AttnParams& p, const Work& work) : w(work), band(p, work) {
        if (PARTIAL_FIRST) {
            const int short_rows = w.nq % Cfg::BLOCK_M;
            const int shift = short_rows ? Cfg::BLOCK_M - short_rows : 0;
            m0 = w.block ? w.block * Cfg::BLOCK_M - shift : 0;
            m_end = w.block || !short_rows ? min(m0 + Cfg::BLOCK_M, w.nq) : short_rows;
        } else {
            m0 = w.block * Cfg::BLOCK_M;
            m_end = min(m0 + Cfg::BLOCK_M, w.nq);
        }
        index_t q_off, k_off, v_off;
        p.template batch_offsets<FAST_DIV>(w.entry, q_off, k_off, v_off);
        g_q = static_cast<const Storage*>(p.q) + q_off + index_t(w.q0 + m0) * p.q_row_stride;
        g_k = static_cast<const Storage*>(p.k) + k_off + index_t(w.k0) * p.k_row_stride;
        g_v = static_cast<const Storage*>(p.v) + v_off + index_t(w.k0) * p.v_row_stride;
        int n_lo, n_hi;
        band.key_range(m0, m_end, n_lo, n_hi);
        nb_begin = n_lo / Cfg::BLOCK_N;
        nb_end = n_hi > n_lo ? ceil_div(n_hi, Cfg::BLOCK_N) : nb_begin;
    }
};

template <class T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int MIN_BLOCKS, bool PACKED, class Scores>
__global__ void __launch_bounds__(WARPGROUPS * 128, MIN_BLOCKS)
attn_fwd_sm90(const AttnParams p) {
    using Cfg = Sm90FwdConfig<T, HEAD_DIM, BLOCK_N, WARPGROUPS>;
    constexpr int STAGES = Cfg::STAGES;
    using QTile = typename Cfg::QTile;
    using KTile = typename Cfg::KTile;
    using VTile = typename Cfg::VTile;
    constexpr int N_TILES = BLOCK_N / 8, D_TILES = HEAD_DIM / 8;
    // Up to head dim 128: divisions by multiplies, copies that step down the rows, masks
    // by row bounds, saturation in the conversion and the hardware's reciprocal, for fewer
    // instructions per tile (short sequences are issue-bound). Head dim 256 sits at its
    // register limit and keeps its code (with a change in its loop its forwards ran 5 %
    // slower; docs/design.md, "Hopper forward").
    constexpr bool LEAN = HEAD_DIM <= 128;
    using Tile = FwdTile<Cfg, LEAN>;

    extern __shared__ __align__(1024) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(Cfg::SMEM_BYTES)) __trap();   // launch/config mismatch

    Work work;
    if (!p.template find_work<PACKED, true, LEAN>(u32(p.num_m_blocks), true, work)) return;
    const Tile tile(p, work);
    const ScorePath<T, Scores> path(p, tile.band, work.entry);
    const int d = int(p.d), dv = int(p.dv);
    const int group_row0 = (threadIdx.x / 128) * 64;                 // this warpgroup's rows
    const int warp_row0 = group_row0 + (threadIdx.x / 32 % 4) * 16;  // this warp's rows

    // swizzle atoms must start on 1024-byte boundaries (SMEM_BYTES leaves room)
    const u32 s_q = (smem_address(smem) + 1023u) & ~1023u;
    const u32 s_k = s_q + QTile::BYTES;                     // + stage * KTile::BYTES
    const u32 s_v = s_k + STAGES * KTile::BYTES;            // + stage * VTile::BYTES

    // Step i (block nb_begin + i) computes block i's scores and block i-1's p v, and
    // issues the loads of K block i + STAGES - 1 and V block i + STAGES - 2: each buffer
    // is refilled the step after its last reader, and one block-wide barrier per step
    // orders all of it.
    auto load_k = [&](int nb, int stage) {
        const int n0 = nb * BLOCK_N;
        load_tile_async<KTile, Cfg::THREADS, LEAN>(s_k + stage * KTile::BYTES, tile.g_k + index_t(n0) * p.k_row_stride,
                                                   p.k_row_stride, tile.w.nk - n0, d);
    };
    auto load_v = [&](int nb, int stage) {
        const int n0 = nb * BLOCK_N;
        load_tile_async<VTile, Cfg::THREADS, LEAN>(s_v + stage * VTile::BYTES, tile.g_v + index_t(n0) * p.v_row_stride,
                                                   p.v_row_stride, tile.w.nk - n0, dv);
    };
    // the loads of step i (i < 0: the prologue's), as one cp.async group
    auto load_step = [&](int i) {
        const int kb = tile.nb_begin + i + STAGES - 1, vb = kb - 1;
        if (kb < tile.nb_end) load_k(kb, int(u32(i + STAGES - 1) % STAGES));
        if (vb >= tile.nb_begin && vb < tile.nb_end) load_v(vb, int(u32(i + STAGES - 2) % STAGES));
        cp_async_commit();
    };

    const float scale_log2 = p.scale_log2;
    const bool vanish = masked_p_vanish<T>(p.scale_log2);   // masked blocks may skip the test
    u32 pa[N_TILES / 2][4];   // p of the previous block, as wgmma A fragments
    float acc[1][D_TILES][4];
    if (tile.nb_begin < tile.nb_end) {
        load_tile_async<QTile, Cfg::THREADS, LEAN>(s_q, tile.g_q, p.q_row_stride, tile.w.nq - tile.m0, d);
#pragma unroll
        for (int i = 1 - STAGES; i < 0; ++i) load_step(i);
    }
    fill_zero(acc);
    OnlineSoftmax<T, 1> softmax(p.scale_log2_lo);

    // acc += p v for the block whose V sits in `stage`; not waited for.
    auto issue_pv = [&](int stage) {
        pin_registers(acc);
        wgmma_fence();
        wgmma_regs_cols<T, VTile, HEAD_DIM>(acc[0], pa, s_v + stage * VTile::BYTES);
        wgmma_commit();
    };

    for (int nb = tile.nb_begin; nb < tile.nb_end; ++nb) {
        const int i = nb - tile.nb_begin, stage = int(u32(i) % STAGES);
        const bool first_step = i == 0;
        cp_async_wait<STAGES - 2>();   // K block i and V block i-1 have landed
        fence_async_shared();
        __syncthreads();               // ... for every thread, and step i-1 is done everywhere
        load_step(i);

        // s = q k^T, then the previous block's p v behind it on the tensor cores
        float s[1][N_TILES][4];
        wgmma_fence();
        wgmma_rows_rows<T, QTile, KTile, HEAD_DIM, BLOCK_N>(s[0], s_q + group_row0 * 128, s_k + stage * KTile::BYTES);
        wgmma_commit();
        if (!first_step) issue_pv(int(u32(i + STAGES - 1) % STAGES));
        if (first_step) wgmma_wait<0>(); else wgmma_wait<1>();
        pin_registers(s);

        // p = exp2((s - m) * scale_log2 - P_SHIFT) while p v runs; acc is
        // rescaled once that product is done. Only blocks that cross the band's
        // edge are masked.
        float alpha[1][2];
        const int n0 = nb * BLOCK_N;
        path.modify(s, tile.m0 + warp_row0, n0);
        // (Head dim 256 keeps the checked form: LEAN above.)
        if (tile.band.cuts(tile.m0, tile.m_end, n0, n0 + BLOCK_N)) {
            if constexpr (LEAN) {
                apply_band_rows(s, tile.band, tile.m_end, tile.m0 + warp_row0, n0);
            } else {
                apply_band(s, tile.band, tile.m0 + warp_row0, n0);
            }
            if (LEAN && vanish) {
                softmax.template probabilities<false>(s, scale_log2, alpha);
            } else {
                softmax.template probabilities<true>(s, scale_log2, alpha);
            }
        } else {
            softmax.template probabilities<false>(s, scale_log2, alpha);
        }
        wgmma_wait<0>();
        pin_registers(acc);
        softmax.rescale(acc, alpha);
        to_a_fragments<T>(pa, s);
    }
    const int steps = tile.nb_end - tile.nb_begin;

    // the last block's p v, once its V has landed for every thread
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();
    if (steps) {
        issue_pv(int(u32(steps - 1) % STAGES));
        wgmma_wait<0>();
        pin_registers(acc);
    }
    float lse[1][2];
    path.template finish<LEAN>(softmax, acc, lse, scale_log2, work.entry);
    store_output<T, LEAN>(p, tile.w, tile.m0, tile.w.nq, 0, warp_row0, acc, lse);
}

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
