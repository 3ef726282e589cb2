// The fast kernels: `mmq` (int8 tensor cores, mma.sync m16n8k32) and `mmq_wgmma` (Hopper's wgmma) read
// both operands tiled for them (below) and compute llama.cpp's MMQ formula (sumi * d_w * d_a over signed
// weights, no sum term); `gemv` (a weight stream at the memory roofline, M <= 8) reads the split Q8_1 layout
// (aq int8 [M, K], ads half2 [M, K/32]) and computes its MMVQ formula.  One 32-value block is one MMA's K,
// so sumi is the exact integer block dot, scaled in fp32.
#include "common.cuh"
#include "groups.cuh"

// ---- mmq ----------------------------------------------------------------------------------------
// Both operands come tiled so that what one stage of one block needs is a few contiguous pieces:
//   weights ("mmq" layout, repacked at upload), per 128-row tile and stage of 4 quant blocks:
//     wq [N/128][SB][128 x 128] int8, the signed values as llama.cpp's MMQ tiles hold them (Q4_0: q - 8;
//     Q8_0: q), wd [N/128][SB][4][128] fp32 d_w;
//   activations (quantize_q8_1_mmq, q8_1.cu), per 64-row tile and stage: qs, dc (d_a 2^111, -d_a 2^-19).
// So the kernels are the same for every weight type: the format's part is its repacking and its
// activation layout (d_a in float or rounded to half: llama.cpp's D4 / DS4).
// Padding rows and blocks are zeros on the weight side, so a stage is always whole: no predicates.
// A quant piece (rows x 128 bytes of K) is stored as 8 x 16-byte "core matrices": byte (r, k) at
// ((r/8)*8 + k/16)*128 + (r%8)*16 + k%16.  That is the canonical no-swizzle K-major layout that wgmma reads
// through a descriptor (LBO 128: next 16 bytes of K, SBO 1024: next 8 rows), and each 8-lane phase of an
// ldmatrix reads one whole 128-byte matrix, so both kernels read it without bank conflicts.
//
// A block of 4 warps computes a 64 x 128 tile, each warp 32 x 64 (2 x 8 MMAs per quant block).  K moves
// a stage at a time through MMQ_STAGES shared-memory buffers (MmqBlock's loaders, below).
// Split-K over gridDim.z adds into a zeroed Y.
//
// The epilogue is two FFMAs per output and block, on top of the MMA, exact for any float d_a:
//   * the MMA adds onto C = 2^19, so its int32 result D = 2^19 + sumi lies in [4096, 2^20) (|sumi| <=
//     32 * 127 * 128); read as a float it is the subnormal D * 2^-149, and with c1 = d_a * 2^111,
//     c2 = -d_a * 2^-19 (both exact: powers of two times d_a), t = fma(F, c1, c2) = round(d_a*sumi) * 2^-38
//     in one instruction (an fma that keeps subnormals: fma_keep_denormals);
//   * acc' = fma(t, d_w, acc') is the output times 2^-38, scaled back at the store.
// llama.cpp computes fma(sumi * d_w, d_a, acc) instead: the same terms, rounded in another order.
// (Before llama.cpp's MMQ formula, Q4_0 kept unsigned weights and a sum term, run as an fp16 MMA;
// docs/reports/parity-llama-cpp.md says why the formula changed.)
#define MMQ_BM 64
#define MMQ_BN 128
#define MMQ_BKB 4
#ifndef MMQ_STAGES  // -D overrides for tuning experiments; 2 stages measured best (3: +3%, 4: +25%)
#define MMQ_STAGES 2
#endif
#ifndef MMQ_MIN_BLOCKS
#define MMQ_MIN_BLOCKS 2
#endif
// mmq itself (one scale a block, no minimum, 64-row tiles) fits 168 registers without spilling: 3 blocks an SM,
// measured on the H100 7% faster at M = 2048, K = 4096 (Q4_0 198.5 -> 184.9 us), 2-3% at M = 512 and K = 14336,
// the same at 128 rows.  The variants with a minimum or two scales a block spill under 168 and ran 10-45% slower.
#ifndef MMQ_MIN_BLOCKS_PLAIN
#define MMQ_MIN_BLOCKS_PLAIN 3
#endif
#define MMQ_THREADS 128
#define MAGIC_I 0x4B400000  // skinny's bias: 1.5 * 2^23 as float bits, F - 12582912 = sumi
#define MAGIC_F 12582912.0f
#define MMQ_BIAS 0x00080000  // mmq's: 2^19 (the epilogue above)
// D = 2 (Q6_K, two int8 digits of its folded values w = 128 hi + lo; mmq_tile says how they are summed): the
// digits' biases, each keeping its MMA's result a positive subnormal (|Σ a lo| <= 32 * 127 * 64 < 2^18,
// |Σ a hi| <= 32 * 127 * 32 < 2^19 - 2^11), and 128 * BIAS_HI + BIAS_LO = 2^26, so that dc's own c2 = -d_a 2^-19
// removes both
#define MMQ_BIAS_LO 0x00040000
#define MMQ_BIAS_HI 0x0007F800

// The accumulators hold out * 2^-38 (the epilogue above); the store multiplies back.
#define WG_UNSCALE 0x1p38f

// Byte offsets in shared memory: MMQ_STAGES stage buffers (each global piece as it is), then the
// barriers.  MIN (formats with a minimum: llama.cpp's (d_w d_a) sumi + m_w s_a): each stage also holds the
// activations' block sums s_a (SA) and the weights' minima m_w (WM) as halves, as llama.cpp holds them (DS4's
// half2 (d, s); Q4_1's m; the K-quants' dm * (sc, m) rounded to half), so that their products are exact in
// fp32 and the m_w s_a term is a K/32-deep fp16 GEMM: one m16n8k8 tensor-core MMA a stage and output tile into
// accumulators of its own, where an FFMA an output and block had cost a third of the kernel.
//   H = 1 (Q4_1, Q5_1, Q4_K, Q5_K): SA half [64][4], WM half [128][4] (k = the stage's 4 blocks, 4-7 zero).
//   H = 2 (Q2_K: a scale and a minimum per 16 values; Q6_K has no minimum): SA half [64][8] with D2S6's sums
//   of halves 0-5 and zeros, then float [2][64]: halves 6 and 7, whose D2S6 "sum" d_a Σq_a is no half
//   (llama.cpp forms it in float), times 2^-38; WM half [128][8], then float [2][128] for halves 6 and 7,
//   which take an FFMA an output and stage.  Two weight scales a block and row (WD [4][2][128]).
// D = 2: the weight piece holds the low digits' 128 x 128 bytes, then the high digits'.
// launch.py's MMQ_SMEM mirrors BYTES.
template <bool MIN, int H = 1, int D = 1>
struct MmqSmem {
    static constexpr int SA_BYTES = !MIN ? 0 : H == 1 ? MMQ_BM * 8 : MMQ_BM * (16 + 8);
    static constexpr int WM_BYTES = !MIN ? 0 : H == 1 ? MMQ_BN * 8 : MMQ_BN * (16 + 8);
    static constexpr int A = 0, B = MMQ_BM * 128, DC = B + D * MMQ_BN * 128, WD = DC + MMQ_BKB * MMQ_BM * 8;
    static constexpr int SA = WD + H * MMQ_BKB * MMQ_BN * 4, WM = SA + SA_BYTES, STAGE = WM + WM_BYTES;
    static constexpr int BARS = MMQ_STAGES * STAGE, BYTES = BARS + 8 * MMQ_STAGES;
};

// D = A*B + C_BITS in all four lanes: C is one constant register, so no per-MMA moves to reset it.
template <int C_BITS>
__device__ __forceinline__ void mma_s8_const(int* d, const int* a, const int* b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(C_BITS));
}
__device__ __forceinline__ float magic_to_float(int c) { return __int_as_float(c) - MAGIC_F; }

// D += A*B, fp16 inputs, fp32 accumulators (m16n8k8): the m_w s_a term of the formats with a minimum
__device__ __forceinline__ void mma_f16_k8(float* d, const unsigned* a, unsigned b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b));
}

// fma.rn without .ftz: the epilogue's F is subnormal (this file is compiled with -ftz=true)
__device__ __forceinline__ float fma_keep_denormals(float a, float b, float c) {
    float r;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}

