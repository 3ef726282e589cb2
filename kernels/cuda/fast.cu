// The fast kernels: `mmq` (int8 tensor cores, mma.sync m16n8k32) for M > 8 and `gemv` (a weight
// stream at the memory roofline) for M <= 8.  Both read activations in the split Q8_1 layout
// (aq int8 [M, K], ads half2 [M, K/32]) and compute llama.cpp's per-block formula exactly:
// one 32-value block is one MMA's K, so sumi is the exact integer block dot, scaled in fp32.
#include "common.cuh"

// ---- mmq --------------------------------------------------------------------------------------
// Weights repacked at upload ("mmq" layout): wq int8 [N, K] (Q4_0 widened to 0..15), wd fp32 [N, K/32].
// Tile 64 (M) x 128 (N) per block of 8 warps, each warp 32 x 32 (2 x 4 MMAs per K block).  K moves in
// stages of 4 blocks (128 values) through two shared-memory buffers filled by cp.async, so the next
// stage loads while this one computes.  Rows are padded to 36 words so that a warp's fragment loads
// hit 32 distinct banks.  Split-K over gridDim.z adds into a zeroed Y.
#define MMQ_BM 64
#define MMQ_BN 128
#define MMQ_BKB 4
#define MMQ_LD 36
#define MMQ_STAGE (MMQ_BM * MMQ_LD + MMQ_BN * MMQ_LD + MMQ_BM * MMQ_BKB + MMQ_BN * MMQ_BKB)  // ints

// The MMA accumulates into the bit pattern of 1.5 * 2^23: the int32 result is then a float whose value is
// 12582912 + sumi exactly (|sumi| <= 32*127*127 < 2^22), and one FADD recovers (float)sumi, instead of an
// int-to-float conversion that runs at a quarter of the FP32 rate on Hopper.
#define MAGIC_I 0x4B400000
#define MAGIC_F 12582912.0f
__device__ __forceinline__ float magic_to_float(int c) { return __int_as_float(c) - MAGIC_F; }

// D = A*B + MAGIC_I in all four lanes: C is one constant register, so no per-MMA moves to reset it.
__device__ __forceinline__ void mma_s8_magic(int* d, const int* a, const int* b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(MAGIC_I));
}

// What each thread copies per stage never changes but for the K offset: its rows, chunks, shared-memory
// destinations and row predicates are worked out once, so a stage costs a pointer add per copy.
// Thread tid copies A chunks tid and tid+256 (rows r, r+32; 16-byte chunk c of the 128-byte stage row),
// B chunks tid + 256i (rows rb + 32i), the activation scale of (row tid%64, block tid/64) and the weight
// scales of (row tid%128, blocks tid/128 and tid/128+2).
struct MmqLoader {
    const i8* a;       // row m0+r of aq at chunk c (clamped to row 0 when past M)
    const i8* b;       // row n0+r of wq at chunk c
    const __half2* s;  // ads at (m0 + tid%64, tid/64)
    const float* d;    // wd at (n0 + tid%128, tid/128)
    int r, c, sr, dr, M_left, N_left, K;

    __device__ MmqLoader(const i8* aq, const i8* wq, const __half2* ads, const float* wd, int M, int N, int K_,
                         int m0, int n0) {
        const int tid = threadIdx.x, KB = K_ / QK;
        K = K_;
        r = tid >> 3;
        c = tid & 7;
        sr = tid & (MMQ_BM - 1);
        dr = tid & (MMQ_BN - 1);
        M_left = M - m0;
        N_left = N - n0;
        a = aq + (size_t)(r < M_left ? m0 + r : 0) * K + (c >> 1) * QK + (c & 1) * 16;
        b = wq + (size_t)(r < N_left ? n0 + r : 0) * K + (c >> 1) * QK + (c & 1) * 16;
        s = ads + (size_t)(sr < M_left ? m0 + sr : 0) * KB + (tid >> 6);
        d = wd + (size_t)(dr < N_left ? n0 + dr : 0) * KB + (tid >> 7);
    }

