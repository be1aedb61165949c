// wgmma.cuh: Hopper warpgroup MMA (wgmma.mma_async, sm_90a) and the shared-memory
// layout it reads.
//
// A warpgroup is four warps (128 threads) that issue one m64nNk16 product together.
// Warp w of the group owns rows 16w .. 16w+15 of the 64, and within a warp the
// accumulator and A-register layouts are those of mma.sync m16n8k16 (mma.cuh),
// repeated over the N / 8 column tiles: the online softmax and the masking work
// on wgmma results unchanged.
//
// Operands in shared memory are described by a 64-bit descriptor rather than
// loaded by threads. Tiles are stored in 64-column panels (128 bytes of 16-bit
// elements per row) with the 128-byte swizzle: 16-byte chunk c of row r sits at
// chunk c ^ (r % 8). Every 8 rows x 128 bytes form one 1024-byte swizzle atom,
// which the hardware expects 1024-byte aligned.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {

using u64 = unsigned long long;

// ROWS x COLS tile of 16-bit elements as COLS / 64 panels of ROWS x 128 bytes.
// Same interface as SmemTile (smem.cuh), so load_tile_async fills it.
template <class Storage, int ROWS_, int COLS>
struct PanelTile {
    static_assert(sizeof(Storage) == 2 && COLS % 64 == 0 && ROWS_ % 8 == 0, "16-bit tiles of whole panels and atoms");
    static constexpr int ROWS = ROWS_;
    static constexpr int ELEMS_PER_CHUNK = 8;
    static constexpr int CHUNKS = COLS / ELEMS_PER_CHUNK;
    static constexpr int ROWS_X_CHUNKS = ROWS * CHUNKS;
    static constexpr int PANEL_BYTES = ROWS * 128;
    static constexpr int BYTES = PANEL_BYTES * (COLS / 64);

    __device__ __forceinline__ static u32 chunk_offset(int row, int chunk) {
        return u32((chunk / 8) * PANEL_BYTES + row * 128 + ((chunk % 8) ^ (row % 8)) * 16);
    }
};

// Descriptor of a swizzled operand starting at shared address `addr`.
//   sbo: bytes between consecutive 8-row atoms (1024 here: atoms are stacked)
//   lbo: bytes between 64-column panels, for an operand read across them
//        (N-major B); unused when the reduction runs along the panel's row
// Bits: 0-13 address >> 4, 16-29 lbo >> 4, 32-45 sbo >> 4, 62-63 swizzle (1 = 128 B).
__device__ __forceinline__ u64 smem_descriptor(u32 addr, u32 lbo, u32 sbo) {
    return u64((addr & 0x3FFFF) >> 4) | (u64(lbo >> 4) << 16) | (u64(sbo >> 4) << 32) | (1ull << 62);
}

// Shared-memory writes by threads (cp.async included) made visible to wgmma,
// which reads through the async proxy. Each writer fences, then the block syncs.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Orders register writes before the wgmmas that read them (accumulators, A fragments).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(PENDING) : "memory"); }

// Keeps the compiler from moving reads or writes of accumulator registers across
// an issue or wait: the asm statements above do not name the registers in flight.
template <int A, int B>
__device__ __forceinline__ void pin_registers(float (&x)[A][B][4]) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(x[a][b][e]) :: "memory");
}
// The same for A fragments, which must stay unchanged until their product is waited for.
template <int A>
__device__ __forceinline__ void pin_registers(u32 (&x)[A][4]) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(x[a][e]) :: "memory");
}

// d[N/8][4] += A . B for one m64nNk16 step, fp32 accumulate.
//   wgmma_ss: A and B both in shared memory, K-major (Q, K for q k^T)
//   wgmma_rs: A in registers (mma.sync A-fragment layout), B N-major in shared memory (V for p v)
// scale_d = 0 ignores the old d (first step of a fresh product).
template <class T, int N> __device__ void wgmma_ss(float (&d)[N / 8][4], u64 a, u64 b, int scale_d);
template <class T, int N> __device__ void wgmma_rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b, int scale_d);
//   wgmma_ss_nb: A K-major in shared memory, B N-major there (ds from shared memory times k)
template <class T, int N> __device__ void wgmma_ss_nb(float (&d)[N / 8][4], u64 a, u64 b, int scale_d);

#define CUFLASH_R0_15 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define CUFLASH_R0_31 CUFLASH_R0_15 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CUFLASH_R32_63 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CUFLASH_R64_127 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

#define CUFLASH_R32_39 "%32, %33, %34, %35, %36, %37, %38, %39"
#define CUFLASH_R64_87 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87"

#define CUFLASH_ACC1(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define CUFLASH_ACC8(j) CUFLASH_ACC1(j), CUFLASH_ACC1(j + 1), CUFLASH_ACC1(j + 2), CUFLASH_ACC1(j + 3), \
    CUFLASH_ACC1(j + 4), CUFLASH_ACC1(j + 5), CUFLASH_ACC1(j + 6), CUFLASH_ACC1(j + 7)
