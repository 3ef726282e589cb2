// mmq: int8 tensor cores (mma.sync m16n8k32) over both operands tiled for them (mmq.cuh), llama.cpp's MMQ formula.
// Its entry points, one per variant (kernels.py Mmq declares them).
#include "common.cuh"
#include "groups.cuh"
#include "mma.cuh"
#include "mmq.cuh"

// The entries, each also as name_m32 (HALF, for M <= 32; launch: Mmq).  Formats with a minimum: unsigned weights,
// and the m_w s_a term (sa: the activations' sums, tiled as dc).  mmq16: the formats with a scale per 16 values
// (Q6_K; Q2_K with its minima and D2S6 sums): wd, wm and sa hold two values a block and row, the halves'
// (launch.py's mmq layout with H = 2; q8_1.cu's D2S6 quantizer).  mmq_d2: two int8 digits a value (Q6_K, D = 2).
#define MMQ_ENTRY_D(name, H, HALF, MINB, D)                                                                     \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MINB)                                             \
        name(const i8* __restrict__ wq, const float* __restrict__ wd, const i8* __restrict__ aq,               \
             const float2* __restrict__ dc, float* __restrict__ Y, int M, int N, int K, int stages_per_split,  \
             int atomic) {                                                                                      \
        extern __shared__ __align__(128) char smem[];                                                           \
        mmq_tile<false, H, HALF, D>(wq, wd, aq, dc, nullptr, nullptr, Y, M, N, K, stages_per_split, atomic,    \
                                    smem);                                                                      \
    }
#define MMQ_ENTRY(name, H, HALF, MINB) MMQ_ENTRY_D(name, H, HALF, MINB, 1)
#define MMQ_ENTRY_MIN(name, H, HALF)                                                                            \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQ_MIN_BLOCKS)                                   \
        name(const i8* __restrict__ wq, const float* __restrict__ wd, const i8* __restrict__ aq,               \
             const float2* __restrict__ dc, const void* __restrict__ sa, const void* __restrict__ wm,          \
             float* __restrict__ Y, int M, int N, int K, int stages_per_split, int atomic) {                    \
        extern __shared__ __align__(128) char smem[];                                                           \
        mmq_tile<true, H, HALF>(wq, wd, aq, dc, sa, wm, Y, M, N, K, stages_per_split, atomic, smem);            \
    }
MMQ_ENTRY(mmq, 1, false, MMQ_MIN_BLOCKS_PLAIN) MMQ_ENTRY(mmq_m32, 1, true, MMQ_MIN_BLOCKS)
MMQ_ENTRY_MIN(mmq_min, 1, false) MMQ_ENTRY_MIN(mmq_min_m32, 1, true)
MMQ_ENTRY(mmq16, 2, false, MMQ_MIN_BLOCKS) MMQ_ENTRY(mmq16_m32, 2, true, MMQ_MIN_BLOCKS)
MMQ_ENTRY_MIN(mmq16_min, 2, false) MMQ_ENTRY_MIN(mmq16_min_m32, 2, true)
MMQ_ENTRY_D(mmq_d2, 1, false, MMQ_MIN_BLOCKS, 2) MMQ_ENTRY_D(mmq_d2_m32, 1, true, MMQ_MIN_BLOCKS, 2)
