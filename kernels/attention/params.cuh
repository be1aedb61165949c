// params.cuh: what the host passes to a kernel, by value.
//
// Every field is 8 bytes wide (or a pair of 4-byte ones), so the layout has no padding; cuflash/_params.py
// builds the same record as a NumPy structured scalar, field for field, and
// passes its size as CUFLASH_PARAMS_BYTES so a mismatch fails to compile.
#pragma once

namespace cuflash {

constexpr int MAX_BATCH_DIMS = 8;

// The rows [first, first + count) of packed sequence s, its offsets clamped to [0, total]
// and an end before the start read as an empty sequence (schedule.cuh and the kernels agree).
__device__ __forceinline__ void sequence_rows(const int* cu, int s, int total, int& first, int& count) {
    first = min(max(cu[s], 0), total);
    count = min(max(cu[s + 1], first), total) - first;
}

// One thread block's work: `block` of the blocks of rows of one sequence (the whole
// problem when dense) of batch entry `entry`.
struct Work {
    u32 entry;
    int block;
    int q0, k0;   // the sequence's first query and key row (0 when dense)
    int nq, nk;   // its query and key rows
};

// n / d for a divisor known before the launch, by a multiply and a shift: for dividends below
// 2^31 and d >= 2, with l = ceil(log2 d) and m = ceil(2^(31 + l) / d), n / d is
// umulhi(n, m) >> (l - 1). The host packs m | (l - 1) << 32, and 0 for d = 1
// (cuflash/_params.py: fast_divisor). About 3 instructions instead of 20.
__device__ __forceinline__ u32 fast_div(u32 n, index_t magic) {
    const u32 m = u32(magic);
    return m ? __umulhi(n, m) >> u32(magic >> 32) : n;
}

struct AttnParams {
    const void* q;            // (batch..., nq, d)   rows strided, elements contiguous
    const void* k;            // (batch..., nk, d)
    const void* v;            // (batch..., nk, dv)
    void* out;                // (batch, nq, dv)     contiguous
    float* lse;               // (batch, nq)         contiguous, natural log
    // Packed sequences (all three null for one dense problem per batch entry):
    // (S + 1) row offsets along q's and k's axis -2, and this launch's tile list
    // (schedule.cuh), one (sequence, block) per tile, sequence -1 past the last.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    const int2* tiles;
    // Score modifiers (score_path.cuh; null where absent): ALiBi's slope and the sink's logit
    // of each entry of the broadcast batch, float32, contiguous.
    const float* alibi_slopes;
    const float* sinks;
    // an additive bias (bias_batch_stride, bias_row_stride, bias_col_stride; float32 or the
    // inputs' type: bias_float32), and dropout's seed (dropout.cuh), both written per call
    const void* bias;
    unsigned long long dropout_seed;
    // the user score path's arguments (kernels/user/user_scores.cuh), null elsewhere
    const void* user_args;
    index_t q_row_stride, k_row_stride, v_row_stride;   // in elements
    index_t nq, nk, d, dv;    // rows of q and k (of all sequences when packed)
    // Row i attends key j iff i + off - window_left <= j <= i + off + window_right,
    // off = nk - nq. Both are >= 0; "unbounded" arrives as the least that reaches every
    // key, left nk and right nq (_params.window_sides).
    index_t window_left, window_right;
    // softmax scale * log2(e) (exp2 replaces exp) rounded to float, and the float nearest
    // the rest, for float32's two-part multiply (common.cuh: SPLIT_SCALE). Split on the
    // host: a conversion from double in the kernel is redone in loops short of registers.
    float scale_log2, scale_log2_lo;
    // softcap c as c / scale and scale / c (0, 0: none); 1 / scale_log2, and 1 / scale, which
    // brings ALiBi's slopes to raw scores' units (score_path.cuh)
    float cap, cap_inv;
    float unscale, slope_unit;
    // dropout_p as floor(p * 65536), 0: no dropout; 1 / (1 - p)
    u32 dropout_threshold;
    float dropout_scale;
    index_t bias_row_stride, bias_col_stride, bias_float32;
    index_t num_m_blocks;     // query blocks per batch entry
    index_t num_tiles;        // the forward's tiles: blocks of a smaller grid run several in turn
    index_t batch_size;       // entries of the broadcast batch
    index_t grid_group;       // batch entries per group of the grid order (grid_position)
    // Native grouped-query attention in the dk/dv passes: batch entries are then
    // K/V entries, each shared by group_size query entries of the flat batch,
    // group_inner apart there and q_group_stride elements apart in q. Else 1, 1, 0.
    index_t group_size, group_inner, q_group_stride;
    index_t batch_ndim;       // broadcast batch dims, outermost first
    index_t batch_shape[MAX_BATCH_DIMS];
    index_t q_batch_stride[MAX_BATCH_DIMS];   // 0 where q is broadcast
    index_t k_batch_stride[MAX_BATCH_DIMS];
    index_t v_batch_stride[MAX_BATCH_DIMS];
    index_t bias_batch_stride[MAX_BATCH_DIMS];
    // fast_div's constants, for the kernels that divide with FAST_DIV: each batch dim's,
    // batch_size's, grid_group's and grid_group * num_m_blocks' (the forward's grid order)
    index_t batch_div[MAX_BATCH_DIMS];
    index_t entries_div, group_div, grid_div;

