// attn_bwd_sm90_ws.cuh: the Hopper backward's passes with their loads on their own warps.
//
// attn_bwd_dkdv_sm90 and attn_bwd_dq_sm90 tie their two warpgroups together with a
// block-wide barrier each step, and their registers hold the loads' addresses and
// cursors beside the gradients. Here warpgroup 0 only loads, by cp.async (any layout,
// packed sequences, grouped queries): the block's 128 resident rows once, then each
// step's rows of the other side into a ring of STAGES, a stage's "full" barrier
// completing as its copies land and its "empty" one once both computing warpgroups
// are done with it. Warpgroups 1 and 2 own 64 resident rows each and run the
// products of attn_bwd_sm90.cuh without waiting for each other.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {
// A pass's barriers, after its buffers: its resident tiles' "full", then per stage a
// step's "full" (its copies landed: one arrival per loading thread) and "empty" (both
// computing warpgroups are done with it). init: by thread 0 before the block syncs.
template <int STAGES, int PRODUCERS, int CONSUMERS>
struct StepRing {
    u32 base;
    __device__ __forceinline__ u32 resident_full() const { return base; }
    __device__ __forceinline__ u32 full(int s) const { return base + 8u * u32(1 + s); }
    __device__ __forceinline__ u32 empty(int s) const { return base + 8u * u32(1 + STAGES + s); }
    __device__ __forceinline__ void init() const {
        if (threadIdx.x == 0) {
            mbarrier_init(resident_full(), PRODUCERS);
            for (int s = 0; s < STAGES; ++s) {
                mbarrier_init(full(s), PRODUCERS);
                mbarrier_init(empty(s), CONSUMERS);
            }
        }
        __syncthreads();
    }
};

// The shared memory of a dk/dv pass, from a 1024-byte boundary (swizzle atoms):
// [K][V][Q x STAGES][dO x STAGES][ds tiles][dq chunks][lse x STAGES][delta x STAGES]
// [barriers], lse as stored; the ds tiles and dq chunks only in a pass that adds dq up.
template <class Cfg>
struct DkdvSmem {
    u32 k, v, q, dout;
    u32 ds, dq_chunks;       // (Cfg::ADDS_DQ) ds^T tiles; per computing warp, 16 rows of dq
    u32 lse, delta;
    StepRing<Cfg::STAGES, Cfg::PRODUCER_THREADS, Cfg::CONSUMER_THREADS> ring;
    const float* lse_rows;   // lse, then delta, as the computing threads read them

    __device__ __forceinline__ explicit DkdvSmem(unsigned char* smem)
        : k((smem_address(smem) + 1023u) & ~1023u), v(k + Cfg::ResidentTile::BYTES), q(v + Cfg::ResidentTile::BYTES),
          dout(q + Cfg::STAGES * Cfg::StepTile::BYTES), ds(dout + Cfg::STAGES * Cfg::StepTile::BYTES),
          dq_chunks(ds + Cfg::DS_BYTES), lse(dq_chunks + Cfg::DQ_CHUNKS * Cfg::DQ_CHUNK_BYTES),
          delta(lse + Cfg::STAGES * Cfg::STEP * 4), ring{delta + Cfg::STAGES * Cfg::STEP * 4},
          lse_rows(reinterpret_cast<const float*>(smem + (lse - smem_address(smem)))) {}
    __device__ __forceinline__ u32 end() const { return ring.base + 8u * u32(Cfg::BARRIERS); }
    // For the computing warpgroups: step j's stage once its copies have landed, its Q and
    // dO tiles, lse (as stored) and delta; released once the warpgroup is done with it.
    struct Stage {
        u32 q, dout;
        const float *lse, *delta;
    };
    __device__ __forceinline__ Stage wait_step(int j) const {
        const RingSlot<Cfg::STAGES> slot{u32(j)};
        mbarrier_wait(ring.full(slot.stage), slot.parity);
        fence_async_shared();   // the copies (generic proxy) before wgmma's reads (async proxy)
        const float* rows = lse_rows + slot.stage * Cfg::STEP;
        return {q + slot.stage * Cfg::StepTile::BYTES, dout + slot.stage * Cfg::StepTile::BYTES, rows,
                rows + Cfg::STAGES * Cfg::STEP};
    }
    __device__ __forceinline__ void release(int j) const { mbarrier_arrive(ring.empty(RingSlot<Cfg::STAGES>{u32(j)}.stage)); }
};

