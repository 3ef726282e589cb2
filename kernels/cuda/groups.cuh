// The grouped formats' per-format part (K-quants, IQ4_NL / IQ4_XS, MXFP4; kernels/groups.py is their numpy
// twin): each decodes one 32-value sub-block of its GGUF blocks, read from field planes made at upload
// (launch.py: every field of the block array as its own contiguous array, so each is naturally aligned and
// nothing is read twice).  decode(P, s, j, w, sc, cf): super-block (or block) s, sub-block j of SUBS:
//   w[8]   the 32 values as int8 words, value 4i + b in byte b of w[i] (they pair with Q8_1 words in order);
//   sc[2]  MMVQ's weight scale of values 0..15 and 16..31 (G16) or of all 32 (sc[0]);
//   cf[2]  (MIN) the factor of d_a * Σq_a over the same values: -dmin * m.
// LOOKAHEAD: sub-blocks a lane of gemv's M = 1 kernel decodes before computing them; MIN_BLOCKS: that kernel's
// __launch_bounds__ blocks an SM, 0 for none (fast.cu gemv1_<type>_s1; both measured on the H100).
// All are exact products of the block's fields, as llama.cpp's vec_dot_*_q8_1 forms them.
#pragma once
#include "common.cuh"

struct GPlanes { const u8 *p0, *p1, *p2, *p3, *p4; };

__device__ __forceinline__ void load32(const u8* p, int* r) {  // 32 bytes, 16-byte aligned
    const int4 a = __ldg(reinterpret_cast<const int4*>(p)), b = __ldg(reinterpret_cast<const int4*>(p) + 1);
    r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w; r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
}
__device__ __forceinline__ float ldg_half(const u8* p) { return __half2float(__ldg(reinterpret_cast<const __half*>(p))); }
// How a K-quant's scales() reads its scale fields: from global memory through the read-only path (gemv_groups), or
// from the skinny kernel's shared copies of them (fast.cu SkinnyGroups)
struct LdGlobal {
    __device__ static int byte(const u8* p) { return __ldg(p); }
    __device__ static int sbyte(const u8* p) { return i8(__ldg(p)); }
    __device__ static float half(const u8* p) { return ldg_half(p); }
};
struct LdShared {
    __device__ static int byte(const u8* p) { return *p; }
    __device__ static int sbyte(const u8* p) { return *reinterpret_cast<const i8*>(p); }
    __device__ static float half(const u8* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }
};
__device__ __forceinline__ float half_of(unsigned v, int i) {  // half i (0: low) of a word
    return __half2float(__ushort_as_half((unsigned short)(v >> (16 * i))));
}

// 8 codes (the nibbles of q) through a 16-entry int8 table packed in 4 words, as llama.cpp's
// get_int_from_table_16: PRMT looks each code up among entries 0..7 and 8..15 by its low 3 bits, a third PRMT
// picks between the two by bit 3, and two more gather the low nibbles' values (x) and the high nibbles' (y).
// 10 PRMTs and 4 logic ops for 8 values; picking among 16 for 4 codes at a time took 13 ops for 4.
__device__ __forceinline__ int2 lookup16x8(unsigned q, unsigned t0, unsigned t1, unsigned t2, unsigned t3) {
    const unsigned idx = q & 0x77777777u, pick = 0x32103210u | ((q & 0x88888888u) >> 1);
    const unsigned a = __byte_perm(__byte_perm(t0, t1, idx), __byte_perm(t2, t3, idx), pick);  // codes 0-3
    const unsigned b = __byte_perm(__byte_perm(t0, t1, idx >> 16), __byte_perm(t2, t3, idx >> 16), pick >> 16);
    return make_int2(int(__byte_perm(a, b, 0x6420u)), int(__byte_perm(a, b, 0x7531u)));
}
// kvalues_iq4nl {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113} and kvalues_mxfp4
// (E2M1 times 2) {0, 1, 2, 3, 4, 6, 8, 12, -0, -1, -2, -3, -4, -6, -8, -12}, 4 bytes a word
#define IQ4NL_TABLE 0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u
#define MXFP4_TABLE 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu

// A 16-entry int8 code book packed in 4 words: 8 codes at a time (lookup), or 16 bytes of nibbles (byte l: value l
// low, value l + 16 high) to the 32 values' words (words)
template <unsigned T0, unsigned T1, unsigned T2, unsigned T3>
struct CodeBook {
    __device__ static __forceinline__ int2 lookup(unsigned q) { return lookup16x8(q, T0, T1, T2, T3); }
    __device__ static __forceinline__ void words(const u8* qs, int* w) {
        const int4 v = __ldg(reinterpret_cast<const int4*>(qs));
        const int p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int2 r = lookup(unsigned(p[i]));
            w[i] = r.x;
            w[i + 4] = r.y;
        }
    }
};

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (get_scale_min_k4) from the 12 scale bytes q
// without a branch: a warp's lanes hold sub-blocks 0-7, so both sides of `j < 4` ran, each with its own loads
template <typename Ld = LdGlobal>
__device__ __forceinline__ void scale_min_k4(const u8* q, int j, int& sc, int& m) {
    const int a = Ld::byte(q + (j & 3)), b = Ld::byte(q + j + 4), c = Ld::byte(q + j);  // c: q[j] (j >= 4; a when j < 4)
    sc = j < 4 ? a & 63 : (b & 0xF) | ((a >> 6) << 4);
    m = j < 4 ? b & 63 : (b >> 4) | ((c >> 6) << 4);
}

// The K-quants' values come from two of their planes: QS_BYTES a super-block of low bits in p0 (the 32 bytes of
// sub-block j at qs_at(j)) and HI_BYTES of high bits in plane HI (at hi_at(j); 0: none); word(r, h, j) makes
// values 4i.. of sub-block j from int i of each run.  scales<Ld>() gives sub-block j's MMVQ scale(s) and min
// factor from the planes scale_bytes(p) > 0 names (bytes a super-block).  gemv_groups decodes a whole sub-block
// from global memory (decode); fast.cu's skinny MMA reads the value runs, a thread's two words, and the scale
// fields from shared copies of a stage's super-blocks (SkinnyGroups).
template <typename T>
__device__ __forceinline__ void decode_k(const GPlanes& P, size_t s, int j, int* w, float* sc, float* cf) {
    int r[8], h[8] = {};
    load32(P.p0 + s * T::QS_BYTES + T::qs_at(j), r);
    if constexpr (T::HI_BYTES > 0) load32(T::hi_plane(P) + s * T::HI_BYTES + T::hi_at(j), h);
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = T::word(r[i], h[i], j);
    T::scales(P, s, j, sc, cf);
}

// Planes: p0 qs [128], p1 scales [12], p2 d, p3 dmin (halves); Q5_K also p4 qh [32].  One 16-byte load of
// d, dmin and scales together (as IQ4_XS's head) was slower: Q4_K M = 1 12.9 -> 19.4 us at K = 14336 (sweep8)
template <bool FIFTH>
struct QK_45 {
    static constexpr int SUBS = 8;
    static constexpr int LOOKAHEAD = FIFTH ? 1 : 4;
    static constexpr int MIN_BLOCKS = 0;
    static constexpr bool G16 = false, MIN = true;
    static constexpr int QS_BYTES = 128, HI_BYTES = FIFTH ? 32 : 0;
    __device__ static const u8* hi_plane(const GPlanes& P) { return P.p4; }
    __device__ static int qs_at(int j) { return (j >> 1) * 32; }  // sub-blocks 2p and 2p + 1: low and high nibbles
    __device__ static int hi_at(int) { return 0; }
    __device__ static int word(int r, int h, int j) {
        const int v = (r >> (4 * (j & 1))) & 0x0F0F0F0F;
        return FIFTH ? v | (((h >> j) & 0x01010101) << 4) : v;  // bit j of qh[l] is value l's fifth bit
    }
    __host__ __device__ static constexpr int scale_bytes(int p) { return p == 1 ? 12 : p == 2 || p == 3 ? 2 : 0; }
    template <typename Ld = LdGlobal>
    __device__ static void scales(const GPlanes& P, size_t s, int j, float* sc, float* cf) {
        int scv, mv;
        scale_min_k4<Ld>(P.p1 + s * 12, j, scv, mv);
        sc[0] = Ld::half(P.p2 + 2 * s) * float(scv);
        cf[0] = -(Ld::half(P.p3 + 2 * s) * float(mv));
    }
    __device__ static void decode(const GPlanes& P, size_t s, int j, int* w, float* sc, float* cf) {
        decode_k<QK_45>(P, s, j, w, sc, cf);
    }
};
using Q4_K = QK_45<false>;
using Q5_K = QK_45<true>;

