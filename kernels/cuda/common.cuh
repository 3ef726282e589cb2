// Block types and device helpers shared by every qgemm kernel.
//
// Block layouts are llama.cpp's (ggml-common.h): Q4_0 = half d + 16 bytes of nibbles (byte j holds
// q[j] low, q[j+16] high), Q8_0 = half d + 32 int8, Q8_1 = half2 (d, sum x) + 32 int8 (36 bytes);
// Q4_1 adds a half minimum m, Q5_0/Q5_1 a uint32 of fifth bits (kernels/formats.py says each).
// Each weight type is a traits struct (like ggml's mmq_type_traits), so that a kernel is written once:
// the ladder's rungs read whole GGUF blocks (Q4_0, Q8_0); the fast kernels read the split layout, made
// at upload (launch.py): quants, fifth bits and scales in three planes.
#pragma once
#include <cuda_fp16.h>

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;

#define QK 32
#define WARP 32

struct block_q8_1 { __half2 ds; i8 qs[QK]; };  // 36 bytes, 4-byte aligned

// ---- warp reductions: butterfly order (offsets 16, 8, 4, 2, 1), as llama.cpp's warp_reduce_* ----
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}

// ---- loads ----
// GGUF blocks are 18 or 34 bytes, so their payload is only 2-byte aligned: read words as two u16.
__device__ __forceinline__ int load_i32_a2(const u8* p) {
    const u16* h = reinterpret_cast<const u16*>(p);
    return int(unsigned(h[0]) | (unsigned(h[1]) << 16));
}
__device__ __forceinline__ float load_half(const u8* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }

// Byte-wise dot of 4 packed int8 pairs, without dp4a (the scalar rungs of the ladder).
__device__ __forceinline__ int dot4_scalar(int a, int b, int acc) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc += int(i8(a >> (8 * i))) * int(i8(b >> (8 * i)));
    return acc;
}
template <bool DP4A>
__device__ __forceinline__ int dot4(int a, int b, int acc) {
    if constexpr (DP4A) return __dp4a(a, b, acc); else return dot4_scalar(a, b, acc);
}

// ---- weight types ----
// words(b, i, lo, hi): the i-th packed 4-value int32 group of a block's values as int8 words that
// pair with activation words lo = q_a[4i..4i+3] (and, for Q4_0, hi = q_a[16+4i..16+4i+3]).
// epilogue: llama.cpp's vec_dot_*_q8_1_impl for one whole block.
// Split-layout part of every type: QS_BYTES of quants a block (nibbles or int8), QH: a uint32 of fifth bits
// a block, Scale: d (half) or (d, m) (half2, MIN), OFFSET: what unsigned quants are offset by (the
// epilogue takes OFFSET * s_a back); split_epilogue below is each family's MMVQ block formula.
struct Q4_0 {
    static constexpr int BYTES = 18, QS_BYTES = 16, WORDS = 4;  // 4 packed words give 8 value words
    static constexpr int OFFSET = 8;  // q in 0..15: the epilogue subtracts 8 * s_a
    static constexpr bool QH = false, MIN = false;
    using Scale = __half;
    __device__ static float scale(const u8* b) { return load_half(b); }
    __device__ static int word(const u8* b, int i) { return load_i32_a2(b + 2 + 4 * i); }
    template <bool DP4A>
    __device__ static int dot_packed(int v, int a_lo, int a_hi, int acc) {  // v: 8 nibbles
        acc = dot4<DP4A>(v & 0x0F0F0F0F, a_lo, acc);
        return dot4<DP4A>((v >> 4) & 0x0F0F0F0F, a_hi, acc);
    }
    template <bool DP4A>
    __device__ static int dot(const u8* b, const int* a) {  // a: the 8 activation words of a block
        int s = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) s = dot_packed<DP4A>(word(b, i), a[i], a[i + 4], s);
        return s;
    }
    __device__ static float epilogue(float dw, int sumi, float2 ds) { return dw * (sumi * ds.x - 8.0f * ds.y); }
    __device__ static float value(const u8* b, int j) {  // dequantized, as gguf: d * (q - 8)
        const u8 byte = b[2 + (j & 15)];
        const int q = (j < 16 ? (byte & 15) : (byte >> 4)) - 8;
        return scale(b) * float(q);
    }
};

struct Q8_0 {
    static constexpr int BYTES = 34, QS_BYTES = 32, WORDS = 8;
    static constexpr int OFFSET = 0;
    static constexpr bool QH = false, MIN = false;
    using Scale = __half;
    __device__ static float scale(const u8* b) { return load_half(b); }
    __device__ static int word(const u8* b, int i) { return load_i32_a2(b + 2 + 4 * i); }
    template <bool DP4A>
    __device__ static int dot(const u8* b, const int* a) {
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = dot4<DP4A>(word(b, i), a[i], s);
        return s;
    }
    __device__ static float epilogue(float dw, int sumi, float2 ds) { return dw * ds.x * float(sumi); }
    __device__ static float value(const u8* b, int j) { return scale(b) * float(i8(b[2 + j])); }
};

