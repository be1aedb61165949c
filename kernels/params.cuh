// params.cuh: what the host passes to a kernel, by value.
//
// Every field is 8 bytes wide, so the layout has no padding; cuflash/_params.py
// builds the same record as a NumPy structured scalar, field for field, and
// passes its size as CUFLASH_PARAMS_BYTES so a mismatch fails to compile.
#pragma once

namespace cuflash {

constexpr int MAX_BATCH_DIMS = 8;

struct AttnParams {
    const void* q;            // (batch..., nq, d)   rows strided, elements contiguous
    const void* k;            // (batch..., nk, d)
    const void* v;            // (batch..., nk, dv)
    void* out;                // (batch, nq, dv)     contiguous
    float* lse;               // (batch, nq)         contiguous, natural log
    index_t q_row_stride, k_row_stride, v_row_stride;   // in elements
    index_t nq, nk, d, dv;
    // Row i attends key j iff i + off - window_left <= j <= i + off + window_right,
    // off = nk - nq. Both are >= 0; "unbounded" arrives as nq + nk.
    index_t window_left, window_right;
    double scale_log2;        // softmax scale * log2(e): exp2 replaces exp
    index_t num_m_blocks;     // query blocks per batch entry
    index_t batch_size;       // entries of the broadcast batch
    index_t grid_group;       // batch entries per group of the grid order (grid_position)
    index_t batch_ndim;       // broadcast batch dims, outermost first
    index_t batch_shape[MAX_BATCH_DIMS];
    index_t q_batch_stride[MAX_BATCH_DIMS];   // 0 where q is broadcast
    index_t k_batch_stride[MAX_BATCH_DIMS];
    index_t v_batch_stride[MAX_BATCH_DIMS];

    // The batch entry and block (of num_blocks per entry) this thread block runs.
    // Entries go in groups of grid_group, few enough that the blocks running at
    // once share their K and V (or Q and dO) in L2; within a group the blocks
    // with the most keys under a causal mask go first (block num_blocks - 1 when
    // heavy_last), so the light ones fill the end of the grid.
    __device__ __forceinline__ void grid_position(u32 num_blocks, bool heavy_last, u32& batch, u32& block) const {
        const u32 group = u32(grid_group), per_group = group * num_blocks;
        const u32 first = blockIdx.x / per_group * group, r = blockIdx.x % per_group;
        const u32 size = min(group, u32(batch_size) - first);
        const u32 rank = r / size;   // 0: the block with the most work
        batch = first + r % size;
        block = heavy_last ? num_blocks - 1 - rank : rank;
    }

    // Element offsets of q, k, v for flat batch index b. The batch count fits
    // in 32 bits (it is at most the grid size), so 32-bit division suffices.
    __device__ __forceinline__ void batch_offsets(u32 b, index_t& oq, index_t& ok, index_t& ov) const {
        oq = ok = ov = 0;
#pragma unroll
        for (int j = 0; j < MAX_BATCH_DIMS; ++j) {
            const int i = MAX_BATCH_DIMS - 1 - j;   // innermost dim first
            if (i < batch_ndim) {
                const u32 n = u32(batch_shape[i]);
                const u32 idx = b % n;
                b /= n;
                oq += idx * q_batch_stride[i];
                ok += idx * k_batch_stride[i];
                ov += idx * v_batch_stride[i];
            }
        }
    }
};

// The backward adds its inputs and outputs, all contiguous over the broadcast
// batch: (batch, nq, dv) for out and dout, (batch, nq) for lse and delta,
// (batch, n, d or dv) for the gradients (summed over broadcast dims afterwards).
struct BwdParams : AttnParams {
    const void* dout;
    float* delta;             // rowsum(dout * out), float32
    void* dq;
    void* dk;
    void* dv_grad;
    index_t num_n_blocks;     // key blocks per batch entry
};

#ifdef CUFLASH_PARAMS_BYTES
static_assert(sizeof(AttnParams) == CUFLASH_PARAMS_BYTES, "AttnParams differs from cuflash/_params.py");
static_assert(sizeof(BwdParams) == CUFLASH_BWD_PARAMS_BYTES, "BwdParams differs from cuflash/_params.py");
#endif

}  // namespace cuflash
