// grid_dependency.cuh: programmatic dependent launch (Hopper).
//
// A kernel launched with programmatic stream serialization (cuflash/_launch.py) may start
// while the kernel queued before it on the stream is still finishing, so that its launch
// and its blocks' setup hide under that kernel's tail (a short decoding call is a few
// microseconds long, and its launch is one of them). Such a kernel must wait for the
// grids before it, which also makes their writes visible, before it touches global
// memory. Launched the ordinary way, both calls do nothing; before sm_90 they are left out.
#pragma once

namespace cuflash {

// Blocks until the grids this one depends on have completed and their writes are visible.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream, if launched programmatically, start launching now
// (it still waits for this one's completion before it reads what this one writes).
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

}  // namespace cuflash