// Unpack one weight block into 8 value words (Q4_0: nibbles widened to bytes 0..15).
template <typename T> __device__ __forceinline__ void unpack_words(const u8* b, int* w);
template <> __device__ __forceinline__ void unpack_words<Q4_0>(const u8* b, int* w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int v = Q4_0::word(b, i);
        w[i] = v & 0x0F0F0F0F;
        w[i + 4] = (v >> 4) & 0x0F0F0F0F;
    }
}
template <> __device__ __forceinline__ void unpack_words<Q8_0>(const u8* b, int* w) {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = Q8_0::word(b, i);
}

// The other legacy formats: split layout only (the fast kernels).
struct Q4_1 {
    static constexpr int QS_BYTES = 16, OFFSET = 0;
    static constexpr bool QH = false, MIN = true;
    using Scale = __half2;
};
struct Q5_0 {
    static constexpr int QS_BYTES = 16, OFFSET = 16;
    static constexpr bool QH = true, MIN = false;
    using Scale = __half;
};
struct Q5_1 {
    static constexpr int QS_BYTES = 16, OFFSET = 0;
    static constexpr bool QH = true, MIN = true;
    using Scale = __half2;
};

// 4 fifth bits (bit i: value i of a 4-value word) as bit 4 of each byte: one multiply moves bit i to bit 4 + 8i
// (the four shifted copies of the 4 bits, at bits 4-7, 11-14, 18-21 and 25-28, never overlap, so nothing carries)
__device__ __forceinline__ int fifth_bits(unsigned h) { return int(((h & 0xFu) * 0x02040810u) & 0x10101010u); }
// Each byte x of v minus B, as int8 bytes, for bytes x < 128 + B (B <= 128): x + 128 - B never carries into the
// next byte, and flipping bit 7 takes 128 back off.  Two instructions where __vsubss4 is about ten on sm_90
// (emulated); exact wherever the saturation it also does would not apply.
template <unsigned B>
__device__ __forceinline__ int bytes_minus(unsigned v) { return int((v + (128u - B) * 0x01010101u) ^ 0x80808080u); }
// Packed word v of a block's quants (bytes 4i..4i+3) to the value words of values 4i.. (lo) and 16+4i.. (hi):
// nibbles widened to bytes, with their fifth bits from qh; int8 quants are two words as they are.
template <typename T>
__device__ __forceinline__ void nibble_words(int v, unsigned qh, int i, int* lo, int* hi) {
    *lo = v & 0x0F0F0F0F;
    *hi = (v >> 4) & 0x0F0F0F0F;
    if constexpr (T::QH) {
        *lo |= fifth_bits(qh >> (4 * i));
        *hi |= fifth_bits(qh >> (16 + 4 * i));
    }
}

// Split layout (vec_dp4a, gemv): a block's quants alone, 16-byte aligned, and its fifth bits; unpack them
// to 8 value words.
template <typename T>
__device__ __forceinline__ void load_split_words(const u8* qs, unsigned qh, int* w) {
    const int4* v = reinterpret_cast<const int4*>(qs);
    if constexpr (T::QS_BYTES == 32) {
        const int4 v0 = v[0], v1 = v[1];
        w[0] = v0.x; w[1] = v0.y; w[2] = v0.z; w[3] = v0.w; w[4] = v1.x; w[5] = v1.y; w[6] = v1.z; w[7] = v1.w;
    } else {
        const int4 v0 = v[0];
        const int p[4] = {v0.x, v0.y, v0.z, v0.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) nibble_words<T>(p[i], qh, i, &w[i], &w[i + 4]);
    }
}

// llama.cpp's MMVQ block formulas (vec_dot_*_q8_1_impl), sumi the block's integer dot as a float:
// d_w*(d_a*sumi - OFFSET*s_a); d_w*d_a*sumi; with a minimum, (d_w*d_a, m_w*s_a) as one half2 product
// (__hmul2, FAST_FP16), then sumi*(d_w d_a) + (m_w s_a).
template <typename T>
__device__ __forceinline__ float split_epilogue(typename T::Scale w, float sumi, __half2 ds) {
    if constexpr (T::MIN) {
        const float2 p = __half22float2(__hmul2(w, ds));
        return fmaf(sumi, p.x, p.y);
    } else {
        const float2 a = __half22float2(ds);
        if constexpr (T::OFFSET != 0) return __half2float(w) * fmaf(sumi, a.x, -float(T::OFFSET) * a.y);
        else return __half2float(w) * a.x * sumi;
    }
}

