// attn_bwd.cuh: the backward pass, recomputing each score block from q, k and lse.
//
//   delta_i = rowsum(dout_i * out_i)                         (attn_bwd_delta; on sm_90a the dq pass)
//   p = exp(scale * q k^T - lse),  dp = dout v^T,  ds = p (dp - delta)
//   dv = p^T dout,  dk = scale * ds^T q                      (attn_bwd_dkdv: keys resident)
//   dq = scale * ds k                                        (attn_bwd_dq: queries resident)
// dq has its own pass so that every gradient element is written by exactly
// one block: no atomics, bitwise-repeatable results.
#pragma once

namespace cuflash {

template <class T>
__global__ void __launch_bounds__(128) attn_bwd_delta(const BwdParams p) {
    using Storage = typename T::storage;
    const index_t row = index_t(blockIdx.x) * 4 + threadIdx.x / 32;
    if (row >= p.batch_size * p.nq) return;
    const Storage* dout = static_cast<const Storage*>(p.dout) + row * p.dv;
    const Storage* out = static_cast<const Storage*>(p.out) + row * p.dv;
    float sum = 0.f;
    for (int c = threadIdx.x % 32; c < p.dv; c += 32) sum += Load<T>::one(dout + c) * Load<T>::one(out + c);
    sum = warp_sum(sum);
    if (threadIdx.x % 32 == 0) p.delta[row] = sum;
}

// Writes a warp's 16 x DCOL gradient fragment times `scale` to rows [row0, row0 + 16)
// of a contiguous (rows, width) array, skipping rows >= rows and columns >= width.
template <class T, int D_TILES>
__device__ __forceinline__ void store_rows(typename T::storage* g, const float (&acc)[1][D_TILES][4], float scale,
                                           int row0, int rows, int col0, int width) {
    const int g_ = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + g_ + 8 * h;
        if (row >= rows) continue;
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
            const int col = col0 + dt * 8 + 2 * t;
            if (col < width)
                Store<T>::pair(g + index_t(row) * width + col, acc[0][dt][2 * h] * scale, acc[0][dt][2 * h + 1] * scale);
        }
    }
}

// The query side of a dk/dv block: the blocks of STEP query rows that see its keys,
// for each member of its K/V entry's query group in turn (one member unless the
// pass groups: native grouped-query attention), so that dk and dv sum over the
// group in registers. Steps are visited in order, each by a Cursor that moves one
// step at a time (no division per step).
template <int STEP>
struct QuerySteps {
    const AttnParams& p;   // read where used: the parameters stay in the constant bank
    u32 kv_entry;
    int q0, mb_begin, mb_end, count;

    // A step: its block starts at row m0 of the sequence; member_q and member_row are
    // q's offset (from member 0's entry) and the flat row (in dout, lse, delta) of the
    // member's first sequence row.
    struct Cursor {
        int m0;
        index_t member_q, member_row;
    };

    __device__ __forceinline__ QuerySteps(const AttnParams& p, const Work& w, int mb_begin, int mb_end)
        : p(p), kv_entry(w.entry), q0(w.q0), mb_begin(mb_begin), mb_end(mb_end),
          count((mb_end - mb_begin) * int(p.group_size)) {}

