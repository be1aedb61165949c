// merge.cuh: the attention over the union of disjoint key sets, from the attentions
// over each (cuflash.merge_attention, and the splits of a decoding call):
// out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s), in float32.
//
// merge_attention: one block per query row. Merging is a handful of dependent loads per
// part, so the parts are spread over the block's warps (warp w takes parts w,
// w + MergeTiles::WARPS, ...), each lane a set of output columns, and the warps' sums meet
// in shared memory. The splits of a decoding call: merge_rows_by_warp, inside the decoding
// kernel's last block of each row group, one warp per row, two rows at a time; or, launched
// in clusters (Hopper), merge_cluster_parts, shared by the cluster's blocks, from each
// other's shared memory (and with several clusters per row group, the clusters' parts then
// through global memory).
#pragma once

namespace cuflash {

struct MergeTiles {
    static constexpr int WARPS = 8;          // per row (the block)
    static constexpr int UNROLL = 2;         // parts a warp loads at once: WARPS * UNROLL per round trip
    static constexpr int COLS_PER_LANE = 4;  // columns a lane holds at once: 128 per pass of a warp
};

// The logsumexp of ROWS rows' parts, by one warp, each lane's share of the parts a running
// sum rescaled as its top grows: lse_of(s, r) is part s's lse in row r; BATCH loads per lane
// and row go out together (at clamped, valid indices) before any is used.
template <int ROWS, int BATCH, class LseOf>
__device__ __forceinline__ void warp_logsumexp(int parts, LseOf lse_of, float (&total)[ROWS]) {
    const int lane = threadIdx.x % 32;
    float top[ROWS], sum[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) top[r] = -CUFLASH_INF, sum[r] = 0.f;
    for (int s0 = 0; s0 < parts; s0 += 32 * BATCH) {
        float l[ROWS][BATCH];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int u = 0; u < BATCH; ++u) l[r][u] = lse_of(min(s0 + u * 32 + lane, parts - 1), r);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const float x = s0 + u * 32 + lane < parts ? l[r][u] : -CUFLASH_INF;
                const float next = fmaxf(top[r], x);
                sum[r] = (next == -CUFLASH_INF ? 0.f : sum[r] * expf(top[r] - next)) +
                         (x == -CUFLASH_INF ? 0.f : expf(x - next));
                top[r] = next;
            }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float row_top = warp_max(top[r]);
        const float row_sum = warp_sum(row_top == -CUFLASH_INF ? 0.f : sum[r] * expf(top[r] - row_top));
        total[r] = row_top == -CUFLASH_INF ? -CUFLASH_INF : row_top + logf(row_sum);
    }
}

// Row `row` of a merge, by the whole block: part s's lse is lse_of(s), its output column c
// out_of(s, c) (as float); out and lse are the merged arrays, (rows, dv) and (rows).
template <class T, class LseOf, class OutOf>
__device__ __forceinline__ void merge_row(int parts, int dv, index_t row, LseOf lse_of, OutOf out_of, void* out,
                                          float* lse) {
    using Storage = typename T::storage;
    constexpr int PASS = 32 * MergeTiles::COLS_PER_LANE;
    __shared__ float s_sum[MergeTiles::WARPS][PASS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // the row's lse, found by every warp alike (lanes over the parts)
    float totals[1];
    warp_logsumexp<1, 2>(parts, [&](int s, int) { return lse_of(s); }, totals);
    const float total = totals[0];

    Storage* dst = static_cast<Storage*>(out) + row * dv;
    for (int c0 = 0; c0 < dv; c0 += PASS) {
        float acc[MergeTiles::COLS_PER_LANE] = {};
        if (total != -CUFLASH_INF)
#pragma unroll (MergeTiles::UNROLL)
            for (int s = warp; s < parts; s += MergeTiles::WARPS) {
                const float l = lse_of(s);   // (a part without keys adds nothing, whatever its out holds)
                const bool seen = l != -CUFLASH_INF;
                const float weight = seen ? expf(l - total) : 0.f;
#pragma unroll
                for (int j = 0; j < MergeTiles::COLS_PER_LANE; ++j) {
                    const int c = c0 + j * 32 + lane;
                    const float o = c < dv ? out_of(s, c) : 0.f;
                    if (seen) acc[j] += weight * o;
                }
            }
#pragma unroll
        for (int j = 0; j < MergeTiles::COLS_PER_LANE; ++j) s_sum[warp][j * 32 + lane] = acc[j];
        __syncthreads();
        for (int i = threadIdx.x; i < PASS && c0 + i < dv; i += blockDim.x) {
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < MergeTiles::WARPS; ++w) o += s_sum[w][i];
            Store<T>::one(dst + c0 + i, saturate<T>(o));
        }
        __syncthreads();   // s_sum is free for the next pass
    }
    if (threadIdx.x == 0) lse[row] = total;
}

