// block_mask.cuh: what a mask function allows in each tile (cuflash.block_mask). It follows
// the generated code (cuflash._codegen: the preamble and the mask function with its form for a
// flat batch entry, cuflash_mask_mod_entry), so one source serves the GPU and the host
// compiler's tests.
// A tile is EMPTY, PARTIAL or FULL as cuflash.reference.BlockMask says: only elements inside
// (nq, nk) count, so a ragged last tile is full when all of its elements inside are allowed.
// (Joined to the generated code as text, never #included: no include guard.)

// The tiles of a call, all int64 (the host writes them as one array): the batch dims (as many
// as the mask function takes), rows and keys, a tile's rows and keys, tiles down and across.
struct cf_tiling {
    long long batch[CUFLASH_MAX_DIMS];
    long long nq, nk, rows, keys, tiles_m, tiles_n;
};

// BlockMask's kinds: EMPTY (a kernel skips the tile), PARTIAL (it tests each element), FULL
CUFLASH_MOD_FN signed char cf_tile_kind(bool some, bool all) { return all ? 2 : (some ? 1 : 0); }

// Whether some, and whether all, of elements first, first + stride, ... of flat tile `tile`
// (batch dims outermost, then the tile's row, then its column) are allowed.
CUFLASH_MOD_FN void cf_tile_part(const cf_tiling& s, long long tile, long long first, long long stride,
                                 const cuflash_array* arrays, bool* some, bool* all) {
    long long rest = tile;
    const long long n = rest % s.tiles_n;
    rest /= s.tiles_n;
    const long long m = rest % s.tiles_m;
    const long long entry = rest / s.tiles_m;   // the tile's flat batch entry
    const long long q0 = m * s.rows, k0 = n * s.keys;
    const long long rows = cf_imin(s.rows, s.nq - q0), keys = cf_imin(s.keys, s.nk - k0);
    bool any = false, every = true;
    for (long long e = first; e < rows * keys; e += stride) {
        const bool ok = cuflash_mask_mod_entry(entry, s.batch, q0 + e / keys, k0 + e % keys, arrays);
        any = any || ok;
        every = every && ok;
    }
    *some = any;
    *all = every;
}

#if defined(__CUDACC__)
// One block of threads per tile, the grid striding over `tiles` of them; kinds[tile] its kind.
extern "C" __global__ void cuflash_block_mask(const cf_tiling* tiling, const cuflash_array* arrays,
                                              signed char* kinds, long long tiles) {
    const cf_tiling s = *tiling;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        bool some, all;
        cf_tile_part(s, tile, threadIdx.x, blockDim.x, arrays, &some, &all);
        some = __syncthreads_or(some);
        all = __syncthreads_and(all);
        if (threadIdx.x == 0) kinds[tile] = cf_tile_kind(some, all);
    }
}
#endif
