// attn_bwd_sm90.cuh: the backward's dk/dv and dq passes on Hopper (sm_90a).
//
// The algorithm and the split into passes are attn_bwd's (deterministic: each
// gradient element is written by one block). Each warpgroup owns 64 resident
// rows (keys for dk/dv, queries for dq) and the other side streams through
// STAGES cp.async buffers in steps of STEP rows. The score products
// (k q^T, v dout^T; q k^T, dout v^T) read both operands from shared memory;
// the gradient products (p^T dout, ds^T q; ds k) take p or ds from registers.
// The two score products of a step are issued together, and the first
// gradient product runs while the second score tile is turned into ds; with
// three or more stages (Sm90BwdConfig::OVERLAP) a step's gradient products are
// issued at the start of the next step instead, behind its score products.
// The dq pass runs first and also computes delta = rowsum(dout * out) for its
// query rows, which the dk/dv pass reads.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {

// Pieces of a step that the Hopper backward kernels share (here and attn_bwd_sm90_ws.cuh).

// s = A B^T and dp = C D^T for a warpgroup's 64 resident rows (s_rows, dp_rows: their
// first rows in resident tiles) against a step's rows, as two commit groups: k q^T and
// v dout^T in the dk/dv passes, q k^T and dout v^T in the dq passes. The caller waits.
template <class T, class RTile, class STile, int HEAD_DIM, int STEP>
__device__ __forceinline__ void issue_score_products(float (&s)[1][STEP / 8][4], float (&dp)[1][STEP / 8][4],
                                                     u32 s_rows, u32 s_step, u32 dp_rows, u32 dp_step) {
    wgmma_fence();
    wgmma_rows_rows<T, RTile, STile, HEAD_DIM, STEP>(s[0], s_rows, s_step);
    wgmma_commit();
    wgmma_rows_rows<T, RTile, STile, HEAD_DIM, STEP>(dp[0], dp_rows, dp_step);
    wgmma_commit();
}

// lse and delta of each step's query rows for the dk/dv passes, one row per
// thread below STEP, filled into a stage's buffers together with its Q and dO
// tiles. PREFETCH (Sm90BwdConfig::PREFETCH_ROW_STATS): a step's values are
// fetched into registers one fill early, since a global load followed by its
// store holds the issuing warp, and with it its warpgroup's products, for the
// load's whole latency.
template <int STEP, int THREADS, bool PREFETCH>
struct QueryRowStats {
    static_assert(STEP <= THREADS, "one query row per thread");
    const QuerySteps<STEP>& steps;
    const float* g_lse;
    const float* g_delta;
    float* s_lse2;    // [stage][STEP], log2 domain
    float* s_delta;   // [stage][STEP]
    int nq;
    float lse = -CUFLASH_INF, delta = 0.f;   // raw, of the step stored next; a row past nq: p = 0, ds = 0

    __device__ __forceinline__ QueryRowStats(const QuerySteps<STEP>& steps, const float* g_lse, const float* g_delta,
                                             float* s_lse2, float* s_delta, int nq)
        : steps(steps), g_lse(g_lse), g_delta(g_delta), s_lse2(s_lse2), s_delta(s_delta), nq(nq) {}

    // before the first fill, which is of step 0
    __device__ __forceinline__ void prime() {
        if (PREFETCH) fetch();
    }
    // stage `stage` gets step j's rows (fills come in step order)
    __device__ __forceinline__ void fill(int j, int stage) {
        if (!PREFETCH) fetch();
        if (threadIdx.x < STEP) {
            s_lse2[stage * STEP + threadIdx.x] = lse_to_log2(lse);
            s_delta[stage * STEP + threadIdx.x] = delta;
        }
        if (PREFETCH && j + 1 < steps.count) fetch();
    }

  private:
    typename QuerySteps<STEP>::Cursor next = steps.first();   // the step fetched next

    __device__ __forceinline__ void fetch() {
        const index_t row = steps.row(next);
        const bool inside = threadIdx.x < STEP && next.m0 + int(threadIdx.x) < nq;
        lse = inside ? g_lse[row + threadIdx.x] : -CUFLASH_INF;
        delta = inside ? g_delta[row + threadIdx.x] : 0.f;
        steps.advance(next);
    }
};