#define CUFLASH_ACC_32 CUFLASH_ACC1(0), CUFLASH_ACC1(1), CUFLASH_ACC1(2), CUFLASH_ACC1(3)
#define CUFLASH_ACC_64 CUFLASH_ACC8(0)
#define CUFLASH_ACC_80 CUFLASH_ACC8(0), CUFLASH_ACC1(8), CUFLASH_ACC1(9)
#define CUFLASH_ACC_128 CUFLASH_ACC8(0), CUFLASH_ACC8(8)
#define CUFLASH_ACC_176 CUFLASH_ACC8(0), CUFLASH_ACC8(8), CUFLASH_ACC1(16), CUFLASH_ACC1(17), CUFLASH_ACC1(18), \
    CUFLASH_ACC1(19), CUFLASH_ACC1(20), CUFLASH_ACC1(21)
#define CUFLASH_ACC_256 CUFLASH_ACC8(0), CUFLASH_ACC8(8), CUFLASH_ACC8(16), CUFLASH_ACC8(24)

// REGS: the accumulator operand list; A, B, SCALE: the operand numbers after it.
// CUFLASH_WGMMA_SS: NAME wgmma_ss (B K-major, TRANS_B "0") or wgmma_ss_nb (N-major, "1").
#define CUFLASH_WGMMA_SS(NAME, TRANS_B, TYPE, PTX_TYPE, N, REGS, A, B, SCALE)                           \
    template <> __device__ __forceinline__ void NAME<TYPE, N>(float (&d)[N / 8][4], u64 a, u64 b,         \
                                                              int scale_d) {                              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                    \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " "           \
                     "{" REGS "}, " A ", " B ", p, 1, 1, 0, " TRANS_B ";\n}\n"                            \
                     : CUFLASH_ACC_##N : "l"(a), "l"(b), "r"(scale_d));                                  \
    }
#define CUFLASH_WGMMA_RS(TYPE, PTX_TYPE, N, REGS, A, B, SCALE)                                          \
    template <> __device__ __forceinline__ void wgmma_rs<TYPE, N>(float (&d)[N / 8][4], const u32 (&a)[4], \
                                                                  u64 b, int scale_d) {                   \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                    \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " "           \
                     "{" REGS "}, {" A "}, " B ", p, 1, 1, 1;\n}\n"                                       \
                     : CUFLASH_ACC_##N : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b),             \
                       "r"(scale_d));                                                                     \
    }
#define CUFLASH_WGMMA_ALL(TYPE, PTX_TYPE)                                                                              \
    CUFLASH_WGMMA_SS(wgmma_ss, "0", TYPE, PTX_TYPE, 32, CUFLASH_R0_15, "%16", "%17", "%18")                            \
    CUFLASH_WGMMA_SS(wgmma_ss, "0", TYPE, PTX_TYPE, 64, CUFLASH_R0_31, "%32", "%33", "%34")                            \
    CUFLASH_WGMMA_SS(wgmma_ss, "0", TYPE, PTX_TYPE, 80, CUFLASH_R0_31 ", " CUFLASH_R32_39, "%40", "%41", "%42")        \
    CUFLASH_WGMMA_SS(wgmma_ss, "0", TYPE, PTX_TYPE, 128, CUFLASH_R0_31 ", " CUFLASH_R32_63, "%64", "%65", "%66")       \
    CUFLASH_WGMMA_SS(wgmma_ss, "0", TYPE, PTX_TYPE, 176, CUFLASH_R0_31 ", " CUFLASH_R32_63 ", " CUFLASH_R64_87, "%88", "%89", "%90") \
    CUFLASH_WGMMA_SS(wgmma_ss_nb, "1", TYPE, PTX_TYPE, 64, CUFLASH_R0_31, "%32", "%33", "%34")                         \
    CUFLASH_WGMMA_SS(wgmma_ss_nb, "1", TYPE, PTX_TYPE, 128, CUFLASH_R0_31 ", " CUFLASH_R32_63, "%64", "%65", "%66")    \
    CUFLASH_WGMMA_RS(TYPE, PTX_TYPE, 64, CUFLASH_R0_31, "%32, %33, %34, %35", "%36", "%37")                            \
    CUFLASH_WGMMA_RS(TYPE, PTX_TYPE, 128, CUFLASH_R0_31 ", " CUFLASH_R32_63, "%64, %65, %66, %67", "%68", "%69")       \
    CUFLASH_WGMMA_RS(TYPE, PTX_TYPE, 256, CUFLASH_R0_31 ", " CUFLASH_R32_63 ", " CUFLASH_R64_127,                      \
                     "%128, %129, %130, %131", "%132", "%133")