    // The batch entry and block (of num_blocks per entry) this thread block runs.
    // Entries go in groups of grid_group, few enough that the blocks running at
    // once share their K and V (or Q and dO) in L2; within a group the blocks
    // with the most keys under a causal mask go first (block num_blocks - 1 when
    // heavy_last), so the light ones fill the end of the grid.
    // FAST_DIV: by fast_div, whose constant grid_div holds for num_m_blocks blocks per
    // entry, so those are the blocks (a forward's), whatever num_blocks says.
    template <bool FAST_DIV = false>
    __device__ __forceinline__ void grid_position(u32 index, u32 num_blocks, bool heavy_last, u32& batch, u32& block) const {
        if constexpr (FAST_DIV) num_blocks = u32(num_m_blocks);
        const u32 group = u32(grid_group), per_group = group * num_blocks;
        if constexpr (FAST_DIV) {
            const u32 g = fast_div(index, grid_div), first = g * group, r = index - g * per_group;
            const u32 size = min(group, u32(batch_size) - first);   // less than group in the last group only
            const u32 rank = size == group ? fast_div(r, group_div) : r / size;
            batch = first + (r - rank * size);
            block = heavy_last ? num_blocks - 1 - rank : rank;
        } else {
            const u32 first = index / per_group * group, r = index % per_group;
            const u32 size = min(group, u32(batch_size) - first);
            const u32 rank = r / size;   // 0: the block with the most work
            batch = first + r % size;
            block = heavy_last ? num_blocks - 1 - rank : rank;
        }
    }

    // The work of tile `index` (blockIdx.x, unless a block runs several); false:
    // nothing (a tile-list entry past the last, and so are all later ones). Dense:
    // from grid_position. Packed: entry index / batch_size of the list (ordered
    // heaviest first by schedule.cuh) for entry index % batch_size, so the entries
    // of one tile run side by side; the sequence's rows are clamped to the arrays,
    // so no offset, however wrong, reaches outside them.
    // PACKED is a template argument so that a dense kernel keeps nq and nk where the
    // parameters are (the constant bank) rather than in registers.
    // GRID_ORDER: dense blocks in grid_position's order; else entry by entry, blocks
    // in order (the portable kernels, whose registers are at the limit).
    // FAST_DIV: the divisions by fast_div (a forward's: num_m_blocks blocks per entry).
    template <bool PACKED, bool GRID_ORDER = true, bool FAST_DIV = false>
    __device__ __forceinline__ bool work_at(u32 index, u32 num_blocks, bool heavy_last, Work& w) const {
        if (!PACKED) {
            u32 block;
            if (GRID_ORDER) {
                grid_position<FAST_DIV>(index, num_blocks, heavy_last, w.entry, block);
            } else {
                w.entry = index / num_blocks;
                block = index % num_blocks;
            }
            w.block = int(block);
            w.q0 = w.k0 = 0;
            w.nq = int(nq);
            w.nk = int(nk);
            return true;
        }
        const u32 entries = u32(batch_size);
        int2 tile;
        if constexpr (FAST_DIV) {
            const u32 list_index = fast_div(index, entries_div);
            tile = tiles[list_index];
            if (tile.x < 0) return false;
            w.entry = index - list_index * entries;
        } else {
            tile = tiles[index / entries];
            if (tile.x < 0) return false;
            w.entry = index % entries;
        }
        w.block = tile.y;
        sequence_rows(cu_seqlens_q, tile.x, int(nq), w.q0, w.nq);
        sequence_rows(cu_seqlens_k, tile.x, int(nk), w.k0, w.nk);
        return true;
    }