// Rows [first, first + count) of a merge, one warp per row (warp w of WARPS takes rows
// first + w, first + w + WARPS, ..., two at a time): for the block of a split decoding call that merges
// its rows' float32 partials. Part s of row `row` has lse lse_of(s, row) and dv float
// outputs from row_of(s, row) on, on 16-byte boundaries (dv a multiple of 4, at most
// HEAD_DIM), all of them written (a part without keys: lse -inf, out 0). Lanes take float4
// columns, and where a row has fewer than 32 of them, several parts at once, summed by
// shuffles at the end. The loads of a batch of parts go out together, at clamped (valid)
// addresses, before any is used: a part's weight waits on its lse, and a load behind that
// test would wait a round trip to L2 per part. Loads go to L2 (ld.global.cg): the parts
// were written by other blocks of the same grid.
template <class T, int HEAD_DIM, int WARPS, class LseOf, class RowOf>
__device__ __forceinline__ void merge_rows_by_warp(int parts, int dv, index_t first, int count, LseOf lse_of,
                                                   RowOf row_of, void* out, float* lse) {
    using Storage = typename T::storage;
    constexpr int CHUNKS = HEAD_DIM / 4;                     // float4 columns of the widest row
    constexpr int COL_LANES = CHUNKS < 32 ? CHUNKS : 32;     // lanes over a row's columns
    constexpr int PART_LANES = 32 / COL_LANES;               // parts a warp reads at once
    constexpr int COL_ITERS = CHUNKS / COL_LANES;
    constexpr int BATCH = COL_ITERS >= 8 ? 1 : 8 / COL_ITERS;   // parts per lane and row in flight at once
    constexpr int LSE_BATCH = 4;                                 // lse per lane and row in flight at once
    constexpr int PAIR = 2;   // rows a warp merges at once, warps * PAIR apart, their loads side by side
    const int lane = threadIdx.x % 32, col = lane % COL_LANES, slot = lane / COL_LANES;
    const int last_chunk = dv / 4 - 1;
    for (int i0 = threadIdx.x / 32; i0 < count; i0 += WARPS * PAIR) {
        index_t row[PAIR];
        bool live[PAIR];
#pragma unroll
        for (int r = 0; r < PAIR; ++r) {   // (a row past the last repeats it and is not stored)
            live[r] = i0 + r * WARPS < count;
            row[r] = first + min(i0 + r * WARPS, count - 1);
        }
        float total[PAIR];   // each row's lse over the parts
        warp_logsumexp<PAIR, LSE_BATCH>(parts, [&](int s, int r) { return lse_of(s, row[r]); }, total);

        float4 acc[PAIR][COL_ITERS];
#pragma unroll
        for (int r = 0; r < PAIR; ++r)
#pragma unroll
            for (int j = 0; j < COL_ITERS; ++j) acc[r][j] = make_float4(0.f, 0.f, 0.f, 0.f);
        bool any = false;
#pragma unroll
        for (int r = 0; r < PAIR; ++r) any |= total[r] != -CUFLASH_INF;
        if (any)
            for (int s0 = slot; s0 < parts; s0 += PART_LANES * BATCH) {
                float l[PAIR][BATCH];
                float4 o[PAIR][BATCH][COL_ITERS];
#pragma unroll
                for (int r = 0; r < PAIR; ++r)
#pragma unroll
                    for (int u = 0; u < BATCH; ++u) {
                        const int s = min(s0 + u * PART_LANES, parts - 1);
                        l[r][u] = lse_of(s, row[r]);
                        const float4* src = reinterpret_cast<const float4*>(row_of(s, row[r]));
#pragma unroll
                        for (int j = 0; j < COL_ITERS; ++j) o[r][u][j] = __ldcg(src + min(col + j * COL_LANES, last_chunk));
                    }
#pragma unroll
                for (int r = 0; r < PAIR; ++r)
#pragma unroll
                    for (int u = 0; u < BATCH; ++u) {
                        // (a part without keys adds nothing, whatever its out holds; nor does any to a row without keys)
                        const bool seen = s0 + u * PART_LANES < parts && l[r][u] != -CUFLASH_INF &&
                                          total[r] != -CUFLASH_INF;
                        const float weight = expf(l[r][u] - total[r]);
#pragma unroll
                        for (int j = 0; j < COL_ITERS; ++j) {
                            float4& a = acc[r][j];
                            const float4 x = o[r][u][j];
                            a.x = seen ? fmaf(weight, x.x, a.x) : a.x;
                            a.y = seen ? fmaf(weight, x.y, a.y) : a.y;
                            a.z = seen ? fmaf(weight, x.z, a.z) : a.z;
                            a.w = seen ? fmaf(weight, x.w, a.w) : a.w;
                        }
                    }
            }
#pragma unroll
        for (int r = 0; r < PAIR; ++r) {
#pragma unroll
            for (int j = 0; j < COL_ITERS; ++j) {
                float4& a = acc[r][j];
#pragma unroll
                for (int o = COL_LANES; o < 32; o *= 2) {
                    a.x += __shfl_xor_sync(0xffffffffu, a.x, o);
                    a.y += __shfl_xor_sync(0xffffffffu, a.y, o);
                    a.z += __shfl_xor_sync(0xffffffffu, a.z, o);
                    a.w += __shfl_xor_sync(0xffffffffu, a.w, o);
                }
                const int c = 4 * (col + j * COL_LANES);
                if (live[r] && slot == 0 && c < dv) {
                    Storage* dst = static_cast<Storage*>(out) + row[r] * dv + c;
                    Store<T>::pair(dst, saturate<T>(a.x), saturate<T>(a.y));
                    Store<T>::pair(dst + 2, saturate<T>(a.z), saturate<T>(a.w));
                }
            }
            if (live[r] && lane == 0) lse[row[r]] = total[r];
        }
    }
}

