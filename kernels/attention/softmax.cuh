// softmax.cuh: online softmax over key blocks (log2 domain).
//
// Each thread owns two rows per 16-row tile (g and g + 8). For each it keeps
// m, the raw score q.k with the largest scaled value seen so far (the max, or
// for a negative scale the min), and l, its share of the running sum of
// p = exp2((score - m) * scale_log2 - P_SHIFT). When m moves, l and the output
// accumulator are rescaled by exp2((m_old - m_new) * scale_log2).
//
// The exponent starts from score - m, which is exact near the top of the row
// (the two are close), so the largest p is exactly 2^-P_SHIFT however large
// the logits; scaling first and subtracting a rounded, scaled max would leave
// that rounding error (thousands, for logits of 1e10) in the exponent. The fast form
// (ROUNDED_BASE, below) does round the scaled max, and carries that error with the row's
// sums, only while it is at most 1/32.
#pragma once

namespace cuflash {

__device__ __forceinline__ bool is_inf(float x) { return fabsf(x) == CUFLASH_INF; }

// Whether a masked score's p comes out 0 by itself: exp2((-inf - m) * scale_log2 - P_SHIFT)
// is exp2(-inf) = 0 for a positive scale in one float. A masked block may then take the
// unmasked probabilities (below), skipping a test and a select per score.
template <class T>
__device__ __forceinline__ bool masked_p_vanish(float scale_log2) {
    return !T::SPLIT_SCALE && scale_log2 > 0.f;
}

// ROUNDED_BASE (probabilities' fast form, 16-bit types): a row's exponents are one FMA
// each, score * scale_log2 - c, against its rounded c = fl(m * scale_log2 + P_SHIFT), in
// place of a subtraction and an FMA. c's rounding error delta is the same for the whole row,
// so it cancels in out = acc / l, and lse (from c) carries it exactly, as long as the
// row's earlier sums are brought over with it too (alpha below); it only shifts p by
// 2^-delta, |delta| <= 1/32 while |c| < 2^20. Past that (logits of millions)
// the warp takes the exact form for the block, whose delta is 0.
// CHAINS: the independent chains in which a thread reduces its share of a row (below); more
// hide the latency of each max and add, at a register apiece.
template <class T, int M_TILES, int CHAINS = 1>
struct OnlineSoftmax {
    static constexpr float P_SHIFT = float(T::P_SHIFT);
    float m[M_TILES][2];
    float l[M_TILES][2];
    float delta[M_TILES][2];   // c - (m * scale_log2 + P_SHIFT) of the row's sums (ROUNDED_BASE; else 0)
    float scale_lo;   // the scale's rest past its float (params.cuh: scale_log2_lo), used where T::SPLIT_SCALE

