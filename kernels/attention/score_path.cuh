// score_path.cuh: the one step from a raw score q.k to its probability, forward and
// backward, with the score modifiers. Every kernel takes it from here; mask.cuh alone says
// which keys a row sees.
//
// Modified scores stay in raw units, s' = mod(scale s) / scale, so the softmax's scale_log2
// applies to them as to plain scores (its negative-scale and large-logit forms unchanged):
//   softcap c:  s' = (c / scale) tanh(s scale / c)     (AttnParams: cap = c / scale, cap_inv = scale / c)
//   ALiBi a:    s' = s' - (a / scale) |i + off - j|    (AttnParams: slope_unit = 1 / scale)
// A sink z enters only the forward's row sums (finish), on every score path, so lse counts it
// and the backward's p = exp2(s' scale_log2 - lse2) holds as it is; dsinks is a row sum the
// host takes. A call with sinks alone thus runs the plain kernels.
// The backward's ds is taken with respect to the raw score: softcap's factor 1 - tanh^2
// comes from p itself (scale s' = ln p + lse), so no second copy of the scores is kept.
#pragma once

namespace cuflash {

constexpr float LOG2E = 1.4426950408889634f;

// The score paths, a kernel's template argument: plain scores compile to exactly the
// kernels without modifiers.
struct PlainScores {
    static constexpr bool MODIFIED = false;
};
// softcap and ALiBi, each off at run time (cap 0, no slopes)
struct ModifiedScores {
    static constexpr bool MODIFIED = true;
};

// lse in the log2 domain for p = exp2(scaled score - lse2); a row that sees no
// key (lse = -inf) or lies past nq gets +inf, so its p is 0.
__device__ __forceinline__ float lse_to_log2(float l) { return l == -CUFLASH_INF ? CUFLASH_INF : l * LOG2E; }
__device__ __forceinline__ float lse_log2(const float* lse, int row, int nq) {
    return lse_to_log2(row < nq ? lse[row] : -CUFLASH_INF);
}

// p from a raw score, rounded once in the exponent. MASKED: s is -inf where
// the band excludes the key, and p must be 0 there whatever the scale's sign.
template <class T, bool MASKED>
__device__ __forceinline__ float probability(float s, float scale_log2, float lse2) {
    const float p = exp2_p<T>(fmaf(s, scale_log2, -lse2));
    return MASKED && s == -CUFLASH_INF ? 0.f : p;
}

// tanh and log2: the hardware's one-instruction forms for 16-bit inputs (2^-11 relative,
// below the inputs' rounding), the library's for float32 inputs.
template <class T>
__device__ __forceinline__ float tanh_of(float x) {
    if constexpr (T::SPLIT_SCALE) {
        return tanhf(x);
    } else {
        float y;
        asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
}
template <class T>
__device__ __forceinline__ float log2_of(float x) {
    if constexpr (T::SPLIT_SCALE) {
        return log2f(x);
    } else {
        float y;
        asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
        return y;
    }
}

// The parameters it reads stay in the constant bank (read at each use); it holds only the
// row's ALiBi slope and the band's offset in registers.
// Params: AttnParams, or the decoding kernel's DecodeParams (the same modifier fields).
template <class T, class Scores, class Params = AttnParams>
struct ScorePath {
    static constexpr bool MODIFIED = Scores::MODIFIED;
    const Params& p;
    float slope = 0.f;   // ALiBi's slope in raw units (AttnParams: slope_unit); 0: none
    int off = 0;

    // The path of query batch entry `entry` (the flat index of the broadcast batch).
    __device__ __forceinline__ ScorePath(const Params& p, const Band& band, u32 entry) : p(p) {
        if constexpr (MODIFIED) {
            slope = slope_of(entry);
            off = band.off;
        }
    }
    // The path of rows of several entries (the decoding kernel's), each its own: modify_rows,
    // slope_of and sink2_of.
    __device__ __forceinline__ explicit ScorePath(const Params& p) : p(p) {}

    __device__ __forceinline__ float slope_of(u32 e) const {
        return MODIFIED && p.alibi_slopes ? p.alibi_slopes[e] * p.slope_unit : 0.f;
    }
    // The sink's logit * log2(e) for OnlineSoftmax::finish; -inf: none.
    __device__ __forceinline__ float sink2_of(u32 e) const { return p.sinks ? p.sinks[e] * LOG2E : -CUFLASH_INF; }

    // softmax.finish (APPROX as there) with the sink of query entry `entry` where the call
    // has sinks: a branch per block, after its last key.
    template <bool APPROX, class Softmax, class Acc, class Lse>
    __device__ __forceinline__ void finish(Softmax& softmax, Acc& acc, Lse& lse, float scale_log2, u32 entry) const {
        if (p.sinks) {
            softmax.template finish<APPROX, true>(acc, lse, scale_log2, sink2_of(entry));
        } else {
            softmax.template finish<APPROX>(acc, lse, scale_log2);
        }
    }

    __device__ __forceinline__ bool capped() const { return MODIFIED && p.cap != 0.f; }

    // Raw scores to the scores the softmax sees, in place (before the mask). Fragments as
    // in apply_band: row0/col0 locate the warp's first element; KEYS_IN_ROWS: transposed.
    // softcap switched off is skipped (a uniform branch per tile); ALiBi's term with slope 0 is
    // two adds and an FMA per score (skipping it too spilled the portable D 96 dq pass).
    template <bool KEYS_IN_ROWS = false, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify(Score (&s)[M_TILES][N_TILES][4], int row0, int col0) const {
        if constexpr (MODIFIED) {
            if (capped()) {
                modify_all<KEYS_IN_ROWS, true>(s, row0, col0);
            } else {
                modify_all<KEYS_IN_ROWS, false>(s, row0, col0);
            }
        }
    }

    template <bool KEYS_IN_ROWS, bool CAP, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify_all(Score (&s)[M_TILES][N_TILES][4], int row0, int col0) const {
        const float first = first_offset<KEYS_IN_ROWS>(row0, col0);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = softcapped<CAP>(float(s[mt][nt][e]));
                    const float d = distance<KEYS_IN_ROWS>(first, mt * 16 + 8 * (e >> 1), nt * 8 + (e & 1));
                    s[mt][nt][e] = Score(fmaf(-slope, d, x));
                }
    }

    // modify() for rows of several entries (the decoding kernel's: query heads of one K/V
    // head), rows not transposed: the thread's row (mt, h) with its slope slopes[mt][h] and its
    // query's position against the keys, i + off, at[mt][h]; keys from col0.
    template <class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify_rows(Score (&s)[M_TILES][N_TILES][4], const float (&slopes)[M_TILES][2],
                                                const int (&at)[M_TILES][2], int col0) const {
        if constexpr (MODIFIED) {
            if (capped()) {
                modify_rows_all<true>(s, slopes, at, col0);
            } else {
                modify_rows_all<false>(s, slopes, at, col0);
            }
        }
    }

    template <bool CAP, class Score, int M_TILES, int N_TILES>
    __device__ __forceinline__ void modify_rows_all(Score (&s)[M_TILES][N_TILES][4], const float (&slopes)[M_TILES][2],
                                                    const int (&at)[M_TILES][2], int col0) const {
        const int t = threadIdx.x % 4;
        float first[M_TILES][2];   // i + off - j at the thread's first key, 2t from col0
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) first[mt][h] = float(at[mt][h] - col0 - 2 * t);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = softcapped<CAP>(float(s[mt][nt][e]));
                    const float d = distance<false>(first[mt][e >> 1], 0, nt * 8 + (e & 1));
                    s[mt][nt][e] = Score(fmaf(-slopes[mt][e >> 1], d, x));
                }
    }

    // A raw score softcapped (CAP), before ALiBi's term
    template <bool CAP>
    __device__ __forceinline__ float softcapped(float x) const {
        return CAP ? p.cap * tanh_of<T>(x * p.cap_inv) : x;
    }

    // i + off - j of query i and key j at the thread's first fragment element (row0 + g,
    // col0 + 2t), as a float: the others differ from it by constants, so a distance costs
    // no conversion per score (exact below 2^24 positions).
    template <bool KEYS_IN_ROWS>
    __device__ __forceinline__ float first_offset(int row0, int col0) const {
        const int row = row0 + (threadIdx.x % 32) / 4, col = col0 + 2 * (threadIdx.x % 4);
        return float(KEYS_IN_ROWS ? col + off - row : row + off - col);
    }
    // |i + off - j| of the element `rows` rows and `cols` columns past the first
    template <bool KEYS_IN_ROWS>
    __device__ __forceinline__ static float distance(float first, int rows, int cols) {
        return fabsf(first + float(KEYS_IN_ROWS ? cols - rows : rows - cols));
    }

    // p times the derivative of the modified score by the raw one (CAP: 1 - tanh^2, with
    // tanh from p: scale s' = ln p + lse, plus ALiBi's term back, `dist` its distance); 0
    // where p is.
    template <bool CAP>
    __device__ __forceinline__ float chained(float prob, float lse2, float dist) const {
        if constexpr (!CAP) {
            return prob;
        } else {
            const float capped_score = fmaf(fmaxf(log2_of<T>(prob), -150.f) + lse2, p.unscale, slope * dist);
            const float th = capped_score * p.cap_inv;
            return prob > 0.f ? prob * fmaf(-th, th, 1.f) : 0.f;
        }
    }

    // p^T from s^T in place, 0 where masked: rows are keys (the warp's from key_row0 of
    // [n0, n_end)), columns queries of [m0, m_end) with their lse2 from shared memory
    // (RAW: lse as stored).
    template <bool RAW = false, int S_TILES>
    __device__ __forceinline__ void transposed_probabilities(float (&st)[1][S_TILES][4], const Band& band, int m0,
                                                             int m_end, int n0, int n_end, int key_row0,
                                                             float scale_log2, const float* lse2) const {
        modify<true>(st, key_row0, m0);
        if (band.cuts(m0, m_end, n0, n_end)) {
            apply_band<true>(st, band, key_row0, m0);
            by_col<true, RAW>(st, scale_log2, lse2);
        } else {
            by_col<false, RAW>(st, scale_log2, lse2);
        }
    }

    // p from s in place, 0 where masked: rows are queries (the warp's from row0 of
    // [m0, m_end), the thread's two lse2 in registers), columns keys of [n0, n_end).
    template <int S_TILES>
    __device__ __forceinline__ void row_probabilities(float (&s)[1][S_TILES][4], const Band& band, int m0, int m_end,
                                                      int n0, int n_end, int row0, float scale_log2,
                                                      const float (&lse2)[2]) const {
        modify(s, row0, n0);
        if (band.cuts(m0, m_end, n0, n_end)) {
            apply_band(s, band, row0, n0);
            by_row<true>(s, scale_log2, lse2);
        } else {
            by_row<false>(s, scale_log2, lse2);
        }
    }

    template <bool MASKED, bool RAW, int S_TILES>
    __device__ __forceinline__ static void by_col(float (&s)[1][S_TILES][4], float scale_log2, const float* lse2) {
        const int t = threadIdx.x % 4;
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float l = lse2[nt * 8 + 2 * t + (e & 1)];
                s[0][nt][e] = probability<T, MASKED>(s[0][nt][e], scale_log2, RAW ? lse_to_log2(l) : l);
            }
    }
    template <bool MASKED, int S_TILES>
    __device__ __forceinline__ static void by_row(float (&s)[1][S_TILES][4], float scale_log2, const float (&lse2)[2]) {
#pragma unroll
        for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][nt][e] = probability<T, MASKED>(s[0][nt][e], scale_log2, lse2[e >> 1]);
    }

    // ds = p' (dp - delta) in dp's registers, p' = chained(p). transposed_ds: rows are keys
    // from key_row0, each query column's delta and lse2 (RAW: lse) from shared memory (or
    // taken from there per fragment element), from m0; row_ds: rows are queries from row0,
    // the thread's two deltas and lse2, keys from n0.
    template <bool RAW = false, int S_TILES>
    __device__ __forceinline__ void transposed_ds(float (&dpt)[1][S_TILES][4], const float (&pt)[1][S_TILES][4],
                                                  const float* delta, const float* lse2, int key_row0, int m0) const {
        const int t = threadIdx.x % 4;
        ds_by<true, RAW>(dpt, pt, [&](int nt, int e) { return delta[nt * 8 + 2 * t + (e & 1)]; },
                         [&](int nt, int e) { return lse2[nt * 8 + 2 * t + (e & 1)]; }, key_row0, m0);
    }
    template <int S_TILES>
    __device__ __forceinline__ void transposed_ds(float (&dpt)[1][S_TILES][4], const float (&pt)[1][S_TILES][4],
                                                  const float (&delta)[1][S_TILES][4],
                                                  const float (&lse2)[1][S_TILES][4], int key_row0, int m0) const {
        ds_by<true, false>(dpt, pt, [&](int nt, int e) { return delta[0][nt][e]; },
                           [&](int nt, int e) { return lse2[0][nt][e]; }, key_row0, m0);
    }
    template <int S_TILES>
    __device__ __forceinline__ void row_ds(float (&dp)[1][S_TILES][4], const float (&p)[1][S_TILES][4],
                                           const float (&delta)[2], const float (&lse2)[2], int row0, int n0) const {
        ds_by<false, false>(dp, p, [&](int, int e) { return delta[e >> 1]; }, [&](int, int e) { return lse2[e >> 1]; },
                            row0, n0);
    }

    template <bool KEYS_IN_ROWS, bool RAW, int S_TILES, class Delta, class Lse2>
    __device__ __forceinline__ void ds_by(float (&dp)[1][S_TILES][4], const float (&p)[1][S_TILES][4], Delta delta,
                                          Lse2 lse2, int row0, int col0) const {
        if (capped()) {
            // (row0 through an opaque move: ALiBi's distances are then recomputed here, where
            // the compiler would rather keep modify()'s through the products, in registers)
            int row0_here;
            asm("mov.b32 %0, %1;" : "=r"(row0_here) : "r"(row0));
            const float first = first_offset<KEYS_IN_ROWS>(row0_here, col0);
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float l = lse2(nt, e);
                    const float dist = distance<KEYS_IN_ROWS>(first, 8 * (e >> 1), nt * 8 + (e & 1));
                    dp[0][nt][e] = chained<true>(p[0][nt][e], RAW ? lse_to_log2(l) : l, dist) * (dp[0][nt][e] - delta(nt, e));
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < S_TILES; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[0][nt][e] = p[0][nt][e] * (dp[0][nt][e] - delta(nt, e));
        }
    }
};

}  // namespace cuflash
