// softmax.cuh: online softmax over key blocks (log2 domain).
//
// Each thread owns two rows per 16-row tile (g and g + 8). For each it keeps
// m, the running max of the scaled scores, and l, its share of the running
// sum of exp2(score - m); when m grows, l and the output accumulator are
// rescaled by exp2(m_old - m_new).
#pragma once

namespace cuflash {

template <int M_TILES>
struct OnlineSoftmax {
    float m[M_TILES][2];
    float l[M_TILES][2];

    __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) { m[mt][h] = -CUFLASH_INF; l[mt][h] = 0.f; }
    }

    // s: raw scores q.k of one key block, -inf where masked; replaced by
    // p = exp2(s * scale_log2 - m). The exponent is one fused multiply-add, so
    // it is rounded once, near the row max, however large the logits.
    // acc: the output accumulator, rescaled to the new max.
    template <int N_TILES, int D_TILES>
    __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4], float (&acc)[M_TILES][D_TILES][4],
                                           float scale_log2) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m_new = m[mt][h];
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e)
                        if (s[mt][nt][e] != -CUFLASH_INF) m_new = fmaxf(m_new, s[mt][nt][e] * scale_log2);
                m_new = quad_max(m_new);
                // A row that has seen no key yet keeps m = -inf; subtracting 0
                // then gives p = 0 instead of exp2(-inf + inf) = NaN.
                const float base = m_new == -CUFLASH_INF ? 0.f : m_new;
                const float alpha = exp2f(m[mt][h] - base);
                m[mt][h] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        const float x = s[mt][nt][e];
                        s[mt][nt][e] = x == -CUFLASH_INF ? 0.f : exp2f(fmaf(x, scale_log2, -base));
                        sum += s[mt][nt][e];
                    }
                l[mt][h] = l[mt][h] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) {
                    acc[mt][dt][2 * h] *= alpha;
                    acc[mt][dt][2 * h + 1] *= alpha;
                }
            }
    }

    // out = acc / l; lse = ln(sum exp(scale * score)) = (m + log2 l) * ln 2.
    // A row that saw no key gets out = 0 and lse = -inf.
    template <int D_TILES>
    __device__ __forceinline__ void finish(float (&acc)[M_TILES][D_TILES][4], float (&lse)[M_TILES][2]) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sum = quad_sum(l[mt][h]);
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
                lse[mt][h] = sum > 0.f ? (m[mt][h] + log2f(sum)) * 0.69314718055994530942f : -CUFLASH_INF;
#pragma unroll
                for (int dt = 0; dt < D_TILES; ++dt) {
                    acc[mt][dt][2 * h] *= inv;
                    acc[mt][dt][2 * h + 1] *= inv;
                }
            }
    }
};

}  // namespace cuflash
