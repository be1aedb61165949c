// mma.cuh: tensor-core fragments (mma.sync m16n8k16, fp32 accumulate) and
// the loads that fill them from shared-memory tiles.
//
// Fragment layout, with g = lane / 4 and t = lane % 4 (PTX ISA, m16n8k16):
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B (16 x 8, "col"):      b0 = (k 2t..2t+1, n g)   b1 = (k 2t+8..2t+9, n g)
//   C (16 x 8, fp32):       c0,c1 = (g, 2t..2t+1)   c2,c3 = (g+8, 2t..2t+1)
#pragma once

namespace cuflash {

// Register fragments. 16-bit types hold two elements per register, as the
// tensor cores take them; float32 holds the same elements as plain floats.
template <class T> struct FragA { u32 r[4]; };
template <class T> struct FragB { u32 r[2]; };
template <> struct FragA<f32> { float r[8]; };   // (a0.x, a0.y, a1.x, a1.y, a2.x, ...)
template <> struct FragB<f32> { float r[4]; };   // (b0.x, b0.y, b1.x, b1.y)

__device__ __forceinline__ void mma_16816(float (&c)[4], const FragA<f16>& a, const FragB<f16>& b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}
__device__ __forceinline__ void mma_16816(float (&c)[4], const FragA<bf16>& a, const FragB<bf16>& b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}
__device__ __forceinline__ float fma_sum(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_sum(double a, double b, double c) { return fma(a, b, c); }

// The same 16x8x16 product for float32, on the FMA units: each thread gathers
// the A row parts and B column parts it needs from the lanes that hold them.
// Tensor cores accumulate with less than float32 rounding; this keeps float32
// inputs at least as accurate as a float32 GEMM. The 16 products go to a fresh
// partial sum of type Acc that is then added to c. Dot products over the head
// dim (mma_rows_rows: the scores, and dout v^T in the backward) sum in double,
// where products of floats are exact (common.cuh: dot_sum). Products with P sum
// in float, in 16-term partials (one FMA chain over 128 terms rounds 2-3x worse).
template <class Acc>
__device__ __forceinline__ void mma_16816(Acc (&c)[4], const FragA<f32>& a, const FragB<f32>& b) {
    const int lane = threadIdx.x % 32, quad = lane & ~3, t = lane & 3;
    Acc part[4] = {Acc(0), Acc(0), Acc(0), Acc(0)};
#pragma unroll
    for (int src = 0; src < 4; ++src) {   // the quad lane holding k = 2src, 2src+1, 2src+8, 2src+9
        float a_g[4], a_g8[4];            // A rows g and g+8 at those k
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int x = (i & 1) + 4 * (i >> 1);   // a0.x a0.y a2.x a2.y (row g), +2 for row g+8
            a_g[i] = __shfl_sync(0xffffffffu, a.r[x], quad | src);
            a_g8[i] = __shfl_sync(0xffffffffu, a.r[x + 2], quad | src);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {     // output column 2t + j is B column n = 2t + j, held by lanes 4n..4n+3
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const Acc bk = __shfl_sync(0xffffffffu, b.r[i], 4 * (2 * t + j) + src);
                part[j] = fma_sum(Acc(a_g[i]), bk, part[j]);
                part[2 + j] = fma_sum(Acc(a_g8[i]), bk, part[2 + j]);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] += part[e];
}

template <class T, class Acc>
__device__ __forceinline__ void mma(Acc (&c)[4], const FragA<T>& a, const FragB<T>& b) { mma_16816(c, a, b); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ float2 lds_float2(u32 addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ float lds_float(u32 addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
    return v;
}

// Operand loads. 16-bit tiles use ldmatrix; float32 tiles are read as floats.
//   load_a:         A = tile[row0 .. row0+16, col0 .. col0+16]
//   load_b_rows:    two B fragments for n = row0 .. row0+16 in steps of 8, k = col0 .. col0+16,
//                   where B[k][n] = tile[n][k] (the tile holds B transposed: K for Q K^T)
//   load_b_cols:    two B fragments for n = col0 .. col0+16 in steps of 8, k = row0 .. row0+16,
//                   where B[k][n] = tile[k][n] (V for P V)
template <class T, class Tile> struct Operands {
    __device__ __forceinline__ static void load_a(FragA<T>& a, u32 s_tile, int row0, int col0) {
        const int lane = threadIdx.x % 32;
        ldmatrix_x4(a.r, s_tile + Tile::offset(row0 + (lane & 15), col0 + (lane >> 4) * 8));
    }
    __device__ __forceinline__ static void load_b_rows(FragB<T> (&b)[2], u32 s_tile, int row0, int col0) {
        const int lane = threadIdx.x % 32, mi = lane >> 3;
        u32 r[4];
        ldmatrix_x4(r, s_tile + Tile::offset(row0 + (lane & 7) + (mi >> 1) * 8, col0 + (mi & 1) * 8));
        b[0].r[0] = r[0]; b[0].r[1] = r[1];
        b[1].r[0] = r[2]; b[1].r[1] = r[3];
    }
    __device__ __forceinline__ static void load_b_cols(FragB<T> (&b)[2], u32 s_tile, int row0, int col0) {
        const int lane = threadIdx.x % 32, mi = lane >> 3;
        u32 r[4];
        ldmatrix_x4_trans(r, s_tile + Tile::offset(row0 + (lane & 7) + (mi & 1) * 8, col0 + (mi >> 1) * 8));
        b[0].r[0] = r[0]; b[0].r[1] = r[1];
        b[1].r[0] = r[2]; b[1].r[1] = r[3];
    }
};

template <class Tile> struct Operands<f32, Tile> {
    __device__ __forceinline__ static void load_a(FragA<f32>& a, u32 s_tile, int row0, int col0) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int i = 0; i < 4; ++i) {   // a_i: row g + 8 (i & 1), cols 2t + 8 (i >> 1)
            const float2 x = lds_float2(s_tile + Tile::offset(row0 + g + 8 * (i & 1), col0 + 2 * t + 8 * (i >> 1)));
            a.r[2 * i] = x.x;
            a.r[2 * i + 1] = x.y;
        }
    }
    __device__ __forceinline__ static void load_b_rows(FragB<f32> (&b)[2], u32 s_tile, int row0, int col0) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 2; ++i) {   // b_i: k = 2t + 8i and the next, n = g
                const float2 x = lds_float2(s_tile + Tile::offset(row0 + 8 * n + g, col0 + 2 * t + 8 * i));
                b[n].r[2 * i] = x.x;
                b[n].r[2 * i + 1] = x.y;
            }
    }
    __device__ __forceinline__ static void load_b_cols(FragB<f32> (&b)[2], u32 s_tile, int row0, int col0) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int i = 0; i < 2; ++i) {   // b_i: k = 2t + 8i and the next, n = g
                const int k = row0 + 2 * t + 8 * i, col = col0 + 8 * n + g;
                b[n].r[2 * i] = lds_float(s_tile + Tile::offset(k, col));
                b[n].r[2 * i + 1] = lds_float(s_tile + Tile::offset(k + 1, col));
            }
    }
};