    __device__ __forceinline__ explicit OnlineSoftmax(float scale_log2_lo) : scale_lo(scale_log2_lo) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) { m[mt][h] = -CUFLASH_INF; l[mt][h] = 0.f; delta[mt][h] = 0.f; }
    }

    // m is infinite only for a row that has seen no key; it then subtracts 0,
    // so that its masked scores give exp2(-inf) = 0 rather than NaN.
    __device__ __forceinline__ static float base_of(float m) { return is_inf(m) ? 0.f : m; }

    // diff * scale_log2 - SHIFT: the exponent of p (SHIFT = P_SHIFT) or of alpha (0)
    template <int SHIFT>
    __device__ __forceinline__ float exponent(float diff, float scale_log2) const {
        return T::SPLIT_SCALE ? fmaf(diff, scale_log2, fmaf(diff, scale_lo, -float(SHIFT)))
                              : fmaf(diff, scale_log2, -float(SHIFT));
    }

    // s: raw scores q.k of one key block; replaced by p. MASKED: s holds -inf
    // where the band excludes a key; those become p = 0 whatever the sign of
    // the scale. An unmasked block has only finite scores and skips that test.
    // alpha: the factor that brings each row's earlier sums to the new m; l is
    // rescaled here, the output accumulator by rescale() (which may wait for
    // products still in flight).
    // Score: float, or double for float32 (common.cuh: dot_sum), whose difference
    // from m is then taken in double and rounded after the subtraction.
    template <bool MASKED, bool ROUNDED_BASE = false, class Score, int N_TILES>
    __device__ __forceinline__ void probabilities(Score (&s)[M_TILES][N_TILES][4], float scale_log2,
                                                  float (&alpha)[M_TILES][2]) {
        static_assert(!ROUNDED_BASE || (!T::SPLIT_SCALE && sizeof(Score) == 4), "the fast form is for 16-bit types");
        // (the fast form's maxima first, for the warp's vote; the exact form's row by row,
        // which keeps fewer registers live)
        float m_new[M_TILES][2];
        bool rounded = false;   // every row of the warp has |c| under the limit
        if constexpr (ROUNDED_BASE) {
            constexpr float LIMIT = 1048576.f;   // 2^20
            bool fits = true;
            new_maxima<MASKED>(s, scale_log2, m_new);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) fits &= fabsf(fmaf(base_of(m_new[mt][h]), scale_log2, P_SHIFT)) < LIMIT;
            rounded = __all_sync(0xffffffffu, fits);
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if constexpr (!ROUNDED_BASE) m_new[mt][h] = new_max<MASKED>(s, mt, h, scale_log2);
                const float m_old = m[mt][h];
                const float base = base_of(m_new[mt][h]);
                const float c = fmaf(base, scale_log2, P_SHIFT);   // (ROUNDED_BASE)
                if constexpr (ROUNDED_BASE) {
                    // alpha = 2^((m_old - m_new) * scale_log2 + delta_old - delta_new)
                    const float delta_new = rounded ? -(fmaf(base, scale_log2, -c) + P_SHIFT) : 0.f;
                    alpha[mt][h] = is_inf(m_old) ? 0.f
                                                 : exp2_p<T>(fmaf(m_old - base, scale_log2, delta[mt][h] - delta_new));
                    delta[mt][h] = delta_new;
                } else {
                    // a row that saw no key before this block has acc = l = 0
                    alpha[mt][h] = is_inf(m_old) ? 0.f : exp2_p<T>(exponent<0>(m_old - base, scale_log2));
                }
                m[mt][h] = m_new[mt][h];
                // (one loop per form: the choice made once per row, not per score)
                const float sum = rounded ? exponentiate<MASKED, true>(s, mt, h, base, c, scale_log2)
                                          : exponentiate<MASKED, false>(s, mt, h, base, c, scale_log2);
                l[mt][h] = l[mt][h] * alpha[mt][h] + sum;
            }
    }

    // p for each score of row (mt, h), in place, and their sum: from score * scale_log2 - c
    // (ROUNDED: the fast form) or from score - base (the exact form).
    template <bool MASKED, bool ROUNDED, class Score, int N_TILES>
    __device__ __forceinline__ float exponentiate(Score (&s)[M_TILES][N_TILES][4], int mt, int h, float base, float c,
                                                  float scale_log2) const {
        constexpr int K = chains(N_TILES);
        float sum[K];
#pragma unroll
        for (int k = 0; k < K; ++k) sum[k] = 0.f;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const Score x = s[mt][nt][2 * h + e];
                const float exp = ROUNDED ? fmaf(float(x), scale_log2, -c)
                                          : exponent<T::P_SHIFT>(float(x - base), scale_log2);
                const float p = exp2_p<T>(exp);
                const float kept = MASKED && x == -CUFLASH_INF ? 0.f : p;
                s[mt][nt][2 * h + e] = kept;
                sum[(2 * nt + e) % K] += kept;
            }
        return fold<K>(sum, [](float a, float b) { return a + b; });
    }

    // Reductions over a thread's share of a row run in CHAINS independent chains, joined at
    // the end: a single chain of 2 * N_TILES maxima or sums waits out each operation's
    // latency, and during a block's softmax each scheduler has only a warp or two to switch to.
    __host__ __device__ static constexpr int chains(int n_tiles) { return 2 * n_tiles < CHAINS ? 2 * n_tiles : CHAINS; }

    // x[0] op x[1] op ... op x[K - 1], pairwise
    template <int K, class Op>
    __device__ __forceinline__ static float fold(float (&x)[K], Op op) {
#pragma unroll
        for (int w = 1; w < K; w *= 2)
#pragma unroll
            for (int k = 0; k + w < K; k += 2 * w) x[k] = op(x[k], x[k + w]);
        return x[0];
    }

    // The thread's share of row (mt, h)'s extreme: its largest score (LARGEST), or its smallest
    // with masked scores left out.
    template <bool MASKED, bool LARGEST, class Score, int N_TILES>
    __device__ __forceinline__ static float thread_top(const Score (&s)[M_TILES][N_TILES][4], int mt, int h) {
        constexpr int K = chains(N_TILES);
        float top[K];
#pragma unroll
        for (int k = 0; k < K; ++k) top[k] = LARGEST ? -CUFLASH_INF : CUFLASH_INF;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float x = float(s[mt][nt][2 * h + e]);
                float& t = top[(2 * nt + e) % K];
                t = LARGEST ? fmaxf(t, x) : fminf(t, MASKED && x == -CUFLASH_INF ? CUFLASH_INF : x);
            }
        return fold<K>(top, [](float a, float b) { return LARGEST ? fmaxf(a, b) : fminf(a, b); });
    }

    // m from the row's old m and its new top (taken across the quad)
    template <bool LARGEST>
    __device__ __forceinline__ static float moved_max(float m_old, float top) {
        return LARGEST ? fmaxf(m_old, top) : m_old == -CUFLASH_INF ? top : fminf(m_old, top);
    }

    // The row's new m: the largest scaled score so far (the max, or for a negative scale the
    // min, masked scores left out).
    template <bool MASKED, class Score, int N_TILES>
    __device__ __forceinline__ float new_max(const Score (&s)[M_TILES][N_TILES][4], int mt, int h,
                                             float scale_log2) const {
        return scale_log2 >= 0.f ? moved_max<true>(m[mt][h], quad_max(thread_top<MASKED, true>(s, mt, h)))
                                 : moved_max<false>(m[mt][h], quad_min(thread_top<MASKED, false>(s, mt, h)));
    }

    // new_max of every row at once, each step of the quad's exchange taken for all rows together
    template <bool MASKED, class Score, int N_TILES>
    __device__ __forceinline__ void new_maxima(const Score (&s)[M_TILES][N_TILES][4], float scale_log2,
                                               float (&m_new)[M_TILES][2]) const {
        if (scale_log2 >= 0.f) rows_max<MASKED, true>(s, m_new);
        else rows_max<MASKED, false>(s, m_new);
    }

    template <bool MASKED, bool LARGEST, class Score, int N_TILES>
    __device__ __forceinline__ void rows_max(const Score (&s)[M_TILES][N_TILES][4], float (&m_new)[M_TILES][2]) const {
        float top[M_TILES][2];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) top[mt][h] = thread_top<MASKED, LARGEST>(s, mt, h);
