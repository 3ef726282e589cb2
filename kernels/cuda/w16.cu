// FP32-activation kernels (W4A16 / W8A16): weights dequantized inside the kernel, fp32 math; the
// one-time dequantization to fp16 / fp32 that the cuBLAS kernels multiply with; and the float matrices'
// own kernels (llama.cpp's F16 and BF16 matrix-vector product, the cuBLAS products' casts).
#include "common.cuh"
#include <cuda_bf16.h>

template <typename T>
__device__ void w16_naive(const u8* __restrict__ W, const float* __restrict__ X, float* __restrict__ Y,
                          int M, int N, int K) {
    int m, n;
    if (!output_of_thread(M, N, m, n)) return;
    const int KB = K / QK;
    const u8* w = weight_row<T>(W, n, K);
    const float* x = X + (size_t)m * K;
    float acc = 0.0f;
    for (int kb = 0; kb < KB; ++kb) {  // a sum per 32-value block, then over blocks: two-level rounding
        const u8* b = w + (size_t)kb * T::BYTES;
        float blk = 0.0f;
        for (int j = 0; j < QK; ++j) blk += x[kb * QK + j] * T::value(b, j);
        acc += blk;
    }
    Y[(size_t)m * N + n] = acc;
}

// 64 x 64 tile of Y per block, 4 x 4 per thread, K in steps of one 32-value block through shared memory.
template <typename T>
__device__ void w16_tiled(const u8* __restrict__ W, const float* __restrict__ X, float* __restrict__ Y,
                          int M, int N, int K) {
    constexpr int BM = 64, BN = 64;
    __shared__ float sX[QK][BM + 1];
    __shared__ float sW[QK][BN + 1];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN, KB = K / QK;
    float acc[4][4] = {};
    for (int kb = 0; kb < KB; ++kb) {
        for (int idx = tid; idx < BM * QK; idx += 256) {  // coalesced along k
            const int r = idx / QK, k = idx % QK, m = m0 + r;
            sX[k][r] = m < M ? X[(size_t)m * K + kb * QK + k] : 0.0f;
        }
        for (int idx = tid; idx < BN * QK; idx += 256) {
            const int r = idx / QK, k = idx % QK, n = n0 + r;
            sW[k][r] = n < N ? T::value(W + ((size_t)n * KB + kb) * T::BYTES, k) : 0.0f;
        }
        __syncthreads();
        float blk[4][4] = {};  // this block's partial sums, added to acc once: two-level rounding
#pragma unroll 8
        for (int k = 0; k < QK; ++k) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) { a[i] = sX[k][ty + 16 * i]; b[i] = sW[k][tx + 16 * i]; }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) blk[i][j] += a[i] * b[j];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] += blk[i][j];
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
            if (m < M && n < N) Y[(size_t)m * N + n] = acc[i][j];
        }
}

template <typename T, typename OUT>
__device__ void dequantize(const u8* __restrict__ W, OUT* __restrict__ out, long long n_values) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_values) return;
    out[i] = OUT(T::value(W + (i / QK) * T::BYTES, int(i % QK)));
}

#define W16(t, T)                                                                                          \
    extern "C" __global__ void w16_naive_##t(const u8* W, const float* X, float* Y, int M, int N, int K) { \
        w16_naive<T>(W, X, Y, M, N, K);                                                                    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        w16_tiled_##t(const u8* W, const float* X, float* Y, int M, int N, int K) {                        \
        w16_tiled<T>(W, X, Y, M, N, K);                                                                    \
    }                                                                                                      \
    extern "C" __global__ void dequantize_f32_##t(const u8* W, float* out, long long n) {                  \
        dequantize<T, float>(W, out, n);                                                                   \
    }                                                                                                      \
    extern "C" __global__ void dequantize_f16_##t(const u8* W, __half* out, long long n) {                 \
        dequantize<T, __half>(W, out, n);                                                                  \
    }
QGEMM_FOR_TYPES(W16)