// Planes: p0 qs [64], p1 scales [16] (4-bit scale, 4-bit min per 16 values), p2 d, p3 dmin
struct Q2_K {
    static constexpr int SUBS = 8;
    static constexpr int LOOKAHEAD = 1;
    static constexpr int MIN_BLOCKS = 0;
    static constexpr bool G16 = true, MIN = true;
    __device__ static void decode(const GPlanes& P, size_t s, int j, int* w, float* sc, float* cf) {
        int r[8];
        load32(P.p0 + s * 64 + (j >> 2) * 32, r);  // values 128n + 32jj + l: bits 2jj of byte 32n + l
        const int sh = 2 * (j & 3);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = (r[i] >> sh) & 0x03030303;
        const float d = ldg_half(P.p2 + 2 * s), dmin = ldg_half(P.p3 + 2 * s);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int b = __ldg(P.p1 + s * 16 + 2 * j + h);
            sc[h] = d * float(b & 0xF);
            cf[h] = -(dmin * float(b >> 4));
        }
    }
};

// Planes: p0 qs [64] (low 2 bits), p1 hmask [32] (bit 4n + jj of byte l), p2 scales [12] (6-bit), p3 d
struct Q3_K {
    static constexpr int SUBS = 8;
    static constexpr int LOOKAHEAD = 4;
    static constexpr int MIN_BLOCKS = 4;
    static constexpr bool G16 = true, MIN = false;
    static constexpr int QS_BYTES = 64, HI_BYTES = 32;
    __device__ static const u8* hi_plane(const GPlanes& P) { return P.p1; }
    __device__ static int qs_at(int j) { return (j >> 2) * 32; }
    __device__ static int hi_at(int) { return 0; }
    __device__ static int word(int r, int h, int j) {  // the high bit: bit 4n + jj == j
        return bytes_minus<4>(((r >> (2 * (j & 3))) & 0x03030303) | (((h >> j) & 0x01010101) << 2));
    }
    __host__ __device__ static constexpr int scale_bytes(int p) { return p == 2 ? 12 : p == 3 ? 2 : 0; }
    template <typename Ld = LdGlobal>
    __device__ static void scales(const GPlanes& P, size_t s, int j, float* sc, float*) {
        const float d = Ld::half(P.p3 + 2 * s);
        const u8* q = P.p2 + s * 12;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = 2 * j + hh;
            const int v = ((Ld::byte(q + (i & 7)) >> (4 * (i >> 3))) & 0xF) | (((Ld::byte(q + 8 + (i & 3)) >> (2 * (i >> 2))) & 3) << 4);
            sc[hh] = d * float(v - 32);
        }
    }
    __device__ static void decode(const GPlanes& P, size_t s, int j, int* w, float* sc, float* cf) {
        decode_k<Q3_K>(P, s, j, w, sc, cf);
    }
};

// Planes: p0 ql [128], p1 qh [64], p2 scales [16] int8, p3 d
struct Q6_K {
    static constexpr int SUBS = 8;
    static constexpr int LOOKAHEAD = 2;
    static constexpr int MIN_BLOCKS = 0;
    static constexpr bool G16 = true, MIN = false;
    static constexpr int QS_BYTES = 128, HI_BYTES = 64;
    __device__ static const u8* hi_plane(const GPlanes& P) { return P.p1; }
    __device__ static int qs_at(int j) { return 64 * (j >> 2) + 32 * (j & 1); }  // values 128n + 32 quarter + l
    __device__ static int hi_at(int j) { return 32 * (j >> 2); }
    __device__ static int word(int r, int h, int j) {
        const int quarter = j & 3;
        return bytes_minus<32>(((r >> (4 * (quarter >> 1))) & 0x0F0F0F0F) | (((h >> (2 * quarter)) & 0x03030303) << 4));
    }
    __host__ __device__ static constexpr int scale_bytes(int p) { return p == 2 ? 16 : p == 3 ? 2 : 0; }
    template <typename Ld = LdGlobal>
    __device__ static void scales(const GPlanes& P, size_t s, int j, float* sc, float*) {
        const float d = Ld::half(P.p3 + 2 * s);
        sc[0] = d * float(Ld::sbyte(P.p2 + s * 16 + 2 * j));
        sc[1] = d * float(Ld::sbyte(P.p2 + s * 16 + 2 * j + 1));
    }
    __device__ static void decode(const GPlanes& P, size_t s, int j, int* w, float* sc, float* cf) {
        decode_k<Q6_K>(P, s, j, w, sc, cf);
    }
};

// The code-book formats are also read by fast.cu's skinny MMA (SkinnyCodes; launch.py says from which M): 16 bytes
// of nibbles a 32-value block in plane p0, in order along a row, and BLOCK_SCALE_BYTES of plane p1 a block on
// average, from whose run in shared memory block_scale(run, kb) gives block kb's MMVQ scale (times d_a * sumi).

