// smem.cuh: shared-memory tiles and the asynchronous copies that fill them.
#pragma once

namespace cuflash {

__device__ __forceinline__ u32 smem_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// A ROWS x COLS tile of 16-byte chunks. Chunk c of row r is stored at
// c ^ f(r): the eight rows one ldmatrix reads at one logical chunk then fall
// in eight different 16-byte bank groups, with no padding. G is the largest
// power of two (at most 8) dividing the chunks per row; XOR-ing within groups
// of G keeps every chunk inside its row.
template <class Storage, int ROWS_, int COLS_>
struct SmemTile {
    static constexpr int ROWS = ROWS_, COLS = COLS_;
    static constexpr int ELEMS_PER_CHUNK = 16 / int(sizeof(Storage));
    static constexpr int CHUNKS = COLS / ELEMS_PER_CHUNK;
    static constexpr int ROWS_X_CHUNKS = ROWS * CHUNKS;
    static constexpr int BYTES = ROWS * COLS * int(sizeof(Storage));
    static constexpr int G = CHUNKS % 8 == 0 ? 8 : CHUNKS % 4 == 0 ? 4 : CHUNKS % 2 == 0 ? 2 : 1;
    static constexpr int ROWS_PER_SWIZZLE = 8 / G;   // rows that one chunk-row of banks spans
    static constexpr int SWIZZLE_ROWS = 8;            // rows after which the swizzle repeats
    static_assert(COLS % ELEMS_PER_CHUNK == 0, "tile rows are whole 16-byte chunks");

    // Byte offset of chunk `chunk` of row `row`.
    __device__ __forceinline__ static u32 chunk_offset(int row, int chunk) {
        return u32(row * CHUNKS + (chunk ^ ((row / ROWS_PER_SWIZZLE) & (G - 1)))) * 16u;
    }
    // Byte offset of element (row, col).
    __device__ __forceinline__ static u32 offset(int row, int col) {
        return chunk_offset(row, col / ELEMS_PER_CHUNK) + u32(col % ELEMS_PER_CHUNK) * u32(sizeof(Storage));
    }
};

// Four floats to 16 bytes of shared memory at a shared-space address.
__device__ __forceinline__ void st_shared_v4(u32 s_addr, float x, float y, float z, float w) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "r"(s_addr), "f"(x), "f"(y), "f"(z), "f"(w)
                 : "memory");
}

// 16-byte global -> shared copy that bypasses registers; when !valid it reads
// nothing and writes zeros, which pads ragged rows and head dims.
__device__ __forceinline__ void cp_async_16(u32 s_addr, const void* g_ptr, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(s_addr), "l"(g_ptr), "r"(valid ? 16 : 0));
}
// The same for 4 bytes (one float), through L1.
__device__ __forceinline__ void cp_async_4(u32 s_addr, const void* g_ptr, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(s_addr), "l"(g_ptr), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING)); }

// Hand-off between groups of warps through shared memory: the producers' writes
// before arrive() are visible to the consumers after sync() on the same barrier
// id (1..15; 0 is __syncthreads'). THREADS counts producers and consumers.
template <int ID, int THREADS>
__device__ __forceinline__ void named_barrier_arrive() { asm volatile("bar.arrive %0, %1;\n" :: "n"(ID), "n"(THREADS) : "memory"); }
template <int ID, int THREADS>
__device__ __forceinline__ void named_barrier_sync() { asm volatile("bar.sync %0, %1;\n" :: "n"(ID), "n"(THREADS) : "memory"); }
// (the same, for an id known only at run time: which warpgroup a thread is in)
__device__ __forceinline__ void named_barrier_arrive(u32 id, u32 threads) { asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory"); }
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) { asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory"); }

// The copies of load_tile_async one 16-byte chunk at a time: chunk i of the tile (row-major)
// by thread i % THREADS of the THREADS taking part, `tid` this thread's index among them;
// the loop unrolled UNROLL times.
template <class Tile, int THREADS, int UNROLL, class Storage>
__device__ __forceinline__ void load_chunks_async(u32 s_tile, const Storage* g, index_t row_stride, int rows_valid,
                                                  int cols_valid, int tid) {
    constexpr int TOTAL = Tile::ROWS_X_CHUNKS;
#pragma unroll UNROLL
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
        const int i = it * THREADS + tid;
        if (TOTAL % THREADS != 0 && i >= TOTAL) break;
        const int r = i / Tile::CHUNKS, c = i % Tile::CHUNKS;
        const bool valid = r < rows_valid && c * Tile::ELEMS_PER_CHUNK < cols_valid;
        const Storage* src = valid ? g + r * row_stride + c * Tile::ELEMS_PER_CHUNK : g;
        cp_async_16(s_tile + Tile::chunk_offset(r, c), src, valid);
    }
}

