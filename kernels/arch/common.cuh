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
// K_UNROLL: how far head-dim loops unroll; float32's emulated products need
// many registers per step, so its loops stay rolled.
// MAX_FINITE: the largest finite value; outputs saturate there, since rounding
// can push a result that is at most max|v| just past it.
// P_SHIFT: bfloat16 keeps softmax probabilities as p * 2^-32, so that the float32
// sum of p * v over many keys cannot overflow when |v| nears bfloat16's largest
// values. The shift sits in the exponent, which then lies near -32 and is
// rounded at that scale: 3e-6 relative, far below bfloat16's precision but not
// float32's. float16 values are far from overflow, and its P needs all of
// float16's range.
// dot_sum: what dot products over the head dim sum in, and what the forward keeps
// scores in until the row max is subtracted. float32 sums its exact products in
// double: at logits of 1e4 a float32 score is off by up to half its ulp (1e-3),
// which reaches the exponent and so the output; the difference score - max, small
// where it matters, is rounded instead.
// SPLIT_SCALE: float32 multiplies score differences by scale_log2 in two parts
// (its float32 rounding and the remainder), so that a difference of tens does
// not carry scale_log2's rounding error into the exponent at float32 precision.
struct f16  { using storage = u16;   static constexpr int K_UNROLL = 16; static constexpr float MAX_FINITE = 65504.f;         static constexpr int P_SHIFT = 0;  static constexpr bool SPLIT_SCALE = false; using dot_sum = float; };
struct bf16 { using storage = u16;   static constexpr int K_UNROLL = 16; static constexpr float MAX_FINITE = 3.38953139e38f;  static constexpr int P_SHIFT = 32; static constexpr bool SPLIT_SCALE = false; using dot_sum = float; };
struct f32  { using storage = float; static constexpr int K_UNROLL = 2;  static constexpr float MAX_FINITE = 3.40282347e38f;  static constexpr int P_SHIFT = 0;  static constexpr bool SPLIT_SCALE = true;  using dot_sum = double; };

// 2^x for softmax probabilities. 16-bit types take the hardware's approximate
// exp2 (2 ulp, subnormal results flushed to 0: p below 2^-126 is far under their
// precision); float32 keeps exp2f, which also keeps subnormal results.
template <class T> __device__ __forceinline__ float exp2_p(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
template <> __device__ __forceinline__ float exp2_p<f32>(float x) { return exp2f(x); }

// x clamped to T's finite range; NaN stays NaN (both comparisons are false).
template <class T> __device__ __forceinline__ float saturate(float x) {
    return x > T::MAX_FINITE ? T::MAX_FINITE : (x < -T::MAX_FINITE ? -T::MAX_FINITE : x);
}

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

// Two floats as one register of a 16-bit type, `lo` in the low half.
template <class T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<f16>(float lo, float hi) { return pack_f16x2(lo, hi); }
template <> __device__ __forceinline__ u32 pack2<bf16>(float lo, float hi) { return pack_bf16x2(lo, hi); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// pack2 of saturate()d values in one conversion: .satfinite turns +-inf and values past
// the range into +-MAX_FINITE and keeps NaN, as saturate() does, without its compares
// and selects (three instructions per element). PTX 8.1, so for the sm_90a kernels
// only (they need NVRTC 12.9).
template <class T> __device__ __forceinline__ u32 pack2_satfinite(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2_satfinite<f16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 pack2_satfinite<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.satfinite.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif

// Stores two adjacent output elements (the address is aligned to the pair), or one.
// pair_satfinite: saturated to T's finite range (sm_90a).
template <class T> struct Store {
    __device__ __forceinline__ static void pair(u16* p, float x, float y) { *reinterpret_cast<u32*>(p) = pack2<T>(x, y); }
    __device__ __forceinline__ static void one(u16* p, float x) { *p = u16(pack2<T>(x, 0.f)); }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __device__ __forceinline__ static void pair_satfinite(u16* p, float x, float y) {
        *reinterpret_cast<u32*>(p) = pack2_satfinite<T>(x, y);
    }
#endif
};
template <> struct Store<f32> {
    __device__ __forceinline__ static void pair(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
    __device__ __forceinline__ static void one(float* p, float x) { *p = x; }
};

// Loads one element as float.
template <class T> struct Load;
template <> struct Load<f16> {
    __device__ __forceinline__ static float bits(u16 h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    __device__ __forceinline__ static float one(const u16* p) { return bits(*p); }
};
template <> struct Load<bf16> {
    __device__ __forceinline__ static float bits(u16 h) { return __uint_as_float(u32(h) << 16); }
    __device__ __forceinline__ static float one(const u16* p) { return bits(*p); }
};
template <> struct Load<f32> {
    __device__ __forceinline__ static float one(const float* p) { return *p; }
};

// Accumulator tiles (C fragments): clear and scale.
template <class Acc, int A, int B>
__device__ __forceinline__ void fill_zero(Acc (&x)[A][B][4]) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int e = 0; e < 4; ++e) x[a][b][e] = Acc(0);
}
template <int A, int B>
__device__ __forceinline__ void scale_by(float (&x)[A][B][4], float f) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int e = 0; e < 4; ++e) x[a][b][e] *= f;
}

// Reductions over the four lanes that share one row of an MMA fragment.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_min(float x) {
    x = fminf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fminf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

}  // namespace cuflash