    __device__ __forceinline__ Cursor first() const {
        return {mb_begin * STEP, 0, index_t(p.group_member(kv_entry, 0)) * p.nq + q0};
    }
    __device__ __forceinline__ void advance(Cursor& c) const {
        c.m0 += STEP;
        if (c.m0 >= mb_end * STEP) {   // the next member's first block
            c.m0 = mb_begin * STEP;
            c.member_q += p.q_group_stride;
            c.member_row += p.group_inner * p.nq;
        }
    }
    __device__ __forceinline__ index_t q_offset(const Cursor& c) const {
        return c.member_q + index_t(q0 + c.m0) * p.q_row_stride;
    }
    __device__ __forceinline__ index_t row(const Cursor& c) const { return c.member_row + c.m0; }
    // Step j's place computed afresh (for kernels whose registers cannot hold a Cursor)
    __device__ __forceinline__ void at(int j, int& m0, index_t& q_off, index_t& flat_row) const {
        const int per_member = mb_end - mb_begin, member = j / per_member;
        m0 = (mb_begin + j - member * per_member) * STEP;
        q_off = member * p.q_group_stride + index_t(q0 + m0) * p.q_row_stride;
        flat_row = index_t(p.group_member(kv_entry, member)) * p.nq + q0 + m0;
    }
    // the query block of the step after one at block mb
    __device__ __forceinline__ int next_block(int mb) const { return mb + 1 == mb_end ? mb_begin : mb + 1; }
};

// The query steps of the dk/dv block of keys [n0, n_end) of work w.
template <int STEP>
__device__ __forceinline__ QuerySteps<STEP> query_steps(const AttnParams& p, const Work& w, const Band& band, int n0,
                                                        int n_end) {
    int begin, end;
    band.query_blocks<STEP>(n0, n_end, w.nq, begin, end);
    return QuerySteps<STEP>(p, w, begin, end);
}

// Writes a block's dk (scaled) or dv, a warp's 16 rows from warp_row0 of the keys from
// n0 of work w, columns from col0, from the accumulator of a dk/dv pass.
template <class T, int D_TILES>
__device__ __forceinline__ void store_key_gradient(const BwdParams& p, const Work& w, int n0, bool dv,
                                                   const float (&acc)[1][D_TILES][4], int warp_row0, int col0) {
    using Storage = typename T::storage;
    const index_t key_row = index_t(w.entry) * p.nk + w.k0 + n0;
    const index_t width = dv ? p.dv : p.d;
    Storage* g = static_cast<Storage*>(dv ? p.dv_grad : p.dk) + key_row * width;
    store_rows<T>(g, acc, dv ? 1.f : p.scale_log2 / LOG2E, warp_row0, w.nk - n0, col0, int(width));
}