// ---- gemv's weight layout (kernels/cuda/layouts.py CHUNKED mirrors it) ----
// K in chunks of CHUNK_BLOCKS quant blocks, the skinny kernel's stage (gemv.cu), so that a stage is one copy a
// weight row.
#define CHUNK_BLOCKS 64
// A legacy format's weight row: its chunks one after another, each (of nb blocks) the nb blocks' quants, then their
// fifth bits (a uint32 a block, Q5_0 / Q5_1), then their scales (d or (d, m)), padded to 16 bytes; every part
// starts aligned for its loads (quants at 16 bytes, fifth bits at 16, scales at 4), and a full chunk is
// CHUNK_BLOCKS block sizes (a multiple of 128 bytes).
// A format whose blocks are the 8 sub-blocks of a super-block (groups.cuh's K-quant rows: Q4_KR, Q5_KR, Q6_KR)
// also has SUPER_BYTES of fields a super-block (its part after the scales; K is then a multiple of 8 blocks), and
// may have HIGH_BYTES of high bits a block in place of the legacy fifth bits (Q6_KR: 8, two bits a value).
template <typename T, typename = void> struct SuperBytes { static constexpr int value = 0; };
template <typename T> struct SuperBytes<T, decltype(void(T::SUPER_BYTES))> { static constexpr int value = T::SUPER_BYTES; };
template <typename T, typename = void> struct HighBytes { static constexpr int value = T::QH ? 4 : 0; };
template <typename T> struct HighBytes<T, decltype(void(T::HIGH_BYTES))> { static constexpr int value = T::HIGH_BYTES; };
template <int B> struct Word { using type = unsigned; };  // a field of B <= 8 bytes as one load's register(s)
template <> struct Word<2> { using type = unsigned short; };
template <> struct Word<8> { using type = uint2; };
template <typename T>
struct ChunkedRows {
    using Scale = typename T::Scale;
    static constexpr int HB = HighBytes<T>::value, SUP = SuperBytes<T>::value;
    static constexpr int PER = T::QS_BYTES + HB + (int)sizeof(Scale);
    using High = typename Word<HB>::type;
    using Super = typename Word<SUP>::type;
    static constexpr int CHUNK = CHUNK_BLOCKS * PER + CHUNK_BLOCKS / 8 * SUP;
    __device__ static int chunk_bytes(int nb) { return (nb * PER + nb / 8 * SUP + 15) & ~15; }
    __device__ static size_t row_bytes(int KB) {
        return (size_t)(KB / CHUNK_BLOCKS) * CHUNK + chunk_bytes(KB % CHUNK_BLOCKS);
    }
    // block j of a chunk of nb blocks
    __device__ static const u8* qs(const u8* chunk, int j) { return chunk + j * T::QS_BYTES; }
    __device__ static const High* qh(const u8* chunk, int nb, int j) {
        return reinterpret_cast<const High*>(chunk + nb * T::QS_BYTES) + j;
    }
    __device__ static const Scale* d(const u8* chunk, int nb, int j) {
        return reinterpret_cast<const Scale*>(chunk + nb * (T::QS_BYTES + HB)) + j;
    }
    __device__ static const Super* super(const u8* chunk, int nb, int j) {  // block j's super-block fields
        return reinterpret_cast<const Super*>(chunk + nb * PER) + j / 8;
    }
};

// The skinny kernel's split activations (q8_1.cu quantize_q8_1_split with `chunked`; layouts.py Q8_1Split): int8
// quants and half2 (d, s) apart, K in chunks of CHUNK_BLOCKS blocks; chunk c holds the M rows' parts one after
// another, padded (ACT_ROW = 2048 + 16 bytes of quants, ACT_DS_ROW = 64 + 4 (d, s)), so that a stage's activations are
// two copies whatever M, into shared rows that start 4 banks apart.  The warp-a-row kernels read them by row
// ([M, K] and [M, K / 32]): chunked and padded parts cost them 8-13% at M > 1 (one more 128-byte line a warp load),
// and an XOR swizzle instead of the padding more, in address arithmetic.
#define ACT_ROW (CHUNK_BLOCKS * QK + 16)
#define ACT_DS_ROW (CHUNK_BLOCKS + 4)
__device__ __forceinline__ size_t act_q(int r, int kb, int M) {  // the byte offset of row r's block kb
    const int c = kb / CHUNK_BLOCKS;
    return ((size_t)c * M + r) * ACT_ROW + (size_t)(kb - c * CHUNK_BLOCKS) * QK;
}
__device__ __forceinline__ size_t act_ds(int r, int kb, int M) {  // the index of row r's block kb's (d, s)
    const int c = kb / CHUNK_BLOCKS;
    return ((size_t)c * M + r) * ACT_DS_ROW + (kb - c * CHUNK_BLOCKS);
}