__device__ __forceinline__ void ldmatrix_x4(int* r, const void* smem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// One block's view of the tiled operands: its first pieces (row tile, stage s_begin) and stage count,
// and the pipeline that brings stage after stage into MMQ_STAGES shared-memory buffers, by one of two
// loaders.  BULK (Hopper): one thread hands each piece whole to the copy engine (cp.async.bulk),
// completing on the buffer's mbarrier.  Otherwise every thread copies 16-byte chunks with cp.async.
// Measured on the H100 (GEMM alone), bulk is faster for both types: Q8_0 1-7%; Q4_0 4-10% since its
// s-term pieces go to the ring (sharing stage buffers with them, bulk had been 2-5% slower).  So both
// kernels take it on Hopper (mmq_wgmma's tensor cores read through the same async proxy anyway).
// store(): a pair of adjacent outputs (row m, columns n, n+1), or their split-K partial sums.
#ifdef QGEMM_BULK
#define MMQ_CAN_BULK true
#else
#define MMQ_CAN_BULK false
#endif
template <bool BULK, bool MIN = false, int H = 1, int D = 1>
struct MmqBlock {
    const i8 *a, *b;
    const float2* dc;
    const float* wd;
    const char *sa, *wm;  // pieces of S::SA_BYTES and S::WM_BYTES
    int m0, n0, stages;

    __device__ MmqBlock(const i8* wq, const float* wd_, const i8* aq, const float2* dc_, int K, int stages_per_split,
                        const void* sa_ = nullptr, const void* wm_ = nullptr) {
        const int SB = (K / QK + MMQ_BKB - 1) / MMQ_BKB, s_begin = blockIdx.z * stages_per_split;
        const size_t pm = (size_t)blockIdx.y * SB + s_begin, pn = (size_t)blockIdx.x * SB + s_begin;
        m0 = blockIdx.y * MMQ_BM;
        n0 = blockIdx.x * MMQ_BN;
        stages = min(SB, s_begin + stages_per_split) - s_begin;
        a = aq + (pm << 13);
        b = wq + (pn << (13 + D));
        dc = dc_ + (pm << 8);
        wd = wd_ + (pn << 9) * H;
        sa = MIN ? static_cast<const char*>(sa_) + pm * S::SA_BYTES : nullptr;
        wm = MIN ? static_cast<const char*>(wm_) + pn * S::WM_BYTES : nullptr;
    }

    using S = MmqSmem<MIN, H, D>;
    static __device__ __forceinline__ unsigned long long* bar(char* smem, int buf) {
        return reinterpret_cast<unsigned long long*>(smem + S::BARS) + buf;
    }
    // thread tid's first 16-byte chunk of the piece of `stage` (pieces of 1 << shift elements)
    template <typename P>
    static __device__ __forceinline__ const char* chunk(const P* p, int shift, int stage) {
        return reinterpret_cast<const char*>(p + ((size_t)stage << shift)) + threadIdx.x * 16;
    }
    __device__ __forceinline__ void load(char* smem, int stage) const {
        char* st = smem + (stage % MMQ_STAGES) * S::STAGE;
        if constexpr (BULK) {  // one thread: the stage's pieces, whole
#ifdef QGEMM_BULK
            constexpr unsigned bytes = S::STAGE;  // every piece, whole
            unsigned long long* done = bar(smem, stage % MMQ_STAGES);
            mbar_expect(done, bytes);
            bulk_copy(st + S::A, a + ((size_t)stage << 13), MMQ_BM * 128, done);
            bulk_copy(st + S::B, b + ((size_t)stage << (13 + D)), D * MMQ_BN * 128, done);
            bulk_copy(st + S::DC, dc + ((size_t)stage << 8), MMQ_BKB * MMQ_BM * 8, done);
            bulk_copy(st + S::WD, wd + ((size_t)stage << 9) * H, H * MMQ_BKB * MMQ_BN * 4, done);
            if constexpr (MIN) {
                bulk_copy(st + S::SA, sa + (size_t)stage * S::SA_BYTES, S::SA_BYTES, done);
                bulk_copy(st + S::WM, wm + (size_t)stage * S::WM_BYTES, S::WM_BYTES, done);
            }
#endif
        } else {  // every thread: its 16-byte chunks
            const int tid = threadIdx.x;
            st += tid * 16;
#pragma unroll
            for (int q = 0; q < MMQ_BM / 16; ++q)
                cp_async16(st + S::A + q * 2048, chunk(a, 13, stage) + q * 2048, true);
#pragma unroll
            for (int q = 0; q < D * MMQ_BN / 16; ++q)
                cp_async16(st + S::B + q * 2048, chunk(b, 13 + D, stage) + q * 2048, true);
            cp_async16(st + S::DC, chunk(dc, 8, stage), true);
#pragma unroll
            for (int h = 0; h < H; ++h)  // pieces of H times the floats: H chunks a thread
                cp_async16(st + S::WD + h * MMQ_THREADS * 16, chunk(wd, 9, stage * H) + h * MMQ_THREADS * 16, true);
            if constexpr (MIN) {  // 16-byte chunks a thread
                const char* sa_at = sa + (size_t)stage * S::SA_BYTES + tid * 16;
                const char* wm_at = wm + (size_t)stage * S::WM_BYTES + tid * 16;
#pragma unroll
                for (int o = 0; o < S::SA_BYTES; o += MMQ_THREADS * 16)
                    if (o + tid * 16 < S::SA_BYTES) cp_async16(st + S::SA + o, sa_at + o, true);
#pragma unroll
                for (int o = 0; o < S::WM_BYTES; o += MMQ_THREADS * 16)
                    if (o + tid * 16 < S::WM_BYTES) cp_async16(st + S::WM + o, wm_at + o, true);
            }
        }
    }
    __device__ __forceinline__ void start(char* smem) const {  // the first MMQ_STAGES - 1 stages in flight
        if constexpr (BULK) {
#ifdef QGEMM_BULK
            if (threadIdx.x == 0) {
                for (int i = 0; i < MMQ_STAGES; ++i) mbar_init(bar(smem, i), 1);
                asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // seen by the copy engine
            }
            __syncthreads();
            if (threadIdx.x == 0)
                for (int s = 0; s < MMQ_STAGES - 1 && s < stages; ++s) load(smem, s);
#endif
        } else {
#pragma unroll
            for (int s = 0; s < MMQ_STAGES - 1; ++s) {
                if (s < stages) load(smem, s);
                cp_async_commit();
            }
        }
    }
    __device__ __forceinline__ void next(char* smem, int s) const {  // before computing stage s
        if constexpr (BULK) {
#ifdef QGEMM_BULK
            __syncthreads();  // everyone is done with stage s - 1's buffer, the one refilled now
            if (threadIdx.x == 0 && s + MMQ_STAGES - 1 < stages) load(smem, s + MMQ_STAGES - 1);
            mbar_wait(bar(smem, s % MMQ_STAGES), (s / MMQ_STAGES) & 1);
#endif
        } else {
            cp_async_wait<MMQ_STAGES - 2>();  // stage s has landed (this thread's copies)
            __syncthreads();                  // everyone's copies; everyone is done with the buffer refilled now
            if (s + MMQ_STAGES - 1 < stages) load(smem, s + MMQ_STAGES - 1);
            cp_async_commit();
        }
    }

    // The accumulators hold out * 2^-38.  A pair goes out as one 8-byte store (or vector atomic) when N is
    // even (then m * N + n is even): against two 4-byte stores, each of which half-fills the warp's 32-byte
    // sectors, that took GEMM alone at K=4096 M=512 from 57.2 to 51.4 us (Q4_0) and 50.9 to 48.7 (Q8_0).
    // u0, u1: terms that are not scaled (MIN's m_w s_a sums), added after the scaling.  (An FFMA with 0 where there
    // are none: the same outputs as a multiply, and measured 1.5-2% faster than it for mmq and mmq16 on the H100,
    // from the schedule NVRTC makes around it.)
    __device__ __forceinline__ void store(float* Y, int M, int N, int atomic, int m, int n, float a0, float a1,
                                          float u0 = 0.f, float u1 = 0.f) const {
        if (m >= M) return;
        const float v0 = fmaf(WG_UNSCALE, a0, u0), v1 = fmaf(WG_UNSCALE, a1, u1);
        float* y = Y + (size_t)m * N + n;
        if (n + 1 < N && !(N & 1)) {
            if (!atomic) { *reinterpret_cast<float2*>(y) = make_float2(v0, v1); return; }
#if __CUDA_ARCH__ >= 900  // vector atomics: Hopper on
            atomicAdd(reinterpret_cast<float2*>(y), make_float2(v0, v1));
            return;
#endif
        }
        if (atomic) {
            if (n < N) atomicAdd(y, v0);
            if (n + 1 < N) atomicAdd(y + 1, v1);
        } else {
            if (n < N) y[0] = v0;
            if (n + 1 < N) y[1] = v1;
        }
    }
};

// The stage's 4 quant blocks fully unrolled (measured fastest for Q8_0 at every size on the H100, 10% over
// unrolling by 2 or 1 at M=512; Q4_0 runs the same code since it lost its sum term).
#ifndef MMQ_UNROLL  // dev: -D overrides
#define MMQ_UNROLL MMQ_BKB
#endif
constexpr int kMmqUnroll = MMQ_UNROLL;  // #pragma unroll takes a constant expression, not a macro

// D = A*B + C_BITS for one half of a quant block (k16: a[0..1], b[0] of a k32 fragment are its values 0..15)
template <int C_BITS>
__device__ __forceinline__ void mma16_s8_const(int* d, const int* a, int b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b), "r"(C_BITS));
}