// p^T as the dv product's A fragments through dropout's mask: dropped 0, kept scaled (KeepMask);
// p^T itself without dropout (NoDrop)
template <class T, int S_TILES>
__device__ __forceinline__ void dropped_a_fragments(u32 (&pa)[S_TILES / 2][4], const float (&pt)[1][S_TILES][4],
                                                    NoDrop) {
    to_a_fragments<T>(pa, pt);
}
template <class T, int S_TILES, int TILES>
__device__ __forceinline__ void dropped_a_fragments(u32 (&pa)[S_TILES / 2][4], const float (&pt)[1][S_TILES][4],
                                                    const KeepMask<TILES>& kept) {
    float dropped[1][S_TILES][4];
    for_each_element<1, S_TILES>([&](int, int nt, int e) { dropped[0][nt][e] = kept(0, nt, e, pt[0][nt][e]); });
    to_a_fragments<T>(pa, dropped);
}

template <class T, int HEAD_DIM, int STEP, int WARPGROUPS, int STAGES, int MIN_BLOCKS, bool PACKED, class Scores>
__global__ void __launch_bounds__(WARPGROUPS * 128, MIN_BLOCKS)
attn_bwd_dkdv_sm90(const BwdParams p) {
    using Cfg = Sm90BwdConfig<T, HEAD_DIM, STEP, WARPGROUPS, STAGES>;
    using Storage = typename Cfg::Storage;
    using RTile = typename Cfg::ResidentTile;
    using STile = typename Cfg::StepTile;
    constexpr int S_TILES = STEP / 8, D_TILES = HEAD_DIM / 8, STEP_BYTES = STile::BYTES;

    extern __shared__ __align__(1024) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(Cfg::SMEM_BYTES)) __trap();
    Work w;
    if (!p.template find_work<PACKED>(u32(p.num_n_blocks), false, w)) return;
    const int n0 = w.block * Cfg::RESIDENT;
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv);
    const int group_row0 = (threadIdx.x / 128) * 64;
    const int warp_row0 = group_row0 + (threadIdx.x / 32 % 4) * 16;

    index_t q_off, k_off, v_off;
    p.batch_offsets(p.group_member(w.entry, 0), q_off, k_off, v_off);
    const Storage* g_q = static_cast<const Storage*>(p.q) + q_off;   // + QuerySteps' q_off
    const Storage* g_do = static_cast<const Storage*>(p.dout);        // + QuerySteps' row * dv

    // [K][V][Q stage 0, 1][dO stage 0, 1][lse2 stage 0, 1][delta stage 0, 1], tiles 1024-aligned
    const u32 base = (smem_address(smem) + 1023u) & ~1023u;
    const u32 s_k = base;
    const u32 s_v = s_k + RTile::BYTES;
    const u32 s_q = s_v + RTile::BYTES;
    const u32 s_do = s_q + STAGES * STEP_BYTES;
    float* s_lse2 = reinterpret_cast<float*>(smem + (base - smem_address(smem)) + 2 * RTile::BYTES +
                                             2 * STAGES * STEP_BYTES);
    float* s_delta = s_lse2 + STAGES * STEP;

    const Band band(p, w);
    // (ALiBi's passes do not group, nor do FULL's; a bias never comes with packed sequences)
    const ScorePath<T, Scores, AttnParams, Scores::BIAS_DROPOUT && !PACKED> path(p, band, p.group_member(w.entry, 0), w);
    using Factors = ScoreFactors<Scores::USER, S_TILES>;   // (the user path's: ds's factors)
    // (FULL skips the steps a block mask leaves empty: a gradient product carried into the next
    // step would read a stage refilled meanwhile)
    static_assert(!(Scores::FULL && Cfg::OVERLAP), "the FULL path runs without OVERLAP");
    const int n_end = min(n0 + Cfg::RESIDENT, nk);
    const QuerySteps<STEP> steps = query_steps<STEP>(p, w, band, n0, n_end);

    QueryRowStats<STEP, Cfg::THREADS, Cfg::PREFETCH_ROW_STATS> stats(steps, p.lse, p.delta, s_lse2, s_delta, nq);
    auto loads = steps.first();   // the next step to load
    auto load_step = [&](int j, int stage) {
        const int m0 = loads.m0;
        load_tile_async<STile, Cfg::THREADS>(s_q + stage * STEP_BYTES, g_q + steps.q_offset(loads), p.q_row_stride,
                                             nq - m0, d);
        load_tile_async<STile, Cfg::THREADS>(s_do + stage * STEP_BYTES, g_do + steps.row(loads) * p.dv, p.dv,
                                             nq - m0, dv);
        stats.fill(j, stage);
        steps.advance(loads);
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
        stats.prime();
#pragma unroll
        for (int i = 0; i < Cfg::AHEAD; ++i) {
            if (i < steps.count) load_step(i, i);
            cp_async_commit();
        }
    }
    // With OVERLAP (Cfg) a step's gradient products are issued at the start of the
    // next step, behind its score products, and run while its p^T is formed; their
    // A fragments and B tiles (pa, dsa; q and dout of step mb - 1) stay until then.
    u32 pa[S_TILES / 2][4], dsa[S_TILES / 2][4];
    u32 q_prev = 0, do_prev = 0;
    auto issue_gradients = [&](u32 q_tile, u32 do_tile) {
        pin_registers(acc_dv);
        pin_registers(acc_dk);
        wgmma_regs_cols<T, STile, HEAD_DIM>(acc_dv[0], pa, do_tile);
        wgmma_regs_cols<T, STile, HEAD_DIM>(acc_dk[0], dsa, q_tile);
    };
    int mb = steps.mb_begin;   // the query block of step j
    BlockWalk<Scores::USER> walk;
    for (int j = 0; j < steps.count; ++j) {
        const int stage = int(u32(j) % STAGES);
        cp_async_wait<Cfg::AHEAD - 1>();
        fence_async_shared();
        __syncthreads();         // step j has landed; no product in flight reads the stage refilled next
        if (j + Cfg::AHEAD < steps.count) load_step(j + Cfg::AHEAD, int(u32(stage + Cfg::AHEAD) % STAGES));
        cp_async_commit();
        const u32 q_st = s_q + stage * STEP_BYTES, do_st = s_do + stage * STEP_BYTES;
        const float* lse2 = s_lse2 + stage * STEP;
        const float* delta = s_delta + stage * STEP;
        const int m0 = mb * STEP;
        // a step the call's block mask leaves empty is skipped (uniform over the block; its loads
        // are not, as in attn_bwd_dkdv)
        TileKind kind = TileKind::PARTIAL;
        if constexpr (Scores::USER) {
            kind = walk.at(mb, [&](int b) {
                return b < steps.mb_end ? path.tile(b * STEP, (b + 1) * STEP, n0, n_end) : TileKind::EMPTY;
            });
        }
        mb = steps.next_block(mb);
        if (kind == TileKind::EMPTY) continue;

        // s^T = k q^T and dp^T = v dout^T (rows: this warpgroup's keys; columns: the step's queries)
        float st[1][S_TILES][4], dpt[1][S_TILES][4];
        pin_registers(pa);
        pin_registers(dsa);
        issue_score_products<T, RTile, STile, HEAD_DIM, STEP>(st, dpt, s_k + group_row0 * 128, q_st,
                                                             s_v + group_row0 * 128, do_st);
        if (Cfg::OVERLAP) {
            if (j > 0) issue_gradients(q_prev, do_prev);
            wgmma_commit();   // empty in the first step, so the waits below count alike
        }
        wgmma_wait<Cfg::OVERLAP ? 2 : 1>();
        pin_registers(st);

        // p^T = exp2(s^T * scale_log2 - lse2 of each query column), 0 where masked
        Factors factors;
        path.transposed_probabilities(st, band, m0, min(m0 + STEP, nq), n0, n_end, n0 + warp_row0, scale_log2, lse2,
                                      factors, kind);
        const auto kept = path.template keep_mask<true, S_TILES>(n0 + warp_row0, m0);   // dropout's (FULL)

        if (!Cfg::OVERLAP) {
            // dv += p^T dout (through dropout's mask, which dp^T takes too), running while ds^T is formed
            dropped_a_fragments<T>(pa, st, kept);
            pin_registers(acc_dv);
            pin_registers(pa);
            wgmma_fence();
            wgmma_regs_cols<T, STile, HEAD_DIM>(acc_dv[0], pa, do_st);
            wgmma_commit();
        }
        wgmma_wait<1>();
        pin_registers(dpt);

        // ds^T = p^T (dp^T - delta of each query column); dk += ds^T q (scaled at the end)
        path.transposed_ds(dpt, st, delta, lse2, n0 + warp_row0, m0, kept, factors);
        if (Cfg::OVERLAP) {
            wgmma_wait<0>();   // the previous step's products: pa and dsa are free
            pin_registers(acc_dv);
            pin_registers(acc_dk);
            to_a_fragments<T>(pa, st);
            to_a_fragments<T>(dsa, dpt);
            q_prev = q_st;
            do_prev = do_st;
        } else {
            to_a_fragments<T>(dsa, dpt);
            pin_registers(acc_dk);
            pin_registers(dsa);
            wgmma_fence();
            wgmma_regs_cols<T, STile, HEAD_DIM>(acc_dk[0], dsa, q_st);
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(acc_dv);
            pin_registers(acc_dk);
        }
    }
    if (Cfg::OVERLAP && steps.count) {
        pin_registers(pa);
        pin_registers(dsa);
        wgmma_fence();
        issue_gradients(q_prev, do_prev);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc_dv);
        pin_registers(acc_dk);
    }

    store_key_gradient<T>(p, w, n0, false, acc_dk, warp_row0, 0);
    store_key_gradient<T>(p, w, n0, true, acc_dv, warp_row0, 0);
}

