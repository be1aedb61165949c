// block_tiles.cuh: what a call's block mask (cuflash.block_mask, passed as attention's
// block_mask) says of a kernel's tile, whose rows and keys need not line up with the mask's
// blocks: EMPTY (0) when every block it touches is, FULL (2) when every one is, else PARTIAL (1).
// It follows _codegen's preamble; host-and-device code, so the host compiler's tests run it.
// (Joined to the generated code as text, never #included: no include guard.)

// A block mask as a call's user_args carry it after the batch shape (cuflash/_user.py,
// block_words): its kinds (null: none), a block's rows and keys, the blocks down and across and
// their strides, and the stride of each of the call's batch dims (0 where the mask broadcasts),
// all in elements of the int8 kinds.
struct cf_block_mask {
    const signed char* kinds;
    long long rows, keys, blocks_m, blocks_n, stride_m, stride_n;
    long long batch_stride[CUFLASH_MAX_DIMS];
};

// The kind of rows [r0, r1) and keys [c0, c1) (not empty, inside the mask's Nq x Nk) of flat
// batch entry `entry` of the call's batch `shape` (CUFLASH_MAX_DIMS words, 0 past its dims).
// PARTIAL without a block mask, and where the range leaves the mask's blocks (the host checks
// the shapes; never a read outside the kinds). The batch and the blocks' indices in 32 bits.
CUFLASH_MOD_FN int cf_block_mask_tile(const cf_block_mask& b, const long long* shape, unsigned entry, long long r0,
                                      long long r1, long long c0, long long c1) {
    if (b.kinds == nullptr) return 1;
    long long at = 0;
    unsigned rest = entry;
    for (int d = CUFLASH_MAX_DIMS - 1; d >= 0; --d) {
        const unsigned n = unsigned(shape[d]);
        if (n != 0) {
            at += (long long)(rest % n) * b.batch_stride[d];
            rest /= n;
        }
    }
    const unsigned rows = unsigned(b.rows), keys = unsigned(b.keys);
    const long long m_first = unsigned(r0) / rows, m_last = unsigned(r1 - 1) / rows;
    const long long n_first = unsigned(c0) / keys, n_last = unsigned(c1 - 1) / keys;
    if (r0 < 0 || c0 < 0 || r1 <= r0 || c1 <= c0 || m_last >= b.blocks_m || n_last >= b.blocks_n) return 1;
    bool some = false, all = true;
    for (long long m = m_first; m <= m_last; ++m)
        for (long long n = n_first; n <= n_last; ++n) {
            const signed char kind = b.kinds[at + m * b.stride_m + n * b.stride_n];
            some = some || kind != 0;
            all = all && kind == 2;
        }
    return all ? 2 : (some ? 1 : 0);
}