// dk and dv for RESIDENT keys of one sequence of one batch entry (one K/V entry
// when grouped), over the query blocks that see them.
// Each warp owns 16 keys and works on transposed score tiles (rows = keys).
// Two blocks an SM: at head dim 32, left to itself, ptxas aims at three (168 registers) and
// spills the packed kernel's; the wider head dims need more than 168 anyway.
template <class T, int HEAD_DIM, int DCOL, int STEP, int WARPS, bool PACKED, class Scores>
__global__ void __launch_bounds__(WARPS * 32, 2)
attn_bwd_dkdv(const BwdParams p) {
    using Cfg = BwdConfig<T, HEAD_DIM, DCOL, STEP, WARPS>;
    using Storage = typename Cfg::Storage;
    using RTile = typename Cfg::ResidentTile;
    using STile = typename Cfg::StepTile;
    constexpr int S_TILES = Cfg::S_TILES, D_TILES = Cfg::D_TILES, STEP_BYTES = STile::BYTES;

    extern __shared__ __align__(128) unsigned char smem[];
    Work w;
    if (!p.template find_work<PACKED, false>(u32(p.num_n_blocks), false, w)) return;
    const int n0 = w.block * Cfg::RESIDENT;
    const int col0 = blockIdx.y * DCOL;
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv);
    const int warp_row0 = (threadIdx.x / 32) * 16;

    index_t q_off, k_off, v_off;
    p.batch_offsets(p.group_member(w.entry, 0), q_off, k_off, v_off);
    const Storage* g_q = static_cast<const Storage*>(p.q) + q_off;   // + QuerySteps' q_off
    const Storage* g_do = static_cast<const Storage*>(p.dout);        // + QuerySteps' row * dv

    // [K][V][Q stage 0, 1][dO stage 0, 1][lse2 stage 0, 1][delta stage 0, 1]
    const u32 s_k = smem_address(smem);
    const u32 s_v = s_k + RTile::BYTES;
    const u32 s_q = s_v + RTile::BYTES;
    const u32 s_do = s_q + Cfg::STAGES * STEP_BYTES;
    float* s_lse2 = reinterpret_cast<float*>(smem + 2 * RTile::BYTES + 2 * Cfg::STAGES * STEP_BYTES);
    float* s_delta = s_lse2 + Cfg::STAGES * STEP;

    const Band band(p, w);
    // (a pass with ALiBi does not group: its query entries are one, each with its slope)
    const ScorePath<T, Scores, AttnParams, Scores::BIAS_DROPOUT && !PACKED> path(p, band, p.group_member(w.entry, 0), w);
    using Factors = ScoreFactors<Scores::USER, S_TILES>;   // (the user path's: ds's factors)
    const int n_end = min(n0 + Cfg::RESIDENT, nk);
    int mb_begin, mb_end;
    band.query_blocks<STEP>(n0, n_end, nq, mb_begin, mb_end);
    const QuerySteps<STEP> steps(p, w, mb_begin, mb_end);

    auto load_step = [&](int j, int stage) {
        int m0;
        index_t qo, row;
        steps.at(j, m0, qo, row);
        load_tile_async<STile, Cfg::THREADS>(s_q + stage * STEP_BYTES, g_q + qo, p.q_row_stride, nq - m0, d);
        load_tile_async<STile, Cfg::THREADS>(s_do + stage * STEP_BYTES, g_do + row * p.dv, p.dv, nq - m0, dv);
        for (int i = threadIdx.x; i < STEP; i += Cfg::THREADS) {
            s_lse2[stage * STEP + i] = lse_log2(p.lse + row, i, nq - m0);
            s_delta[stage * STEP + i] = m0 + i < nq ? p.delta[row + i] : 0.f;
        }
    };

    float acc_dk[1][D_TILES][4], acc_dv[1][D_TILES][4];
    fill_zero(acc_dk);
    fill_zero(acc_dv);
    const float scale_log2 = p.scale_log2;

    if (steps.count) {
        const index_t key0 = w.k0 + n0;
        const Storage* g_k = static_cast<const Storage*>(p.k) + k_off + key0 * p.k_row_stride;
        const Storage* g_v = static_cast<const Storage*>(p.v) + v_off + key0 * p.v_row_stride;
        load_tile_async<RTile, Cfg::THREADS>(s_k, g_k, p.k_row_stride, nk - n0, d);
        load_tile_async<RTile, Cfg::THREADS>(s_v, g_v, p.v_row_stride, nk - n0, dv);
        load_step(0, 0);
        cp_async_commit();
    }
    int mb = steps.mb_begin;   // the query block of step j
    BlockWalk<Scores::USER> walk;
    for (int j = 0; j < steps.count; ++j) {
        const int stage = j & 1;
        if (j + 1 < steps.count) load_step(j + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const u32 q_st = s_q + stage * STEP_BYTES, do_st = s_do + stage * STEP_BYTES;
        const float* lse2 = s_lse2 + stage * STEP;
        const float* delta = s_delta + stage * STEP;
        const int m0 = mb * STEP;
        // a step the call's block mask leaves empty is skipped (uniform over the block: the
        // stage it leaves unread is refilled only after the next step's barrier)
        TileKind kind = TileKind::PARTIAL;
        if constexpr (Scores::USER) {
            kind = walk.at(mb, [&](int b) {
                return b < steps.mb_end ? path.tile(b * STEP, (b + 1) * STEP, n0, n_end) : TileKind::EMPTY;
            });
        }
        mb = steps.next_block(mb);
        if (kind == TileKind::EMPTY) continue;

        // s^T = k q^T (rows: this warp's keys; columns: the step's queries)
        float st[1][S_TILES][4];
        fill_zero(st);
        mma_rows_rows<T, RTile, STile, HEAD_DIM, Cfg::K_UNROLL>(st, s_k, warp_row0, q_st);

        // p^T = exp2(s^T * scale_log2 - lse2 of each query column), 0 where masked
        Factors factors;
        path.transposed_probabilities(st, band, m0, min(m0 + STEP, nq), n0, n_end, n0 + warp_row0, scale_log2, lse2,
                                      factors, kind);

        // dv += p^T dout (through dropout's mask, which dp^T takes too)
        const auto kept = path.template keep_mask<true, S_TILES>(n0 + warp_row0, m0);
        mma_regs_cols<T, STile>(acc_dv, st, do_st, col0, kept);

        // dp^T = v dout^T
        float dpt[1][S_TILES][4];
        fill_zero(dpt);
        mma_rows_rows<T, RTile, STile, HEAD_DIM, Cfg::K_UNROLL>(dpt, s_v, warp_row0, do_st);

        // ds^T = p^T (dp^T - delta of each query column)
        path.transposed_ds(dpt, st, delta, lse2, n0 + warp_row0, m0, kept, factors);

        // dk += ds^T q (scaled at the end)
        mma_regs_cols<T, STile>(acc_dk, dpt, q_st, col0);
        __syncthreads();
    }

    const float scale = p.scale_log2 / LOG2E;
    const index_t key_row = index_t(w.entry) * p.nk + w.k0 + n0;
    Storage* g_dk = static_cast<Storage*>(p.dk) + key_row * p.d;
    Storage* g_dv = static_cast<Storage*>(p.dv_grad) + key_row * p.dv;
    store_rows<T>(g_dk, acc_dk, scale, warp_row0, nk - n0, col0, d);
    store_rows<T>(g_dv, acc_dv, 1.f, warp_row0, nk - n0, col0, dv);
}

