// The fast kernels: `mmq` (int8 tensor cores, mma.sync m16n8k32) for M > 8 and `gemv` (a weight
// stream at the memory roofline) for M <= 8.  Both read activations in the split Q8_1 layout
// (aq int8 [M, K], ads half2 [M, K/32]) and compute llama.cpp's per-block formula exactly:
// one 32-value block is one MMA's K, so sumi is the exact integer block dot, scaled in fp32.
#include "common.cuh"

// ---- mmq --------------------------------------------------------------------------------------
// Weights repacked at upload ("mmq" layout): wq int8 [N, K] (Q4_0 widened to 0..15), wd fp32 [N, K/32].
// Tile 64 (M) x 128 (N) per block of 8 warps, each warp 32 x 32 (2 x 4 MMAs); K staged 4 blocks
// (128 values) at a time through shared memory with 16-byte loads; rows padded to 36 words so the
// fragment loads of a warp hit 32 distinct banks.  Split-K over gridDim.z adds into a zeroed Y.
#define MMQ_BM 64
#define MMQ_BN 128
#define MMQ_BKB 4
#define MMQ_LD 36

__device__ __forceinline__ void mma_s8(int* c, const int* a, const int* b) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename T>
__device__ void mmq(const i8* __restrict__ wq, const float* __restrict__ wd, const i8* __restrict__ aq,
                    const __half2* __restrict__ ads, float* __restrict__ Y, int M, int N, int K, int kb_per_split,
                    int atomic) {
    __shared__ __align__(16) int sA[MMQ_BM * MMQ_LD];
    __shared__ __align__(16) int sB[MMQ_BN * MMQ_LD];
    __shared__ float sAd[MMQ_BM][MMQ_BKB], sAs[MMQ_BM][MMQ_BKB], sBd[MMQ_BN][MMQ_BKB];
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp / 4, wn = warp % 4;
    const int m0 = blockIdx.y * MMQ_BM, n0 = blockIdx.x * MMQ_BN, KB = K / QK;
    const int kb_begin = blockIdx.z * kb_per_split, kb_end = min(KB, kb_begin + kb_per_split);
    float acc[2][4][4] = {};
    for (int kb0 = kb_begin; kb0 < kb_end; kb0 += MMQ_BKB) {
        for (int idx = tid; idx < MMQ_BM * MMQ_BKB * 2; idx += 256) {
            const int r = idx / (MMQ_BKB * 2), c = idx % (MMQ_BKB * 2), m = m0 + r, kb = kb0 + c / 2;
            int4 v = make_int4(0, 0, 0, 0);
            if (m < M && kb < kb_end) v = *reinterpret_cast<const int4*>(aq + (size_t)m * K + (size_t)kb * QK + (c & 1) * 16);
            *reinterpret_cast<int4*>(&sA[r * MMQ_LD + c * 4]) = v;
        }
        for (int idx = tid; idx < MMQ_BN * MMQ_BKB * 2; idx += 256) {
            const int r = idx / (MMQ_BKB * 2), c = idx % (MMQ_BKB * 2), n = n0 + r, kb = kb0 + c / 2;
            int4 v = make_int4(0, 0, 0, 0);
            if (n < N && kb < kb_end) v = *reinterpret_cast<const int4*>(wq + (size_t)n * K + (size_t)kb * QK + (c & 1) * 16);
            *reinterpret_cast<int4*>(&sB[r * MMQ_LD + c * 4]) = v;
        }
        for (int idx = tid; idx < MMQ_BM * MMQ_BKB; idx += 256) {
            const int r = idx / MMQ_BKB, j = idx % MMQ_BKB, m = m0 + r, kb = kb0 + j;
            const float2 ds = (m < M && kb < kb_end) ? __half22float2(ads[(size_t)m * KB + kb]) : make_float2(0.f, 0.f);
            sAd[r][j] = ds.x;
            sAs[r][j] = ds.y;
        }
        for (int idx = tid; idx < MMQ_BN * MMQ_BKB; idx += 256) {
            const int r = idx / MMQ_BKB, j = idx % MMQ_BKB, n = n0 + r, kb = kb0 + j;
            sBd[r][j] = (n < N && kb < kb_end) ? wd[(size_t)n * KB + kb] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < MMQ_BKB; ++j) {
            int a[2][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r = wm * 32 + mi * 16 + g;
                a[mi][0] = sA[r * MMQ_LD + j * 8 + t];
                a[mi][1] = sA[(r + 8) * MMQ_LD + j * 8 + t];
                a[mi][2] = sA[r * MMQ_LD + j * 8 + 4 + t];
                a[mi][3] = sA[(r + 8) * MMQ_LD + j * 8 + 4 + t];
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int c = wn * 32 + ni * 8 + g;
                b[ni][0] = sB[c * MMQ_LD + j * 8 + t];
                b[ni][1] = sB[c * MMQ_LD + j * 8 + 4 + t];
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r0 = wm * 32 + mi * 16 + g;
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) {
                    int c[4] = {0, 0, 0, 0};
                    mma_s8(c, a[mi], b[ni]);
                    const int q0 = wn * 32 + ni * 8 + 2 * t;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = r0 + (e >> 1) * 8, q = q0 + (e & 1);
                        acc[mi][ni][e] += T::epilogue(sBd[q][j], c[e], make_float2(sAd[r][j], sAs[r][j]));
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = m0 + wm * 32 + mi * 16 + g + (e >> 1) * 8;
                const int n = n0 + wn * 32 + ni * 8 + 2 * t + (e & 1);
                if (m < M && n < N) {
                    if (atomic) atomicAdd(&Y[(size_t)m * N + n], acc[mi][ni][e]);
                    else Y[(size_t)m * N + n] = acc[mi][ni][e];
                }
            }
}

// ---- gemv -------------------------------------------------------------------------------------
// A warp per weight row of the split layout, lanes over K blocks, 16-byte loads of weights and
// activations, the loop unrolled so several loads are in flight; MT activation rows share each
// weight block from registers.
template <typename T, int MT>
__device__ void gemv(const u8* __restrict__ wq, const __half* __restrict__ wd, const i8* __restrict__ aq,
                     const __half2* __restrict__ ads, float* __restrict__ Y, int M, int N, int K) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * (blockDim.x / WARP) + warp;
    if (n >= N) return;
    const int KB = K / QK;
    const u8* wrow = wq + (size_t)n * KB * T::QS_BYTES;
    const __half* drow = wd + (size_t)n * KB;
    float acc[MT] = {};
#pragma unroll 4
    for (int kb = lane; kb < KB; kb += WARP) {
        int w[8];
        load_split_words<T>(wrow + (size_t)kb * T::QS_BYTES, w);
        const float dw = __half2float(drow[kb]);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            if (i < M) {
                const int4* ap = reinterpret_cast<const int4*>(aq + (size_t)i * K + (size_t)kb * QK);
                const int4 a0 = __ldg(ap), a1 = __ldg(ap + 1);
                const int a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                acc[i] += T::epilogue(dw, dot8<true>(w, a), __half22float2(ads[(size_t)i * KB + kb]));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const float s = warp_sum(acc[i]);
        if (lane == 0 && i < M) Y[(size_t)i * N + n] = s;
    }
}

#define FAST(t, T)                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        mmq_##t(const i8* wq, const float* wd, const i8* aq, const __half2* ads, float* Y, int M, int N, int K, \
                int kb_per_split, int atomic) {                                                                 \
        mmq<T>(wq, wd, aq, ads, Y, M, N, K, kb_per_split, atomic);                                              \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        gemv_##t(const u8* wq, const __half* wd, const i8* aq, const __half2* ads, float* Y, int M, int N,      \
                 int K) {                                                                                       \
        if (M <= 1) gemv<T, 1>(wq, wd, aq, ads, Y, M, N, K);                                                    \
        else if (M <= 2) gemv<T, 2>(wq, wd, aq, ads, Y, M, N, K);                                               \
        else if (M <= 4) gemv<T, 4>(wq, wd, aq, ads, Y, M, N, K);                                               \
        else gemv<T, 8>(wq, wd, aq, ads, Y, M, N, K);                                                           \
    }
QGEMM_FOR_TYPES(FAST)
