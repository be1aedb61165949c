// schedule.cuh: the tile list of a launch over packed variable-length sequences.
//
// A tile is one block of rows (queries, or keys for the dk/dv pass) of one
// sequence; the launch runs tile blockIdx.x / batch_size (params.cuh: find_work).
// Tiles are listed heaviest first, longest-processing-time order: sequences by
// the rows each of their tiles streams over (keys for query tiles, queries for
// key tiles), longest first, in buckets of 64 rows, and within a sequence the
// tile with the most work under a causal mask first. So the long sequences
// start at once and the short ones fill the end of the grid, and no SM idles
// while a long sequence finishes. The order within a bucket depends on atomics;
// each tile computes its own rows in full, so results do not depend on it.
//
// One thread block of SCHEDULE_THREADS builds the list, reading only the
// offsets: no host synchronization. Past the last tile it writes sequence -1,
// and it never writes more than `capacity` tiles (offsets that claim more rows
// than the arrays hold lose tiles, never memory).
#pragma once

namespace cuflash {

#ifndef CUFLASH_SCHEDULE_THREADS
#error "CUFLASH_SCHEDULE_THREADS comes from cuflash/_params.py (cuflash/_compile.py passes it)"
#endif
constexpr int SCHEDULE_THREADS = CUFLASH_SCHEDULE_THREADS;
constexpr int SCHEDULE_BUCKETS = 1024;   // of 64 streamed rows each; the last takes all longer
constexpr int SCHEDULE_BUCKET_ROWS = 64;

// by_keys: tiles are blocks of `block` keys (dk/dv); else blocks of `block` queries.
// heavy_last: within a sequence, the last block has the most work (query tiles under a
// causal mask); else the first (key tiles).
__global__ void __launch_bounds__(SCHEDULE_THREADS)
build_tile_list(const int* cu_seqlens_q, const int* cu_seqlens_k, int num_seqs, int total_q, int total_k,
                int block, int by_keys, int heavy_last, int2* tiles, int capacity) {
    // tiles per bucket, then the next free slot of each: 64-bit, since offsets that
    // claim more rows than the arrays hold may count more tiles than an int holds
    using count_t = unsigned long long;
    __shared__ count_t tiles_in[SCHEDULE_BUCKETS];
    __shared__ count_t scan[SCHEDULE_BUCKETS];
    if (blockDim.x != SCHEDULE_THREADS) __trap();   // launch/kernel mismatch
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

    // the blocks of sequence s and its bucket (0: the longest streamed rows)
    auto measure = [&](int s, int& blocks, int& bucket) {
        int q0, nq, k0, nk;
        sequence_rows(cu_seqlens_q, s, total_q, q0, nq);
        sequence_rows(cu_seqlens_k, s, total_k, k0, nk);
        const int rows = by_keys ? nk : nq, streamed = by_keys ? nq : nk;
        blocks = ceil_div(rows, block);
        bucket = SCHEDULE_BUCKETS - 1 - min(SCHEDULE_BUCKETS - 1, streamed / SCHEDULE_BUCKET_ROWS);
    };

    for (int b = tid; b < SCHEDULE_BUCKETS; b += SCHEDULE_THREADS) tiles_in[b] = 0;
    __syncthreads();
    for (int s = tid; s < num_seqs; s += SCHEDULE_THREADS) {
        int blocks, bucket;
        measure(s, blocks, bucket);
        if (blocks) atomicAdd(&tiles_in[bucket], count_t(blocks));
    }
    __syncthreads();

    // exclusive prefix sum over buckets (Hillis-Steele in shared memory)
    static_assert(SCHEDULE_BUCKETS == SCHEDULE_THREADS, "one bucket per thread");
    count_t inclusive = tiles_in[tid];
    scan[tid] = inclusive;
    __syncthreads();
    for (int step = 1; step < SCHEDULE_BUCKETS; step *= 2) {
        const count_t add = tid >= step ? scan[tid - step] : 0;
        __syncthreads();
        inclusive += add;
        scan[tid] = inclusive;
        __syncthreads();
    }
    const count_t total_tiles = scan[SCHEDULE_BUCKETS - 1];
    tiles_in[tid] = inclusive - tiles_in[tid];   // the bucket's first slot
    __syncthreads();

    // each warp places whole sequences: one slot range claimed, its tiles written by all lanes
    for (int s = warp; s < num_seqs; s += SCHEDULE_THREADS / 32) {
        int blocks, bucket;
        measure(s, blocks, bucket);
        if (!blocks) continue;
        count_t first = 0;
        if (lane == 0) first = atomicAdd(&tiles_in[bucket], count_t(blocks));
        first = __shfl_sync(0xffffffffu, first, 0);
        for (int i = lane; i < blocks && first + i < count_t(capacity); i += 32)
            tiles[first + i] = make_int2(s, heavy_last ? blocks - 1 - i : i);
    }
    for (count_t t = total_tiles + tid; t < count_t(capacity); t += SCHEDULE_THREADS) tiles[t] = make_int2(-1, -1);
}

}  // namespace cuflash
