// mbarrier.cuh: shared-memory barriers with phases (sm_90), for hand-offs between
// warps that load and warps that compute.
//
// A barrier completes a phase when its expected number of arrivals has come; its
// phases alternate in parity, starting at 0. A waiter names the parity of the
// phase it waits for. On a fresh barrier, waiting for parity 1 returns at once (the
// phase "before" the first counts as complete), so a ring's "empty" barriers are
// waited for with the opposite parity of its "full" ones and start out free.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace cuflash {

__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(arrivals) : "memory");
}

// One arrival of this thread, now.
__device__ __forceinline__ void mbarrier_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// One arrival of this thread once all its cp.async copies issued so far have
// landed; the barrier's arrival count already includes it (.noinc).
__device__ __forceinline__ void mbarrier_arrive_after_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}

// Blocks until the phase of parity `parity` has completed; what the arriving
// threads wrote before arriving is then visible to this thread.
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// Place of the n-th use of a ring of STAGES buffers: the buffer and the parity of
// the phase its "full" barrier completes for that use.
template <int STAGES>
struct RingSlot {
    int stage;
    u32 parity;
    __device__ __forceinline__ explicit RingSlot(u32 n) : stage(int(n % STAGES)), parity((n / STAGES) & 1u) {}
};

// Warpgroup-wide register budget changes (all 128 threads of a warpgroup execute them):
// loading warps give registers back, computing warps take them.
template <int REGS> __device__ __forceinline__ void registers_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS));
}
template <int REGS> __device__ __forceinline__ void registers_claim() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS));
}

}  // namespace cuflash

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
