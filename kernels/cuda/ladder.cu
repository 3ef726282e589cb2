// The seeds' ladder of W4A8 / W8A8 kernels: quantized weights x Q8_1 activations -> fp32 Y[M, N].
// Every rung computes llama.cpp's per-block formula (T::epilogue); they differ in how they reach it.
#include "common.cuh"

// naive (scalar) and dp4a: one thread per output, GGUF block layout.
template <typename T, bool DP4A>
__device__ void thread_per_output(const u8* __restrict__ W, const block_q8_1* __restrict__ A, float* __restrict__ Y,
                                  int M, int N, int K) {
    int m, n;
    if (!output_of_thread(M, N, m, n)) return;
    const int KB = K / QK;
    const u8* w = weight_row<T>(W, n, K);
    const block_q8_1* a = A + (size_t)m * KB;
    float acc = 0.0f;
    for (int kb = 0; kb < KB; ++kb) {
        int av[8];
        float2 ds;
        load_q8_1(a[kb], av, ds);
        const u8* b = w + (size_t)kb * T::BYTES;
        acc += T::epilogue(T::scale(b), T::template dot<DP4A>(b, av), ds);
    }
    Y[(size_t)m * N + n] = acc;
}

// tiled and tiled_dp4a: a BM x BN tile of Y per thread block, one Q8_1 block of K per step through
// shared memory; weights unpacked to int8 words on the way in; rows padded to 9 words (no conflicts).
template <typename T, int BM, int BN, int TM, int TN, bool DP4A>
__device__ void tiled(const u8* __restrict__ W, const block_q8_1* __restrict__ A, float* __restrict__ Y,
                      int M, int N, int K) {
    constexpr int TX = BN / TN, TY = BM / TM, NT = TX * TY;
    __shared__ int sA[BM][9];
    __shared__ int sW[BN][9];
    __shared__ float2 sAds[BM];
    __shared__ float sWd[BN];
    const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN, KB = K / QK;
    float acc[TM][TN] = {};
    for (int kb = 0; kb < KB; ++kb) {
        for (int idx = tid; idx < BM * 8; idx += NT) {
            const int r = idx / 8, c = idx % 8, m = m0 + r;
            sA[r][c] = m < M ? reinterpret_cast<const int*>(A[(size_t)m * KB + kb].qs)[c] : 0;
        }
        for (int r = tid; r < BM; r += NT) {
            const int m = m0 + r;
            sAds[r] = m < M ? __half22float2(A[(size_t)m * KB + kb].ds) : make_float2(0.f, 0.f);
        }
        for (int r = tid; r < BN; r += NT) {
            const int n = n0 + r;
            if (n < N) {
                const u8* b = W + ((size_t)n * KB + kb) * T::BYTES;
                unpack_words<T>(b, sW[r]);
                sWd[r] = T::scale(b);
            } else {
#pragma unroll
                for (int c = 0; c < 8; ++c) sW[r][c] = 0;
                sWd[r] = 0.f;
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TM; ++i) {
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int r = ty + i * TY, c = tx + j * TX;
                acc[i][j] += T::epilogue(sWd[c], dot8<DP4A>(sW[c], sA[r]), sAds[r]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int m = m0 + ty + i * TY, n = n0 + tx + j * TX;
            if (m < M && n < N) Y[(size_t)m * N + n] = acc[i][j];
        }
    }
}

// vec_dp4a: split layout (quants 16-byte aligned, scales apart); a warp per weight row, lanes over
// K blocks with 16-byte loads, MT activation rows reusing each weight block from registers.
template <typename T, int MT>
__device__ void vec_dp4a(const u8* __restrict__ Wq, const __half* __restrict__ Wd, const block_q8_1* __restrict__ A,
                         float* __restrict__ Y, int M, int N, int K) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * (blockDim.x / WARP) + warp;
    const int m0 = blockIdx.y * MT;
    if (n >= N) return;
    const int KB = K / QK;
    float acc[MT] = {};
    for (int kb = lane; kb < KB; kb += WARP) {
        int w[8];
        load_split_words<T>(Wq + ((size_t)n * KB + kb) * T::QS_BYTES, 0u, w);  // Q4_0/Q8_0: no fifth bits
        const float dw = __half2float(Wd[(size_t)n * KB + kb]);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            if (m0 + i < M) {
                int a[8];
                float2 ds;
                load_q8_1(A[(size_t)(m0 + i) * KB + kb], a, ds);
                acc[i] += T::epilogue(dw, dot8<true>(w, a), ds);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const float s = warp_sum(acc[i]);
        if (lane == 0 && m0 + i < M) Y[(size_t)(m0 + i) * N + n] = s;
    }
}

#define LADDER(t, T)                                                                                        \
    extern "C" __global__ void naive_##t(const u8* W, const block_q8_1* A, float* Y, int M, int N, int K) { \
        thread_per_output<T, false>(W, A, Y, M, N, K);                                                      \
    }                                                                                                       \
    extern "C" __global__ void dp4a_##t(const u8* W, const block_q8_1* A, float* Y, int M, int N, int K) {  \
        thread_per_output<T, true>(W, A, Y, M, N, K);                                                       \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                       \
        tiled_##t(const u8* W, const block_q8_1* A, float* Y, int M, int N, int K) {                        \
        tiled<T, 16, 16, 1, 1, false>(W, A, Y, M, N, K);                                                    \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                       \
        tiled_dp4a_##t(const u8* W, const block_q8_1* A, float* Y, int M, int N, int K) {                   \
        tiled<T, 64, 64, 4, 4, true>(W, A, Y, M, N, K);                                                     \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) vec_dp4a_##t(const u8* Wq, const __half* Wd,         \
                                                                   const block_q8_1* A, float* Y, int M,    \
                                                                   int N, int K) {                          \
        vec_dp4a<T, 4>(Wq, Wd, A, Y, M, N, K);                                                              \
    }
QGEMM_FOR_TYPES(LADDER)
