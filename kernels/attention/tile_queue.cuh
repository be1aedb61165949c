// tile_queue.cuh: the tiles of a persistent launch, handed out one at a time (sm_90).
//
// A persistent block that ran tiles blockIdx.x, + gridDim.x, ... got a fixed share of
// the work. Under a causal mask a tile's work is its key blocks, and in the grid's
// shapes the largest share came out 1.2-1.3 times the mean at head dim 128 (1.6-1.8 at
// 256), the whole launch waiting for it; docs/design.md, "Hopper forward"). Here each
// block draws its next tile from a counter when it is about to need one, in the launch's order
// (heaviest first within each group of the grid order), so a block that drew light
// tiles draws more of them.
//
// One thread of the block draws and writes each draw into a ring of SLOTS words in
// shared memory; the block's other threads that walk the tiles read it there. Each
// slot has a full barrier (one arrival: the draw is written) and an empty one (every
// reader has read it).
//
// The counter, in global memory, is two words: the draws past each block's first, and
// the blocks that drew their last. Both start at zero and the last block to finish
// drawing sets them back to zero, so every launch on one stream can use the same one
// (cuflash/_launch.py: tile_counter), one launch after the other.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {

template <int SLOTS>
struct TileQueue {
    static constexpr int BYTES = 24 * SLOTS;   // full and empty barriers, then the words (8-byte slots)
    u32 base;
    u32* counter;

    __device__ __forceinline__ u32 full(int s) const { return base + 8u * u32(s); }
    __device__ __forceinline__ u32 empty(int s) const { return base + 8u * u32(SLOTS + s); }
    __device__ __forceinline__ u32 word(int s) const { return base + 16u * u32(SLOTS) + 8u * u32(s); }

    // By one thread before the block's first sync; `readers` threads take every draw.
    __device__ __forceinline__ void init(u32 readers) const {
        for (int s = 0; s < SLOTS; ++s) {
            mbarrier_init(full(s), 1);
            mbarrier_init(empty(s), readers);
        }
    }

    // The drawing thread: the block's first tile, then one more from the counter each call.
    __device__ __forceinline__ u32 first() const { return blockIdx.x; }
    __device__ __forceinline__ u32 draw() const { return gridDim.x + atomicAdd(counter, 1u); }

    // The drawing thread: tile `index` is the block's n-th, once the slot's readers of
    // draw n - SLOTS are done with it.
    __device__ __forceinline__ void publish(u32 n, u32 index) const {
        const RingSlot<SLOTS> slot(n);
        mbarrier_wait(empty(slot.stage), slot.parity ^ 1u);
        asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(word(slot.stage)), "r"(index) : "memory");
        mbarrier_arrive(full(slot.stage));
    }

    // A reader: the block's n-th tile.
    __device__ __forceinline__ u32 take(u32 n) const {
        const RingSlot<SLOTS> slot(n);
        mbarrier_wait(full(slot.stage), slot.parity);
        u32 index;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(index) : "r"(word(slot.stage)) : "memory");
        mbarrier_arrive(empty(slot.stage));
        return index;
    }

    // The drawing thread, after its block's last draw: the last block to get here sets
    // the counter back (atomicInc wraps the second word to 0 on the last block's count).
    __device__ __forceinline__ void retire() const {
        __threadfence();   // this block's draws before its count
        if (atomicInc(counter + 1, gridDim.x - 1u) == gridDim.x - 1u) {
            __threadfence();   // every block's count, and so its draws, before the reset
            atomicExch(counter, 0u);
        }
    }
};

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