// The loading warpgroup of a dk/dv pass: K and V of the block's keys from n0 once, then
// each step's Q, dO, lse and delta into the next stage once both computing warpgroups
// are done with it. Rows past nq read zeros, lse and delta too: their q and dout are 0,
// so are their p dout and ds.
template <class Cfg>
__device__ __forceinline__ void load_dkdv_steps(const BwdParams& p, const Work& w, const QuerySteps<Cfg::STEP>& steps,
                                                const DkdvSmem<Cfg>& s, int n0) {
    using Storage = typename Cfg::Storage;
    using RTile = typename Cfg::ResidentTile;
    using STile = typename Cfg::StepTile;
    using Slot = RingSlot<Cfg::STAGES>;
    constexpr int LOADERS = Cfg::PRODUCER_THREADS, STEP = Cfg::STEP;
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv);
    index_t q_off, k_off, v_off;
    p.batch_offsets(p.group_member(w.entry, 0), q_off, k_off, v_off);
    const index_t key0 = w.k0 + n0;
    load_tile_async<RTile, LOADERS, true>(s.k, static_cast<const Storage*>(p.k) + k_off + key0 * p.k_row_stride,
                                          p.k_row_stride, nk - n0, d);
    load_tile_async<RTile, LOADERS, true>(s.v, static_cast<const Storage*>(p.v) + v_off + key0 * p.v_row_stride,
                                          p.v_row_stride, nk - n0, dv);
    mbarrier_arrive_after_copies(s.ring.resident_full());
    const Storage* g_q = static_cast<const Storage*>(p.q) + q_off;   // + QuerySteps' q_off
    const Storage* g_do = static_cast<const Storage*>(p.dout);        // + QuerySteps' row * dv
    auto at = steps.first();
    for (int j = 0; j < steps.count; ++j) {
        const Slot slot{u32(j)};
        mbarrier_wait(s.ring.empty(slot.stage), slot.parity ^ 1u);
        const int rows = nq - at.m0;
        const index_t row = steps.row(at);
        load_tile_async<STile, LOADERS, true>(s.q + slot.stage * STile::BYTES, g_q + steps.q_offset(at), p.q_row_stride,
                                              rows, d);
        load_tile_async<STile, LOADERS, true>(s.dout + slot.stage * STile::BYTES, g_do + row * p.dv, p.dv, rows, dv);
        if (threadIdx.x < STEP) {
            const bool inside = int(threadIdx.x) < rows;
            const u32 at_row = u32(slot.stage * STEP + threadIdx.x) * 4u;
            cp_async_4(s.lse + at_row, p.lse + (inside ? row + threadIdx.x : 0), inside);
            cp_async_4(s.delta + at_row, p.delta + (inside ? row + threadIdx.x : 0), inside);
        }
        mbarrier_arrive_after_copies(s.ring.full(slot.stage));
        steps.advance(at);
    }
}

// On the loading warpgroup (true: the thread is done, as is its warpgroup), with
// registers given up to the computing ones: load_dkdv_steps.
template <class Cfg>
__device__ __forceinline__ bool run_dkdv_loads(const BwdParams& p, const Work& w, const QuerySteps<Cfg::STEP>& steps,
                                               const DkdvSmem<Cfg>& buf, int n0) {
    if (threadIdx.x >= Cfg::PRODUCER_THREADS) return false;
    registers_release<Cfg::PRODUCER_REGS>();
    if (steps.count) load_dkdv_steps<Cfg>(p, w, steps, buf, n0);
    cp_async_wait<0>();   // no copy outlives its thread
    return true;
}