// dk and dv for 64 keys at head dims too wide for one warpgroup to hold both
// accumulators (64 x 256 each). Both warpgroups own the same keys: warpgroup 0
// forms p^T and accumulates dv, warpgroup 1 forms dp^T and accumulates dk, with
// p^T passed through shared memory. Four products per step, as in
// attn_bwd_dkdv_sm90, where a column split would recompute both score products.
template <class T, int HEAD_DIM, int STEP, int STAGES, bool PACKED, class Scores>
__global__ void __launch_bounds__(256, 1)
attn_bwd_dkdv_wide_sm90(const BwdParams p) {
    using Cfg = Sm90BwdConfig<T, HEAD_DIM, STEP, 1, STAGES>;
    using Storage = typename Cfg::Storage;
    using RTile = typename Cfg::ResidentTile;
    using STile = typename Cfg::StepTile;
    constexpr int THREADS = 256, S_TILES = STEP / 8, D_TILES = HEAD_DIM / 8, STEP_BYTES = STile::BYTES;
    constexpr int EXCHANGE_FLOATS = 64 * STEP;   // one step's p^T, in fragment order

    extern __shared__ __align__(1024) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(Cfg::SMEM_BYTES + 4 * EXCHANGE_FLOATS)) __trap();
    Work w;
    if (!p.template find_work<PACKED>(u32(p.num_n_blocks), false, w)) return;
    const int n0 = w.block * 64;
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv);
    const int group = threadIdx.x / 128, rank = threadIdx.x % 128;   // rank within the warpgroup
    const int warp_row0 = (rank / 32) * 16;
    const int t = threadIdx.x % 4;

    index_t q_off, k_off, v_off;
    p.batch_offsets(p.group_member(w.entry, 0), q_off, k_off, v_off);
    const Storage* g_q = static_cast<const Storage*>(p.q) + q_off;   // + QuerySteps' q_off
    const Storage* g_do = static_cast<const Storage*>(p.dout);        // + QuerySteps' row * dv

    // [K][V][Q x STAGES][dO x STAGES][lse2 x STAGES][delta x STAGES][p^T exchange]
    const u32 base = (smem_address(smem) + 1023u) & ~1023u;
    const u32 s_k = base;
    const u32 s_v = s_k + RTile::BYTES;
    const u32 s_q = s_v + RTile::BYTES;
    const u32 s_do = s_q + STAGES * STEP_BYTES;
    float* s_lse2 = reinterpret_cast<float*>(smem + (base - smem_address(smem)) + 2 * RTile::BYTES +
                                             2 * STAGES * STEP_BYTES);
    float* s_delta = s_lse2 + STAGES * STEP;
    float* s_exchange = s_delta + STAGES * STEP;

    const Band band(p, w);
    const ScorePath<T, Scores> path(p, band, p.group_member(w.entry, 0));   // (ALiBi's passes do not group)
    const int n_end = min(n0 + 64, nk);
    const QuerySteps<STEP> steps = query_steps<STEP>(p, w, band, n0, n_end);

    QueryRowStats<STEP, THREADS, Cfg::PREFETCH_ROW_STATS> stats(steps, p.lse, p.delta, s_lse2, s_delta, nq);
    auto loads = steps.first();   // the next step to load
    auto load_step = [&](int j, int stage) {
        const int m0 = loads.m0;
        load_tile_async<STile, THREADS>(s_q + stage * STEP_BYTES, g_q + steps.q_offset(loads), p.q_row_stride,
                                        nq - m0, d);
        load_tile_async<STile, THREADS>(s_do + stage * STEP_BYTES, g_do + steps.row(loads) * p.dv, p.dv, nq - m0, dv);
        stats.fill(j, stage);
        steps.advance(loads);
    };

    float acc[1][D_TILES][4];   // dv in warpgroup 0, dk in warpgroup 1
    fill_zero(acc);
    const float scale_log2 = p.scale_log2;

    if (steps.count) {
        const index_t key0 = w.k0 + n0;
        const Storage* g_k = static_cast<const Storage*>(p.k) + k_off + key0 * p.k_row_stride;
        const Storage* g_v = static_cast<const Storage*>(p.v) + v_off + key0 * p.v_row_stride;
        load_tile_async<RTile, THREADS>(s_k, g_k, p.k_row_stride, nk - n0, d);
        load_tile_async<RTile, THREADS>(s_v, g_v, p.v_row_stride, nk - n0, dv);
        stats.prime();
#pragma unroll
        for (int i = 0; i < STAGES - 1; ++i) {
            if (i < steps.count) load_step(i, i);
            cp_async_commit();
        }
    }
    int mb = steps.mb_begin;   // the query block of step j
    for (int j = 0; j < steps.count; ++j) {
        const int stage = int(u32(j) % STAGES);
        cp_async_wait<STAGES - 2>();
        fence_async_shared();
        __syncthreads();         // step j has landed, step j-1 (and its exchange) is done everywhere
        if (j + STAGES - 1 < steps.count) load_step(j + STAGES - 1, int(u32(stage + STAGES - 1) % STAGES));
        cp_async_commit();
        const u32 q_st = s_q + stage * STEP_BYTES, do_st = s_do + stage * STEP_BYTES;
        const int m0 = mb * STEP;
        mb = steps.next_block(mb);

        // warpgroup 0: s^T = k q^T; warpgroup 1: dp^T = v dout^T
        float s[1][S_TILES][4];
        wgmma_fence();
        wgmma_rows_rows<T, RTile, STile, HEAD_DIM, STEP>(s[0], group == 0 ? s_k : s_v, group == 0 ? q_st : do_st);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(s);

        if (group == 0) {
            // p^T, 0 where masked; shared with warpgroup 1 element by element
            const float* lse2 = s_lse2 + stage * STEP;
            path.transposed_probabilities(s, band, m0, min(m0 + STEP, nq), n0, n_end, n0 + warp_row0, scale_log2, lse2);
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_exchange[(nt * 4 + e) * 128 + rank] = s[0][nt][e];
            named_barrier_arrive<1, THREADS>();
        } else {
            // ds^T = p^T (dp^T - delta of each query column). The deltas are read before the
            // named barrier: ordered by the step barrier alone, as warp 0's refill of the stage
            // is, rather than by both (compute-sanitizer's racecheck reported the pair otherwise).
            // (the lse2 too, where softcap's factor wants them)
            const float* delta = s_delta + stage * STEP;
            const float* lse2 = s_lse2 + stage * STEP;
            float column_delta[1][S_TILES][4], column_lse2[1][S_TILES][4], pt[1][S_TILES][4];
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    column_delta[0][nt][e] = delta[nt * 8 + 2 * t + (e & 1)];
                    column_lse2[0][nt][e] = path.capped() ? lse2[nt * 8 + 2 * t + (e & 1)] : 0.f;
                }
            named_barrier_sync<1, THREADS>();
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) pt[0][nt][e] = s_exchange[(nt * 4 + e) * 128 + rank];
            path.transposed_ds(s, pt, column_delta, column_lse2, n0 + warp_row0, m0);
        }

        // warpgroup 0: dv += p^T dout; warpgroup 1: dk += ds^T q (scaled at the end)
        u32 a[S_TILES / 2][4];
        to_a_fragments<T>(a, s);
        pin_registers(acc);
        wgmma_fence();
        wgmma_regs_cols<T, STile, HEAD_DIM>(acc[0], a, group == 0 ? do_st : q_st);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc);
    }

    store_key_gradient<T>(p, w, n0, group == 0, acc, warp_row0, 0);   // dv in warpgroup 0, dk in 1
}

