// merge.cuh: the attention over the union of disjoint key sets, from the attentions
// over each (cuflash.merge_attention): out = sum_s exp(lse_s - lse) out_s with
// lse = log sum_s exp(lse_s), in float32.
//
// One warp per query row: its lanes find the row's lse from the parts' (rows where
// every part's lse is -inf get out 0, lse -inf), then take the output columns in
// turn. The parts are separate arrays of one shape, contiguous, reached through
// tables of their addresses.
#pragma once

namespace cuflash {

constexpr int MERGE_WARPS = 4;   // rows per block

template <class T>
__global__ void __launch_bounds__(MERGE_WARPS * 32)
merge_attention(const unsigned long long* out_parts, const unsigned long long* lse_parts, int parts, index_t rows,
                int dv, void* out, float* lse) {
    using Storage = typename T::storage;
    const index_t row = index_t(blockIdx.x) * MERGE_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    auto part_lse = [&](int s) { return reinterpret_cast<const float*>(lse_parts[s])[row]; };

    float top = -CUFLASH_INF;
    for (int s = lane; s < parts; s += 32) top = fmaxf(top, part_lse(s));
    top = warp_max(top);
    float sum = 0.f;
    if (top != -CUFLASH_INF)
        for (int s = lane; s < parts; s += 32) sum += expf(part_lse(s) - top);
    sum = warp_sum(sum);
    const float total = top == -CUFLASH_INF ? -CUFLASH_INF : top + logf(sum);

    Storage* dst = static_cast<Storage*>(out) + row * dv;
    for (int c = lane; c < dv; c += 32) {
        float acc = 0.f;
        if (total != -CUFLASH_INF)
            for (int s = 0; s < parts; ++s) {
                const float l = part_lse(s);
                if (l != -CUFLASH_INF)
                    acc += expf(l - total) * Load<T>::one(reinterpret_cast<const Storage*>(out_parts[s]) + row * dv + c);
            }
        Store<T>::one(dst + c, saturate<T>(acc));
    }
    if (lane == 0) lse[row] = total;
}

}  // namespace cuflash