// dq for RESIDENT query rows of one sequence of one batch entry, over the key blocks they see.
template <class T, int HEAD_DIM, int DCOL, int STEP, int WARPS, bool PACKED, class Scores>
__global__ void __launch_bounds__(WARPS * 32)
attn_bwd_dq(const BwdParams p) {
    using Cfg = BwdConfig<T, HEAD_DIM, DCOL, STEP, WARPS>;
    using Storage = typename Cfg::Storage;
    using RTile = typename Cfg::ResidentTile;
    using STile = typename Cfg::StepTile;
    constexpr int S_TILES = Cfg::S_TILES, D_TILES = Cfg::D_TILES, STEP_BYTES = STile::BYTES;

    extern __shared__ __align__(128) unsigned char smem[];
    Work w;
    if (!p.template find_work<PACKED, false>(u32(p.num_m_blocks), true, w)) return;
    const int m0 = w.block * Cfg::RESIDENT;
    const int col0 = blockIdx.y * DCOL;
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv);
    const int warp_row0 = (threadIdx.x / 32) * 16;
    const int g = (threadIdx.x % 32) / 4;

    index_t q_off, k_off, v_off;
    p.batch_offsets(w.entry, q_off, k_off, v_off);
    const Storage* g_k = static_cast<const Storage*>(p.k) + k_off + index_t(w.k0) * p.k_row_stride;
    const Storage* g_v = static_cast<const Storage*>(p.v) + v_off + index_t(w.k0) * p.v_row_stride;
    // the flat row of m0 in dout, lse, delta and dq, computed where used rather than held
    // in registers through the loop
    auto row0 = [&] { return index_t(w.entry) * p.nq + w.q0 + m0; };

    // [Q][dO][K stage 0, 1][V stage 0, 1]
    const u32 s_q = smem_address(smem);
    const u32 s_do = s_q + RTile::BYTES;
    const u32 s_k = s_do + RTile::BYTES;
    const u32 s_v = s_k + Cfg::STAGES * STEP_BYTES;

    // lse2 and delta of the two rows each thread owns
    float lse2[2], delta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + g + 8 * h;
        lse2[h] = lse_log2(p.lse + row0(), row, nq - m0);
        delta[h] = row < nq - m0 ? p.delta[row0() + row] : 0.f;
    }

    const Band band(p, w);
    const ScorePath<T, Scores, AttnParams, Scores::BIAS_DROPOUT && !PACKED> path(p, band, w.entry, w);
    using Factors = ScoreFactors<Scores::USER, S_TILES, Scores::GRADS>;   // (GRADS: score_mod's inputs too)
    const int m_end = min(m0 + Cfg::RESIDENT, nq);
    int nb_begin, nb_end;
    band.key_blocks<STEP>(m0, m_end, nb_begin, nb_end);

    auto load_step = [&](int nb, int stage) {
        const int n0 = nb * STEP;
        load_tile_async<STile, Cfg::THREADS>(s_k + stage * STEP_BYTES, g_k + index_t(n0) * p.k_row_stride,
                                             p.k_row_stride, nk - n0, d);
        load_tile_async<STile, Cfg::THREADS>(s_v + stage * STEP_BYTES, g_v + index_t(n0) * p.v_row_stride,
                                             p.v_row_stride, nk - n0, dv);
    };

    float acc_dq[1][D_TILES][4];
    fill_zero(acc_dq);
    const float scale_log2 = p.scale_log2;

    if (nb_begin < nb_end) {
        const Storage* g_q = static_cast<const Storage*>(p.q) + q_off + index_t(w.q0 + m0) * p.q_row_stride;
        const Storage* g_do = static_cast<const Storage*>(p.dout) + row0() * p.dv;
        load_tile_async<RTile, Cfg::THREADS>(s_q, g_q, p.q_row_stride, nq - m0, d);
        load_tile_async<RTile, Cfg::THREADS>(s_do, g_do, p.dv, nq - m0, dv);
        load_step(nb_begin, 0);
        cp_async_commit();
    }
    BlockWalk<Scores::USER> walk;
    for (int nb = nb_begin; nb < nb_end; ++nb) {
        const int stage = (nb - nb_begin) & 1;
        if (nb + 1 < nb_end) load_step(nb + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const u32 k_st = s_k + stage * STEP_BYTES, v_st = s_v + stage * STEP_BYTES;
        const int n0 = nb * STEP;
        // a block the call's block mask leaves empty is skipped (uniform over the block, as in
        // the dk/dv pass; skipping its loads too spilled the dense pass)
        TileKind kind = TileKind::PARTIAL;
        if constexpr (Scores::USER) {
            kind = walk.at(nb, [&](int b) {
                return b < nb_end ? path.tile(m0, m_end, b * STEP, (b + 1) * STEP) : TileKind::EMPTY;
            });
            if (kind == TileKind::EMPTY) continue;
        }

        // s = q k^T, then p = exp2(s * scale_log2 - lse2)
        float s[1][S_TILES][4];
        fill_zero(s);
        mma_rows_rows<T, RTile, STile, HEAD_DIM>(s, s_q, warp_row0, k_st);
        Factors factors;
        path.row_probabilities(s, band, m0, m_end, n0, n0 + STEP, m0 + warp_row0, scale_log2, lse2, factors,
                               kind);

        // dp = dout v^T
        float dp[1][S_TILES][4];
        fill_zero(dp);
        mma_rows_rows<T, RTile, STile, HEAD_DIM>(dp, s_do, warp_row0, v_st);

        // ds = p (dp - delta) (and dbias = ds before softcap's factor where asked); dq += ds k
        // (scaled at the end)
        path.dq_ds(dp, s, delta, lse2, m0 + warp_row0, n0, p, w.entry, factors);
        mma_regs_cols<T, STile>(acc_dq, dp, k_st, col0);
        __syncthreads();
    }

    const float scale = p.scale_log2 / LOG2E;
    Storage* g_dq = static_cast<Storage*>(p.dq) + row0() * p.d;
    store_rows<T>(g_dq, acc_dq, scale, warp_row0, nq - m0, col0, d);
}

}  // namespace cuflash