// A running merge of one float4 column chunk over parts: the largest lse seen (top), the
// sum of exp(lse - top) and the outputs so weighted.
struct ChunkMerge {
    float top = -CUFLASH_INF, sum = 0.f;   // (fmaxf passes NaN over: a NaN part's exp below keeps it)
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);

    // Folds in parts [first, first + count), count <= BATCH: their lse_of(s) and out_of(s)
    // loads go out at once, before any is used (one round trip). ONLY: the one fold of a
    // merge, with nothing to rescale.
    template <int BATCH, bool ONLY = false, class LseOf, class OutOf>
    __device__ __forceinline__ void fold(int first, int count, LseOf lse_of, OutOf out_of) {
        float l[BATCH];
        float4 o[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u)
            if (u < count) l[u] = lse_of(first + u), o[u] = out_of(first + u);
        float next = top;
#pragma unroll
        for (int u = 0; u < BATCH; ++u)
            if (u < count) next = fmaxf(next, l[u]);
        if (!ONLY && next != top) {   // (the first fold: the running sums are 0 and stay so)
            const float rescale = expf(top - next);
            sum *= rescale, acc.x *= rescale, acc.y *= rescale, acc.z *= rescale, acc.w *= rescale;
        }
        top = next;
#pragma unroll
        for (int u = 0; u < BATCH; ++u)
            if (u < count && l[u] != -CUFLASH_INF) {   // (a part without keys adds nothing)
                const float w = expf(l[u] - top);
                sum += w;
                acc.x = fmaf(w, o[u].x, acc.x), acc.y = fmaf(w, o[u].y, acc.y);
                acc.z = fmaf(w, o[u].z, acc.z), acc.w = fmaf(w, o[u].w, acc.w);
            }
    }

    // The merged chunk, and returns the merged lse (NaN with a NaN part).
    __device__ __forceinline__ float result(float4& out) const {
        const float inv = sum == 0.f ? 0.f : 1.f / sum;
        out = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
        return sum == 0.f ? -CUFLASH_INF : top + logf(sum);
    }
};