// The A fragment of P for keys 16j .. 16j+15 from the score accumulators of
// n-tiles 2j and 2j+1 (C layout of two m16n8 tiles = A layout of one m16k16).
template <class T>
__device__ __forceinline__ void scores_to_a(FragA<T>& a, const float (&c0)[4], const float (&c1)[4]) {
    a.r[0] = pack2<T>(c0[0], c0[1]);
    a.r[1] = pack2<T>(c0[2], c0[3]);
    a.r[2] = pack2<T>(c1[0], c1[1]);
    a.r[3] = pack2<T>(c1[2], c1[3]);
}
// P: float, or double where the forward keeps float32 scores (common.cuh: dot_sum)
template <class P>
__device__ __forceinline__ void scores_to_a_f32(FragA<f32>& a, const P (&c0)[4], const P (&c1)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        a.r[e] = float(c0[e]);
        a.r[4 + e] = float(c1[e]);
    }
}
__device__ __forceinline__ void scores_to_a(FragA<f32>& a, const float (&c0)[4], const float (&c1)[4]) {
    scores_to_a_f32(a, c0, c1);
}
__device__ __forceinline__ void scores_to_a(FragA<f32>& a, const double (&c0)[4], const double (&c1)[4]) {
    scores_to_a_f32(a, c0, c1);
}

