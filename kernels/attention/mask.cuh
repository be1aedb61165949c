// mask.cuh: the only kernel code that knows which keys a query row may see.
//
// Bottom-right aligned band (FlashAttention-2): with off = nk - nq, row i
// attends key j iff i + off - left <= j <= i + off + right and j < nk.
// Causal is right = 0; "unbounded" sides arrive as the least that reaches every key
// (left nk, right nq: _params.window_sides), so that row + off + right + 1 fits an int.
#pragma once

namespace cuflash {

struct Band {
    int nk, off, left, right;

    // the band of one sequence (the whole problem when dense): w.nq queries, w.nk keys
    __device__ __forceinline__ Band(const AttnParams& p, const Work& w)
        : nk(w.nk), off(w.nk - w.nq), left(int(p.window_left)), right(int(p.window_right)) {}

    __device__ __forceinline__ bool allows(int row, int col) const {
        return col < nk && col <= row + off + right && col >= row + off - left;
    }
    // Rows [lo, hi) that attend some key in [key_begin, key_end); empty if hi <= lo.
    __device__ __forceinline__ void row_range(int key_begin, int key_end, int nq, int& lo, int& hi) const {
        lo = max(0, key_begin - off - right);
        hi = min(nq, key_end - 1 - off + left + 1);
    }
    // Keys [lo, hi) that some row in [row_begin, row_end) attends; empty if hi <= lo.
    __device__ __forceinline__ void key_range(int row_begin, int row_end, int& lo, int& hi) const {
        lo = max(0, row_begin + off - left);
        hi = min(nk, row_end - 1 + off + right + 1);
    }
    // Whether the block rows [r0, r1) x keys [c0, c1) holds any key some row may not see.
    __device__ __forceinline__ bool cuts(int r0, int r1, int c0, int c1) const {
        return c1 > nk || c1 - 1 > r0 + off + right || c0 < r1 - 1 + off - left;
    }
    // Whether the left edge of some row in [.., r1) lies past key c0 (cuts' last test).
    __device__ __forceinline__ bool cuts_left(int r1, int c0) const { return c0 < r1 - 1 + off - left; }

    // The blocks of BLOCK keys that rows [row_begin, row_end) see: [begin, end).
    template <int BLOCK>
    __device__ __forceinline__ void key_blocks(int row_begin, int row_end, int& begin, int& end) const {
        int lo, hi;
        key_range(row_begin, row_end, lo, hi);
        begin = lo / BLOCK;
        end = hi > lo ? ceil_div(hi, BLOCK) : begin;
    }
    // The blocks of BLOCK query rows (of nq) that keys [key_begin, key_end) are seen by.
    template <int BLOCK>
    __device__ __forceinline__ void query_blocks(int key_begin, int key_end, int nq, int& begin, int& end) const {
        int lo, hi;
        row_range(key_begin, key_end, nq, lo, hi);
        begin = lo / BLOCK;
        end = hi > lo ? ceil_div(hi, BLOCK) : begin;
    }
};

// Writes -inf over the scores a row may not see. s holds the C fragments of
// M_TILES x N_TILES m16n8 tiles; row0/col0 locate the warp's first element.
// KEYS_IN_ROWS: the tile is transposed (rows are keys, columns queries).
template <bool KEYS_IN_ROWS = false, class Score, int M_TILES, int N_TILES>
__device__ __forceinline__ void apply_band(Score (&s)[M_TILES][N_TILES][4], const Band& band, int row0, int col0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + mt * 16 + g + 8 * (e >> 1);
                const int col = col0 + nt * 8 + 2 * t + (e & 1);
                if (!(KEYS_IN_ROWS ? band.allows(col, row) : band.allows(row, col))) s[mt][nt][e] = -CUFLASH_INF;
            }
}

// apply_band by rows: each of a thread's rows gets its keys [lo, hi) once, relative to its
// first column, so that a score takes one compare per edge against a constant of the
// unrolled loop (LEFT false: no row's left edge lies in the block, and that edge is not
// tested). The same result as apply_band in fewer instructions.
template <bool LEFT, class Score, int M_TILES, int N_TILES>
__device__ __forceinline__ void apply_row_bounds(Score (&s)[M_TILES][N_TILES][4], const Band& band, int row0, int col0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int first_col = col0 + 2 * t;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + mt * 16 + g + 8 * h;
            const int hi = min(band.nk, row + band.off + band.right + 1) - first_col;
            const int lo = row + band.off - band.left - first_col;
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    const int c = nt * 8 + (e & 1);
                    if (c >= hi || (LEFT && c < lo)) s[mt][nt][e] = -CUFLASH_INF;
                }
        }
}

// apply_band (not transposed) for a block of rows ending at row_end, by row bounds.
template <class Score, int M_TILES, int N_TILES>
__device__ __forceinline__ void apply_band_rows(Score (&s)[M_TILES][N_TILES][4], const Band& band, int row_end,
                                                int row0, int col0) {
    if (band.cuts_left(row_end, col0)) {
        apply_row_bounds<true>(s, band, row0, col0);
    } else {
        apply_row_bounds<false>(s, band, row0, col0);
    }
}

}  // namespace cuflash