template <bool DP4A>
__device__ __forceinline__ int dot8(const int* w, const int* a) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = dot4<DP4A>(w[i], a[i], s);
    return s;
}

// The activations' 8 words and (d, s) of one Q8_1 block.
__device__ __forceinline__ void load_q8_1(const block_q8_1& blk, int* a, float2& ds) {
    const int* q = reinterpret_cast<const int*>(blk.qs);
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = q[i];
    ds = __half22float2(blk.ds);
}

// ---- asynchronous global -> shared copies (sm_80+); a false predicate zero-fills ----
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool pred) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- Hopper (sm_90+): bulk copies completed on an mbarrier, and programmatic dependent launch ----
#if __CUDA_ARCH__ >= 900
#define QGEMM_BULK 1
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
// The calling thread arrives and announces `bytes` of bulk copies that complete the phase.
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// The calling thread arrives (release: what it read or wrote before is ordered before the phase completes).
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
// One contiguous global range (16-byte aligned, a multiple of 16 bytes) into shared memory by the copy engine.
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
#endif
// A kernel launched with programmatic stream serialization (kernels/cuda/pdl.py; gemv's M = 1 kernel) may
// start while the one before it still runs: it calls wait_for_inputs() before reading what that kernel
// writes, and before writing anything.  Its quantize kernel lets dependents launch early.  Both are
// no-ops for ordinary launches.
__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void let_dependents_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Weights a kernel streams once.  KEEP_L1 = false: not allocated in L1, so the activations that every warp
// re-reads stay there (gemv on the H100: Q4_0, whose activations are twice its weight bytes, gains ~2%
// at K = 14336; Q8_0 loses ~2%, so it keeps the default).
template <bool KEEP_L1>
__device__ __forceinline__ int4 load_once(const int4* p) {
    if constexpr (KEEP_L1) return __ldg(p);
    int4 r;
    asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
template <bool KEEP_L1>
__device__ __forceinline__ __half load_once(const __half* p) {
    if constexpr (KEEP_L1) return __ldg(p);
    unsigned short r;
    asm("ld.global.nc.L1::no_allocate.b16 %0, [%1];" : "=h"(r) : "l"(p));
    return __ushort_as_half(r);
}
template <bool KEEP_L1>
__device__ __forceinline__ unsigned char load_once(const unsigned char* p) {
    if constexpr (KEEP_L1) return __ldg(p);
    unsigned short r;
    asm("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=h"(r) : "l"(p));
    return (unsigned char)r;
}
template <bool KEEP_L1>
__device__ __forceinline__ unsigned short load_once(const unsigned short* p) {
    if constexpr (KEEP_L1) return __ldg(p);
    unsigned short r;
    asm("ld.global.nc.L1::no_allocate.b16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}
template <bool KEEP_L1>
__device__ __forceinline__ unsigned load_once(const unsigned* p) {
    if constexpr (KEEP_L1) return __ldg(p);
    unsigned r;
    asm("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
template <bool KEEP_L1>
__device__ __forceinline__ uint2 load_once(const uint2* p) {
    if constexpr (KEEP_L1) return __ldg(p);
    uint2 r;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
template <bool KEEP_L1>
__device__ __forceinline__ __half2 load_once(const __half2* p) {
    const unsigned r = load_once<KEEP_L1>(reinterpret_cast<const unsigned*>(p));
    return *reinterpret_cast<const __half2*>(&r);
}

// One thread per output Y[m, n] (threadIdx.x along N, threadIdx.y along M), for the naive rungs:
// its coordinates, or false when the thread lies past the matrix; and its weight row's first block.
__device__ __forceinline__ bool output_of_thread(int M, int N, int& m, int& n) {
    n = blockIdx.x * blockDim.x + threadIdx.x;
    m = blockIdx.y * blockDim.y + threadIdx.y;
    return n < N && m < M;
}
template <typename T>
__device__ __forceinline__ const u8* weight_row(const u8* W, int n, int K) { return W + (size_t)n * (K / QK) * T::BYTES; }

// Define extern "C" entry points for every weight type from one template: the ladder's (whole GGUF blocks)
// and the fast kernels' (split layout).  Adding a format: its traits above and its row here.
#define QGEMM_FOR_TYPES(MACRO) MACRO(q4_0, Q4_0) MACRO(q8_0, Q8_0)
#define QGEMM_FOR_FAST_TYPES(MACRO) QGEMM_FOR_TYPES(MACRO) MACRO(q4_1, Q4_1) MACRO(q5_0, Q5_0) MACRO(q5_1, Q5_1)