// A warp's 16 rows of a step's dq, added into the float32 sums at g by the copy engine:
// staged in the accumulator's order (lane l's four floats of a column tile side by side
// with the other lanes': no bank conflicts), so that the sums hold each 16-row chunk in
// that order ([column tile][lane][4]; scale_dq_sums puts it back). The chunk is this
// warp's own, so only its own previous add, two steps back, must have read it.
template <int D_TILES>
__device__ __forceinline__ void add_dq_chunk(float* g, u32 chunk, const float (&part)[1][D_TILES][4], bool rows_there) {
    const int lane = int(threadIdx.x) % 32;
    if (lane == 0) bulk_wait_group<0, true>();   // the previous add has read the chunk
    __syncwarp();
#pragma unroll
    for (int dt = 0; dt < D_TILES; ++dt)
        st_shared_v4(chunk + u32((dt * 32 + lane) * 16), part[0][dt][0], part[0][dt][1], part[0][dt][2],
                     part[0][dt][3]);
    fence_async_shared();   // the stores (generic proxy) before the copy engine reads them
    __syncwarp();
    if (lane == 0 && rows_there) {
        bulk_add_f32(g, chunk, u32(16 * D_TILES * 8 * 4));
        bulk_commit_group();
    }
}

// ADDS_DQ (deterministic=False, head dims 64 and 128): the pass also forms dq, ds k over
// the block's 128 keys, one warpgroup a step in turn (step j: computing warpgroup j % 2),
// while the other runs on into its next step's scores. Each warpgroup stores its ds^T
// transposed into shared memory (a tile per warpgroup and step parity); the one whose turn
// it is waits at named barrier 1 + j % 2 for both and reads them with K. Its accumulators
// (64 x HEAD_DIM) live only from that product, issued once dk's is done, to the add, in
// registers the scores have left. Each of its warps adds 16 rows into float32 p.dq (dq's
// shape, unscaled) by add_dq_chunk, through a chunk of its own (chunks shared by the two
// warpgroups' warps in turn, ordered by the barrier, drew racecheck reports): one add per
// step and block, blocks in whatever order. No dq pass runs: a delta launch comes first,
// and scale_dq_sums after. (The other warpgroup writes its tile of parity j % 2 again at
// step j + 2, having waited at step j + 1's barrier, where the reader of step j arrives
// after its product.)
template <class T, int HEAD_DIM, int STAGES, bool PACKED, bool ADDS_DQ, class Scores>
__global__ void __launch_bounds__(384, 1)
attn_bwd_dkdv_sm90_ws(const BwdParams p) {
    using Cfg = Sm90WsBwdConfig<T, HEAD_DIM, 128, 64, STAGES, true, ADDS_DQ>;
    static_assert(!ADDS_DQ || HEAD_DIM == 64 || HEAD_DIM == 128, "dq's sums fit beside dk and dv up to 128");
    using RTile = typename Cfg::ResidentTile;
    using STile = typename Cfg::StepTile;
    constexpr int STEP = Cfg::STEP, S_TILES = STEP / 8, D_TILES = HEAD_DIM / 8;

    extern __shared__ __align__(1024) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(Cfg::SMEM_BYTES)) __trap();   // launch/config mismatch
    Work w;
    if (!p.template find_work<PACKED>(u32(p.num_n_blocks), false, w)) return;
    const int n0 = w.block * Cfg::RESIDENT;
    const int nq = w.nq, nk = w.nk;
    const DkdvSmem<Cfg> buf(smem);
    buf.ring.init();   // resident_full: K and V landed

    const Band band(p, w);
    const ScorePath<T, Scores> path(p, band, p.group_member(w.entry, 0));   // (ALiBi's passes do not group)
    const int n_end = min(n0 + Cfg::RESIDENT, nk);
    const QuerySteps<STEP> steps = query_steps<STEP>(p, w, band, n0, n_end);

    if (run_dkdv_loads<Cfg>(p, w, steps, buf, n0)) return;   // the loading warpgroup is done

    registers_claim<Cfg::CONSUMER_REGS>();
    const int consumer = int(threadIdx.x) / 128 - 1;                       // 0 or 1
    const int group_row0 = consumer * 64;                                  // this warpgroup's keys
    const int warp = int(threadIdx.x) / 32 % 4;
    const int warp_row0 = group_row0 + warp * 16;                          // this warp's
    const float scale_log2 = p.scale_log2;

    float acc_dk[1][D_TILES][4], acc_dv[1][D_TILES][4];
    fill_zero(acc_dk);
    fill_zero(acc_dv);
    if (steps.count) {
        mbarrier_wait(buf.ring.resident_full(), 0);
    }
    int mb = steps.mb_begin;   // the query block of step j
    auto at = steps.first();   // (ADDS_DQ) step j's rows
    for (int j = 0; j < steps.count; ++j) {
        const auto stage = buf.wait_step(j);
        const u32 q_st = stage.q, do_st = stage.dout;
        const int m0 = mb * STEP;
        mb = steps.next_block(mb);

        // s^T = k q^T and dp^T = v dout^T (rows: this warpgroup's keys; columns: the step's queries)
        float st[1][S_TILES][4], dpt[1][S_TILES][4];
        issue_score_products<T, RTile, STile, HEAD_DIM, STEP>(st, dpt, buf.k + group_row0 * 128, q_st,
                                                             buf.v + group_row0 * 128, do_st);
        wgmma_wait<1>();
        pin_registers(st);

        // p^T, 0 where masked; dv += p^T dout, running while ds^T is formed
        path.template transposed_probabilities<true>(st, band, m0, min(m0 + STEP, nq), n0, n_end, n0 + warp_row0,
                                                     scale_log2, stage.lse);
        u32 pa[S_TILES / 2][4], dsa[S_TILES / 2][4];
        to_a_fragments<T>(pa, st);
        pin_registers(acc_dv);
        pin_registers(pa);
        wgmma_fence();
        wgmma_regs_cols<T, STile, HEAD_DIM>(acc_dv[0], pa, do_st);
        wgmma_commit();
        wgmma_wait<1>();
        pin_registers(dpt);

        // ds^T = p^T (dp^T - delta of each query column); dk += ds^T q (scaled at the end)
        path.template transposed_ds<true>(dpt, st, stage.delta, stage.lse, n0 + warp_row0, m0);
        to_a_fragments<T>(dsa, dpt);
        const u32 ds_tiles = buf.ds + u32(2 * (j & 1)) * Cfg::DsTile::BYTES;   // (ADDS_DQ) step j's two
        const bool forms_dq = ADDS_DQ && (j & 1) == consumer;
        const u32 ds_barrier = 1u + u32(j & 1);
        if (ADDS_DQ) {
            store_transposed(ds_tiles + u32(consumer) * Cfg::DsTile::BYTES, dsa, warp_row0 - group_row0);
            fence_async_shared();   // before wgmma reads it
            if (!forms_dq) named_barrier_arrive(ds_barrier, Cfg::CONSUMER_THREADS);
        }
        pin_registers(acc_dk);
        pin_registers(dsa);
        wgmma_fence();
        wgmma_regs_cols<T, STile, HEAD_DIM>(acc_dk[0], dsa, q_st);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc_dv);
        pin_registers(acc_dk);
        buf.release(j);   // this warpgroup's last read of the stage is done
        if (ADDS_DQ) {
            if (forms_dq) {
                named_barrier_sync(ds_barrier, Cfg::CONSUMER_THREADS);   // both ds^T are there
                float dq[1][D_TILES][4];
                wgmma_fence();
                wgmma_smem_cols<T, RTile, HEAD_DIM, STEP / 16>(dq[0], ds_tiles, buf.k);
                wgmma_smem_cols<T, RTile, HEAD_DIM, STEP / 16, true>(dq[0], ds_tiles + Cfg::DsTile::BYTES,
                                                                     buf.k + 64 * 128);
                wgmma_commit();
                wgmma_wait<0>();
                pin_registers(dq);
                // whole chunks of rows only (the host sends rows in multiples of 16, width HEAD_DIM)
                const bool rows_there = at.m0 + warp * 16 + 16 <= nq && p.d == HEAD_DIM;
                add_dq_chunk(static_cast<float*>(p.dq) + (steps.row(at) + warp * 16) * HEAD_DIM,
                             buf.dq_chunks + u32(consumer * 4 + warp) * Cfg::DQ_CHUNK_BYTES, dq, rows_there);
            }
            steps.advance(at);
        }
    }
    if (ADDS_DQ && threadIdx.x % 32 == 0) bulk_wait_group<0, false>();   // the adds done before the block ends

    store_key_gradient<T>(p, w, n0, false, acc_dk, warp_row0, 0);
    store_key_gradient<T>(p, w, n0, true, acc_dv, warp_row0, 0);
}

