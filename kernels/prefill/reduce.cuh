// reduce.cuh: the backward's two small reductions after its passes.
//
// sum_parts: when the query heads that share a K/V head are split in parts (a grouped dk/dv
// pass with too few blocks to fill the GPU otherwise), the pass writes one partial
// dk (and dv) per part: (before, parts, rest) elements. This adds the parts in
// float32 into (before, rest), two neighbouring elements per thread (rest is even:
// a multiple of the padded head dim), in one launch.
// scale_dq_sums: where the Hopper dk/dv pass adds dq up (deterministic=False), it leaves
// float32 sums in its chunks' order; this puts them back in row order, scaled and rounded.
#pragma once

namespace cuflash {

template <class T>
__global__ void __launch_bounds__(256) sum_parts(const void* partial, void* total, index_t before, int parts,
                                                 index_t rest) {
    using Storage = typename T::storage;
    const Storage* in = static_cast<const Storage*>(partial);
    Storage* out = static_cast<Storage*>(total);
    const index_t pairs = before * rest / 2;
    for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs; i += index_t(gridDim.x) * blockDim.x) {
        const index_t e = 2 * i, b = e / rest, r = e % rest;
        const Storage* src = in + b * parts * rest + r;
        float x = 0.f, y = 0.f;
        for (int part = 0; part < parts; ++part, src += rest) {
            x += Load<T>::one(src);
            y += Load<T>::one(src + 1);
        }
        Store<T>::pair(out + e, x, y);
    }
}

// dq = sums * scale in dq's type, from the float32 sums that the Hopper dk/dv pass added
// up (attn_bwd_sm90_ws.cuh: add_dq_chunk), whose every 16 rows hold a warpgroup MMA
// accumulator's order, [column tile of 8][lane][4]: lane l's four are rows l / 4 and
// l / 4 + 8, columns 2 (l % 4) and the next; put back in row order here.
template <class T, int HEAD_DIM>
__global__ void __launch_bounds__(256) scale_dq_sums(const float* sums, void* dq, float scale, index_t pairs) {
    using Storage = typename T::storage;
    Storage* o = static_cast<Storage*>(dq);
    for (index_t i = index_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs; i += index_t(gridDim.x) * blockDim.x) {
        const float2 x = reinterpret_cast<const float2*>(sums)[i];
        const index_t chunk = 2 * i / (16 * HEAD_DIM);
        const int r = int(2 * i % (16 * HEAD_DIM)), column_tile = r / 128, lane = r % 128 / 4, e = r % 4;
        const index_t at = (chunk * 16 + lane / 4 + 8 * (e / 2)) * HEAD_DIM + column_tile * 8 + 2 * (lane % 4);
        Store<T>::pair(o + at, x.x * scale, x.y * scale);
    }
}

}  // namespace cuflash
