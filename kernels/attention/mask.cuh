// mask.cuh: the only kernel code that knows which keys a query row may see.
//
// Bottom-right aligned band (FlashAttention-2): with off = nk - nq, row i
// attends key j iff i + off - left <= j <= i + off + right and j < nk.
// Causal is right = 0; "unbounded" sides arrive as nq + nk.
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

}  // namespace cuflash
