// gemv: the weight stream at the memory roofline for M <= 8, reading the split Q8_1 layout (aq int8 [M, K], ads
// half2 [M, K/32]) and computing llama.cpp's MMVQ formula: the legacy formats' chunked rows, the skinny MMA kernel
// for a few activation rows, and the grouped formats (K-quants, IQ4_NL / IQ4_XS, MXFP4; groups.cuh).
#include "common.cuh"
#include "groups.cuh"
#include "mma.cuh"
#include "q8_1.cuh"

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
    typename R::High h[GEMV_U];  // fifth bits (Q5_0, Q5_1, Q5_KR) or two high bits a value (Q6_KR)
    unsigned s[GEMV_U];          // a K-quant's super-block fields (R::SUP > 0)
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
                if constexpr (R::HB > 0) h[u] = load_once<KEEP_L1>(R::qh(chunk, nb, j));
                else h[u] = 0;
                if constexpr (R::SUP > 0) s[u] = load_once<KEEP_L1>(R::super(chunk, nb, j));
            }
        }
    }
};

// A lane's part of the weight stream of one row, from `cur` (its first GEMV_U blocks, loaded by the caller) on:
// the next GEMV_U blocks a lane are loaded before the current ones are computed; each unpacked weight block serves
// the batch's rows i < M (up to MT).  Acts gives activation row i's Q8_1 block kb: quants(i, kb, a) its 8 quant
// words, ds(i, kb) its (d, s), read in that order around the dot as the two kernels did before they shared this
// loop (the same PTX as then, but for register names).  gemv_rows reads them from global memory (GlobalActs),
// gemv1_fused from its shared copy of X (SharedActs).
template <typename T, int MT, typename Acts>
__device__ __forceinline__ void stream_row(const u8* row, int lane, int KB, int M, GemvStep<T>& cur, float (&acc)[MT],
                                           const Acts& acts) {
    using R = ChunkedRows<T>;
    // The chunk nxt reads asked into L2 first, a 128-byte line a lane.  An H200, [4096, 14336], quantize + GEMM from
    // HBM, without -> with: M = 1 Q5_0 13.8 -> 12.4 us, Q5_1 14.7 -> 13.2, Q8_0 18.4 -> 17.2, Q4_KR 12.5 -> 11.1,
    // Q4_0 and Q4_1 unchanged; at 8 rows (MT = 8) Q8_0 95 -> 69 and Q5_x 50 -> 45, but Q4_0 42 -> 48 and Q4_1 42 ->
    // 43, so the 4-bit blocks of 18 and 20 bytes take it only at M = 1.
    constexpr bool PREFETCH = MT == 1 || R::PER > 20;
    GemvStep<T> nxt;
    for (int kb0 = lane; kb0 < KB; kb0 += WARP * GEMV_U) {
        if constexpr (PREFETCH) {
            const size_t at = (size_t)((kb0 - lane) / CHUNK_BLOCKS + 1) * R::CHUNK + 128 * lane;
            if (128 * lane < R::CHUNK && at < R::row_bytes(KB)) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + at));
        }
        nxt.load(row, kb0 + WARP * GEMV_U, KB);
#pragma unroll
        for (int u = 0; u < GEMV_U; ++u) {
            const int kb = kb0 + u * WARP;
            if (kb < KB) {
                int w[8];
                if constexpr (R::SUP > 0) T::words(cur.w[u][0], cur.h[u], w);
                else load_split_words<T>(reinterpret_cast<const u8*>(cur.w[u]), cur.h[u], w);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    if (i < M) {
                        int a[8];
                        acts.quants(i, kb, a);
                        if constexpr (R::SUP > 0)  // a K-quant's sub-block: gemv_groups' sum
                            acc[i] = fmaf(__low2float(acts.ds(i, kb)), T::sum(cur.d[u], cur.s[u], w, a), acc[i]);
                        else
                            acc[i] += split_epilogue<T>(cur.d[u], float(dot8<true>(w, a)), acts.ds(i, kb));
                    }
                }
            }
        }
        cur = nxt;
    }
}
__device__ __forceinline__ void int8_words(int4 a0, int4 a1, int* a) {
    a[0] = a0.x; a[1] = a0.y; a[2] = a0.z; a[3] = a0.w; a[4] = a1.x; a[5] = a1.y; a[6] = a1.z; a[7] = a1.w;
}
struct GlobalActs {  // the split Q8_1 layout in global memory: aq int8 [M, K], ads half2 [M, K/32]
    const i8* __restrict__ aq;
    const __half2* __restrict__ ads;
    int K, KB;
    __device__ __forceinline__ void quants(int i, int kb, int* a) const {
        const int4* arow = reinterpret_cast<const int4*>(aq + (size_t)i * K) + (size_t)kb * 2;
        int8_words(__ldg(arow), __ldg(arow + 1), a);
    }
    __device__ __forceinline__ __half2 ds(int i, int kb) const {
        const __half2* __restrict__ p = ads;  // (a member's __restrict__ is not taken: the read-only path needs this)
        return p[(size_t)i * KB + kb];
    }
};
struct SharedActs {  // one row of it in shared memory (gemv1_fused): plain loads
    const i8* aq;
    const __half2* ads;
    __device__ __forceinline__ void quants(int, int kb, int* a) const {
        const int4* act = reinterpret_cast<const int4*>(aq) + kb * 2;
        int8_words(act[0], act[1], a);
    }
    __device__ __forceinline__ __half2 ds(int, int kb) const { return ads[kb]; }
};

