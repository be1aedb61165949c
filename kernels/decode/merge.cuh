// merge.cuh: the attention over the union of disjoint key sets, from the attentions
// over each (cuflash.merge_attention): out = sum_s exp(lse_s - lse) out_s with
// lse = log sum_s exp(lse_s), in float32.
//
// One warp per query row: its lanes find the row's lse from the parts' (rows where
// every part's lse is -inf get out 0, lse -inf), then take the output columns in
// turn.
#pragma once

namespace cuflash {

constexpr int MERGE_WARPS = 4;   // rows per block

// Row `row` of a merge, by one warp: part s's lse is lse_of(s), its output column c
// out_of(s, c) (as float); out and lse are the merged arrays, (rows, dv) and (rows).
template <class T, class LseOf, class OutOf>
__device__ __forceinline__ void merge_row(int parts, int dv, index_t row, LseOf lse_of, OutOf out_of, void* out,
                                          float* lse) {
    using Storage = typename T::storage;
    const int lane = threadIdx.x % 32;
    float top = -CUFLASH_INF;
    for (int s = lane; s < parts; s += 32) top = fmaxf(top, lse_of(s));
    top = warp_max(top);
    float sum = 0.f;
    if (top != -CUFLASH_INF)
        for (int s = lane; s < parts; s += 32) sum += expf(lse_of(s) - top);
    sum = warp_sum(sum);
    const float total = top == -CUFLASH_INF ? -CUFLASH_INF : top + logf(sum);

    Storage* dst = static_cast<Storage*>(out) + row * dv;
    for (int c = lane; c < dv; c += 32) {
        float acc = 0.f;
        if (total != -CUFLASH_INF)
            for (int s = 0; s < parts; ++s) {
                const float l = lse_of(s);
                if (l != -CUFLASH_INF) acc += expf(l - total) * out_of(s, c);
            }
        Store<T>::one(dst + c, saturate<T>(acc));
    }
    if (lane == 0) lse[row] = total;
}

// The parts are separate arrays of one shape, contiguous, reached through tables of
// their addresses.
template <class T>
__global__ void __launch_bounds__(MERGE_WARPS * 32)
merge_attention(const unsigned long long* out_parts, const unsigned long long* lse_parts, int parts, index_t rows,
                int dv, void* out, float* lse) {
    using Storage = typename T::storage;
    const index_t row = index_t(blockIdx.x) * MERGE_WARPS + threadIdx.x / 32;
    if (row >= rows) return;
    merge_row<T>(parts, dv, row, [&](int s) { return reinterpret_cast<const float*>(lse_parts[s])[row]; },
                 [&](int s, int c) {
                     return Load<T>::one(reinterpret_cast<const Storage*>(out_parts[s]) + row * dv + c);
                 }, out, lse);
}

}  // namespace cuflash