// Warp-level tile products; every score and gradient product of the kernels is one of these.
//
// acc[mt][nt] += A[a_row0 + 16 mt + (0..16), 0..K) . B[8 nt + (0..8), 0..K)^T
// with A and B both stored one row per output row/column (Q and K for Q K^T).
// UNROLL: how far the loop over K unrolls (unrolled loops let the compiler hoist
// fragment loads, which costs registers that a large warp tile may not have).
// Sums in T::dot_sum (double for float32, common.cuh) and rounds once to acc's type.
template <class T, class ATile, class BTile, int K, int UNROLL = T::K_UNROLL, class Acc, int M_TILES, int N_TILES>
__device__ __forceinline__ void mma_rows_rows(Acc (&acc)[M_TILES][N_TILES][4], u32 s_a, int a_row0, u32 s_b) {
    typename T::dot_sum sums[M_TILES][N_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sums[mt][nt][e] = acc[mt][nt][e];
#pragma unroll UNROLL
    for (int k0 = 0; k0 < K; k0 += 16) {
        FragA<T> a[M_TILES];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) Operands<T, ATile>::load_a(a[mt], s_a, a_row0 + mt * 16, k0);
#pragma unroll
        for (int n = 0; n < N_TILES / 2; ++n) {
            FragB<T> b[2];
            Operands<T, BTile>::load_b_rows(b, s_b, n * 16, k0);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma(sums[mt][2 * n], a[mt], b[0]);
                mma(sums[mt][2 * n + 1], a[mt], b[1]);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = Acc(sums[mt][nt][e]);
}

// acc[mt][nt] += P[mt] . B[0 .. 8 K_TILES, col0 + 8 nt + (0..8))
// with P in registers (C fragments of K_TILES 8-wide tiles) and B stored row-major (V for P V).
// Op: each element of P as the product takes it, op(mt, kt, e, x) (SameScores: as it is;
// score_path.cuh's dropout: kept or 0).
struct SameScores {
    template <class P>
    __device__ __forceinline__ P operator()(int, int, int, P x) const { return x; }
};
template <class T, class BTile, class P, int M_TILES, int K_TILES, int N_TILES, class Op = SameScores>
__device__ __forceinline__ void mma_regs_cols(float (&acc)[M_TILES][N_TILES][4], const P (&p)[M_TILES][K_TILES][4],
                                              u32 s_b, int col0, Op op = {}) {
#pragma unroll
    for (int j = 0; j < K_TILES / 2; ++j) {
        FragA<T> a[M_TILES];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            P lo[4], hi[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                lo[e] = op(mt, 2 * j, e, p[mt][2 * j][e]);
                hi[e] = op(mt, 2 * j + 1, e, p[mt][2 * j + 1][e]);
            }
            scores_to_a(a[mt], lo, hi);
        }
#pragma unroll
        for (int n = 0; n < N_TILES / 2; ++n) {
            FragB<T> b[2];
            Operands<T, BTile>::load_b_cols(b, s_b, j * 16, col0 + n * 16);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma(acc[mt][2 * n], a[mt], b[0]);
                mma(acc[mt][2 * n + 1], a[mt], b[1]);
            }
        }
    }
}

}  // namespace cuflash