// llama.cpp's mul_mat_vec_f for an F16 or BF16 matrix and one activation row, bit for bit (reference.ref_f16_mmvf,
// ref_bf16_mmvf).  ggml gives a row a block of bs threads (bs = 32 W from mmvf_block_size): thread t sums value
// pairs t, t + bs, ...; then a butterfly per warp, and the warps' sums (zero-padded to 32) through a second one.
// Here a warp takes a row (4 rows a block, no barrier) with 16-byte weight loads: lane l plays threads
// t = 128 h + 4 l + j (j < 4, h < H = bs / 128 rounded up), whose pairs 4 l .. 4 l + 3 of each 128 are one load.
// Thread t's lane in its warp is 4 (l % 8) + j, so the warp butterfly's partners t ^ 16, ^ 8, ^ 4 are lanes
// l ^ 4, ^ 2, ^ 1 and t ^ 2, ^ 1 are registers j ^ 2, ^ 1: the same additions in the same order.  The warps' sums
// (warp w at lanes 8 (w % 4), registers h = w / 4) meet in the second butterfly.  Needs K % 8 == 0 (whole,
// aligned 16-byte groups; kernels take K % 32 == 0); `Acc` is how a thread accumulates a pair.  Against ggml's
// block a row on the H100: 55 -> 40.5 us at N = 4096, K = 14336 (96% of copy bandwidth; kernels-at-the-limit.md).
struct MmvfF16Acc {  // default precision: half2 sums of hfma2(w, half2(x)), then low + high in float
    __half2 s = __float2half2_rn(0.0f);
    __device__ __forceinline__ void add(unsigned w, float2 x) {
        s = __hfma2(*reinterpret_cast<const __half2*>(&w), __float22half2_rn(x), s);
    }
    __device__ __forceinline__ float sum() const { return __low2float(s) + __high2float(s); }
};
struct MmvfBf16Acc {  // a float sum of fmaf(w, x) over the pair's two values (bf16 widens exactly)
    float s = 0.0f;
    __device__ __forceinline__ void add(unsigned w, float2 x) {
        s = fmaf(__uint_as_float(w << 16), x.x, s);
        s = fmaf(__uint_as_float(w & 0xFFFF0000u), x.y, s);
    }
    __device__ __forceinline__ float sum() const { return s; }
};

template <class Acc, int H, int U>  // U: steps whose loads are issued before their sums
__device__ __forceinline__ void mmvf_warp(const int4* __restrict__ W, const float4* __restrict__ x,
                                          float* __restrict__ Y, int N, int K, int bs) {
    const int lane = threadIdx.x % WARP, n = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (n >= N) return;
    const int pairs = K / 2;
    const int4* row = W + (size_t)n * (pairs / 4);
    Acc acc[H][4];
    let_dependents_launch();  // launched dependent (pdl.py): the next kernel may get resident now
    for (int s0 = 0; s0 < pairs; s0 += U * bs) {
        int4 w[U][H];
        float4 xa[U][H], xb[U][H];
        // f(u, h, p) for each group of 4 pairs this lane takes in the step: p % 4 == 0, a whole group or none.
        // All weight loads, then all activation loads, then the sums (the order in which they are in flight).
        auto groups = [&](auto&& f) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int h = 0; h < H; ++h) {
                    const int t = 128 * h + 4 * lane, p = s0 + u * bs + t;
                    if (t < bs && p < pairs) f(u, h, p);
                }
        };
        groups([&](int u, int h, int p) { w[u][h] = load_once<false>(row + p / 4); });
        if (s0 == 0) wait_for_inputs();  // the first weights are on their way; x may come from the kernel before
        groups([&](int u, int h, int p) {
            xa[u][h] = __ldg(x + p / 2);
            xb[u][h] = __ldg(x + p / 2 + 1);
        });
        groups([&](int u, int h, int) {
            acc[h][0].add(unsigned(w[u][h].x), make_float2(xa[u][h].x, xa[u][h].y));
            acc[h][1].add(unsigned(w[u][h].y), make_float2(xa[u][h].z, xa[u][h].w));
            acc[h][2].add(unsigned(w[u][h].z), make_float2(xb[u][h].x, xb[u][h].y));
            acc[h][3].add(unsigned(w[u][h].w), make_float2(xb[u][h].z, xb[u][h].w));
        });
    }
    float warp_of[H];  // each warp's butterfly: t ^ 16, 8, 4 across lanes, t ^ 2, 1 across registers
#pragma unroll
    for (int h = 0; h < H; ++h) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = acc[h][j].sum();
