// On-device FP32 -> Q8_1, as llama.cpp's quantize_q8_1: one warp per 32-value block.
#include "common.cuh"

// x: [M, K] row-major fp32, y: [M, K/32] blocks; n_values = M*K (a multiple of 32).
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, block_q8_1* __restrict__ y,
                                         long long n_values) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_values) return;  // whole warps leave together: n_values and blockDim are multiples of 32
    const float xi = x[i];
    const float amax = warp_max(fabsf(xi));
    const float sum = warp_sum(xi);
    const float d = amax / 127.0f;  // IEEE division (no fast math): the reference's q bit for bit
    const i8 q = amax == 0.0f ? i8(0) : i8(roundf(xi / d));
    block_q8_1& b = y[i / QK];
    b.qs[i % QK] = q;
    if (i % QK == 0) b.ds = make_half2(__float2half(d), __float2half(sum));
}

// The same quantization written straight into the split layout the fast kernels read: int8 rows
// qs [M, K] (16-byte aligned blocks) and ds [M, K/32] half2 (d, sum) apart.
extern "C" __global__ void quantize_q8_1_split(const float* __restrict__ x, i8* __restrict__ qs,
                                               __half2* __restrict__ ds, long long n_values) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_values) return;
    const float xi = x[i];
    const float amax = warp_max(fabsf(xi));
    const float sum = warp_sum(xi);
    const float d = amax / 127.0f;
    qs[i] = amax == 0.0f ? i8(0) : i8(roundf(xi / d));
    if (i % QK == 0) ds[i / QK] = make_half2(__float2half(d), __float2half(sum));
}