// delta = rowsum(dout * out) of the two rows a thread owns in the MMA layout
// (rows g and g + 8 of its warp's 16 from flat row flat_row0, of which `rows`
// exist), its quad splitting each row
// into 16-byte chunks (out and dout are contiguous and 16-byte aligned, dv a
// multiple of 8). The dq pass runs first and stores delta for the dk/dv pass.
template <class T>
__device__ __forceinline__ void row_deltas(const BwdParams& p, index_t flat_row0, int rows, bool store, float (&delta)[2]) {
    using Storage = typename T::storage;
    static_assert(sizeof(Storage) == 2, "16-bit elements, eight to a chunk");
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int chunks = int(p.dv) / 8;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = g + 8 * h;
        float sum = 0.f;
        if (row < rows) {
            const index_t off = (flat_row0 + row) * p.dv;
            const uint4* o = reinterpret_cast<const uint4*>(static_cast<const Storage*>(p.out) + off);
            const uint4* d = reinterpret_cast<const uint4*>(static_cast<const Storage*>(p.dout) + off);
            for (int c = t; c < chunks; c += 4) {
                const uint4 a = o[c], b = d[c];
                const u32 aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                for (int w = 0; w < 4; ++w)
                    sum += Load<T>::bits(u16(aw[w])) * Load<T>::bits(u16(bw[w])) +
                           Load<T>::bits(u16(aw[w] >> 16)) * Load<T>::bits(u16(bw[w] >> 16));
            }
        }
        delta[h] = quad_sum(sum);
        if (store && t == 0 && row < rows) p.delta[flat_row0 + row] = delta[h];
    }
}

