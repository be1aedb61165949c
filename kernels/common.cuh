// common.cuh: element types, conversions and warp reductions shared by every kernel.
//
// The kernel sources are compiled as one translation unit, joined in the order
// given by cuflash/_compile.py (KERNEL_FILES), so headers carry no #include.
#pragma once

namespace cuflash {

using index_t = long long;   // element offsets: B * H * N * D can pass 2^31
using u32 = unsigned int;
using u16 = unsigned short;

#define CUFLASH_INF __int_as_float(0x7f800000)

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Element types; `storage` is how one element sits in memory. float16 and
// bfloat16 multiply on the tensor cores; float32 keeps IEEE float32 products
// and sums (see mma.cuh), so its results are as accurate as a float32 GEMM's.
struct f16  { using storage = u16; };
struct bf16 { using storage = u16; };
struct f32  { using storage = float; };

// Two floats -> one register of two 16-bit values, `lo` in the low half (the lower address).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float bf16_lo_to_float(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi_to_float(u32 x) { return __uint_as_float(x & 0xffff0000u); }

// Stores two adjacent output elements (the address is aligned to the pair).
template <class T> struct Store;
template <> struct Store<f16> {
    __device__ __forceinline__ static void pair(u16* p, float x, float y) { *reinterpret_cast<u32*>(p) = pack_f16x2(x, y); }
};
template <> struct Store<bf16> {
    __device__ __forceinline__ static void pair(u16* p, float x, float y) { *reinterpret_cast<u32*>(p) = pack_bf16x2(x, y); }
};
template <> struct Store<f32> {
    __device__ __forceinline__ static void pair(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
};

// Reductions over the four lanes that share one row of an MMA fragment.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cuflash
