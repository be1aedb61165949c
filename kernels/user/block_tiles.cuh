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

// The blocks of rows [r0, r1) of flat batch entry `entry` of the call's batch `shape`
// (CUFLASH_MAX_DIMS words, 0 past its dims): where their kinds lie, looked up once for all the
// keys of a kernel's row of tiles (cf_block_row_tile). No kinds (PARTIAL everywhere) without a
// block mask, and where the rows leave the mask's blocks. The batch and the blocks' indices in
// 32 bits.
struct cf_block_row {
    const signed char* kinds;   // the first block's kind (null: none)
    long long blocks, keys, blocks_n, stride_m, stride_n;   // blocks down; a block's keys; the blocks across
};
CUFLASH_MOD_FN cf_block_row cf_block_mask_row(const cf_block_mask& b, const long long* shape, unsigned entry,
                                              long long r0, long long r1) {
    cf_block_row row = {nullptr, 0, b.keys, b.blocks_n, b.stride_m, b.stride_n};
    if (b.kinds == nullptr) return row;
    const unsigned rows = unsigned(b.rows);
    const long long m_first = unsigned(r0) / rows, m_last = unsigned(r1 - 1) / rows;
    if (r0 < 0 || r1 <= r0 || m_last >= b.blocks_m) return row;
    long long at = 0;
    unsigned rest = entry;
    for (int d = CUFLASH_MAX_DIMS - 1; d >= 0; --d) {
        const unsigned n = unsigned(shape[d]);
        if (n != 0) {
            at += (long long)(rest % n) * b.batch_stride[d];
            rest /= n;
        }
    }
    row.kinds = b.kinds + at + m_first * b.stride_m;
    row.blocks = m_last - m_first + 1;
    return row;
}

// The kind of keys [c0, c1) (not empty, inside the mask's Nk) of those rows: EMPTY (0) when
// every block they touch is, FULL (2) when every one is, else PARTIAL (1), as where there are
// no kinds or the keys leave the mask's blocks (the host checks the shapes; never a read
// outside the kinds).
CUFLASH_MOD_FN int cf_block_row_tile(const cf_block_row& row, long long c0, long long c1) {
    if (row.kinds == nullptr) return 1;
    const unsigned keys = unsigned(row.keys);
    const long long n_first = unsigned(c0) / keys, n_last = unsigned(c1 - 1) / keys;
    if (c0 < 0 || c1 <= c0 || n_last >= row.blocks_n) return 1;
    bool some = false, all = true;
    for (long long m = 0; m < row.blocks; ++m)
        for (long long n = n_first; n <= n_last; ++n) {
            const signed char kind = row.kinds[m * row.stride_m + n * row.stride_n];
            some = some || kind != 0;
            all = all && kind == 2;
        }
    return all ? 2 : (some ? 1 : 0);
}

// The kind of rows [r0, r1) and keys [c0, c1) of flat batch entry `entry`: the two above.
CUFLASH_MOD_FN int cf_block_mask_tile(const cf_block_mask& b, const long long* shape, unsigned entry, long long r0,
                                      long long r1, long long c0, long long c1) {
    return cf_block_row_tile(cf_block_mask_row(b, shape, entry, r0, r1), c0, c1);
}