// The weight stream: a warp per weight row, lanes over K blocks (stream_row), activations read through L1/L2, as
// llama.cpp's MMVQ does.  gemv's M = 1 kernel is MT = 1; gemv_rows (2 <= M <= 8) MT = 8.  Weights: chunked rows
// (common.cuh); activations: split by row (the chunked, padded ones are the skinny kernel's: layouts.py Q8_1Split).
template <typename T, int MT>
__device__ void gemv_rows(const u8* __restrict__ W, const i8* __restrict__ aq, const __half2* __restrict__ ads,
                          float* __restrict__ Y, int M, int N, int K) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * (blockDim.x / WARP) + warp;
    if (n >= N) return;
    const int KB = K / QK;
    const u8* row = W + (size_t)n * ChunkedRows<T>::row_bytes(KB);
    float acc[MT] = {};
    GemvStep<T> cur;
    cur.load(row, lane, KB);
    let_dependents_launch();  // the next quantize kernel may get resident (it waits for this grid to end)
    wait_for_inputs();        // (both no-ops unless launched dependent: pdl.py)
    stream_row<T, MT>(row, lane, KB, M, cur, acc, GlobalActs{aq, ads, K, KB});
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

// ---- M = 1 in one launch --------------------------------------------------------------------------------
// gemv1 without its quantize kernel: each block quantizes X (fp32, one row) into the split Q8_1 layout in its own
// shared memory (q8_1.cuh's quantize4: quantize_q8_1_split's values and sums), then streams FUSED_ROWS weight rows a
// warp each through gemv_rows<T, 1>'s stream_row (the same loads, order of sums and epilogue: its products bit for bit).
// The first weights are in flight while X is quantized.  Why: at K = 4096 a product paid ~2 us that did not scale
// with its bytes, the quantize kernel and the GEMV's wait for it among them (issue #59).  X is read by every block
// (from L2): FUSED_ROWS rows a block keep that to K * 4 bytes per FUSED_ROWS rows of weights.  Compiled without
// IEEE subnormals, unlike q8_1.cu: only a block whose scale d = amax/127 is a subnormal float quantizes differently,
// and such a d is 0 in half precision, so that block adds 0 to the product either way.
#ifndef FUSED_ROWS
#define FUSED_ROWS 16
#endif
template <typename T>
__device__ void gemv1_fused(const u8* __restrict__ W, const float* __restrict__ x, float* __restrict__ Y, int N,
                            int K) {
    extern __shared__ __align__(16) char smem[];
    i8* aq = reinterpret_cast<i8*>(smem);                  // K int8 quants
    __half2* ads = reinterpret_cast<__half2*>(smem + K);   // K / 32 (d, sum); K is a multiple of 32
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int n = blockIdx.x * FUSED_ROWS + warp;
    const int KB = K / QK;
    const u8* row = W + (size_t)min(n, N - 1) * ChunkedRows<T>::row_bytes(KB);  // rows past N load, never write
    GemvStep<T> cur;
    cur.load(row, lane, KB);
    let_dependents_launch();
    wait_for_inputs();  // X is written by the kernel or copy before this one
    // 4 values a thread, 8 threads a quant block; every lane of a warp takes part in quantize4's shuffles
    for (int base = 0; base < K; base += blockDim.x * 4) {
        const int i = base + threadIdx.x * 4;
        const bool active = i < K;
        const float4 v = active ? *reinterpret_cast<const float4*>(x + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        const Q8_1Block4 r = quantize4(v);
        if (active) {
            *reinterpret_cast<int*>(aq + i) = r.packed;
            if (i % QK == 0) ads[i / QK] = make_half2(__float2half(r.d), __float2half(r.sum));
        }
    }
    __syncthreads();
    if (n >= N) return;
    float acc[1] = {};
    stream_row<T, 1>(row, lane, KB, 1, cur, acc, SharedActs{aq, ads});
    const float sum = warp_sum(acc[0]);
    if (lane == 0) Y[n] = sum;
}

// gemv1_fused_<type>: FUSED_ROWS warps a block; launch.py's FUSED_ROWS mirrors it; shared memory K * 9 / 8 bytes
#define FUSED(t, T)                                                                                             \
    extern "C" __global__ void __launch_bounds__(FUSED_ROWS * WARP, 2)                                          \
        gemv1_fused_##t(const u8* w, const float* x, float* Y, int N, int K) {                                  \
        gemv1_fused<T>(w, x, Y, N, K);                                                                          \
    }
QGEMM_FOR_FAST_TYPES(FUSED)

// The K-quants (and IQ4_XS) at M = 1 on their chunked rows (groups.cuh Q4_KR, Q5_KR, Q6_KR, IQ4_XSR), streamed as
// gemv1 streams the legacy formats.  An H200, [4096, 14336], quantize + GEMM from HBM, gemv on the GGUF fields ->
// these: Q4_K 14.0 -> 11.1 us, Q5_K 14.6 -> 13.2, Q6_K 17.0 -> 14.6; at K = 4096 they are 0.1-0.8 us slower (auto's
// table).  For Q4_K the L2 prefetch (stream_row) took 12.5 -> 11.1, 2-4 chunks ahead 11.8-12.0.  Also slower there:
// 3 or 4 blocks a lane a step, or a row split over 2 or 4 warps (more registers or more warps than one wave of 4096
// rows holds), and the one-launch form (gemv1_fused) at K = 4096.
#define GEMV_KR(t, T)                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                           \
        gemv1_##t(const u8* w, const i8* aq, const __half2* ads, float* Y, int N, int K) {                      \
        gemv_rows<T, 1>(w, aq, ads, Y, 1, N, K);                                                                \
    }
GEMV_KR(q4_kr, Q4_KR)
GEMV_KR(q5_kr, Q5_KR)
GEMV_KR(q6_kr, Q6_KR)
GEMV_KR(iq4_xsr, IQ4_XSR)  // an H200, K = 14336: 14.1 -> 13.5 us from HBM, the same from L2; slower at K = 4096

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
