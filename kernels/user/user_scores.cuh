// user_scores.cuh: UserScores, the score path of a call's own score and mask functions
// (cuflash.attention's score_mod and mask_mod). Joined as text after the kernels' source and
// the generated functions (cuflash._codegen: the preamble and user_mods_source, which defines
// cuflash_user_score, cuflash_user_dscore, cuflash_user_mask and CUFLASH_USER_MASK); ScorePath calls it where
// Scores::USER (attention/score_path.cuh), beside FullScores' modifiers.
//
// The call's arguments (AttnParams::user_args), one int64 array on the device (cuflash/_user.py):
// the batch's shape in CUFLASH_MAX_DIMS words (its first those the functions take), the block
// mask (cf_block_mask, user/block_tiles.cuh; no kinds without one), then the captured arrays'
// descriptors (cuflash_array), the score function's first (CUFLASH_USER_ARRAYS of them), then,
// for the dq pass of a call with score_mod_grads (GRADS), a float32 gradient per slot of the
// score function's arrays (null where the call does not ask for it).

namespace cuflash {

// BIAS_DROPOUT_: the bias's and dropout's code compiled in (the call has either); GRADS_: the
// gradients of the arrays the score function reads, added by the dq pass (score_mod_grads)
template <bool BIAS_DROPOUT_, bool GRADS_ = false>
struct UserScores {
    static constexpr bool MODIFIED = true;
    static constexpr bool FULL = true;
    static constexpr bool BIAS_DROPOUT = BIAS_DROPOUT_;
    static constexpr bool USER = true;
    static constexpr bool GRADS = GRADS_ && CUFLASH_USER_READS != 0;
    static constexpr bool SCORE = CUFLASH_USER_SCORE != 0;   // whether there is a score function
    static constexpr bool MASK = CUFLASH_USER_MASK != 0;     // whether there is a mask function

    __device__ __forceinline__ static const long long* shape(const void* args) {
        return static_cast<const long long*>(args);
    }
    __device__ __forceinline__ static const cf_block_mask& block_mask(const void* args) {
        return *reinterpret_cast<const cf_block_mask*>(shape(args) + CUFLASH_MAX_DIMS);
    }
    __device__ __forceinline__ static const cuflash_array* arrays(const void* args) {
        return reinterpret_cast<const cuflash_array*>(&block_mask(args) + 1);
    }
    // What the block mask says of rows [r0, r1) and keys [c0, c1) of flat batch entry `entry`:
    // 0 EMPTY, 1 PARTIAL (also without a block mask), 2 FULL
    __device__ __forceinline__ static int tile(const void* args, u32 entry, long long r0, long long r1, long long c0,
                                               long long c1) {
        return cf_block_mask_tile(block_mask(args), shape(args), entry, r0, r1, c0, c1);
    }
    // The same in two steps, for many key ranges of the same rows: the rows' blocks once
    // (row), then each key range's kind (row_tile); a lookup is then a load or two
    __device__ __forceinline__ static cf_block_row row(const void* args, u32 entry, long long r0, long long r1) {
        return cf_block_mask_row(block_mask(args), shape(args), entry, r0, r1);
    }
    __device__ __forceinline__ static int row_tile(const cf_block_row& row, long long c0, long long c1) {
        return cf_block_row_tile(row, c0, c1);
    }
    // The score function of scaled score s, of row i and key j of flat batch entry `entry`
    __device__ __forceinline__ static float score(float s, u32 entry, long long i, long long j, const void* args) {
        return cuflash_user_score(s, entry, shape(args), i, j, arrays(args));
    }
    // The score function's derivative with respect to its score there (the backward's)
    __device__ __forceinline__ static float dscore(float s, u32 entry, long long i, long long j, const void* args) {
        return cuflash_user_dscore(s, entry, shape(args), i, j, arrays(args));
    }
    // The gradients' pointers (GRADS), after the arrays' descriptors
    __device__ __forceinline__ static float* const* grads(const void* args) {
        return reinterpret_cast<float* const*>(arrays(args) + CUFLASH_USER_ARRAYS);
    }
    // Adds ds (the gradient of the score function's result at s) times the derivative of each
    // read of an array whose gradient the call asks for, at the element read
    __device__ __forceinline__ static void score_grads(float s, float ds, u32 entry, long long i, long long j,
                                                       const void* args) {
        cuflash_user_score_grads(s, ds, entry, shape(args), i, j, arrays(args), grads(args));
    }
    // Whether the mask function lets row i see key j
    __device__ __forceinline__ static bool allowed(u32 entry, long long i, long long j, const void* args) {
        return cuflash_user_mask(entry, shape(args), i, j, arrays(args));
    }
};

}  // namespace cuflash