#pragma unroll
        for (int off = 4; off > 0; off >>= 1)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] += __shfl_xor_sync(0xffffffffu, v[j], off);
        const float a = v[0] + v[2], b = v[1] + v[3];
        warp_of[h] = a + b;
    }
    float s = warp_of[0];
    if (bs > WARP) {  // lane w < W takes warp w's sum; the rest are the zero padding
        s = 0.0f;
#pragma unroll
        for (int h = 0; h < H; ++h) {
            const float from = __shfl_sync(0xffffffffu, warp_of[h], 8 * (lane % 4));
            if (lane / 4 == h && lane < bs / WARP) s = from;
        }
        s = warp_sum(s);
    }
    if (lane == 0) Y[n] = s;
}

// H = 1 (bs <= 128) with two steps' loads ahead, H = 2 with one (48 registers: a row per warp, every row at once)
#define MMVF_WARP(t, ACC, H, U)                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        mmvf_warp_##t##_h##H(const int4* W, const float4* x, float* Y, int N, int K, int bs) {             \
        mmvf_warp<ACC, H, U>(W, x, Y, N, K, bs);                                                           \
    }
MMVF_WARP(f16, MmvfF16Acc, 1, 2)
MMVF_WARP(f16, MmvfF16Acc, 2, 1)
MMVF_WARP(bf16, MmvfBf16Acc, 1, 2)
MMVF_WARP(bf16, MmvfBf16Acc, 2, 1)

// The cuBLAS products' casts: activations fp32 -> fp16 or bf16 (to nearest even, as ggml's to_fp16 / to_bf16
// round them), and F16's half products widened to fp32 (exact, as ggml's to_fp32).  Eight values a thread, in
// 16- and 32-byte accesses where both pointers are 16-byte aligned (else, and in the tail, one at a time: the same
// bits).  One value a thread (CuPy's copyto) took 3-4x as long (H200, F16 at M = 2048: 40.7 -> 12.0 us).
#define CAST_PER_THREAD 8
__device__ __forceinline__ unsigned short narrow_bits(float v, __half*) { return __half_as_ushort(__float2half_rn(v)); }
__device__ __forceinline__ unsigned short narrow_bits(float v, __nv_bfloat16*) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
template <typename H>
__device__ __forceinline__ void narrow(const float* __restrict__ x, H* __restrict__ out, long long n) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * CAST_PER_THREAD;
    if (i >= n) return;
    unsigned short* o = reinterpret_cast<unsigned short*>(out);
    if (i + CAST_PER_THREAD <= n && ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(out)) & 15) == 0) {
        const float4 a = reinterpret_cast<const float4*>(x + i)[0], b = reinterpret_cast<const float4*>(x + i)[1];
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        unsigned w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            w[j] = narrow_bits(v[2 * j], out) | (unsigned)narrow_bits(v[2 * j + 1], out) << 16;
        *reinterpret_cast<int4*>(o + i) = make_int4(w[0], w[1], w[2], w[3]);
        return;
    }
    for (long long j = i; j < min(n, i + CAST_PER_THREAD); ++j) o[j] = narrow_bits(x[j], out);
}
extern "C" __global__ void to_f16(const float* __restrict__ x, __half* __restrict__ out, long long n) {
    narrow(x, out, n);
}
extern "C" __global__ void to_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ out, long long n) {
    narrow(x, out, n);
}
extern "C" __global__ void widen_f16(const __half* __restrict__ h, float* __restrict__ y, long long n) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * CAST_PER_THREAD;
    if (i >= n) return;
    if (i + CAST_PER_THREAD <= n && ((reinterpret_cast<size_t>(h) | reinterpret_cast<size_t>(y)) & 15) == 0) {
        const int4 q = *reinterpret_cast<const int4*>(h + i);
        const unsigned w[4] = {(unsigned)q.x, (unsigned)q.y, (unsigned)q.z, (unsigned)q.w};
        float v[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[2 * j] = __half2float(__ushort_as_half((unsigned short)(w[j] & 0xffff)));
            v[2 * j + 1] = __half2float(__ushort_as_half((unsigned short)(w[j] >> 16)));
        }
        reinterpret_cast<float4*>(y + i)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(y + i)[1] = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    for (long long j = i; j < min(n, i + CAST_PER_THREAD); ++j) y[j] = __half2float(h[j]);
}