CUFLASH_WGMMA_ALL(f16, "f16")
CUFLASH_WGMMA_ALL(bf16, "bf16")

// Warpgroup tile products; every product of the sm_90a kernels is one of these.
// Fencing, committing and waiting are left to the caller, which decides what
// overlaps.
//
// d = A . B^T over K_DIM, with A (64 rows from s_a) and B (N rows from s_b) both
// stored one row per output row/column (q k^T, k q^T, dout v^T, v dout^T).
// A k16 step is 32 bytes along a panel row; every 4 steps, the next panel.
template <class T, class ATile, class BTile, int K_DIM, int N>
__device__ __forceinline__ void wgmma_rows_rows(float (&d)[N / 8][4], u32 s_a, u32 s_b) {
    const u64 a = smem_descriptor(s_a, 16, 1024), b = smem_descriptor(s_b, 16, 1024);
#pragma unroll
    for (int k = 0; k < K_DIM / 16; ++k) {
        const u32 a_step = u32((k / 4) * ATile::PANEL_BYTES + (k % 4) * 32) >> 4;
        const u32 b_step = u32((k / 4) * BTile::PANEL_BYTES + (k % 4) * 32) >> 4;
        wgmma_ss<T, N>(d, a + a_step, b + b_step, k);
    }
}

// d += P . B with P in registers (K_STEPS A fragments of 16 keys or queries) and
// B read down its rows: 16 rows per step, N columns across panels from s_b
// (v for p v, dout for p^T dout, q for ds^T q, k for ds k).
template <class T, class BTile, int N, int K_STEPS>
__device__ __forceinline__ void wgmma_regs_cols(float (&d)[N / 8][4], const u32 (&a)[K_STEPS][4], u32 s_b) {
    const u64 b = smem_descriptor(s_b, BTile::PANEL_BYTES, 1024);
#pragma unroll
    for (int j = 0; j < K_STEPS; ++j) wgmma_rs<T, N>(d, a[j], b + u32(j * 16 * 128 >> 4), 1);
}

// d = A . B (d += A . B with ACCUMULATE) with A (64 rows from s_a, K_STEPS x 16 columns,
// stored one row per output row) and B read down its rows as in wgmma_regs_cols (ds k,
// ds from shared memory).
template <class T, class BTile, int N, int K_STEPS, bool ACCUMULATE = false>
__device__ __forceinline__ void wgmma_smem_cols(float (&d)[N / 8][4], u32 s_a, u32 s_b) {
    static_assert(K_STEPS <= 4, "A within one 64-column panel");
    const u64 a = smem_descriptor(s_a, 16, 1024), b = smem_descriptor(s_b, BTile::PANEL_BYTES, 1024);
#pragma unroll
    for (int j = 0; j < K_STEPS; ++j)
        wgmma_ss_nb<T, N>(d, a + u32(j * 32 >> 4), b + u32(j * 16 * 128 >> 4), ACCUMULATE || j > 0);
}

// The transpose of a warpgroup's A fragments into a 64-row, one-panel tile at s_tile:
// the warp's fragments hold its 16 rows (from warp_row0 of the 64) against K_STEPS x 16
// columns; the tile gets those columns as rows, the warp's rows as its 16 columns, so
// that wgmma can take the transpose as an A operand (ds^T of the dk/dv pass as ds).
// stmatrix .trans stores a thread's pair (row, col..col+1) down a column.
template <int K_STEPS>
__device__ __forceinline__ void store_transposed(u32 s_tile, const u32 (&a)[K_STEPS][4], int warp_row0) {
    static_assert(K_STEPS <= 4, "64 rows out");
    const int lane = threadIdx.x % 32, matrix = lane / 8, r = lane % 8;
    const int chunk = warp_row0 / 8 + (matrix & 1);   // a[j][m]: rows +8 for m odd, columns +8 for m >= 2
#pragma unroll
    for (int j = 0; j < K_STEPS; ++j) {
        const int row = 16 * j + (matrix >> 1) * 8 + r;
        const u32 at = s_tile + u32(row * 128 + ((chunk ^ (row % 8)) * 16));
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(at), "r"(a[j][0]), "r"(a[j][1]), "r"(a[j][2]), "r"(a[j][3]) : "memory");
    }
}

// Score accumulators of 2 K_STEPS n8 tiles as K_STEPS wgmma A fragments (mma.cuh's scores_to_a).
template <class T, int K_STEPS>
__device__ __forceinline__ void to_a_fragments(u32 (&a)[K_STEPS][4], const float (&s)[1][2 * K_STEPS][4]) {
#pragma unroll
    for (int j = 0; j < K_STEPS; ++j) {
        FragA<T> f;
        scores_to_a(f, s[0][2 * j], s[0][2 * j + 1]);
#pragma unroll
        for (int i = 0; i < 4; ++i) a[j][i] = f.r[i];
    }
}

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