    template <bool PACKED, bool GRID_ORDER = true, bool FAST_DIV = false>
    __device__ __forceinline__ bool find_work(u32 num_blocks, bool heavy_last, Work& w) const {
        return work_at<PACKED, GRID_ORDER, FAST_DIV>(blockIdx.x, num_blocks, heavy_last, w);
    }

    // The flat batch index of member `member` of K/V entry e's query group.
    __device__ __forceinline__ u32 group_member(u32 e, int member) const {
        const u32 inner = u32(group_inner);
        return (e / inner) * (inner * u32(group_size)) + e % inner + u32(member) * inner;
    }

    // The element offset of the bias of flat batch index b.
    __device__ __forceinline__ index_t bias_offset(u32 b) const {
        index_t off = 0;
#pragma unroll
        for (int j = 0; j < MAX_BATCH_DIMS; ++j) {
            const int i = MAX_BATCH_DIMS - 1 - j;   // innermost dim first
            if (i < batch_ndim) {
                const u32 n = u32(batch_shape[i]);
                off += (b % n) * bias_batch_stride[i];
                b /= n;
            }
        }
        return off;
    }

    // Element offsets of q, k, v for flat batch index b. The batch count fits
    // in 32 bits (it is at most the grid size), so 32-bit division suffices.
    // FAST_DIV: by fast_div.
    template <bool FAST_DIV = false>
    __device__ __forceinline__ void batch_offsets(u32 b, index_t& oq, index_t& ok, index_t& ov) const {
        oq = ok = ov = 0;
#pragma unroll
        for (int j = 0; j < MAX_BATCH_DIMS; ++j) {
            const int i = MAX_BATCH_DIMS - 1 - j;   // innermost dim first
            if (i < batch_ndim) {
                const u32 n = u32(batch_shape[i]);
                u32 idx;
                if constexpr (FAST_DIV) {
                    const u32 quotient = fast_div(b, batch_div[i]);
                    idx = b - quotient * n;
                    b = quotient;
                } else {
                    idx = b % n;
                    b /= n;
                }
                oq += idx * q_batch_stride[i];
                ok += idx * k_batch_stride[i];
                ov += idx * v_batch_stride[i];
            }
        }
    }
};

// The backward adds its inputs and outputs, all contiguous over the broadcast
// batch: (batch, nq, dv) for out and dout, (batch, nq) for lse and delta,
// (batch, n, d or dv) for the gradients; dk and dv have only the K/V entries when
// the dk/dv pass groups (group_size > 1), else they are summed over broadcast dims afterwards.
struct BwdParams : AttnParams {
    const void* dout;
    float* delta;             // rowsum(dout * out), float32
    void* dq;
    void* dk;
    void* dv_grad;
    float* dbias;             // (batch, nq, nk), float32: dS where the call asks for the bias's gradient
    index_t num_n_blocks;     // key blocks per batch entry
};

#ifdef CUFLASH_PARAMS_BYTES
static_assert(sizeof(AttnParams) == CUFLASH_PARAMS_BYTES, "AttnParams differs from cuflash/_params.py");
static_assert(sizeof(BwdParams) == CUFLASH_BWD_PARAMS_BYTES, "BwdParams differs from cuflash/_params.py");
#endif

}  // namespace cuflash
