// merge.cuh: the attention over the union of disjoint key sets, from the attentions
// over each (cuflash.merge_attention, and the splits of a decoding call):
// out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s), in float32.
//
// One block per query row. Merging is a handful of dependent loads per part, so the
// parts are spread over the block's warps (warp w takes parts w, w + MergeTiles::WARPS, ...),
// each lane a set of output columns, and the warps' sums meet in shared memory.
#pragma once

namespace cuflash {

struct MergeTiles {
    static constexpr int WARPS = 8;          // per row (the block)
    static constexpr int UNROLL = 2;         // parts a warp loads at once: WARPS * UNROLL per round trip
    static constexpr int COLS_PER_LANE = 4;  // columns a lane holds at once: 128 per pass of a warp
};

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
    float top = -CUFLASH_INF;
    for (int s = lane; s < parts; s += 32) top = fmaxf(top, lse_of(s));
    top = warp_max(top);
    float sum = 0.f;
    if (top != -CUFLASH_INF)
        for (int s = lane; s < parts; s += 32) sum += expf(lse_of(s) - top);
    sum = warp_sum(sum);
    const float total = top == -CUFLASH_INF ? -CUFLASH_INF : top + logf(sum);

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