// Issues the copies of rows [0, ROWS) x cols [0, COLS) of a global tile whose
// row r starts at g + r * row_stride; rows >= rows_valid and columns >= cols_valid
// become zeros. Threads 0 .. THREADS - 1 take part (the whole block, or its loading
// warps). STRIDED: each thread steps down the rows (below), in a loop unrolled by 4, or
// where the tile's shape does not allow that, a rolled loop; for loading warps with few
// registers, which a fully unrolled loop's hoisted addresses would spill, and whose issue
// rate alone sets how fast the copies go out, and for kernels whose copies are a large
// share of their instructions (short tiles).
template <class Tile, int THREADS, bool STRIDED = false, class Storage>
__device__ __forceinline__ void load_tile_async(u32 s_tile, const Storage* g, index_t row_stride,
                                                int rows_valid, int cols_valid) {
    constexpr int TOTAL = Tile::ROWS_X_CHUNKS;
    constexpr int ITERS = (TOTAL + THREADS - 1) / THREADS;
    // Strided, when the threads cover whole rows and a multiple of 8 of them per pass: each
    // thread keeps one chunk column and steps down the rows. The swizzles repeat every 8
    // rows, so both addresses move by constants, with no division or 64-bit product per
    // copy. Unrolled loops keep the form below, which carries no registers from copy to
    // copy (the portable forward sits at its register limit).
    constexpr int ROW_STEP = THREADS / Tile::CHUNKS;
    if constexpr (STRIDED && THREADS % Tile::CHUNKS == 0 && ROW_STEP % 8 == 0 && TOTAL % THREADS == 0) {
        const int c = int(threadIdx.x) % Tile::CHUNKS;
        int r = int(threadIdx.x) / Tile::CHUNKS;
        const bool col_valid = c * Tile::ELEMS_PER_CHUNK < cols_valid;
        const Storage* src = g + r * row_stride + c * Tile::ELEMS_PER_CHUNK;
        u32 dst = s_tile + Tile::chunk_offset(r, c);
        const index_t src_step = ROW_STEP * row_stride;
        const u32 dst_step = Tile::chunk_offset(ROW_STEP, 0) - Tile::chunk_offset(0, 0);
#pragma unroll 4
        for (int it = 0; it < ITERS; ++it) {
            const bool valid = col_valid && r < rows_valid;
            cp_async_16(dst, valid ? src : g, valid);
            r += ROW_STEP;
            src += src_step;
            dst += dst_step;
        }
    } else {
        load_chunks_async<Tile, THREADS, STRIDED ? 1 : ITERS>(s_tile, g, row_stride, rows_valid, cols_valid,
                                                             int(threadIdx.x));
    }
}