// ---- float matrices at 2-16 rows on tensor cores (mmf) -------------------------------------------
// llama.cpp's mul_mat_f formula (products of 16-bit weights and activations, exact in fp32; fp32 sums) as
// mma.sync m16n8k16 with fp32 accumulators, the weights streamed once.  A block of 8 warps takes 16 weight rows
// (two row tiles a block measured slower, sweeps 36-39); warp w takes U consecutive 32-value chunks of K at a time
// (w U, then w U + 8 U, ...).  Per chunk a lane (g, t) loads 16 bytes (8 values, k 8t..8t+7 of the chunk) of weight
// rows g and g + 8 and of activation row g of each n8 tile: those are the A and B registers of two MMAs once both sides take the MMAs' k in
// the same permuted order (a lane's values 0-1 and 2-3 as k 2t, 2t+1 and 2t+8, 2t+9 of the first MMA, 4-7 likewise
// of the second), so no shuffle and no shared memory in the loop.  A step's loads all go out before its MMAs, which
// accumulate into a set of registers per chunk of the step (independent chains: with one set, ptxas interleaved
// the loads with the MMAs).  The sets, then the 8 warps' tiles (in shared memory), add in a fixed order.
// K % 8 == 0 (16-byte rows); rows past N or M and values past K are zeros.
template <bool BF>
__device__ __forceinline__ void mma_16x8x16_f32(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                unsigned b0, unsigned b1) {
    if constexpr (BF)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#define MMF_WARPS 8
template <bool BF, int MT, int U>
__device__ __forceinline__ void mmf_skinny(const int4* __restrict__ W, const int4* __restrict__ X,
                                           float* __restrict__ Y, int M, int N, int K) {
    __shared__ float part[MMF_WARPS][MT][4][WARP];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16, row16 = K / 8;  // 16-byte pieces a row
    const int chunks = (K + 31) / 32;
    const int4 zero = make_int4(0, 0, 0, 0);
    // Rows and pieces past the matrix load a clamped (valid) address and are zeroed once the step's loads are out.
    const int4* wrow[2];
    const int4* xrow[MT];
    bool wok[2], xok[MT];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int n = n0 + g + 8 * h;
        wok[h] = n < N;
        wrow[h] = W + (size_t)min(n, N - 1) * row16 + t;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int m = 8 * mt + g;
        xok[mt] = m < M;
        xrow[mt] = X + (size_t)min(m, M - 1) * row16 + t;
    }
    float acc[U][MT][4] = {};
    for (int c0 = warp * U; c0 < chunks; c0 += MMF_WARPS * U) {
        int4 a[U][2], b[U][MT];
        int at[U];
        bool kok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u;
            kok[u] = c < chunks && c * 4 + t < row16;
            at[u] = min(c * 4, row16 - 1 - t);  // this lane's piece: at + t
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int h = 0; h < 2; ++h) a[u][h] = load_once<false>(wrow[h] + at[u]);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) b[u][mt] = __ldg(xrow[mt] + at[u]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (!(kok[u] && wok[h])) a[u][h] = zero;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                if (!(kok[u] && xok[mt])) b[u][mt] = zero;
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int4 lo = a[u][0], hi = a[u][1], x = b[u][mt];
                mma_16x8x16_f32<BF>(acc[u][mt], lo.x, hi.x, lo.y, hi.y, x.x, x.y);
                mma_16x8x16_f32<BF>(acc[u][mt], lo.z, hi.z, lo.w, hi.w, x.z, x.w);
            }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float v = acc[0][mt][e];
#pragma unroll
            for (int u = 1; u < U; ++u) v += acc[u][mt][e];
            part[warp][mt][e][lane] = v;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < MT * 4 * WARP; i += blockDim.x) {
        const int l = i % WARP, e = (i / WARP) % 4, mt = i / (4 * WARP);
        const int n = n0 + (l >> 2) + 8 * (e >> 1), m = 8 * mt + 2 * (l & 3) + (e & 1);
        if (n >= N || m >= M) continue;
        float s = part[0][mt][e][l];
#pragma unroll
        for (int w = 1; w < MMF_WARPS; ++w) s += part[w][mt][e][l];
        Y[(size_t)m * N + n] = s;
    }
}
#ifndef MMF_U
#define MMF_U 4
#endif
#define MMF(t, BF, MT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MMF_WARPS * WARP, 2)                                      \
        mmf_##t##_m##MT(const int4* W, const int4* X, float* Y, int M, int N, int K) {                     \
        mmf_skinny<BF, MT, MMF_U>(W, X, Y, M, N, K);                                                       \
    }
MMF(f16, false, 1)
MMF(f16, false, 2)
MMF(bf16, true, 1)
MMF(bf16, true, 2)