    __device__ __forceinline__ void load(int* st, int kb0, int kb_end) const {
        int* sA = st;
        int* sB = sA + MMQ_BM * MMQ_LD;
        int* sAds = sB + MMQ_BN * MMQ_LD;                                // [BKB][BM] half2 (d, s)
        float* sBd = reinterpret_cast<float*>(sAds + MMQ_BM * MMQ_BKB);  // [BKB][BN]
        const int tid = threadIdx.x;
        const bool k_ok = kb0 + (c >> 1) < kb_end;
        const size_t koff = (size_t)kb0 * QK;
#pragma unroll
        for (int i = 0; i < 2; ++i)  // A: rows r, r+32
            cp_async16(&sA[(r + 32 * i) * MMQ_LD + c * 4], a + koff + (size_t)(32 * i) * K,
                       k_ok && r + 32 * i < M_left);
#pragma unroll
        for (int i = 0; i < 4; ++i)  // B: rows r, r+32, r+64, r+96
            cp_async16(&sB[(r + 32 * i) * MMQ_LD + c * 4], b + koff + (size_t)(32 * i) * K,
                       k_ok && r + 32 * i < N_left);
        cp_async4(&sAds[tid], s + kb0, sr < M_left && kb0 + (tid >> 6) < kb_end);
#pragma unroll
        for (int i = 0; i < 2; ++i)
            cp_async4(&sBd[tid + 256 * i], d + kb0 + 2 * i, dr < N_left && kb0 + (tid >> 7) + 2 * i < kb_end);
    }
};