template <class T, int HEAD_DIM, int STEP, int WARPGROUPS, int STAGES, int MIN_BLOCKS, bool PACKED, class Scores>
__global__ void __launch_bounds__(WARPGROUPS * 128, MIN_BLOCKS)
attn_bwd_dq_sm90(const BwdParams p) {
    using Cfg = Sm90BwdConfig<T, HEAD_DIM, STEP, WARPGROUPS, STAGES>;
    using Storage = typename Cfg::Storage;
    using RTile = typename Cfg::ResidentTile;
    using STile = typename Cfg::StepTile;
    constexpr int S_TILES = STEP / 8, D_TILES = HEAD_DIM / 8, STEP_BYTES = STile::BYTES;

    extern __shared__ __align__(1024) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(Cfg::SMEM_BYTES)) __trap();
    Work w;
    if (!p.template find_work<PACKED>(u32(p.num_m_blocks), true, w)) return;
    const int m0 = w.block * Cfg::RESIDENT;
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv);
    const int group_row0 = (threadIdx.x / 128) * 64;
    const int warp_row0 = group_row0 + (threadIdx.x / 32 % 4) * 16;
    const int g = (threadIdx.x % 32) / 4;

    index_t q_off, k_off, v_off;
    p.batch_offsets(w.entry, q_off, k_off, v_off);
    const Storage* g_k = static_cast<const Storage*>(p.k) + k_off + index_t(w.k0) * p.k_row_stride;
    const Storage* g_v = static_cast<const Storage*>(p.v) + v_off + index_t(w.k0) * p.v_row_stride;
    const index_t row0 = index_t(w.entry) * p.nq + w.q0 + m0;   // flat row of m0 in dout, lse, delta, dq

    // [Q][dO][K stage 0, 1][V stage 0, 1], tiles 1024-aligned
    const u32 s_q = (smem_address(smem) + 1023u) & ~1023u;
    const u32 s_do = s_q + RTile::BYTES;
    const u32 s_k = s_do + RTile::BYTES;
    const u32 s_v = s_k + STAGES * STEP_BYTES;

    const Band band(p, w);
    const ScorePath<T, Scores, AttnParams, Scores::BIAS_DROPOUT && !PACKED> path(p, band, w.entry, w);
    using Factors = ScoreFactors<Scores::USER, S_TILES, Scores::GRADS>;   // (GRADS: score_mod's inputs too)
    static_assert(!(Scores::FULL && Cfg::OVERLAP), "the FULL path runs without OVERLAP (as attn_bwd_dkdv_sm90)");
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
        const Storage* g_do = static_cast<const Storage*>(p.dout) + row0 * p.dv;
        load_tile_async<RTile, Cfg::THREADS>(s_q, g_q, p.q_row_stride, nq - m0, d);
        load_tile_async<RTile, Cfg::THREADS>(s_do, g_do, p.dv, nq - m0, dv);
