// reduce.cuh: the sum of a grouped dk/dv pass's partial results.
//
// When the query heads that share a K/V head are split in parts (a grouped dk/dv
// pass with too few blocks to fill the GPU otherwise), the pass writes one partial
// dk (and dv) per part: (before, parts, rest) elements. This adds the parts in
// float32 into (before, rest), two neighbouring elements per thread (rest is even:
// a multiple of the padded head dim), in one launch.
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

}  // namespace cuflash