// H = 2: each quant block as two k16 MMAs, each half with its own weight scale (and minimum and sum).  HALF: the
// tile's rows past 32 are empty (M <= 32, one row of tiles): the four warps take rows 0-31 and a quarter of the
// columns each, instead of half the rows and half the columns, so that no warp multiplies only padding.
// D = 2 (Q6_K, whose values q * sc, up to 13 bits, are folded as w = 128 hi + lo, two int8 digits; groups.py): a
// k32 MMA a digit, D_hi = BIAS_HI + Σ a hi and D_lo = BIAS_LO + Σ a lo, then three FFMAs an output and block where
// the two k16 MMAs of a scale per 16 take four: t1 = D_hi c1 + c2 = d_a 2^-45 (128 Σ a hi - BIAS_LO) and
// t = D_lo (c1 2^-7) + t1 = d_a 2^-45 Σ a w (two roundings, each of one ulp of a sum below 2^25), times the
// weight scale d 2^7 (layouts.py) into the same out * 2^-38 as the others.  d is a super-block's (two stages), so
// each column's is read once a stage.
template <bool MIN, int H = 1, bool HALF = false, int D = 1>
__device__ __forceinline__ void mmq_tile(const i8* __restrict__ wq, const float* __restrict__ wd,
                                         const i8* __restrict__ aq, const float2* __restrict__ dc,
                                         const void* __restrict__ sa_, const void* __restrict__ wm_,
                                         float* __restrict__ Y, int M, int N, int K, int stages_per_split, int atomic,
                                         char* smem) {
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int g = lane >> 2, t = lane & 3;
    constexpr int NI = HALF ? 4 : 8, WCOLS = 8 * NI;  // a warp's n-tiles of 8 columns, and its columns
    const int wm = HALF ? 0 : warp >> 1, wn = HALF ? warp : warp & 1;
    static_assert(D == 1 || (H == 1 && !MIN), "two digits: one scale a block, signed values");
    const MmqBlock<MMQ_CAN_BULK, MIN, H, D> blk(wq, wd, aq, dc, K, stages_per_split, sa_, wm_);
    using S = typename decltype(blk)::S;
    float acc[2][NI][4] = {};
    // MIN, H = 1: the m_w s_a term, unscaled, added at the store.  H = 2 (mmq16_min) has no registers to spare for
    // it: its stage's part goes into the scaled accumulators (times 2^-38, exact) after the stage's MMAs.
    constexpr bool KEEP_MIN = MIN && H == 1;
    float acc_min[KEEP_MIN ? 2 : 1][KEEP_MIN ? NI : 1][4] = {};
    blk.start(smem);
    // ldmatrix row addresses: lane l gives row (l & 7) + 8 * ((l >> 3) & 1) of A at byte offset 16 * (l >> 4),
    // so .x4 returns a0..a3 of an m16n8k32 int8 A fragment; for B, lanes 0-15 address n-tile 2p and
    // 16-31 n-tile 2p+1, each (l & 7) at byte offset 16 * ((l >> 3) & 1): b[2p][0..1], b[2p+1][0..1].
    // In core-matrix order, 8 rows are 1024 bytes and 16 bytes of K are 128.
    const int a_off = S::A + (wm * 4 + ((lane >> 3) & 1)) * 1024 + (lane >> 4) * 128 + (lane & 7) * 16;
    const int b_off = S::B + (wn * NI + (lane >> 4)) * 1024 + ((lane >> 3) & 1) * 128 + (lane & 7) * 16;
    for (int s = 0; s < blk.stages; ++s) {
        blk.next(smem, s);
        const char* st = smem + (s % MMQ_STAGES) * S::STAGE;
        const float2* sDC = reinterpret_cast<const float2*>(st + S::DC) + wm * 32 + g;
        const float* sWD = reinterpret_cast<const float*>(st + S::WD) + wn * WCOLS + 2 * t;
        if constexpr (KEEP_MIN) {  // fragments of s_a [64][4] (A, rows m) and m_w [128][4] (B, columns n) as
            // m16n8k8's: lane (g, t) holds k = 2t, 2t + 1, which for t >= 2 are the padding blocks 4-7 (zeros)
            const unsigned* hSA = reinterpret_cast<const unsigned*>(st + S::SA) + (wm * 32 + g) * 2 + (t & 1);
            const unsigned* hWM = reinterpret_cast<const unsigned*>(st + S::WM) + (wn * WCOLS + g) * 2 + (t & 1);
            unsigned fa[2][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) fa[mi][h] = t < 2 ? hSA[(mi * 16 + 8 * h) * 2] : 0u;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const unsigned fb = t < 2 ? hWM[ni * 16] : 0u;
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) mma_f16_k8(acc_min[mi][ni], fa[mi], fb);
            }
        } else if constexpr (MIN) {  // H = 2: s_a [64][8] and m_w [128][8], k = halves 0-7, whose 6 and 7 (t = 3)
            // have zero s_a here: their terms are the FFMAs below; the stage's part goes into the scaled accumulators
            const unsigned* hSA = reinterpret_cast<const unsigned*>(st + S::SA) + (wm * 32 + g) * 4 + t;
            const unsigned* hWM = reinterpret_cast<const unsigned*>(st + S::WM) + (wn * WCOLS + g) * 4 + t;
            unsigned fa[2][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) fa[mi][h] = hSA[(mi * 16 + 8 * h) * 4];
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const unsigned fb = hWM[ni * 32];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    float part[4] = {};
                    mma_f16_k8(part, fa[mi], fb);
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mi][ni][e] = fmaf(part[e], 0x1p-38f, acc[mi][ni][e]);
                }
            }
            {  // halves 6 and 7: s 2^-38 and m_w in float, into the scaled accumulators
                const float* s67 = reinterpret_cast<const float*>(st + S::SA + MMQ_BM * 16) + wm * 32 + g;
                const float* m67 = reinterpret_cast<const float*>(st + S::WM + MMQ_BN * 16) + wn * WCOLS + 2 * t;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni) {
                        const float2 mw = *reinterpret_cast<const float2*>(m67 + hh * MMQ_BN + ni * 8);
#pragma unroll
                        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                acc[mi][ni][e] = fmaf(s67[hh * MMQ_BM + mi * 16 + 8 * (e >> 1)], (e & 1) ? mw.y : mw.x,
                                                      acc[mi][ni][e]);
                    }
            }
        }
#pragma unroll kMmqUnroll
        for (int j = 0; j < MMQ_BKB; ++j) {
            int a[2][4], b[D][NI][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) ldmatrix_x4(a[mi], st + a_off + mi * 2048 + j * 256);
#pragma unroll
            for (int dg = 0; dg < D; ++dg)
#pragma unroll
                for (int p = 0; p < NI / 2; ++p) {
                    int v[4];
                    ldmatrix_x4(v, st + b_off + dg * MMQ_BN * 128 + p * 2048 + j * 256);
                    b[dg][2 * p][0] = v[0];
                    b[dg][2 * p][1] = v[1];
                    b[dg][2 * p + 1][0] = v[2];
                    b[dg][2 * p + 1][1] = v[3];
                }
            float2 da[2][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) da[mi][h] = sDC[j * MMQ_BM + mi * 16 + 8 * h];
            float lo_c1[D == 2 ? 2 : 1][2];  // D = 2: c1 2^-7 = d_a 2^104 (exact)
#pragma unroll
            for (int mi = 0; mi < (D == 2 ? 2 : 0); ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) lo_c1[mi][h] = da[mi][h].x * 0x1p-7f;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
#pragma unroll
                for (int hh = 0; hh < H; ++hh) {
                    const int jw = D == 2 ? 0 : j;  // D = 2: the stage's one d (above)
                    const float2 w = *reinterpret_cast<const float2*>(sWD + (jw * H + hh) * MMQ_BN + ni * 8);
#pragma unroll
                    for (int mi = 0; mi < 2; ++mi) {
                        if constexpr (D == 2) {
                            int lo[4], hi[4];
                            mma_s8_const<MMQ_BIAS_LO>(lo, a[mi], b[0][ni]);
                            mma_s8_const<MMQ_BIAS_HI>(hi, a[mi], b[1][ni]);
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const float2 d = da[mi][e >> 1];
                                const float t1 = fma_keep_denormals(__int_as_float(hi[e]), d.x, d.y);
                                const float ts = fma_keep_denormals(__int_as_float(lo[e]), lo_c1[mi][e >> 1], t1);
                                acc[mi][ni][e] = fmaf(ts, (e & 1) ? w.y : w.x, acc[mi][ni][e]);
                            }
                        } else {
                            int c[4];
                            if constexpr (H == 1) mma_s8_const<MMQ_BIAS>(c, a[mi], b[0][ni]);
                            else mma16_s8_const<MMQ_BIAS>(c, a[mi] + 2 * hh, b[0][ni][hh]);
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const float2 d = da[mi][e >> 1];
                                const float ts = fma_keep_denormals(__int_as_float(c[e]), d.x, d.y);  // round(d_a sumi) 2^-38
                                acc[mi][ni][e] = fmaf(ts, (e & 1) ? w.y : w.x, acc[mi][ni][e]);
                            }
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                blk.store(Y, M, N, atomic, blk.m0 + wm * 32 + mi * 16 + g + 8 * h, blk.n0 + wn * WCOLS + ni * 8 + 2 * t,
                          acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1], KEEP_MIN ? acc_min[mi][ni][2 * h] : 0.f,
                          KEEP_MIN ? acc_min[mi][ni][2 * h + 1] : 0.f);
}

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

// ---- mmq_wgmma: the same tiles and stages through Hopper's wgmma (sm_90a) ------------------------
// Two warpgroups a block, each the 64 x 64 half of the 64 x 128 tile (wgmma.m64n64k32 per quant block, 16
// warps an SM), asynchronously: while the tensor cores do block j+1, the warps run the epilogue of block j.
// Operands are read from shared memory through descriptors (no ldmatrix, no fragments in registers).
//
// mmq's 2^19 bias, made by the tensor cores.  wgmma cannot start from a constant C (mmq's free bias), so
// each quant block takes two wgmmas into one accumulator set: the first (scale-d 0) multiplies two constant
// tiles of -128s, 32 * 128 * 128 = 2^19 in every lane, the second adds the block's product; then mmq's
// two-FFMA epilogue, so its outputs equal mmq's bit for bit.  Measured on the H100 5-10% slower than mmq
// (docs/reports/kernel-design.md): the bias doubles the tensor-core work.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Canonical K-major, no swizzle: LBO = 128 bytes (next 16 bytes of K); SBO = the next 8 rows (1024 bytes in
// a stage piece, 256 in the 64 x 32-byte bias tile).
__device__ __forceinline__ unsigned long long wgmma_desc(const void* smem, unsigned sbo = 1024) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(128 >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}

