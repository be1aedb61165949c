// attn_fwd_sm90.cuh: the forward pass on Hopper (sm_90a), with warpgroup MMAs.
//
// The algorithm is attn_fwd's: Q resident, K and V blocks through multi-stage
// cp.async buffers, online softmax in registers. What changes is the product:
// each warpgroup owns 64 query rows and computes s = q k^T with wgmma reading
// Q and K straight from shared memory, and acc += p v with P from registers
// and V from shared memory; one instruction covers a 64 x BLOCK_N (or
// 64 x HEAD_DIM) tile. The products are asynchronous, so a step issues its
// scores and then the previous block's p v, and computes its softmax while
// that p v occupies the tensor cores.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {

template <class T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int STAGES, int MIN_BLOCKS, bool PACKED>
__global__ void __launch_bounds__(WARPGROUPS * 128, MIN_BLOCKS)
attn_fwd_sm90(const AttnParams p) {
    using Cfg = Sm90FwdConfig<T, HEAD_DIM, BLOCK_N, WARPGROUPS, STAGES>;
    using Storage = typename Cfg::Storage;
    using QTile = typename Cfg::QTile;
    using KTile = typename Cfg::KTile;
    using VTile = typename Cfg::VTile;
    constexpr int BLOCK_M = Cfg::BLOCK_M, N_TILES = BLOCK_N / 8, D_TILES = HEAD_DIM / 8;

    extern __shared__ __align__(1024) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(Cfg::SMEM_BYTES)) __trap();   // launch/config mismatch

    Work w;
    if (!p.template find_work<PACKED>(u32(p.num_m_blocks), true, w)) return;
    const int m0 = w.block * BLOCK_M;
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv);
    const int group_row0 = (threadIdx.x / 128) * 64;                 // this warpgroup's rows
    const int warp_row0 = group_row0 + (threadIdx.x / 32 % 4) * 16;  // this warp's rows

    index_t q_off, k_off, v_off;
    p.batch_offsets(w.entry, q_off, k_off, v_off);
    const Storage* g_q = static_cast<const Storage*>(p.q) + q_off + index_t(w.q0 + m0) * p.q_row_stride;
    const Storage* g_k = static_cast<const Storage*>(p.k) + k_off + index_t(w.k0) * p.k_row_stride;
    const Storage* g_v = static_cast<const Storage*>(p.v) + v_off + index_t(w.k0) * p.v_row_stride;

    // swizzle atoms must start on 1024-byte boundaries (SMEM_BYTES leaves room)
    const u32 s_q = (smem_address(smem) + 1023u) & ~1023u;
    const u32 s_k = s_q + QTile::BYTES;                     // + stage * KTile::BYTES
    const u32 s_v = s_k + STAGES * KTile::BYTES;            // + stage * VTile::BYTES

    const Band band(p, w);
    const int m_end = min(m0 + BLOCK_M, nq);
    int n_lo, n_hi;
    band.key_range(m0, m_end, n_lo, n_hi);
    const int nb_begin = n_lo / BLOCK_N;
    const int nb_end = n_hi > n_lo ? ceil_div(n_hi, BLOCK_N) : nb_begin;

    // Step i (block nb_begin + i) computes block i's scores and block i-1's p v,
    // and issues the loads of K block i + STAGES - 1 and V block i + STAGES - 2:
    // each buffer is refilled the step after its last reader, and one
    // block-wide barrier per step orders all of it.
    auto load_k = [&](int nb, int stage) {
        const int n0 = nb * BLOCK_N;
        load_tile_async<KTile, Cfg::THREADS>(s_k + stage * KTile::BYTES, g_k + index_t(n0) * p.k_row_stride,
                                             p.k_row_stride, nk - n0, d);
    };
    auto load_v = [&](int nb, int stage) {
        const int n0 = nb * BLOCK_N;
        load_tile_async<VTile, Cfg::THREADS>(s_v + stage * VTile::BYTES, g_v + index_t(n0) * p.v_row_stride,
                                             p.v_row_stride, nk - n0, dv);
    };

    float acc[1][D_TILES][4];
    fill_zero(acc);
    OnlineSoftmax<T, 1> softmax(p.scale_log2);
    const float scale_log2 = float(p.scale_log2);
    u32 pa[N_TILES / 2][4];   // p of the previous block, as wgmma A fragments

    // acc += p v for the block whose V sits in `stage`; not waited for.
    auto issue_pv = [&](int stage) {
        pin_registers(acc);
        wgmma_fence();
        wgmma_regs_cols<T, VTile, HEAD_DIM>(acc[0], pa, s_v + stage * VTile::BYTES);
        wgmma_commit();
    };

    // the loads of step i (i < 0: the prologue's), as one cp.async group
    auto load_step = [&](int i) {
        const int kb = nb_begin + i + STAGES - 1, vb = kb - 1;
        if (kb < nb_end) load_k(kb, (i + STAGES - 1) % STAGES);
        if (vb >= nb_begin && vb < nb_end) load_v(vb, (i + STAGES - 2) % STAGES);
        cp_async_commit();
    };
    if (nb_begin < nb_end) {
        load_tile_async<QTile, Cfg::THREADS>(s_q, g_q, p.q_row_stride, nq - m0, d);
#pragma unroll
        for (int i = 1 - STAGES; i < 0; ++i) load_step(i);
    }
    for (int nb = nb_begin; nb < nb_end; ++nb) {
        const int i = nb - nb_begin, stage = int(u32(i) % STAGES);
        const bool first = i == 0;
        cp_async_wait<STAGES - 2>();   // K block i and V block i-1 have landed
        fence_async_shared();
        __syncthreads();               // ... for every thread, and step i-1 is done everywhere
        load_step(i);

        // s = q k^T, then the previous block's p v behind it on the tensor cores
        float s[1][N_TILES][4];
        wgmma_fence();
        wgmma_rows_rows<T, QTile, KTile, HEAD_DIM, BLOCK_N>(s[0], s_q + group_row0 * 128, s_k + stage * KTile::BYTES);
        wgmma_commit();
        if (!first) issue_pv(int(u32(i + STAGES - 1) % STAGES));
        if (first) wgmma_wait<0>(); else wgmma_wait<1>();
        pin_registers(s);

        // p = exp2((s - m) * scale_log2 - P_SHIFT) while p v runs; acc is
        // rescaled once that product is done. Only blocks that cross the band's
        // edge are masked.
        float alpha[1][2];
        const int n0 = nb * BLOCK_N;
        if (band.cuts(m0, m_end, n0, n0 + BLOCK_N)) {
            apply_band(s, band, m0 + warp_row0, n0);
            softmax.template probabilities<true>(s, scale_log2, alpha);
        } else {
            softmax.template probabilities<false>(s, scale_log2, alpha);
        }
        wgmma_wait<0>();
        pin_registers(acc);
        softmax.rescale(acc, alpha);
        to_a_fragments<T>(pa, s);
    }
    if (nb_begin < nb_end) {     // the last block's p v
        cp_async_wait<0>();
        fence_async_shared();
        __syncthreads();
        issue_pv(int(u32(nb_end - 1 - nb_begin) % STAGES));
        wgmma_wait<0>();
        pin_registers(acc);
    }

    float lse[1][2];
    softmax.finish(acc, lse, scale_log2);
    store_output<T>(p, w, m0, 0, warp_row0, acc, lse);
}

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
