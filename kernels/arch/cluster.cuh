// cluster.cuh: thread block clusters (Hopper). The blocks of a cluster run at once on one
// GPC and read each other's shared memory, so that results a few blocks must combine meet
// on chip rather than through global memory and a count of finished blocks. Below sm_90 a
// block is a cluster of one and the other calls are never reached.
#pragma once

namespace cuflash {

// Blocks in this block's cluster (1 when launched without clusters), and this block's rank.
__device__ __forceinline__ int cluster_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return int(n);
#else
    return 1;
#endif
}

__device__ __forceinline__ int cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 n;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(n));
    return int(n);
#else
    return 0;
#endif
}

// Every thread of every block of the cluster arrives: shared memory written before is
// visible to the whole cluster after (release, acquire). All threads of each warp call it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The address in block `rank`'s shared memory of what sits at `local` in this block's.
__device__ __forceinline__ u32 peer_smem(u32 local, int rank) {
    u32 remote = local;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
#endif
    return remote;
}

__device__ __forceinline__ float load_peer(u32 address) {
    float x = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(address) : "memory");
#endif
    return x;
}

__device__ __forceinline__ float4 load_peer4(u32 address) {
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(address) : "memory");
#endif
    return x;
}

}  // namespace cuflash