// d (+)= A * B, m64n64k32 s8: SCALE_D 0 writes, 1 accumulates.
template <int SCALE_D>
__device__ __forceinline__ void wgmma_m64n64k32_s8(int* d, unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, %34;\n"
        "}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "l"(da), "l"(db), "n"(SCALE_D));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Registers an async wgmma writes must not be touched (or moved) by the compiler across its wait.
__device__ __forceinline__ void fence_regs(int* d) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// mmq's shared memory, then the bias tile (2 KiB of -128s).  launch.py's mmq_wgmma_smem() mirrors BYTES.
struct MmqWgSmem {
    static constexpr int BIAS = (MmqSmem<false>::BYTES + 127) / 128 * 128, BYTES = BIAS + 2048;
};

extern "C" __global__ void __launch_bounds__(2 * MMQ_THREADS, MMQ_MIN_BLOCKS)
mmq_wgmma(const i8* __restrict__ wq, const float* __restrict__ wd, const i8* __restrict__ aq,
          const float2* __restrict__ dc, float* __restrict__ Y, int M, int N, int K, int stages_per_split, int atomic) {
    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int g = lane >> 2, t = lane & 3, w4 = warp & 3, wg = warp >> 2;
    const MmqBlock<true> blk(wq, wd, aq, dc, K, stages_per_split);
    using S = typename decltype(blk)::S;
    reinterpret_cast<uint2*>(smem + MmqWgSmem::BIAS)[tid] = make_uint2(0x80808080u, 0x80808080u);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic stores, read by the async proxy
    const unsigned long long bias = wgmma_desc(smem + MmqWgSmem::BIAS, 256);
    float acc[1][8][4] = {};  // acc' of n8 tile i: (row 16 w4 + g, col 64 wg + 8i + 2t), (.., +1), (row +8, ..), (.., +1)
    int d[2][32];
    blk.start(smem);  // its __syncthreads also publishes the bias tile
    for (int s = 0; s < blk.stages; ++s) {
        blk.next(smem, s);  // bulk copies: written and read by the async proxy, ordered by the mbarrier
        const char* st = smem + (s % MMQ_STAGES) * S::STAGE;
        const float2* sDC = reinterpret_cast<const float2*>(st + S::DC) + w4 * 16 + g;
        const float* sWD = reinterpret_cast<const float*>(st + S::WD) + 64 * wg + 2 * t;
        auto issue = [&](int j) {  // block j into d[j % 2]: D = 2^19, then D += A_j * B_j, one commit group
            fence_regs(d[j & 1]);
            wgmma_fence();
            wgmma_m64n64k32_s8<0>(d[j & 1], bias, bias);
            wgmma_m64n64k32_s8<1>(d[j & 1], wgmma_desc(st + S::A + 256 * j), wgmma_desc(st + S::B + 8192 * wg + 256 * j));
            wgmma_commit();
        };
        issue(0);
#pragma unroll
        for (int j = 0; j < MMQ_BKB; ++j) {
            if (j + 1 < MMQ_BKB) {
                issue(j + 1);
                wgmma_wait<1>();
            } else {
                wgmma_wait<0>();
            }
            const int* c = d[j & 1];
            fence_regs(d[j & 1]);
            // c2 = c1 * -2^-130 (exact unless d_a < 2^-107), in two steps since 2^-130 is subnormal (flushed
            // here): one load a row, not two (which spilled two more registers)
            const float c10 = sDC[j * MMQ_BM].x, c11 = sDC[j * MMQ_BM + 8].x;
            const float c20 = (c10 * -0x1p-65f) * 0x1p-65f, c21 = (c11 * -0x1p-65f) * 0x1p-65f;
#pragma unroll
            for (int i = 0; i < 8; ++i, c += 4) {
                const float2 w = *reinterpret_cast<const float2*>(sWD + j * MMQ_BN + 8 * i);
                float* o = acc[0][i];
                o[0] = fmaf(fma_keep_denormals(__int_as_float(c[0]), c10, c20), w.x, o[0]);
                o[1] = fmaf(fma_keep_denormals(__int_as_float(c[1]), c10, c20), w.y, o[1]);
                o[2] = fmaf(fma_keep_denormals(__int_as_float(c[2]), c11, c21), w.x, o[2]);
                o[3] = fmaf(fma_keep_denormals(__int_as_float(c[3]), c11, c21), w.y, o[3]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            blk.store(Y, M, N, atomic, blk.m0 + w4 * 16 + g + 8 * hh, blk.n0 + 64 * wg + 8 * i + 2 * t,
                      acc[0][i][2 * hh], acc[0][i][2 * hh + 1]);
}
#endif

// ---- gemv -------------------------------------------------------------------------------------
// M == 1: a warp per weight row (chunked rows, common.cuh), lanes over K blocks, 16-byte loads of weights and
// activations.  Software-pipelined: a lane issues the loads of its next GEMV_U weight blocks before it
// computes the current ones, so 2 * GEMV_U blocks a lane are in flight, and the first ones go out
// before the kernel waits for the quantized activations.  Programmatic dependent launch both ways
// (pdl.py): this kernel gets resident while its quantize kernel runs, and lets the next quantize kernel
// get resident while it runs.  (GEMV_U: 1 and 3 measured slower than 2, rows a warp 2 and 4 slower
// than 1, activations loaded a step ahead slower too.)
#ifndef GEMV_U
#define GEMV_U 2
#endif
template <typename T>
struct GemvStep {  // one lane's weight blocks kb0, kb0 + 32, ... (GEMV_U of them) of a row of chunks
    using R = ChunkedRows<T>;
    static constexpr bool KEEP_L1 = T::QS_BYTES == 32;  // see load_once
    int4 w[GEMV_U][T::QS_BYTES / 16];
    typename T::Scale d[GEMV_U];
    unsigned h[GEMV_U];
    // kb0 = lane + 64 i: its GEMV_U blocks, 32 apart, all lie in chunk i (the chunk's parts found once)
    static_assert(WARP * GEMV_U == CHUNK_BLOCKS, "a lane's step of blocks is one chunk");
    __device__ __forceinline__ void load(const u8* row, int kb0, int KB) {
        const unsigned j0 = unsigned(kb0) % CHUNK_BLOCKS, first = unsigned(kb0) - j0;
        const int nb = min(CHUNK_BLOCKS, KB - int(first));
        const u8* chunk = row + (size_t)(first / CHUNK_BLOCKS) * R::CHUNK;
#pragma unroll
        for (int u = 0; u < GEMV_U; ++u) {
            const int j = int(j0) + u * WARP;
            if (kb0 + u * WARP < KB) {
#pragma unroll
                for (int v = 0; v < T::QS_BYTES / 16; ++v)
                    w[u][v] = load_once<KEEP_L1>(reinterpret_cast<const int4*>(R::qs(chunk, j)) + v);
                d[u] = load_once<KEEP_L1>(R::d(chunk, nb, j));
                if constexpr (T::QH) h[u] = load_once<KEEP_L1>(R::qh(chunk, nb, j));
                else h[u] = 0;
            }
        }
    }
};

// The weight stream: a warp per weight row, lanes over K blocks, GEMV_U blocks a lane in flight; each
// unpacked weight block serves the batch's rows (up to MT, read through L1/L2, as llama.cpp's MMVQ does).
// gemv's M = 1 kernel is MT = 1; gemv_rows (2 <= M <= 8) MT = 8.  Weights: chunked rows (common.cuh); activations:
// split by row (the chunked, padded ones are the skinny kernel's: layouts.py Q8_1Split).
template <typename T, int MT>
__device__ void gemv_rows(const u8* __restrict__ W, const i8* __restrict__ aq, const __half2* __restrict__ ads,
                          float* __restrict__ Y, int M, int N, int K) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * (blockDim.x / WARP) + warp;
    if (n >= N) return;
    const int KB = K / QK;
    const u8* row = W + (size_t)n * ChunkedRows<T>::row_bytes(KB);
    float acc[MT] = {};
    GemvStep<T> cur, nxt;
    cur.load(row, lane, KB);
    let_dependents_launch();  // the next quantize kernel may get resident (it waits for this grid to end)
    wait_for_inputs();        // (both no-ops unless launched dependent: pdl.py)
    for (int kb0 = lane; kb0 < KB; kb0 += WARP * GEMV_U) {
        nxt.load(row, kb0 + WARP * GEMV_U, KB);
#pragma unroll
        for (int u = 0; u < GEMV_U; ++u) {
            const int kb = kb0 + u * WARP;
            if (kb < KB) {
                int w[8];
                load_split_words<T>(reinterpret_cast<const u8*>(cur.w[u]), cur.h[u], w);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    if (i < M) {
                        const int4* arow = reinterpret_cast<const int4*>(aq + (size_t)i * K);
                        const int4 a0 = __ldg(arow + (size_t)kb * 2), a1 = __ldg(arow + (size_t)kb * 2 + 1);
                        const int a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                        acc[i] += split_epilogue<T>(cur.d[u], float(dot8<true>(w, a)), ads[(size_t)i * KB + kb]);
                    }
                }
            }
        }
        cur = nxt;
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const float sum = warp_sum(acc[i]);
        if (lane == 0 && i < M) Y[(size_t)i * N + n] = sum;
    }
}

// 2 <= M <= 8: a skinny tensor-core product.  One MMA m16n8k32 takes 16 weight rows as A and 8
// activation rows as B (more activation tiles per warp, M up to 64, measured slower than mmq: the
// 4-byte activation fragment loads bind the LSU).  A block of 8 compute warps takes 16 weight rows; K moves
// through shared memory a chunk (CHUNK_BLOCKS quant blocks) at a time, in 2-4 buffers: each stage holds the 16
// rows' chunks and the M activation rows' blocks of the chunk; each warp takes every 8th block of the stage, and
// the warps add in shared memory at the end.  (Fragments straight from global memory, 4 bytes of 8 rows per load,
// bound the L1: at K = 14336, M = 8 Q5_0 took 90 us, 5x its M = 1 time.)  A nibble format's packed bytes
// 4t..4t+3 hold k = 4t.. (low nibbles) and k = 16+4t.. (high): exactly a thread's A fragment registers a0/a2, so
// the quants are read as they are, at half the bytes of int8 (and the fifth bits 4t.. and 16+4t.. of qh).  The
// code-book formats (IQ4_NL, IQ4_XS, MXFP4) have the same 16 bytes of nibbles a block, each packed word looked up 8
// codes at a time into the same two registers; the K-quants' words are put together from their low- and high-bit
// runs (groups.cuh word()), with two k16 MMAs where a scale covers 16 values and an all-ones MMA for Σq_a where there
// is a minimum.  Split-K over gridDim.y (when the row blocks alone leave SMs idle) adds into a zeroed Y.
//
// The copies are the cost: a stage is bulk copies (the copy engine, on Hopper), and the engine's rate of copies,
// not of bytes, bounded this kernel.  A copy a plane and row (quants, scales, fifth bits of 16 weight rows; int8
// and (d, s) of M activation rows: 48 copies a stage at M = 8) took Q4_0 M = 8, K = 14336 24 us; the same bytes
// in one copy a plane, 14.8 us (a probe, H100).  So the legacy formats' weights come as chunked rows (one copy a
// row and stage, common.cuh ChunkedRows) and the activations in chunks of padded row parts (two copies a stage,
// common.cuh act_q): 18 copies a stage.  (Activations block-major, also two copies, made gemv_groups, which reads a row's
// blocks at M > 1, 3x slower.)
//
// A format's part (F): WEIGHTS, the bytes of a stage's 16 weight rows in shared memory; copy(), the copies of
// them; Words, load_words() and store_words(), what the filling threads copy themselves (the K-quants' scale fields:
// loaded a stage ahead, stored once the stage's buffer is free); load(), a thread's
// two A registers of block kb of a shared row and its scale; epilogue(), MMVQ's block
// formula, of the block's integer sum and `aux`: with G16 (a scale a 16 values) the sums are of the two halves
// (two m16n8k16), with MIN `aux` is the activations' quant sum Σq_a (an MMA by all-ones weights).
struct SkinnyNoWords {  // a format part whose stages are all bulk copies: nothing the filling threads copy themselves
    struct Words {};
    __device__ void load_words(Words&, const GPlanes&, int, int, int, int, int) const {}
    __device__ void store_words(u8*, const Words&, int, int, int) const {}
};
template <typename T>
struct SkinnyLegacy : SkinnyNoWords {  // Q4_0, Q8_0, Q4_1, Q5_0, Q5_1 (common.cuh): chunked rows
    using Scale = typename T::Scale;
    using R = ChunkedRows<T>;
    static constexpr bool G16 = false, MIN = false;
    // a shared row: a chunk, and 16 bytes so that rows start 4 banks apart (a full chunk is a multiple of 128 bytes)
    static constexpr int ROW = R::CHUNK + 16, WEIGHTS = 16 * ROW;
    size_t row_bytes;
    // F's constructor: (planes, first row, blocks a row, the thread's group, rows of the block)
    __device__ SkinnyLegacy(const GPlanes&, int, int KB, int, int) : row_bytes(R::row_bytes(KB)) {}
    template <typename Copy>
    __device__ void copy(Copy&& f, u8* s, const GPlanes& P, int n0, int rows, int chunk, int nkb) const {
        f(s, ROW, P.p0, (size_t)n0 * row_bytes + (size_t)chunk * R::CHUNK, row_bytes, rows, R::chunk_bytes(nkb));
    }
    __device__ Scale load(const u8* s, bool upper, int r, int nkb, int kb, size_t, int t, int* lo, int* hi) const {
        const u8* row = s + r * ROW;
        const int v = *reinterpret_cast<const int*>(R::qs(row, kb) + 4 * t);
        if constexpr (T::QS_BYTES == 16) {
            nibble_words<T>(v, T::QH ? *R::qh(row, nkb, kb) : 0u, t, lo, hi);
        } else {
            *lo = v;
            *hi = *reinterpret_cast<const int*>(R::qs(row, kb) + 16 + 4 * t);
        }
        return *R::d(row, nkb, kb);
    }
    __device__ static float epilogue(Scale w, float sumi, float, __half2 ds) { return split_epilogue<T>(w, sumi, ds); }
};
template <typename T>
struct SkinnyCodes : SkinnyNoWords {  // IQ4_NL, IQ4_XS, MXFP4 (groups.cuh): planes p0 and p1, a copy a plane and row
    using Scale = float;
    static constexpr bool G16 = false, MIN = false;
    static constexpr int SC = T::BLOCK_SCALE_BYTES;
    // a scale run may start anywhere in its 16 bytes (it is copied from the boundary before it): 48 bytes of slack
    // keep the shared rows' strides at 4 words mod 32
    static constexpr int QS = CHUNK_BLOCKS * 16 + 16, D = CHUNK_BLOCKS * SC + 48, WEIGHTS = 16 * (QS + D);
    size_t KB;
    int dA, dB;  // where rows g and g + 8's scale runs start in their shared rows (the same every stage)
    __device__ SkinnyCodes(const GPlanes&, int n0, int KB_, int g, int) : KB(KB_) {
        dA = int((size_t)(n0 + g) * KB * SC & 15);
        dB = int((size_t)(n0 + g + 8) * KB * SC & 15);
    }
    template <typename Copy>
    __device__ void copy(Copy&& f, u8* s, const GPlanes& P, int n0, int rows, int chunk, int nkb) const {
        const size_t at = (size_t)n0 * KB + (size_t)chunk * CHUNK_BLOCKS;
        f(s, QS, P.p0, at * 16, KB * 16, rows, nkb * 16);
        f(s + 16 * QS, D, P.p1, at * SC, KB * SC, rows, nkb * SC);
    }
    __device__ float load(const u8* s, bool upper, int r, int nkb, int kb, size_t, int t, int* lo, int* hi) const {
        const int2 v = T::Codes::lookup(*reinterpret_cast<const unsigned*>(s + r * QS + kb * 16 + 4 * t));
        *lo = v.x;
        *hi = v.y;
        return T::block_scale(s + 16 * QS + r * D + (upper ? dB : dA), kb);
    }
    // vec_dot_{iq4_nl,iq4_xs,mxfp4}_q8_1: (d_w d_a) sumi (IQ4_XS's sumi (ls - 32) exact in d_w here)
    __device__ static float epilogue(float w, float sumi, float, __half2 ds) { return w * __low2float(ds) * sumi; }
};
// The K-quants (groups.cuh QGEMM_FOR_SKINNY_K_TYPES): a stage's runs of their two value planes (low bits in p0, high
// bits in T::hi_plane), a copy a plane and row, and their scale fields (a few bytes a super-block in up to three
// planes), copied by the producer warp with plain loads into shared rows of 8 super-blocks (Words, load_words,
// store_words): read from global memory where a thread needed them, the scales took half the kernel's time (H100,
// M = 8, K = 14336: Q4_K 34.1 us, 17.2 with the scales left out).  MMVQ's formulas: Q4_K / Q5_K
// d_a (d sc sumi - dmin m Σq_a), Q3_K / Q6_K d_a (d sc_lo sumi_lo + d sc_hi sumi_hi).
template <bool FOUR> struct ScaleWord { using type = unsigned short; };
template <> struct ScaleWord<true> { using type = unsigned; };
template <typename T>
struct SkinnyGroups {
    using Scale = float2;  // (sc, cf) with a min, else the two halves' scales
    static constexpr bool G16 = T::G16, MIN = T::MIN;
    static_assert(G16 != MIN, "the skinny MMA takes a scale a 32 with a min, or a scale a 16 without");
    static constexpr int SB = CHUNK_BLOCKS / 8;  // super-blocks a stage
    static constexpr int QS = SB * T::QS_BYTES + 16, HI = T::HI_BYTES ? SB * T::HI_BYTES + 16 : 0;
    // the scale planes' copies, [row][super-block] each, after the value runs: plane p at O_SCALE + o_scale(p)
    static constexpr int O_SCALE = 16 * (QS + HI);
    __host__ __device__ static constexpr int o_scale(int p) {
        return p == 0 ? 0 : o_scale(p - 1) + 16 * SB * T::scale_bytes(p - 1);
    }
    static constexpr int WEIGHTS = O_SCALE + o_scale(5);
    size_t sbs;  // super-blocks a row
    __device__ SkinnyGroups(const GPlanes&, int, int KB, int, int) : sbs(KB / 8) {}
    template <typename Copy>
    __device__ void copy(Copy&& f, u8* s, const GPlanes& P, int n0, int rows, int chunk, int nkb) const {
        const size_t at = (size_t)n0 * sbs + (size_t)chunk * SB;
        f(s, QS, P.p0, at * T::QS_BYTES, sbs * T::QS_BYTES, rows, nkb / 8 * T::QS_BYTES);
        if constexpr (T::HI_BYTES > 0)
            f(s + 16 * QS, HI, T::hi_plane(P), at * T::HI_BYTES, sbs * T::HI_BYTES, rows, nkb / 8 * T::HI_BYTES);
    }
    // The stage's scale fields in registers, two lanes a row (the filling warp's lanes; other threads none): loaded
    // a stage ahead, while the producer waits for the buffer, and stored when it is free.  Words of 4 bytes where a
    // plane's fields are a multiple of 4 bytes (the scales), else 2 (d, dmin); rows past N are never read.  (Loads
    // and stores in turn, 2 bytes at a time, a lane every 32nd word, made the kernel 2-3x slower than reading the
    // scales where needed; H100, sixth session.)
    template <int p>
    struct PlaneWords {
        static constexpr int B = T::scale_bytes(p);
        using W = typename ScaleWord<B % 4 == 0>::type;
        static constexpr int U = SB * B / int(sizeof(W)) / 2;  // a lane's words
        W v[U ? U : 1];
    };
    struct Words {
        PlaneWords<1> p1;
        PlaneWords<2> p2;
        PlaneWords<3> p3;
    };
    template <int p>
    __device__ void load_plane(PlaneWords<p>& pw, const u8* plane, int n0, int rows, int chunk, int nsb, int i) const {
        using W = typename PlaneWords<p>::W;
        constexpr int B = PlaneWords<p>::B;
        const int r = i >> 1, words = nsb * B / int(sizeof(W));
        if (B == 0 || i >= 32 || r >= rows) return;
        const W* run = reinterpret_cast<const W*>(plane + ((size_t)(n0 + r) * sbs + (size_t)chunk * SB) * B);
#pragma unroll
        for (int u = 0; u < PlaneWords<p>::U; ++u) {
            const int k = (i & 1) + 2 * u;
            if (k < words) pw.v[u] = __ldg(run + k);
        }
    }
    template <int p>
    __device__ void store_plane(u8* s, const PlaneWords<p>& pw, int rows, int nsb, int i) const {
        using W = typename PlaneWords<p>::W;
        constexpr int B = PlaneWords<p>::B;
        const int r = i >> 1, words = nsb * B / int(sizeof(W));
        if (B == 0 || i >= 32 || r >= rows) return;
        W* row = reinterpret_cast<W*>(s + O_SCALE + o_scale(p) + r * SB * B);
#pragma unroll
        for (int u = 0; u < PlaneWords<p>::U; ++u) {
            const int k = (i & 1) + 2 * u;
            if (k < words) row[k] = pw.v[u];
        }
    }
    __device__ void load_words(Words& v, const GPlanes& P, int n0, int rows, int chunk, int nkb, int i) const {
        static_assert(T::scale_bytes(0) == 0 && T::scale_bytes(4) == 0, "scale fields in planes p1..p3");
        load_plane<1>(v.p1, P.p1, n0, rows, chunk, nkb / 8, i);
        load_plane<2>(v.p2, P.p2, n0, rows, chunk, nkb / 8, i);
        load_plane<3>(v.p3, P.p3, n0, rows, chunk, nkb / 8, i);
    }
    __device__ void store_words(u8* s, const Words& v, int rows, int nkb, int i) const {
        store_plane<1>(s, v.p1, rows, nkb / 8, i);
        store_plane<2>(s, v.p2, rows, nkb / 8, i);
        store_plane<3>(s, v.p3, rows, nkb / 8, i);
    }
    __device__ Scale load(const u8* s, bool, int r, int, int kb, size_t, int t, int* lo, int* hi) const {
        const int j = kb & 7, sb = kb >> 3;
        const u8* q = s + r * QS + sb * T::QS_BYTES + T::qs_at(j) + 4 * t;
        int h0 = 0, h1 = 0;
        if constexpr (T::HI_BYTES > 0) {
            const u8* h = s + 16 * QS + r * HI + sb * T::HI_BYTES + T::hi_at(j) + 4 * t;
            h0 = *reinterpret_cast<const int*>(h);
            h1 = *reinterpret_cast<const int*>(h + 16);
        }
        *lo = T::word(*reinterpret_cast<const int*>(q), h0, j);
        *hi = T::word(*reinterpret_cast<const int*>(q + 16), h1, j);
        const u8* o = s + O_SCALE;
        const GPlanes shared = {o, o + o_scale(1), o + o_scale(2), o + o_scale(3), o + o_scale(4)};
        float sc[2] = {0.f, 0.f}, cf[2] = {0.f, 0.f};
        T::template scales<LdShared>(shared, (size_t)(r * SB + sb), j, sc, cf);
        return make_float2(sc[0], MIN ? cf[0] : sc[1]);
    }
    __device__ static float epilogue(Scale w, float sumi, float aux, __half2 ds) {
        return __low2float(ds) * (w.x * sumi + w.y * aux);
    }
};

#if defined(QGEMM_BULK) && !defined(SKINNY_CP_ASYNC)  // (-D SKINNY_CP_ASYNC: the cp.async loader on Hopper too)
#define SKINNY_BULK 1
#endif
#define SKINNY_KB CHUNK_BLOCKS  // quant blocks a stage (H100, K = 14336, M = 8: 32 blocks, 2-6 stages, 40-70% slower)
// 8 compute warps and a producer warp (which on Hopper issues the bulk copies; elsewhere it only shares the
// cp.async copies); launch.py's SKINNY_THREADS mirrors it.
#define SKINNY_WARPS 8
#define SKINNY_THREADS ((SKINNY_WARPS + 1) * WARP)

// Byte layout of one stage: F's WEIGHTS, then the activations' chunk as it is in global memory (common.cuh act_q,
// act_ds, padded): M row parts of int8 quants, then M of (d, s).  launch.py's skinny_stage mirrors stage(M).
template <typename F>
struct SkinnySmem {
    static constexpr int O_A = F::WEIGHTS, A = ACT_ROW, S = ACT_DS_ROW * 4;
    __device__ static int o_s(int M) { return O_A + M * A; }
    __device__ static int stage(int M) { return o_s(M) + M * S; }
};

// Copy `rows` runs of `bytes` bytes (run r at byte off0 + r * row_bytes of src) into shared rows of `stride`
// bytes, in 16-byte chunks from the boundary at or before each run: cp.async, the block's threads sharing the
// chunks.
__device__ __forceinline__ void stage_runs(u8* dst, int stride, const void* src, size_t off0, size_t row_bytes,
                                           int rows, int bytes) {
    const int chunks = (bytes + 15) / 16 + 1;  // a run takes at most
    for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
        const int r = i / chunks, c = i % chunks;
        const size_t start = off0 + r * row_bytes, chunk = (start & ~size_t(15)) + 16 * c;
        if (chunk < start + bytes) cp_async16(dst + r * stride + 16 * c, static_cast<const u8*>(src) + chunk, true);
    }
}
#ifdef SKINNY_BULK
// The same runs, each one bulk copy (the copy engine; 16-byte boundaries around it) completing on `bar`, lane l of
// a warp taking runs l, l + 32, ...; returns those copies' bytes (`issue` false: counts them only).
__device__ __forceinline__ unsigned bulk_runs(u8* dst, int stride, const void* src, size_t off0, size_t row_bytes,
                                              int rows, int bytes, unsigned long long* bar, bool issue) {
    unsigned total = 0;
    for (int r = threadIdx.x % WARP; r < rows; r += WARP) {
        const size_t start = off0 + r * row_bytes, first = start & ~size_t(15);
        const unsigned n = unsigned(((start + bytes + 15) & ~size_t(15)) - first);
        if (issue) bulk_copy(dst + r * stride, static_cast<const u8*>(src) + first, n, bar);
        total += n;
    }
    return total;
}
#endif

// cp.async.wait_group takes an immediate: the stage count is the launch's (2..4)
__device__ __forceinline__ void cp_async_wait_stages(int stages) {
    if (stages >= 4) cp_async_wait<3>();
    else if (stages == 3) cp_async_wait<2>();
    else cp_async_wait<1>();
}

// `stages` buffers of L::stage(M) bytes at `buf` (as many as keep two blocks an SM: launch.py); P: F's weight
// arrays (the chunked rows in p0, or a grouped format's planes)
template <typename F>
__device__ void skinny(const GPlanes P, const i8* __restrict__ aq, const __half2* __restrict__ ads,
                       float* __restrict__ Y, int M, int N, int K, int chunks_per_split, int stages, u8* buf) {
    using Scale = typename F::Scale;
    using L = SkinnySmem<F>;
    __shared__ float red[SKINNY_WARPS][4][WARP];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16, KB = K / QK, rows = min(16, N - n0);
    const int c0 = blockIdx.y * chunks_per_split, chunks = min((KB + SKINNY_KB - 1) / SKINNY_KB - c0, chunks_per_split);
    const int STAGE = L::stage(M), O_S = L::o_s(M);
    const int m0 = 2 * t, m1 = m0 + 1;
    const bool okG = g < M, ok0 = m0 < M, ok1 = m1 < M;
    const F fmt(P, n0, KB, g, rows);

    // f(shared rows, their stride, array, first run's byte offset, bytes from run to run, runs, bytes a run) for
    // each run of stage c of this split
    auto for_runs = [&](int c, auto&& f) {
        u8* s = buf + (c % stages) * STAGE;
        const int kb0 = (c0 + c) * SKINNY_KB, nkb = min(SKINNY_KB, KB - kb0);
        fmt.copy(f, s, P, n0, rows, c0 + c, nkb);
        f(s + L::O_A, 0, aq, (size_t)(c0 + c) * M * L::A, 0, 1, M * L::A);  // the chunk's activations: two copies
        f(s + O_S, 0, ads, (size_t)(c0 + c) * M * L::S, 0, 1, M * L::S);
    };
    // F's own copies of stage c (by threads 0-31 of the filling ones, thread i): loaded into `v`, stored into the
    // stage's buffer
    auto stage_nkb = [&](int c) { return min(SKINNY_KB, KB - (c0 + c) * SKINNY_KB); };
    auto load_words = [&](typename F::Words& v, int c, int i) {
        fmt.load_words(v, P, n0, rows, c0 + c, stage_nkb(c), i);
    };
    auto store_words = [&](const typename F::Words& v, int c, int i) {
        fmt.store_words(buf + (c % stages) * STAGE, v, rows, stage_nkb(c), i);
    };
    float acc[4] = {};
    auto compute = [&](int c) {  // a compute warp's blocks of stage c: every SKINNY_WARPS-th, from its own
        const u8* s = buf + (c % stages) * STAGE;
        const int kb0 = (c0 + c) * SKINNY_KB, nkb = min(SKINNY_KB, KB - kb0);
#pragma unroll
        for (int j = 0; j < SKINNY_KB / SKINNY_WARPS; ++j) {
            const int kb = warp + SKINNY_WARPS * j;
            if (kb >= nkb) break;
            int a[4], b[2] = {0, 0};
            const Scale wA = fmt.load(s, false, g, nkb, kb, (size_t)kb0 + kb, t, &a[0], &a[2]);
            const Scale wB = fmt.load(s, true, g + 8, nkb, kb, (size_t)kb0 + kb, t, &a[1], &a[3]);
            if (okG) {
                const u8* ar = s + L::O_A + g * L::A + kb * QK + 4 * t;
                b[0] = *reinterpret_cast<const int*>(ar);
                b[1] = *reinterpret_cast<const int*>(ar + 16);
            }
            const __half2 sa0 = ok0 ? *reinterpret_cast<const __half2*>(s + O_S + m0 * L::S + 4 * kb) : __half2();
            const __half2 sa1 = ok1 ? *reinterpret_cast<const __half2*>(s + O_S + m1 * L::S + 4 * kb) : __half2();
            // d0: (weight row n0+g, act m0), d1: (n0+g, m1), d2: (n0+g+8, m0), d3: (n0+g+8, m1); x: G16's second
            // half, or MIN's Σq_a of m0, m1
            int d[4], x[4] = {0, 0, 0, 0};
            if constexpr (F::G16) {
                mma16_s8_const<MAGIC_I>(d, a, b[0]);
                mma16_s8_const<MAGIC_I>(x, a + 2, b[1]);
            } else {
                mma_s8_const<MAGIC_I>(d, a, b);
                if constexpr (F::MIN) {
                    const int ones[4] = {0x01010101, 0x01010101, 0x01010101, 0x01010101};
                    mma_s8_const<MAGIC_I>(x, ones, b);
                }
            }
            const bool aux = F::G16 || F::MIN;
            acc[0] += F::epilogue(wA, magic_to_float(d[0]), aux ? magic_to_float(x[0]) : 0.f, sa0);
            acc[1] += F::epilogue(wA, magic_to_float(d[1]), aux ? magic_to_float(x[1]) : 0.f, sa1);
            acc[2] += F::epilogue(wB, magic_to_float(d[2]), aux ? magic_to_float(x[2]) : 0.f, sa0);
            acc[3] += F::epilogue(wB, magic_to_float(d[3]), aux ? magic_to_float(x[3]) : 0.f, sa1);
        }
    };
#ifdef SKINNY_BULK
    // Hopper: warp SKINNY_WARPS is the producer.  It hands each run of stage c to the copy engine, completing on
    // full[c % stages], once the compute warps have released that buffer's previous stage on empty[c % stages]
    // (an arrival a warp).  So no barrier a stage: each compute warp waits only for its data.  (With a barrier a
    // stage and warp 0 issuing the copies, the warps stalled 40% of their cycles on it: ncu, Q4_0 M = 8,
    // K = 14336; without it they wait on the data instead: 3% faster at K = 14336, 3% slower at 4096.)
    __shared__ __align__(8) unsigned long long full[4], empty[4];
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; ++i) {
            mbar_init(full + i, 1);
            mbar_init(empty + i, SKINNY_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // seen by the copy engine
    }
    __syncthreads();
    if (warp == SKINNY_WARPS) {
        typename F::Words words;  // F's own copies of the next stage, loaded while the producer waits for its buffer
        if (chunks > 0) load_words(words, 0, lane);
        for (int c = 0; c < chunks; ++c) {
            unsigned long long* bar = full + c % stages;
            if (c >= stages) mbar_wait(empty + c % stages, (c / stages - 1) & 1);
            unsigned bytes = 0;
            for_runs(c, [&](u8* d, int st, const void* p, size_t o, size_t rb, int n, int b) {
                bytes += bulk_runs(d, st, p, o, rb, n, b, bar, false);
            });
            bytes = __reduce_add_sync(0xffffffffu, bytes);
            store_words(words, c, lane);
            __syncwarp();  // the lanes' stores before lane 0's arrival releases them to the compute warps
            if (lane == 0) mbar_expect(bar, bytes);
            __syncwarp();
            for_runs(c, [&](u8* d, int st, const void* p, size_t o, size_t rb, int n, int b) {
                bulk_runs(d, st, p, o, rb, n, b, bar, true);
            });
            if (c + 1 < chunks) load_words(words, c + 1, lane);
        }
    } else {
        for (int c = 0; c < chunks; ++c) {
            mbar_wait(full + c % stages, (c / stages) & 1);
            compute(c);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + c % stages);
        }
    }
#else  // cp.async: every thread (the producer warp too) its share of the chunks, a barrier a stage
    for (int c = 0; c < stages - 1; ++c) {
        if (c < chunks) {
            for_runs(c, stage_runs);
            typename F::Words words;
            load_words(words, c, threadIdx.x);
            store_words(words, c, threadIdx.x);
        }
        cp_async_commit();
    }
    for (int c = 0; c < chunks; ++c) {
        if (c + stages - 1 < chunks) {
            for_runs(c + stages - 1, stage_runs);
            typename F::Words words;
            load_words(words, c + stages - 1, threadIdx.x);
            store_words(words, c + stages - 1, threadIdx.x);
        }
        cp_async_commit();
        cp_async_wait_stages(stages);
        __syncthreads();
        if (warp < SKINNY_WARPS) compute(c);
        __syncthreads();  // the buffer is loaded again next
    }
#endif
    if (warp < SKINNY_WARPS) {
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp][e][lane] = acc[e];
    }
    __syncthreads();
    if (warp < 4) {  // warp e finishes value e of every lane
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < SKINNY_WARPS; ++w) sum += red[w][warp][lane];
        const int n = n0 + g + ((warp < 2) ? 0 : 8), m = 2 * t + (warp & 1);
        if (n < N && m < M) {
            if (gridDim.y > 1) atomicAdd(Y + (size_t)m * N + n, sum);
            else Y[(size_t)m * N + n] = sum;
        }
    }
}