// load_tile_async by LANES threads of several that copy tiles of their own at once, `lane`
// this thread's index among them. Where the lanes cover whole rows, each keeps one chunk
// column and steps down the rows: one source address computed per tile, not per copy, and
// destinations that repeat, a whole number of rows further, every PERIOD copies (the swizzle
// has a period of 8 rows), so that their offsets hold from tile to tile; a whole tile takes
// its copies with no predicates. Else chunk by chunk.
template <class Tile, int LANES, class Storage>
__device__ __forceinline__ void load_tile_by_lanes_async(u32 s_tile, const Storage* g, index_t row_stride,
                                                          int rows_valid, int cols_valid, int lane) {
    constexpr int TOTAL = Tile::ROWS_X_CHUNKS, ITERS = (TOTAL + LANES - 1) / LANES;
    if constexpr (LANES % Tile::CHUNKS == 0 && TOTAL % LANES == 0) {
        constexpr int ROW_STEP = LANES / Tile::CHUNKS;
        constexpr int PERIOD = ROW_STEP % Tile::SWIZZLE_ROWS == 0 ? 1 : Tile::SWIZZLE_ROWS / ROW_STEP;
        static_assert(PERIOD == 1 || Tile::SWIZZLE_ROWS % ROW_STEP == 0, "the rows a thread copies repeat the swizzle");
        constexpr u32 PERIOD_BYTES = u32(PERIOD * ROW_STEP * Tile::CHUNKS * 16);
        const int c = lane % Tile::CHUNKS, r0 = lane / Tile::CHUNKS;
        const Storage* src = g + r0 * row_stride + c * Tile::ELEMS_PER_CHUNK;
        const index_t src_step = ROW_STEP * row_stride;
        auto dst = [&](int it) {
            return s_tile + Tile::chunk_offset(r0 + it % PERIOD * ROW_STEP, c) + u32(it / PERIOD) * PERIOD_BYTES;
        };
        if (rows_valid >= Tile::ROWS && cols_valid >= Tile::COLS) {
#pragma unroll
            for (int it = 0; it < ITERS; ++it, src += src_step) cp_async_16(dst(it), src, true);
        } else {
            const bool col_valid = c * Tile::ELEMS_PER_CHUNK < cols_valid;
#pragma unroll
            for (int it = 0; it < ITERS; ++it, src += src_step) {
                const bool valid = col_valid && r0 + it * ROW_STEP < rows_valid;
                cp_async_16(dst(it), valid ? src : g, valid);
            }
        }
    } else {
        load_chunks_async<Tile, LANES, ITERS>(s_tile, g, row_stride, rows_valid, cols_valid, lane);
    }
}

// load_tile_async of a tile known to be whole (every row and column valid): where the
// threads cover whole rows, 8 of them (a swizzle period) per pass, the same strided copies
// with no predicate or fallback address, three instructions per copy.
template <class Tile, int THREADS, class Storage>
__device__ __forceinline__ void load_whole_tile_async(u32 s_tile, const Storage* g, index_t row_stride) {
    constexpr int TOTAL = Tile::ROWS_X_CHUNKS, ROW_STEP = THREADS / Tile::CHUNKS;
    if constexpr (THREADS % Tile::CHUNKS == 0 && ROW_STEP % 8 == 0 && TOTAL % THREADS == 0) {
        const int c = int(threadIdx.x) % Tile::CHUNKS, r = int(threadIdx.x) / Tile::CHUNKS;
        const Storage* src = g + r * row_stride + c * Tile::ELEMS_PER_CHUNK;
        const u32 dst = s_tile + Tile::chunk_offset(r, c);
        const index_t src_step = ROW_STEP * row_stride;
        constexpr u32 DST_STEP = u32(ROW_STEP * Tile::CHUNKS * 16);   // chunk_offset(r + ROW_STEP, c) - chunk_offset(r, c)
#pragma unroll
        for (int it = 0; it < TOTAL / THREADS; ++it) {
            cp_async_16(dst + it * DST_STEP, src, true);
            src += src_step;
        }
    } else {
        load_tile_async<Tile, THREADS, true>(s_tile, g, row_stride, Tile::ROWS, Tile::COLS);
    }
}

}  // namespace cuflash