// Planes: p0 qs [16], p1 d
struct IQ4_NL {
    static constexpr int SUBS = 1;
    static constexpr int LOOKAHEAD = 4;
    static constexpr int MIN_BLOCKS = 0;
    static constexpr bool G16 = false, MIN = false;
    using Codes = CodeBook<IQ4NL_TABLE>;
    static constexpr int BLOCK_SCALE_BYTES = 2;
    __device__ static void decode(const GPlanes& P, size_t s, int, int* w, float* sc, float*) {
        Codes::words(P.p0 + s * 16, w);
        sc[0] = ldg_half(P.p1 + 2 * s);
    }
    __device__ static float block_scale(const u8* run, int kb) {
        return __half2float(reinterpret_cast<const __half*>(run)[kb]);
    }
};

// Planes: p0 qs [128] (sub-block j: bytes 16j..16j+15), p1 the head (d, scales_h, scales_l [4]: one 8-byte load,
// not three; M = 1 on the H100: 17.8 -> 17.6 us at K = 14336, 5.3 -> 5.1 at K = 4096, sweep8)
struct IQ4_XS {
    static constexpr int SUBS = 8;
    static constexpr int LOOKAHEAD = 4;
    static constexpr int MIN_BLOCKS = 0;
    static constexpr bool G16 = false, MIN = false;
    using Codes = CodeBook<IQ4NL_TABLE>;
    static constexpr int BLOCK_SCALE_BYTES = 1;  // an 8-byte head a super-block of 8 blocks
    __device__ static float scale(uint2 head, int j) {  // d * (ls - 32); scales_l's nibble j: bits 4j of y
        const int ls = int(((head.y >> (4 * j)) & 0xF) | (((head.x >> (16 + 2 * j)) & 3) << 4));
        return half_of(head.x, 0) * float(ls - 32);
    }
    __device__ static void decode(const GPlanes& P, size_t s, int j, int* w, float* sc, float*) {
        Codes::words(P.p0 + s * 128 + 16 * j, w);
        sc[0] = scale(__ldg(reinterpret_cast<const uint2*>(P.p1) + s), j);
    }
    __device__ static float block_scale(const u8* run, int kb) {
        return scale(reinterpret_cast<const uint2*>(run)[kb >> 3], kb & 7);
    }
};

// E8M0 as llama.cpp's ggml_cuda_e8m0_to_fp32: 2^(e - 127), e = 0 the subnormal 2^-127
__device__ __forceinline__ float e8m0_to_float(unsigned e) { return __uint_as_float(e ? e << 23 : 0x00400000u); }

// Planes: p0 qs [16], p1 e
struct MXFP4 {
    static constexpr int SUBS = 1;
    static constexpr int LOOKAHEAD = 4;
    static constexpr int MIN_BLOCKS = 0;
    static constexpr bool G16 = false, MIN = false;
    using Codes = CodeBook<MXFP4_TABLE>;
    static constexpr int BLOCK_SCALE_BYTES = 1;
    __device__ static void decode(const GPlanes& P, size_t s, int, int* w, float* sc, float*) {
        Codes::words(P.p0 + s * 16, w);
        sc[0] = e8m0_to_float(__ldg(P.p1 + s)) * 0.5f;
    }
    __device__ static float block_scale(const u8* run, int kb) { return e8m0_to_float(run[kb]) * 0.5f; }
};

#define QGEMM_FOR_GROUPED_TYPES(MACRO)                                                                          \
    MACRO(q2_k, Q2_K) MACRO(q3_k, Q3_K) MACRO(q4_k, Q4_K) MACRO(q5_k, Q5_K) MACRO(q6_k, Q6_K)                \
    MACRO(iq4_nl, IQ4_NL) MACRO(iq4_xs, IQ4_XS) MACRO(mxfp4, MXFP4)
#define QGEMM_FOR_CODEBOOK_TYPES(MACRO) MACRO(iq4_nl, IQ4_NL) MACRO(iq4_xs, IQ4_XS) MACRO(mxfp4, MXFP4)
// the K-quants fast.cu's skinny MMA takes (SkinnyGroups): one scale a group of 32 with a min, or two without
#define QGEMM_FOR_SKINNY_K_TYPES(MACRO) MACRO(q3_k, Q3_K) MACRO(q4_k, Q4_K) MACRO(q5_k, Q5_K) MACRO(q6_k, Q6_K)