#define FAST(t, T)                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        gemv1_##t(const u8* w, const i8* aq, const __half2* ads, float* Y, int N, int K) {                      \
        gemv_rows<T, 1>(w, aq, ads, Y, 1, N, K);                                                                \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS, 2)                                             \
        skinny1_##t(const u8* w, const i8* aq, const __half2* ads, float* Y, int M, int N, int K,               \
                    int chunks_per_split, int stages) {                                                         \
        extern __shared__ __align__(128) char smem[];                                                           \
        skinny<SkinnyLegacy<T>>({w, w, w, w, w}, aq, ads, Y, M, N, K, chunks_per_split, stages,                \
                                reinterpret_cast<u8*>(smem));                                                   \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        gemv_rows_##t(const u8* w, const i8* aq, const __half2* ads, float* Y, int M, int N, int K) {           \
        gemv_rows<T, 8>(w, aq, ads, Y, M, N, K);                                                                \
    }
QGEMM_FOR_FAST_TYPES(FAST)

// ---- gemv for the grouped formats (K-quants, IQ4_NL / IQ4_XS, MXFP4; groups.cuh) -----------------------
// llama.cpp's MMVQ formula, M <= MT: a warp per weight row, a lane per 32-value sub-block (lanes of a warp
// cover 4 whole super-blocks, so the field planes are read in contiguous runs), the sub-block decoded once
// from its GGUF fields and reused for each activation row:
//   acc += d_a * (sc_lo * sumi_lo + sc_hi * sumi_hi + cf_lo * Σq_a,lo + cf_hi * Σq_a,hi)
// (halves of 16 values for the G16 formats; one scale for 32 otherwise).  Each lane first decodes U
// sub-blocks (their loads all in flight), then computes them.  H100, M = 1, K = 14336: U = 1 streamed at
// 25-60% of the copy bandwidth, U = 4 took IQ4_NL 23.2 -> 15.8 us, Q4_K 18.0 -> 13.0, Q3_K 29.7 -> 20.4 but
// Q2_K, Q5_K, Q6_K 20-50% slower, and every format at M = 8 (registers): so M = 1 takes the format's
// LOOKAHEAD, M > 1 one sub-block at a time.  With S > 1 a row's K is split over S warps (warp part p takes
// every S-th run of 32 sub-blocks) whose sums add in shared memory, in part order.
template <typename T, int MT, int U, int S>
__device__ void gemv_groups(const GPlanes P, const i8* __restrict__ aq, const __half2* __restrict__ ads,
                            float* __restrict__ Y, int M, int N, int K) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, part = warp % S;
    const int n = blockIdx.x * (blockDim.x / WARP / S) + warp / S;
    __shared__ float parts[S > 1 ? 8 : 1][MT];
    let_dependents_launch();
    if constexpr (S == 1) {
        if (n >= N) return;
    }
    const int KB = S == 1 || n < N ? K / QK : 0;  // (S > 1) rows past N compute nothing but meet the barrier
    float acc[MT] = {};
    bool waited = false;
    for (int kb0 = part * WARP + lane; kb0 < KB; kb0 += WARP * U * S) {
        int w[U][8];
        float sc[U][2], cf[U][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * WARP * S;
            if (kb < KB) {
                const size_t c = (size_t)n * KB + kb;
                T::decode(P, c / T::SUBS, int(c % T::SUBS), w[u], sc[u], cf[u]);
            }
        }
        if (!waited) {  // the first weights are on their way; now the quantized activations (pdl.py)
            wait_for_inputs();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * WARP * S;
            if (kb >= KB) break;
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                if (i < M) {
                    const int4* arow = reinterpret_cast<const int4*>(aq + (size_t)i * K) + (size_t)kb * 2;
                    const int4 a0 = __ldg(arow), a1 = __ldg(arow + 1);
                    const int a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                    int lo = 0, hi = 0;
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        lo = __dp4a(w[u][q], a[q], lo);
                        hi = __dp4a(w[u][q + 4], a[q + 4], hi);
                    }
                    const float v = group_sum<T>(sc[u], cf[u], lo, hi, a);
                    acc[i] = fmaf(__low2float(ads[(size_t)i * KB + kb]), v, acc[i]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const float sum = warp_sum(acc[i]);
        if constexpr (S == 1) {
            if (lane == 0 && i < M && KB) Y[(size_t)i * N + n] = sum;
        } else if (lane == 0) {
            parts[warp][i] = sum;
        }
    }
    if constexpr (S > 1) {  // the row's S parts of K, added in part order
        __syncthreads();
        if (part == 0 && lane < MT && lane < M && KB) {
            float sum = parts[warp][lane];
#pragma unroll
            for (int p = 1; p < S; ++p) sum += parts[warp + p][lane];
            Y[(size_t)lane * N + n] = sum;
        }
    }
}

// M = 1 for Q2_K, Q3_K and Q5_K (groups.cuh M1_LANES, T::Lane): gemv_groups' lanes, order of sums and float
// operations (so its products bit for bit), with a lane's sub-block j = lane % 8 fixed (K is a multiple of 256), its
// bit masks made once and its planes addressed by super-block: LOOKAHEAD super-blocks' raw fields in flight, then
// their sums.
template <typename T, int U, int S>
__device__ void gemv_k1(const GPlanes P, const i8* __restrict__ aq, const __half2* __restrict__ ads,
                        float* __restrict__ Y, int N, int K) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, part = warp % S;
    const int n = blockIdx.x * (blockDim.x / WARP / S) + warp / S;
    __shared__ float parts[S > 1 ? 8 : 1];
    let_dependents_launch();
    if constexpr (S == 1) {
        if (n >= N) return;
    }
    const int SB = S == 1 || n < N ? K / 256 : 0;  // (S > 1) rows past N compute nothing but meet the barrier
    constexpr int STEP = 4 * S;                    // super-blocks from one of a lane's sub-blocks to its next
    const typename T::Lane L(lane % 8);
    int sb = 4 * part + lane / 8;        // the lane's super-block in the row
    unsigned s = unsigned(n) * SB + sb;  // and in the planes (a tensor has fewer than 2^32 super-blocks)
    const int4* act = reinterpret_cast<const int4*>(aq) + 2 * (8 * sb + lane % 8);  // block 8 sb + j: 2 int4
    const __half2* ds = ads + 8 * sb + lane % 8;
    float acc = 0.f;
    bool waited = false;
    for (; sb < SB; sb += STEP * U) {
        typename T::Raw x[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (sb + STEP * u < SB) T::load(P, s, STEP * u, L, x[u]);
        if (!waited) {  // the first weights are on their way; now the quantized activations (pdl.py)
            wait_for_inputs();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (sb + STEP * u >= SB) break;
            const int4 a0 = __ldg(act + 16 * STEP * u), a1 = __ldg(act + 16 * STEP * u + 1);
            const int a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            acc = fmaf(__low2float(ds[8 * STEP * u]), T::dot(x[u], a, L), acc);
        }
        s += STEP * U;
        act += 16 * STEP * U;
        ds += 8 * STEP * U;
    }
    const float sum = warp_sum(acc);
    if constexpr (S == 1) {
        if (lane == 0 && SB) Y[n] = sum;
    } else {
        if (lane == 0) parts[warp] = sum;
        __syncthreads();  // the row's S parts of K, added in part order
        if (part == 0 && lane == 0 && SB) {
            float all = parts[warp];
#pragma unroll
            for (int p = 1; p < S; ++p) all += parts[warp + p];
            Y[n] = all;
        }
    }
}

// M = 1: gemv_k1 for Q2_K, Q3_K and Q5_K, gemv_groups for the others (each with the format's LOOKAHEAD)
template <typename T, int S>
__device__ void gemv1_grouped(const GPlanes P, const i8* aq, const __half2* ads, float* Y, int N, int K) {
    if constexpr (UsesK1<T>::value)
        gemv_k1<T, T::LOOKAHEAD, S>(P, aq, ads, Y, N, K);
    else
        gemv_groups<T, 1, T::LOOKAHEAD, S>(P, aq, ads, Y, 1, N, K);
}

// gemv1_<type>_s<S>: M = 1 with a weight row's K split over S warps (launch.py GROUPS_SPLIT picks S per format:
// one warp a row gives 4096 rows about 31 warps an SM, too few loads in flight for some decoders).  4096 rows at
// S = 1 are one wave while 4 blocks fit an SM (64 registers); Q3_K takes 76 unbounded, so its MIN_BLOCKS is 4 (22.0
// -> 14.7 us at K = 14336).  The bound also steers ptxas's schedule: IQ4_XS is 5% slower under it, Q2_K at S = 2
// streams at 51% of copy bandwidth with it and 44% without, Q5_K at S = 4 at 70% without and 62% with (H100).
#define GEMV1_GROUPS(t, T, S, BOUNDS)                                                                           \
    extern "C" __global__ void __launch_bounds__ BOUNDS                                                         \
        gemv1_##t##_s##S(const u8* p0, const u8* p1, const u8* p2, const u8* p3, const u8* p4, const i8* aq,    \
                         const __half2* ads, float* Y, int N, int K) {                                          \
        gemv1_grouped<T, S>({p0, p1, p2, p3, p4}, aq, ads, Y, N, K);                                            \
    }