// dq for 128 queries of one sequence of one batch entry, over the key blocks of STEP
// that they see: Q and dO resident, K and V streaming. As attn_bwd_dq_sm90, it also
// computes delta = rowsum(dout * out) of its rows and stores it for the dk/dv pass.
template <class T, int HEAD_DIM, int STEP, int STAGES, bool PACKED, class Scores>
__global__ void __launch_bounds__(384, 1)
attn_bwd_dq_sm90_ws(const BwdParams p) {
    using Cfg = Sm90WsBwdConfig<T, HEAD_DIM, 128, STEP, STAGES, false>;
    using Storage = typename Cfg::Storage;
    using RTile = typename Cfg::ResidentTile;
    using STile = typename Cfg::StepTile;
    using Slot = RingSlot<STAGES>;
    constexpr int S_TILES = STEP / 8, D_TILES = HEAD_DIM / 8;

    extern __shared__ __align__(1024) unsigned char smem[];
    if (dynamic_smem_bytes() < u32(Cfg::SMEM_BYTES)) __trap();   // launch/config mismatch
    Work w;
    if (!p.template find_work<PACKED>(u32(p.num_m_blocks), true, w)) return;
    const int m0 = w.block * Cfg::RESIDENT;
    const int nq = w.nq, nk = w.nk, d = int(p.d), dv = int(p.dv);
    const index_t row0 = index_t(w.entry) * p.nq + w.q0 + m0;   // flat row of m0 in dout, lse, delta, dq

    // [Q][dO][K x STAGES][V x STAGES][barriers]
    const u32 s_q = (smem_address(smem) + 1023u) & ~1023u;
    const u32 s_do = s_q + RTile::BYTES;
    const u32 s_k = s_do + RTile::BYTES;
    const u32 s_v = s_k + STAGES * STile::BYTES;
    const StepRing<STAGES, Cfg::PRODUCER_THREADS, Cfg::CONSUMER_THREADS> ring{s_v + STAGES * STile::BYTES};
    ring.init();   // resident_full: Q and dO landed

    const Band band(p, w);
    const ScorePath<T, Scores> path(p, band, w.entry);
    const int m_end = min(m0 + Cfg::RESIDENT, nq);
    int nb_begin, nb_end;
    band.key_blocks<STEP>(m0, m_end, nb_begin, nb_end);

    if (threadIdx.x < Cfg::PRODUCER_THREADS) {
        registers_release<Cfg::PRODUCER_REGS>();
        if (nb_begin < nb_end) {
            index_t q_off, k_off, v_off;
            p.batch_offsets(w.entry, q_off, k_off, v_off);
            load_tile_async<RTile, Cfg::PRODUCER_THREADS, true>(
                s_q, static_cast<const Storage*>(p.q) + q_off + index_t(w.q0 + m0) * p.q_row_stride, p.q_row_stride,
                nq - m0, d);
            load_tile_async<RTile, Cfg::PRODUCER_THREADS, true>(s_do, static_cast<const Storage*>(p.dout) + row0 * p.dv,
                                                                p.dv, nq - m0, dv);
            mbarrier_arrive_after_copies(ring.resident_full());
            const Storage* g_k = static_cast<const Storage*>(p.k) + k_off + index_t(w.k0) * p.k_row_stride;
            const Storage* g_v = static_cast<const Storage*>(p.v) + v_off + index_t(w.k0) * p.v_row_stride;
            for (int nb = nb_begin; nb < nb_end; ++nb) {
                const Slot slot{u32(nb - nb_begin)};
                const int n0 = nb * STEP;
                mbarrier_wait(ring.empty(slot.stage), slot.parity ^ 1u);
                load_tile_async<STile, Cfg::PRODUCER_THREADS, true>(s_k + slot.stage * STile::BYTES,
                                                                    g_k + index_t(n0) * p.k_row_stride, p.k_row_stride,
                                                                    nk - n0, d);
                load_tile_async<STile, Cfg::PRODUCER_THREADS, true>(s_v + slot.stage * STile::BYTES,
                                                                    g_v + index_t(n0) * p.v_row_stride, p.v_row_stride,
                                                                    nk - n0, dv);
                mbarrier_arrive_after_copies(ring.full(slot.stage));
            }
        }
        cp_async_wait<0>();   // no copy outlives its thread
        return;
    }

    registers_claim<Cfg::CONSUMER_REGS>();
    const int consumer = int(threadIdx.x) / 128 - 1;                       // 0 or 1
    const int group_row0 = consumer * 64;                                  // this warpgroup's queries
    const int warp_row0 = group_row0 + (int(threadIdx.x) / 32 % 4) * 16;   // this warp's
    const int g = (threadIdx.x % 32) / 4;
    const float scale_log2 = p.scale_log2;

    // lse2 and delta of the two rows each thread owns, while the first steps load; every
    // row gets its delta, also one that sees no key (the dk/dv pass multiplies it by p = 0)
    float lse2[2], delta[2];
    row_deltas<T>(p, row0 + warp_row0, nq - m0 - warp_row0, true, delta);
#pragma unroll
    for (int h = 0; h < 2; ++h) lse2[h] = lse_log2(p.lse + row0, warp_row0 + g + 8 * h, nq - m0);

    float acc_dq[1][D_TILES][4];
    fill_zero(acc_dq);
    if (nb_begin < nb_end) mbarrier_wait(ring.resident_full(), 0);
    for (int nb = nb_begin; nb < nb_end; ++nb) {
        const Slot slot{u32(nb - nb_begin)};
        mbarrier_wait(ring.full(slot.stage), slot.parity);
        fence_async_shared();   // the copies (generic proxy) before wgmma's reads (async proxy)
        const u32 k_st = s_k + slot.stage * STile::BYTES, v_st = s_v + slot.stage * STile::BYTES;
        const int n0 = nb * STEP;

        // s = q k^T and dp = dout v^T
        float s[1][S_TILES][4], dp[1][S_TILES][4];
        issue_score_products<T, RTile, STile, HEAD_DIM, STEP>(s, dp, s_q + group_row0 * 128, k_st,
                                                             s_do + group_row0 * 128, v_st);
        wgmma_wait<1>();
        pin_registers(s);

        // p = exp2(s * scale_log2 - lse2), while dp finishes
        path.row_probabilities(s, band, m0, m_end, n0, n0 + STEP, m0 + warp_row0, scale_log2, lse2);
        wgmma_wait<0>();
        pin_registers(dp);

        // ds = p (dp - delta); dq += ds k (scaled at the end)
        path.row_ds(dp, s, delta, lse2, m0 + warp_row0, n0);
        u32 dsa[S_TILES / 2][4];
        to_a_fragments<T>(dsa, dp);
        pin_registers(acc_dq);
        pin_registers(dsa);
        wgmma_fence();
        wgmma_regs_cols<T, STile, HEAD_DIM>(acc_dq[0], dsa, k_st);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(acc_dq);
        mbarrier_arrive(ring.empty(slot.stage));   // this warpgroup's last read of the stage is done
    }

    const float scale = p.scale_log2 / LOG2E;
    Storage* g_dq = static_cast<Storage*>(p.dq) + row0 * p.d;
    store_rows<T>(g_dq, acc_dq, scale, warp_row0, nq - m0, 0, d);
}

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