__device__ __forceinline__ void ldmatrix_x4(int* r, const void* smem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

template <typename T>
__device__ void mmq(const i8* __restrict__ wq, const float* __restrict__ wd, const i8* __restrict__ aq,
                    const __half2* __restrict__ ads, float* __restrict__ Y, int M, int N, int K, int kb_per_split,
                    int atomic) {
    extern __shared__ __align__(16) int smem[];
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp / 4, wn = warp % 4;
    const int m0 = blockIdx.y * MMQ_BM, n0 = blockIdx.x * MMQ_BN, KB = K / QK;
    const int kb_begin = blockIdx.z * kb_per_split, kb_end = min(KB, kb_begin + kb_per_split);
    float acc[2][4][4] = {};
    const MmqLoader loader(aq, wq, ads, wd, M, N, K, m0, n0);
    if (kb_begin < kb_end) loader.load(smem, kb_begin, kb_end);
    cp_async_commit();
    int stage = 0;
    for (int kb0 = kb_begin; kb0 < kb_end; kb0 += MMQ_BKB, stage ^= 1) {
        if (kb0 + MMQ_BKB < kb_end) loader.load(smem + (stage ^ 1) * MMQ_STAGE, kb0 + MMQ_BKB, kb_end);
        cp_async_commit();
        cp_async_wait<1>();  // this stage has landed; the next may still be in flight
        __syncthreads();
        const int* sA = smem + stage * MMQ_STAGE;
        const int* sB = sA + MMQ_BM * MMQ_LD;
        const __half2* sAds = reinterpret_cast<const __half2*>(sB + MMQ_BN * MMQ_LD);
        const float* sBd = reinterpret_cast<const float*>(sB + MMQ_BN * MMQ_LD + MMQ_BM * MMQ_BKB);
        // ldmatrix row addresses: lane l gives row (l & 7) + 8 * ((l >> 3) & 1) of A at byte offset 16 * (l >> 4),
        // so .x4 returns a0..a3 of an m16n8k32 int8 A fragment; for B, lanes 0-15 address n-tile 2p and
        // 16-31 n-tile 2p+1, each (l & 7) at byte offset 16 * ((l >> 3) & 1): b[2p][0..1], b[2p+1][0..1].
        const int lr = (lane & 7) + 8 * ((lane >> 3) & 1), lo = 16 * (lane >> 4);
        const int br = (lane & 7) + 8 * (lane >> 4), bo = 16 * ((lane >> 3) & 1);
#pragma unroll
        for (int j = 0; j < MMQ_BKB; ++j) {
            int a[2][4], b[4][2];
            float da[2][2], ms8[2][2], dw[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r = wm * 32 + mi * 16;
                ldmatrix_x4(a[mi], reinterpret_cast<const char*>(sA + (r + lr) * MMQ_LD + j * 8) + lo);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float2 ds = __half22float2(sAds[j * MMQ_BM + r + g + 8 * h]);
                    da[mi][h] = ds.x;
                    ms8[mi][h] = -8.0f * ds.y;
                }
            }
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                int v[4];
                ldmatrix_x4(v, reinterpret_cast<const char*>(sB + (wn * 32 + p * 16 + br) * MMQ_LD + j * 8) + bo);
                b[2 * p][0] = v[0];
                b[2 * p][1] = v[1];
                b[2 * p + 1][0] = v[2];
                b[2 * p + 1][1] = v[3];
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const float2 d2 = *reinterpret_cast<const float2*>(&sBd[j * MMQ_BN + wn * 32 + ni * 8 + 2 * t]);
                dw[ni][0] = d2.x;
                dw[ni][1] = d2.y;
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) {
                    int c[4];
                    mma_s8_magic(c, a[mi], b[ni]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float sf = magic_to_float(c[e]), w = dw[ni][e & 1], d = da[mi][e >> 1];
                        // llama.cpp's block formula: Q4_0 d_w*(d_a*sumi - 8*s_a), Q8_0 d_w*d_a*sumi
                        if constexpr (T::OFFSET8) acc[mi][ni][e] = fmaf(w, fmaf(d, sf, ms8[mi][e >> 1]), acc[mi][ni][e]);
                        else acc[mi][ni][e] = fmaf(w * d, sf, acc[mi][ni][e]);
                    }
                }
        }
        __syncthreads();  // everyone is done with this stage before it is refilled
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
// M == 1: a warp per weight row of the split layout, lanes over K blocks, 16-byte loads of weights and
// activations; each lane loads its next U weight blocks before using any, so more bytes are in flight.
template <typename T>
__device__ void gemv1(const u8* __restrict__ wq, const __half* __restrict__ wd, const i8* __restrict__ aq,
                      const __half2* __restrict__ ads, float* __restrict__ Y, int N, int K) {
    constexpr int U = 2, V = T::QS_BYTES / 16;  // blocks per lane per step (2 measured best: 74% vs 66% of copy BW)
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * (blockDim.x / WARP) + warp;
    if (n >= N) return;
    const int KB = K / QK;
    const int4* wrow = reinterpret_cast<const int4*>(wq + (size_t)n * KB * T::QS_BYTES);
    const __half* drow = wd + (size_t)n * KB;
    const int4* arow = reinterpret_cast<const int4*>(aq);
    float acc = 0.0f;
    for (int kb0 = lane; kb0 < KB; kb0 += WARP * U) {
        int4 wv[U][V];
        __half dh[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * WARP;
            if (kb < KB) {
#pragma unroll
                for (int v = 0; v < V; ++v) wv[u][v] = __ldg(wrow + (size_t)kb * V + v);
                dh[u] = drow[kb];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * WARP;
            if (kb < KB) {
                int w[8];
                load_split_words<T>(reinterpret_cast<const u8*>(wv[u]), w);
                const int4 a0 = __ldg(arow + (size_t)kb * 2), a1 = __ldg(arow + (size_t)kb * 2 + 1);
                const int a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                acc += T::epilogue(__half2float(dh[u]), dot8<true>(w, a), __half22float2(ads[kb]));
            }
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) Y[n] = acc;
}

// 2 <= M <= 8: a skinny tensor-core product.  One MMA m16n8k32 takes 16 weight rows as A and 8
// activation rows as B (a warp can hold MT8 such tiles; MT8 > 1, M up to 64, measured slower than
// mmq: its 4-byte activation fragment loads bind the LSU), the 8 warps of a block split K, then add
// in shared memory.  Q4_0's packed bytes 4t..4t+3 hold k = 4t.. (low nibbles) and
// k = 16+4t.. (high): exactly a thread's A fragment registers a0/a2, so the split layout is read as
// it is, at half the bytes of int8.
template <typename T>
__device__ __forceinline__ void weight_fragment(const u8* blk, int t, int* lo, int* hi) {
    if constexpr (T::OFFSET8) {
        const int v = *reinterpret_cast<const int*>(blk + 4 * t);
        *lo = v & 0x0F0F0F0F;
        *hi = (v >> 4) & 0x0F0F0F0F;
    } else {
        *lo = *reinterpret_cast<const int*>(blk + 4 * t);
        *hi = *reinterpret_cast<const int*>(blk + 16 + 4 * t);
    }
}

__device__ __forceinline__ float block_epilogue(bool offset8, float dw, int c, float2 ds) {
    const float sf = magic_to_float(c);
    return offset8 ? dw * fmaf(ds.x, sf, -8.0f * ds.y) : dw * ds.x * sf;
}

template <typename T, int MT8>
__device__ void skinny(const u8* __restrict__ wq, const __half* __restrict__ wd, const i8* __restrict__ aq,
                       const __half2* __restrict__ ads, float* __restrict__ Y, int M, int N, int K) {
    __shared__ float red[8][4 * MT8][WARP];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16, KB = K / QK;
    const int nA = n0 + g, nB = n0 + g + 8;
    const bool okA = nA < N, okB = nB < N;
    const u8* rowA = wq + (size_t)(okA ? nA : 0) * KB * T::QS_BYTES;
    const u8* rowB = wq + (size_t)(okB ? nB : 0) * KB * T::QS_BYTES;
    float acc[MT8][4] = {};
#pragma unroll 2
    for (int kb = warp; kb < KB; kb += 8) {
        int a[4] = {0, 0, 0, 0};
        if (okA) weight_fragment<T>(rowA + (size_t)kb * T::QS_BYTES, t, &a[0], &a[2]);
        if (okB) weight_fragment<T>(rowB + (size_t)kb * T::QS_BYTES, t, &a[1], &a[3]);
        const float dA = okA ? __half2float(wd[(size_t)nA * KB + kb]) : 0.f;
        const float dB = okB ? __half2float(wd[(size_t)nB * KB + kb]) : 0.f;
#pragma unroll
        for (int mt = 0; mt < MT8; ++mt) {
            const int mg = mt * 8 + g, m0 = mt * 8 + 2 * t, m1 = m0 + 1;
            int b[2] = {0, 0};
            if (mg < M) {
                const i8* act = aq + (size_t)mg * K + (size_t)kb * QK;
                b[0] = *reinterpret_cast<const int*>(act + 4 * t);
                b[1] = *reinterpret_cast<const int*>(act + 16 + 4 * t);
            }
            int c[4];
            mma_s8_magic(c, a, b);
            const float2 s0 = m0 < M ? __half22float2(ads[(size_t)m0 * KB + kb]) : make_float2(0.f, 0.f);
            const float2 s1 = m1 < M ? __half22float2(ads[(size_t)m1 * KB + kb]) : make_float2(0.f, 0.f);
            // c0: (weight row nA, act m0), c1: (nA, m1), c2: (nB, m0), c3: (nB, m1)
            acc[mt][0] += block_epilogue(T::OFFSET8, dA, c[0], s0);
            acc[mt][1] += block_epilogue(T::OFFSET8, dA, c[1], s1);
            acc[mt][2] += block_epilogue(T::OFFSET8, dB, c[2], s0);
            acc[mt][3] += block_epilogue(T::OFFSET8, dB, c[3], s1);
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT8; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp][mt * 4 + e][lane] = acc[mt][e];
    __syncthreads();
    for (int v = warp; v < 4 * MT8; v += 8) {  // each warp finishes some of the values
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) sum += red[w][v][lane];
        const int mt = v / 4, e = v % 4;
        const int n = (e < 2) ? nA : nB, m = mt * 8 + 2 * t + (e & 1);
        if (n < N && m < M) Y[(size_t)m * N + n] = sum;
    }
}

#define FAST(t, T)                                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                        \
        mmq_##t(const i8* wq, const float* wd, const i8* aq, const __half2* ads, float* Y, int M, int N, int K, \
                int kb_per_split, int atomic) {                                                                 \
        mmq<T>(wq, wd, aq, ads, Y, M, N, K, kb_per_split, atomic);                                              \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        gemv1_##t(const u8* wq, const __half* wd, const i8* aq, const __half2* ads, float* Y, int N, int K) {   \
        gemv1<T>(wq, wd, aq, ads, Y, N, K);                                                                     \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        skinny1_##t(const u8* wq, const __half* wd, const i8* aq, const __half2* ads, float* Y, int M, int N,   \
                    int K) {                                                                                    \
        skinny<T, 1>(wq, wd, aq, ads, Y, M, N, K);                                                              \
    }
QGEMM_FOR_TYPES(FAST)