#define GEMV_GROUPS(t, T)                                                                                       \
    GEMV1_GROUPS(t, T, 1, (256, T::MIN_BLOCKS)) GEMV1_GROUPS(t, T, 2, (256, 4)) GEMV1_GROUPS(t, T, 4, (256))    \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        gemv_rows_##t(const u8* p0, const u8* p1, const u8* p2, const u8* p3, const u8* p4, const i8* aq,       \
                      const __half2* ads, float* Y, int M, int N, int K) {                                      \
        gemv_groups<T, 8, 1, 1>({p0, p1, p2, p3, p4}, aq, ads, Y, M, N, K);                                     \
    }
QGEMM_FOR_GROUPED_TYPES(GEMV_GROUPS)

// The code-book formats and the K-quants from their groups.py skinny_min_m rows (launch.py takes_skinny;
// gemv_rows_<type> below): the skinny MMA above on their planes, the code books' nibbles looked up as they are read
// (SkinnyCodes), the K-quants' values put together from two planes (SkinnyGroups)
#define SKINNY_PLANES(t, F)                                                                                     \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS, 2)                                             \
        skinny1_##t(const u8* p0, const u8* p1, const u8* p2, const u8* p3, const u8* p4, const i8* aq,         \
                    const __half2* ads, float* Y, int M, int N, int K, int chunks_per_split, int stages) {      \
        extern __shared__ __align__(128) char smem[];                                                           \
        skinny<F>({p0, p1, p2, p3, p4}, aq, ads, Y, M, N, K, chunks_per_split, stages,                          \
                  reinterpret_cast<u8*>(smem));                                                                 \
    }
#define SKINNY_CODES(t, T) SKINNY_PLANES(t, SkinnyCodes<T>)
#define SKINNY_K(t, T) SKINNY_PLANES(t, SkinnyGroups<T>)
QGEMM_FOR_CODEBOOK_TYPES(SKINNY_CODES)
QGEMM_FOR_SKINNY_K_TYPES(SKINNY_K)
