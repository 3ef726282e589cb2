// bitsandbytes' NF4 / FP4 (kernels/bnb4.py): the blockwise dequantization and a GEMV on the packed codes.
// Codes are bitsandbytes' order: byte j holds value 2j in its high nibble and 2j+1 in its low one; a block's
// absmax (float32, or with double quantization code8[q] * absmax2[b / 256] + offset) scales blocksize values
// of the flattened matrix, so a 4-byte load (8 values, 8-aligned) always lies in one block.
#include "common.cuh"

__constant__ float BNB4_CODE[2][16] = {
    {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
     -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
     0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f,
     1.0f},
    // FP4: {0, 0.0625, 8, 12, 4, 6, 2, 3} / 12 and their negatives, rounded as float32 divides them
    {0.0f, 0.0052083335f, 0.6666667f, 1.0f, 0.33333334f, 0.5f, 0.16666667f, 0.25f,
     -0.0f, -0.0052083335f, -0.6666667f, -1.0f, -0.33333334f, -0.5f, -0.16666667f, -0.25f}};

// The block scale of flat element e: the absmax, or the double-quantized one decoded as bitsandbytes does
// (a rounded product, then a rounded sum: no FMA).
template <bool DQ>
__device__ __forceinline__ float bnb4_scale(const float* __restrict__ absmax, const u8* __restrict__ qabs,
                                            const float* __restrict__ absmax2, const float* __restrict__ code8,
                                            float offset, int log2_bs, long long e) {
    const long long b = e >> log2_bs;
    if (!DQ) return __ldg(absmax + b);
    return __fadd_rn(__fmul_rn(__ldg(code8 + __ldg(qabs + b)), __ldg(absmax2 + (b >> 8))), offset);
}

// The 8 code-book values of a 4-byte load, in order (high nibble first).
__device__ __forceinline__ void bnb4_decode8(const unsigned u, const float* tab, float v[8]) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        v[2 * b] = tab[(u >> (8 * b + 4)) & 15];
        v[2 * b + 1] = tab[(u >> (8 * b)) & 15];
    }
}

template <int QT>
__device__ __forceinline__ const float* bnb4_table() {
    __shared__ float tab[16];  // 16 words in 16 banks: any lookup pattern is conflict-free
    if (threadIdx.x < 16) tab[threadIdx.x] = BNB4_CODE[QT][threadIdx.x];
    __syncthreads();
    return tab;
}

// Y[M, N] = X[M, K] W^T for M <= MR: a warp per weight row; lane l takes 8 values at a time (4 bytes of codes,
// 8 in flight), so that a warp's activation loads are 1 KiB contiguous; each word is decoded once for every
// activation row: sum_j code_j x_j over the 8 values, times their block's scale (bitsandbytes' sum of
// x_j (code_j absmax) in another rounding order).
template <int QT, bool DQ, int MR>
__device__ void gemv_bnb4(const unsigned* __restrict__ W, const float* __restrict__ absmax,
                          const u8* __restrict__ qabs, const float* __restrict__ absmax2,
                          const float* __restrict__ code8, float offset, int log2_bs, const float* __restrict__ X,
                          float* __restrict__ Y, int M, int N, int K) {
    const float* tab = bnb4_table<QT>();
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, n = blockIdx.x * (blockDim.x / WARP) + warp;
    if (n >= N) return;
    const int words = K / 8;
    const unsigned* row = W + (size_t)n * words;
    float acc[MR];
#pragma unroll
    for (int r = 0; r < MR; ++r) acc[r] = 0.0f;
#pragma unroll 8
    for (int c = lane; c < words; c += WARP) {
        const unsigned u = load_once<false>(row + c);  // streamed once
        const float sc = bnb4_scale<DQ>(absmax, qabs, absmax2, code8, offset, log2_bs, (long long)n * K + 8LL * c);
        float v[8];
        bnb4_decode8(u, tab, v);
#pragma unroll
        for (int r = 0; r < MR; ++r) {
            if (r >= M) break;
            const float4* x = reinterpret_cast<const float4*>(X + (size_t)r * K) + 2 * c;
            const float4 a = __ldg(x), b = __ldg(x + 1);
            float p = v[0] * a.x;
            p = fmaf(v[1], a.y, p);
            p = fmaf(v[2], a.z, p);
            p = fmaf(v[3], a.w, p);
            p = fmaf(v[4], b.x, p);
            p = fmaf(v[5], b.y, p);
            p = fmaf(v[6], b.z, p);
            p = fmaf(v[7], b.w, p);
            acc[r] = fmaf(sc, p, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MR; ++r) {
        if (r >= M) break;
        const float s = warp_sum(acc[r]);
        if (lane == 0) Y[(size_t)r * N + n] = s;
    }
}

// The float32 matrix bitsandbytes' dequantize_4bit gives (code * absmax, one rounding): a thread per 8 values,
// so that a warp's stores are 1 KiB contiguous.
template <int QT, bool DQ>
__device__ void dequantize_bnb4(const unsigned* __restrict__ W, const float* __restrict__ absmax,
                                const u8* __restrict__ qabs, const float* __restrict__ absmax2,
                                const float* __restrict__ code8, float offset, int log2_bs, float4* __restrict__ out,
                                long long words) {
    const float* tab = bnb4_table<QT>();
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= words) return;
    const float sc = bnb4_scale<DQ>(absmax, qabs, absmax2, code8, offset, log2_bs, 8LL * c);
    float v[8];
    bnb4_decode8(load_once<false>(W + c), tab, v);
    out[2 * c] = make_float4(__fmul_rn(v[0], sc), __fmul_rn(v[1], sc), __fmul_rn(v[2], sc), __fmul_rn(v[3], sc));
    out[2 * c + 1] = make_float4(__fmul_rn(v[4], sc), __fmul_rn(v[5], sc), __fmul_rn(v[6], sc), __fmul_rn(v[7], sc));
}

#define BNB4_ARGS                                                                                             \
    const unsigned *W, const float *absmax, const u8 *qabs, const float *absmax2, const float *code8, float offset, \
        int log2_bs
#define BNB4_PASS W, absmax, qabs, absmax2, code8, offset, log2_bs
#define BNB4_GEMV(name, QT, DQ, MR)                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        name(BNB4_ARGS, const float* X, float* Y, int M, int N, int K) {                                      \
        gemv_bnb4<QT, DQ, MR>(BNB4_PASS, X, Y, M, N, K);                                                      \
    }
#define BNB4_KERNELS(t, QT, DQ, dq)                                                                           \
    BNB4_GEMV(gemv_bnb4_##t##dq##_1, QT, DQ, 1)                                                               \
    BNB4_GEMV(gemv_bnb4_##t##dq##_2, QT, DQ, 2)                                                               \
    BNB4_GEMV(gemv_bnb4_##t##dq##_4, QT, DQ, 4)                                                               \
    BNB4_GEMV(gemv_bnb4_##t##dq##_8, QT, DQ, 8)                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        dequantize_bnb4_##t##dq(BNB4_ARGS, float4* out, long long words) {                                   \
        dequantize_bnb4<QT, DQ>(BNB4_PASS, out, words);                                                      \
    }
BNB4_KERNELS(nf4, 0, false, )
BNB4_KERNELS(nf4, 0, true, _dq)
BNB4_KERNELS(fp4, 1, false, )
BNB4_KERNELS(fp4, 1, true, _dq)
