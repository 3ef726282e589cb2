// FP32 -> Q8_1 a block at a time, as llama.cpp computes it (q8_1.cu's kernels, and gemv.cu's one-launch M = 1
// kernel, which quantizes X itself): the same values and sums whoever calls them.
#pragma once
#include "common.cuh"

// q = roundf(x / d) for N values of a block (d = amax/127), bit for bit, with one IEEE division a thread,
// not one a value: y = x * fl(1/d) is within |x/d| * 2^-23 <= 1.52e-5 of x/d, and fl(x/d) within 2^-18
// of it, so y and fl(x/d) round alike unless y lies within 2^-15 (3.05e-5) of a half-integer, i.e.
// |y - rint(y)| > 0.5 - 2^-15.  Away from half-integers rint (one FRND) and roundf agree.  Near one (about
// 6 values in 10^5), or where 1/d overflows (subnormal d below 2^-128: y is inf or NaN, and the test below
// is false for both), the thread redoes its N values with the reference's division: one rarely taken
// branch a thread, not one a value.
template <int N>
__device__ __forceinline__ void round_quants(const float (&x)[N], float amax, float d, int (&q)[N]) {
    const float inv = amax == 0.0f ? 0.0f : 1.0f / d;
    float r[N];
    bool exact = true;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const float y = x[j] * inv;
        r[j] = rintf(y);
        exact &= fabsf(y - r[j]) <= 0.5f - 0x1p-15f;
    }
    if (!exact) {
#pragma unroll
        for (int j = 0; j < N; ++j) r[j] = roundf(x[j] / d);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) q[j] = __float2int_rn(r[j]);
}

__device__ __forceinline__ int pack4(const int* q) {
    return (q[0] & 0xff) | (q[1] & 0xff) << 8 | (q[2] & 0xff) << 16 | (q[3] & 0xff) << 24;
}

// llama.cpp's MMQ activations (quantize_mmq_q8_1): d_inv = 127/amax, q = roundf(x*d_inv), d = 1/d_inv, in
// IEEE fp32 (llama.cpp builds with -use_fast_math, whose approximate divisions differ in the last bit for
// some amax: `git show 13e6adb:docs/reports/parity-llama-cpp.md` measures how rarely that moves a q).  The int8 conversion saturates and takes
// NaN to 0 (PTX's cvt), which only matters where d_inv overflows (amax < 127/FLT_MAX): there d = 0.
template <int N>
__device__ __forceinline__ float mmq_quants(const float (&x)[N], float amax, int (&q)[N]) {
    const float d_inv = 127.0f / amax;
#pragma unroll
    for (int j = 0; j < N; ++j) q[j] = max(-128, min(127, __float2int_rn(roundf(x[j] * d_inv))));
    return 1.0f / d_inv;
}

struct Q8_1Block4 {
    int packed;   // this thread's 4 quants
    float d, sum; // the block's scale and sum (the same in all 8 threads; MMQ: no sum)
};

// Four consecutive values a thread (one float4 load), 8 threads a block: the butterfly's offsets 16, 8, 4
// are lane xors 4, 2, 1; offsets 2, 1 are inside the thread: (v0 + v2) + (v1 + v3).
// MMQ: llama.cpp's MMQ rounding (mmq_quants) and no sum (its Q4_0 and Q8_0 formulas read none).
template <bool MMQ = false>
__device__ __forceinline__ Q8_1Block4 quantize4(float4 v) {
    float s[4] = {v.x, v.y, v.z, v.w};
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));  // max: any order
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) {
        if constexpr (!MMQ) {
#pragma unroll
            for (int j = 0; j < 4; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    Q8_1Block4 r;
    const float x[4] = {v.x, v.y, v.z, v.w};
    int q[4];
    if constexpr (MMQ) {
        r.sum = 0.0f;
        r.d = mmq_quants<4>(x, amax, q);
        r.packed = pack4(q);
        return r;
    }
    r.sum = (s[0] + s[2]) + (s[1] + s[3]);
    r.d = amax / 127.0f;  // IEEE division (no fast math): the reference's d bit for bit
    round_quants<4>(x, amax, r.d, q);
    r.packed = pack4(q);
    return r;
}