#pragma unroll
        for (int lanes = 1; lanes <= 2; lanes *= 2) {
            float other[M_TILES][2];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) other[mt][h] = __shfl_xor_sync(0xffffffffu, top[mt][h], lanes);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    top[mt][h] = LARGEST ? fmaxf(top[mt][h], other[mt][h]) : fminf(top[mt][h], other[mt][h]);
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) m_new[mt][h] = moved_max<LARGEST>(m[mt][h], top[mt][h]);
    }

    template <int D_TILES>
    __device__ __forceinline__ static void rescale(float (&acc)[M_TILES][D_TILES][4], const float (&alpha)[M_TILES][2]) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int dt = 0; dt < D_TILES; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][dt][e] *= alpha[mt][e >> 1];
    }

    // Both steps at once, for products that have completed.
    template <bool MASKED, class Score, int N_TILES, int D_TILES>
    __device__ __forceinline__ void update(Score (&s)[M_TILES][N_TILES][4], float (&acc)[M_TILES][D_TILES][4],
                                           float scale_log2) {
        float alpha[M_TILES][2];
        probabilities<MASKED>(s, scale_log2, alpha);
        rescale(acc, alpha);
    }

    // update() for a warp that owns its accumulator alone (no other warp waits on it): the
    // rescale is skipped when no row of the warp moved its max, alpha then being exactly 1
    // (most blocks once the maxima settle, and the rescale is the largest part of a short
    // block's softmax: one multiply per accumulator).
    template <bool MASKED, class Score, int N_TILES, int D_TILES>
    __device__ __forceinline__ void update_warp(Score (&s)[M_TILES][N_TILES][4], float (&acc)[M_TILES][D_TILES][4],
                                                float scale_log2) {
        float alpha[M_TILES][2];
        probabilities<MASKED>(s, scale_log2, alpha);
        if (any_moved(alpha)) rescale(acc, alpha);
    }

    // Whether some row of the warp moved its max (alpha is then not exactly 1).
    __device__ __forceinline__ static bool any_moved(const float (&alpha)[M_TILES][2]) {
        bool moved = false;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) moved |= alpha[mt][0] != 1.f || alpha[mt][1] != 1.f;
        return __any_sync(0xffffffffu, moved);
    }

    // A row's lse, ln(sum exp(scale * score)) = (m * scale_log2 + P_SHIFT + log2 l) * ln 2, from
    // its m and the log2 of its sum l (for the decoding kernel's warps too, from their best m and
    // the sum they rescaled to it); -inf for a row that saw no key (none).
    __device__ __forceinline__ static float lse_from(float m, float scale_log2, float log2_sum, bool none) {
        const float lse2 = fmaf(base_of(m), scale_log2, P_SHIFT) + log2_sum;
        return none ? -CUFLASH_INF : lse2 * 0.69314718055994530942f;
    }

    // A row's lse with a sink of logit sink2 (log2 units; -inf: none), from its m and its sum l:
    // lse2 = log2(2^c l + 2^sink2), c the row's base, taken from the larger term; and inv, the
    // factor 2^(c - lse2) that makes its accumulator out (0 where lse is -inf). finish's SINK form,
    // and the decoding kernel's, whose warps' (m, l) are merged first.
    __device__ __forceinline__ static float lse_with_sink(float m, float sum, float scale_log2, float sink2, float& inv) {
        const float c = fmaf(base_of(m), scale_log2, P_SHIFT);
        const float keys = sum == 0.f ? -CUFLASH_INF : c + log2f(sum);
        const float hi = fmaxf(keys, sink2), lo = fminf(keys, sink2);
        const float lse2 = hi == -CUFLASH_INF ? hi : hi + log2f(1.f + exp2f(lo - hi));
        inv = lse2 == -CUFLASH_INF ? 0.f : exp2f(c - lse2);
        return lse2 * 0.69314718055994530942f;
    }

    // out = acc / l; lse = lse_from(m, log2 l). A row that saw no key gets out = 0 and lse = -inf.
    // APPROX: the hardware's reciprocal and log2 (1 ulp; 2^-22 absolute), a sixth of the
    // instructions of the IEEE forms with their range checks, for 16-bit outputs: a row's sum
    // is then at least 2^-P_SHIFT, a normal float.
    // SINK: the row's sum also counts exp2(sink2), a logit whose value vector is 0 (-inf: none;
    // score_path.cuh); a row that saw no key then gets out = 0 and lse = the sink's logit.
    template <bool APPROX = false, bool SINK = false, int D_TILES>
    __device__ __forceinline__ void finish(float (&acc)[M_TILES][D_TILES][4], float (&lse)[M_TILES][2],
                                           float scale_log2, float sink2 = 0.f) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sum = quad_sum(l[mt][h]);
                if constexpr (SINK) {
                    float inv;
                    lse[mt][h] = lse_with_sink(m[mt][h], sum, scale_log2, sink2, inv);
#pragma unroll
                    for (int dt = 0; dt < D_TILES; ++dt) {
                        acc[mt][dt][2 * h] *= inv;
                        acc[mt][dt][2 * h + 1] *= inv;
                    }
                    continue;
                }
                // sum is 0 only for a row that saw no key; a NaN sum (NaN in the inputs) stays NaN
                const bool none = sum == 0.f;
                float inv, log2_sum;
                if constexpr (APPROX) {
                    float rcp;
                    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rcp) : "f"(sum));
                    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(log2_sum) : "f"(sum));
                    inv = none ? 0.f : rcp;
                } else {
                    inv = none ? 0.f : 1.f / sum;
                    log2_sum = log2f(sum);
                }
                lse[mt][h] = lse_from(m[mt][h], scale_log2, log2_sum, none);
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) {
                    acc[mt][dt][2 * h] *= inv;
                    acc[mt][dt][2 * h + 1] *= inv;
                }
            }
    }
};

}  // namespace cuflash
