// mma.cuh: tensor-core fragments (mma.sync m16n8k16, fp32 accumulate) and
// the loads that fill them from shared-memory tiles.
//
// Fragment layout, with g = lane / 4 and t = lane % 4 (PTX ISA, m16n8k16):
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B (16 x 8, "col"):      b0 = (k 2t..2t+1, n g)   b1 = (k 2t+8..2t+9, n g)
//   C (16 x 8, fp32):       c0,c1 = (g, 2t..2t+1)   c2,c3 = (g+8, 2t..2t+1)
#pragma once

namespace cuflash {

template <class T> struct FragA { u32 r[T::SPLITS][4]; };
template <class T> struct FragB { u32 r[T::SPLITS][2]; };

template <bool F16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    if (F16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// c += a * b. A split operand (float32) multiplies term by term, keeping the
// products whose size is within float32's precision (i + j <= SPLITS - 1),
// smallest first.
template <class T>
__device__ __forceinline__ void mma(float (&c)[4], const FragA<T>& a, const FragB<T>& b) {
#pragma unroll
    for (int order = T::SPLITS - 1; order >= 0; --order) {
#pragma unroll
        for (int i = 0; i <= order; ++i) mma_16816<T::MMA_F16>(c, a.r[i], b.r[order - i]);
    }
}

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

// Operand loads. 16-bit tiles use ldmatrix; float32 tiles are read as floats
// and split into bfloat16 terms on the way into registers.
//   load_a:         A = tile[row0 .. row0+16, col0 .. col0+16]
//   load_b_rows:    two B fragments for n = row0 .. row0+16 in steps of 8, k = col0 .. col0+16,
//                   where B[k][n] = tile[n][k] (the tile holds B transposed: K for Q K^T)
//   load_b_cols:    two B fragments for n = col0 .. col0+16 in steps of 8, k = row0 .. row0+16,
//                   where B[k][n] = tile[k][n] (V for P V)
template <class T, class Tile> struct Operands {
    __device__ __forceinline__ static void load_a(FragA<T>& a, u32 s_tile, int row0, int col0) {
        const int lane = threadIdx.x % 32;
        ldmatrix_x4(a.r[0], s_tile + Tile::offset(row0 + (lane & 15), col0 + (lane >> 4) * 8));
    }
    __device__ __forceinline__ static void load_b_rows(FragB<T> (&b)[2], u32 s_tile, int row0, int col0) {
        const int lane = threadIdx.x % 32, mi = lane >> 3;
        u32 r[4];
        ldmatrix_x4(r, s_tile + Tile::offset(row0 + (lane & 7) + (mi >> 1) * 8, col0 + (mi & 1) * 8));
        b[0].r[0][0] = r[0]; b[0].r[0][1] = r[1];
        b[1].r[0][0] = r[2]; b[1].r[0][1] = r[3];
    }
    __device__ __forceinline__ static void load_b_cols(FragB<T> (&b)[2], u32 s_tile, int row0, int col0) {
        const int lane = threadIdx.x % 32, mi = lane >> 3;
        u32 r[4];
        ldmatrix_x4_trans(r, s_tile + Tile::offset(row0 + (lane & 7) + (mi & 1) * 8, col0 + (mi >> 1) * 8));
        b[0].r[0][0] = r[0]; b[0].r[0][1] = r[1];
        b[1].r[0][0] = r[2]; b[1].r[0][1] = r[3];
    }
};

template <class Tile> struct Operands<f32, Tile> {
    __device__ __forceinline__ static void load_a(FragA<f32>& a, u32 s_tile, int row0, int col0) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int i = 0; i < 4; ++i) {   // a_i: row g + 8 (i & 1), cols 2t + 8 (i >> 1)
            const float2 x = lds_float2(s_tile + Tile::offset(row0 + g + 8 * (i & 1), col0 + 2 * t + 8 * (i >> 1)));
            u32 s[3];
            Split<f32>::pair(x.x, x.y, s);
#pragma unroll
            for (int p = 0; p < 3; ++p) a.r[p][i] = s[p];
        }
    }
    __device__ __forceinline__ static void load_b_rows(FragB<f32> (&b)[2], u32 s_tile, int row0, int col0) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {   // b_i: k = 2t + 8i, n = g
                const float2 x = lds_float2(s_tile + Tile::offset(row0 + 8 * n + g, col0 + 2 * t + 8 * i));
                u32 s[3];
                Split<f32>::pair(x.x, x.y, s);
#pragma unroll
                for (int p = 0; p < 3; ++p) b[n].r[p][i] = s[p];
            }
        }
    }
    __device__ __forceinline__ static void load_b_cols(FragB<f32> (&b)[2], u32 s_tile, int row0, int col0) {
        const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {   // b_i: k = 2t + 8i and the next, n = g
                const int k = row0 + 2 * t + 8 * i, col = col0 + 8 * n + g;
                const float x = lds_float(s_tile + Tile::offset(k, col));
                const float y = lds_float(s_tile + Tile::offset(k + 1, col));
                u32 s[3];
                Split<f32>::pair(x, y, s);
#pragma unroll
                for (int p = 0; p < 3; ++p) b[n].r[p][i] = s[p];
            }
        }
    }
};

// The A fragment of P for keys 16j .. 16j+15 from the score accumulators of
// n-tiles 2j and 2j+1 (C layout of two m16n8 tiles = A layout of one m16k16).
template <class T>
__device__ __forceinline__ void scores_to_a(FragA<T>& a, const float (&c0)[4], const float (&c1)[4]) {
    u32 s[T::SPLITS];
    Split<T>::pair(c0[0], c0[1], s);
#pragma unroll
    for (int p = 0; p < T::SPLITS; ++p) a.r[p][0] = s[p];
    Split<T>::pair(c0[2], c0[3], s);
#pragma unroll
    for (int p = 0; p < T::SPLITS; ++p) a.r[p][1] = s[p];
    Split<T>::pair(c1[0], c1[1], s);
#pragma unroll
    for (int p = 0; p < T::SPLITS; ++p) a.r[p][2] = s[p];
    Split<T>::pair(c1[2], c1[3], s);
#pragma unroll
    for (int p = 0; p < T::SPLITS; ++p) a.r[p][3] = s[p];
}

}  // namespace cuflash
