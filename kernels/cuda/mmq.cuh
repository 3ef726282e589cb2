// mmq's shared part: the tiled operands, the stages in shared memory, the MMAs and the epilogue of llama.cpp's MMQ
// formula (sumi * d_w * d_a over signed weights, no sum term), for mmq.cu (mma.sync m16n8k32) and mmq_wgmma.cu
// (Hopper's wgmma).  One 32-value block is one MMA's K, so sumi is the exact integer block dot, scaled in fp32.
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
// `git show 13e6adb:docs/reports/parity-llama-cpp.md` says why the formula changed.)
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