#pragma unroll
        for (int i = 0; i < Cfg::AHEAD; ++i) {
            if (nb_begin + i < nb_end) load_step(nb_begin + i, i);
            cp_async_commit();
        }
    }
    // lse2 and delta of the two rows each thread owns, while the first steps load;
    // every row gets its delta, also one that sees no key (the dk/dv pass multiplies it by p = 0)
    float lse2[2], delta[2];
    row_deltas<T>(p, row0 + warp_row0, nq - m0 - warp_row0, blockIdx.y == 0, delta);
#pragma unroll
    for (int h = 0; h < 2; ++h) lse2[h] = lse_log2(p.lse + row0, warp_row0 + g + 8 * h, nq - m0);

    // With OVERLAP (Cfg) a step's dq product is issued at the start of the next
    // step, behind its score products, and runs while its p is formed.
    u32 dsa[S_TILES / 2][4];   // ds as A fragments
    u32 k_prev = 0;            // the k tile of the step whose ds is in dsa
    auto issue_dq = [&](u32 k_tile) {
        pin_registers(acc_dq);
        wgmma_regs_cols<T, STile, HEAD_DIM>(acc_dq[0], dsa, k_tile);
    };
    BlockWalk<Scores::USER> walk;
    for (int nb = nb_begin; nb < nb_end; ++nb) {
        const int stage = int(u32(nb - nb_begin) % STAGES);
        cp_async_wait<Cfg::AHEAD - 1>();
        fence_async_shared();
        __syncthreads();         // step nb has landed; no product in flight reads the stage refilled next
        if (nb + Cfg::AHEAD < nb_end) load_step(nb + Cfg::AHEAD, int(u32(stage + Cfg::AHEAD) % STAGES));
        cp_async_commit();
        const u32 k_st = s_k + stage * STEP_BYTES, v_st = s_v + stage * STEP_BYTES;
        const int n0 = nb * STEP;
        // a block the call's block mask leaves empty is skipped (uniform over the block)
        TileKind kind = TileKind::PARTIAL;
        if constexpr (Scores::USER) {
            kind = walk.at(nb, [&](int b) {
                return b < nb_end ? path.tile(m0, m_end, b * STEP, (b + 1) * STEP) : TileKind::EMPTY;
            });
            if (kind == TileKind::EMPTY) continue;
        }

        // s = q k^T and dp = dout v^T
        float s[1][S_TILES][4], dp[1][S_TILES][4];
        pin_registers(dsa);
        issue_score_products<T, RTile, STile, HEAD_DIM, STEP>(s, dp, s_q + group_row0 * 128, k_st,
                                                             s_do + group_row0 * 128, v_st);
        if (Cfg::OVERLAP) {
            if (nb > nb_begin) issue_dq(k_prev);
            wgmma_commit();   // empty in the first step, so the waits below count alike
        }
        wgmma_wait<Cfg::OVERLAP ? 2 : 1>();
        pin_registers(s);

        // p = exp2(s * scale_log2 - lse2), while dp finishes
        Factors factors;
        path.row_probabilities(s, band, m0, m_end, n0, n0 + STEP, m0 + warp_row0, scale_log2, lse2, factors, kind);
        wgmma_wait<Cfg::OVERLAP ? 1 : 0>();
        pin_registers(dp);

        // ds = p (dp - delta) (and dbias = ds before softcap's factor where asked); dq += ds k
        // (scaled at the end)
        path.dq_ds(dp, s, delta, lse2, m0 + warp_row0, n0, p, w.entry, factors);
        if (Cfg::OVERLAP) {
            wgmma_wait<0>();   // the previous step's dq product: dsa is free
            pin_registers(acc_dq);
            to_a_fragments<T>(dsa, dp);
            k_prev = k_st;
        } else {
            to_a_fragments<T>(dsa, dp);
            pin_registers(dsa);
            wgmma_fence();
            issue_dq(k_st);
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(acc_dq);
        }
    }
    if (Cfg::OVERLAP && nb_begin < nb_end) {
        pin_registers(dsa);
        wgmma_fence();
        issue_dq(k_prev);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc_dq);
    }

    const float scale = p.scale_log2 / LOG2E;
    Storage* g_dq = static_cast<Storage*>(p.dq) + row0 * p.d;
    store_rows<T>(g_dq, acc_dq, scale, warp_row0, nq - m0, 0, d);
}

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