// One float4 column chunk of a merge over `parts` parts, BATCH at a time (one round trip
// each): out = the merged chunk, returns the merged lse.
template <int BATCH, class LseOf, class OutOf>
__device__ __forceinline__ float merge_chunk(int parts, LseOf lse_of, OutOf out_of, float4& out) {
    ChunkMerge m;
    for (int s0 = 0; s0 < parts; s0 += BATCH) m.fold<BATCH>(s0, min(BATCH, parts - s0), lse_of, out_of);
    return m.result(out);
}

// f(r, c) for the float4 column chunks c < dv of a cluster's `rows` rows, over the threads
// of its blocks. BY_ROWS: the block of rank k takes rows k, k + ranks, ... (the same rows in
// every cluster of a row group, for the second level of a two-level merge); else the chunks
// are dealt out in order, thread by thread and block by block.
template <int HEAD_DIM, bool BY_ROWS, class F>
__device__ __forceinline__ void for_cluster_chunks(int rows, int dv, int rank, int ranks, F f) {
    constexpr int CHUNKS = HEAD_DIM / 4;
    if constexpr (BY_ROWS) {
        const int mine = rank < rows ? (rows - rank + ranks - 1) / ranks : 0;
        for (int i = int(threadIdx.x); i < mine * CHUNKS; i += int(blockDim.x)) {
            const int r = rank + (i / CHUNKS) * ranks, c = 4 * (i % CHUNKS);
            if (c < dv) f(r, c);
        }
    } else {
        for (int i = rank * int(blockDim.x) + int(threadIdx.x); i < rows * CHUNKS; i += ranks * int(blockDim.x)) {
            const int r = i / CHUNKS, c = 4 * (i % CHUNKS);
            if (c < dv) f(r, c);
        }
    }
}

// The splits of a decoding call launched in clusters of its splits, one per block (Hopper):
// each block has left its rows' part in its own shared memory, out at s_out ([row][HEAD_DIM]
// floats, columns to HEAD_DIM written) and lse at s_lse ([row]). After the cluster's barrier
// the blocks merge the rows (for_cluster_chunks<BY_ROWS>), each thread a float4 column chunk,
// all its parts' lse and outputs read from the peers at once: one round trip on chip, where
// the global merge waits for the partials' writes, a fence, a count and two round trips to
// L2. Each merged chunk goes to store(r, c, out, lse).
template <int HEAD_DIM, int MAX_PARTS, bool BY_ROWS, class Store>
__device__ __forceinline__ void merge_cluster_parts(int rows, int dv, u32 s_out, u32 s_lse, Store store) {
    const int parts = cluster_blocks(), rank = cluster_rank();
    cluster_sync();
    for_cluster_chunks<HEAD_DIM, BY_ROWS>(rows, dv, rank, parts, [&](int r, int c) {
        ChunkMerge m;   // (all parts in one fold: parts <= MAX_PARTS)
        m.fold<MAX_PARTS, true>(0, parts, [&](int s) { return load_peer(peer_smem(s_lse + 4 * r, s)); },
                                [&](int s) { return load_peer4(peer_smem(s_out + 4 * (r * HEAD_DIM + c), s)); });
        float4 o;
        const float l = m.result(o);
        store(r, c, o, l);
    });
    cluster_sync();   // a block's shared memory stays until every peer has read it
}

// Whether this block is the last of `count` to count itself at `counter`: its writes are
// made visible everywhere first, and the last sees the others' after. atomicInc wraps the
// count to 0 at `count`, which leaves the counter ready for the next call.
__device__ __forceinline__ bool last_to_count(unsigned* counter, int count) {
    __shared__ bool s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicInc(counter, unsigned(count - 1)) == unsigned(count - 1);
    __syncthreads();
    if (s_last) __threadfence();
    return s_last;
}

// The parts are separate arrays of one shape, contiguous, reached through tables of
// their addresses.
template <class T>
__global__ void __launch_bounds__(MergeTiles::WARPS * 32)
merge_attention(const unsigned long long* out_parts, const unsigned long long* lse_parts, int parts, index_t rows,
                int dv, void* out, float* lse) {
    using Storage = typename T::storage;
    const index_t row = blockIdx.x;
    merge_row<T>(parts, dv, row, [&](int s) { return reinterpret_cast<const float*>(lse_parts[s])[row]; },
                 [&](int s, int c) {
                     return Load<T>::one(reinterpret_cast<const Storage*>(out_parts[s]) + row * dv + c);
                 }, out, lse);
}

}  // namespace cuflash
