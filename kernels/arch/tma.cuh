// tma.cuh: Hopper's bulk tensor copy engine (TMA). One thread's instruction copies a
// box of a global tensor into shared memory; the tensor map (made on the host by
// cuflash/_tensor_map.py) holds the tensor's address, sizes and strides, the box, and
// the swizzle the box lands in. Boxes past the tensor's ends read zeros. A copy's
// bytes count on an mbarrier (mbarrier.cuh): whoever arms the barrier says how many
// bytes to expect, and its phase completes when they have all landed.
//
// With the 128-byte swizzle a box of ROWS rows x 64 16-bit columns lands exactly as
// one panel of PanelTile (wgmma.cuh): chunk c of row r at chunk c ^ (r % 8), the
// destination 1024-byte aligned.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {

// The host's 128 bytes as a kernel holds them: in a __grid_constant__ parameter record,
// whose members' addresses the copy instructions take.
struct alignas(64) TensorMap {
    unsigned long long bytes[16];
};

__device__ __forceinline__ u64 map_address(const TensorMap& map) { return reinterpret_cast<u64>(&map); }

// Brings a map into the cache ahead of the first copy through it.
__device__ __forceinline__ void tma_prefetch(const TensorMap& map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(map_address(map)) : "memory");
}

// After mbarrier_init, before the copy engine may complete bytes on the barrier.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival of this thread, which also tells the barrier to wait for `bytes` more
// bytes from copies (issued before or after, within the phase).
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}

// The box whose first element sits at coordinates (c0 innermost, c1, ...) into shared
// memory at `dst`; its bytes complete on `bar`.
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap& map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
        :: "r"(dst), "l"(map_address(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap& map, u32 bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
        :: "r"(dst), "l"(map_address(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap& map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        :: "r"(dst), "l"(map_address(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

__device__ __forceinline__ void tma_load(u32 dst, const TensorMap& map, u32 bar, int c0, int c1, int c2, int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
        :: "r"(dst), "l"(map_address(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4) : "memory");
}

// The other way: the copy engine adds `bytes` (a multiple of 16) of float32 from shared
// memory into global memory, element by element, as atomically as red.global.add (any
// order). The issuing thread groups its bulk operations: commit closes a group, and
// wait_group<N, READ> waits until at most N of its groups are pending (READ: only their
// reads of shared memory, after which the source may be written again).
__device__ __forceinline__ void bulk_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N, bool READ>
__device__ __forceinline__ void bulk_wait_group() {
    if (READ)
        asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
    else
        asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
