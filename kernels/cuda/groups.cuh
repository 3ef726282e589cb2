// The grouped formats' per-format part (K-quants, IQ4_NL / IQ4_XS, MXFP4; kernels/groups.py is their numpy
// twin): each decodes one 32-value sub-block of its GGUF blocks, read from field planes made at upload
// (launch.py: every field of the block array as its own contiguous array, so each is naturally aligned and
// nothing is read twice).  decode(P, s, j, w, sc, cf): super-block (or block) s, sub-block j of SUBS:
//   w[8]   the 32 values as int8 words, value 4i + b in byte b of w[i] (they pair with Q8_1 words in order);
//   sc[2]  MMVQ's weight scale of values 0..15 and 16..31 (G16) or of all 32 (sc[0]);
//   cf[2]  (MIN) the factor of d_a * Σq_a over the same values: -dmin * m.
// LOOKAHEAD: sub-blocks a lane of gemv's M = 1 kernel decodes (or, M1_LANES, loads) before computing them;
// MIN_BLOCKS: that kernel's __launch_bounds__ blocks an SM, 0 for none (gemv.cu gemv1_<type>_s1; both measured on
// the H100).  M1_LANES: that kernel is gemv_k1 (Lane, load and dot below), not gemv_groups over decode().
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
// from the skinny kernel's shared copies of them (gemv.cu SkinnyGroups)
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

// 8 codes of a word through a 16-entry int8 table packed in 4 words, as llama.cpp's get_int_from_table_16: PRMT
// looks each code up among entries 0..7 and 8..15 by its low 3 bits and a third PRMT picks between the two by bit
// 3.  The word is in the order groups.py's paired_nibbles packs at upload: nibbles 0-3 are the values that pair with
// one activation word (x), nibbles 4-7 those of the word 4 on (y), so they need no regathering PRMTs, as GGUF's order
// (byte l: value l low, l + 16 high) did.  6 PRMTs and 5 logic ops for 8 values (10 and 4 in GGUF's order).
__device__ __forceinline__ int2 lookup16x8(unsigned q, unsigned t0, unsigned t1, unsigned t2, unsigned t3) {
    const unsigned idx = q & 0x77777777u, pick = 0x32103210u | ((q >> 1) & 0x44444444u), hi = idx >> 16;
    return make_int2(int(__byte_perm(__byte_perm(t0, t1, idx), __byte_perm(t2, t3, idx), pick)),
                     int(__byte_perm(__byte_perm(t0, t1, hi), __byte_perm(t2, t3, hi), pick >> 16)));
}
// kvalues_iq4nl {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113} and kvalues_mxfp4
// (E2M1 times 2) {0, 1, 2, 3, 4, 6, 8, 12, -0, -1, -2, -3, -4, -6, -8, -12}, 4 bytes a word
#define IQ4NL_TABLE 0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u
#define MXFP4_TABLE 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu

// A 16-entry int8 code book packed in 4 words: 8 codes at a time (lookup), or a block's 16 bytes of paired nibbles
// to the 32 values' words (words)
template <unsigned T0, unsigned T1, unsigned T2, unsigned T3>
struct CodeBook {
    __device__ static __forceinline__ int2 lookup(unsigned q) { return lookup16x8(q, T0, T1, T2, T3); }
    __device__ static __forceinline__ void words(int4 v, int* w) {  // a block's 16 code bytes, as loaded
        const int p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int2 r = lookup(unsigned(p[i]));
            w[i] = r.x;
            w[i + 4] = r.y;
        }
    }
    __device__ static __forceinline__ void words(const u8* qs, int* w) {
        words(__ldg(reinterpret_cast<const int4*>(qs)), w);
    }
};

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (get_scale_min_k4) from the 12 scale bytes q
// without a branch: a warp's lanes hold sub-blocks 0-7, so both sides of `j < 4` ran, each with its own loads
// (a, b, c: bytes j & 3, j + 4 and j of q; c is only read for j >= 4, where it is q[j], and a when j < 4)
__device__ __forceinline__ void scale_min_k4_of(int a, int b, int c, int j, int& sc, int& m) {
    sc = j < 4 ? a & 63 : (b & 0xF) | ((a >> 6) << 4);
    m = j < 4 ? b & 63 : (b >> 4) | ((c >> 6) << 4);
}
template <typename Ld = LdGlobal>
__device__ __forceinline__ void scale_min_k4(const u8* q, int j, int& sc, int& m) {
    scale_min_k4_of(Ld::byte(q + (j & 3)), Ld::byte(q + j + 4), Ld::byte(q + j), j, sc, m);
}

// ---- gemv's M = 1 kernel for Q2_K, Q3_K and Q5_K (gemv.cu gemv_k1) ----
// A lane there always takes sub-block j = lane % 8 of its super-blocks, so what picks sub-block j's bits out of the
// packed bytes is fixed per lane (T::Lane, made once).  The values are not shifted down to bytes of their own: each
// packed word is masked in place, and the dp4a of those unsigned bytes with the signed activations is shifted down
// once (every masked byte is a multiple of 2^shift, so the shift is exact).  T::load reads super-block s + i's
// fields into T::Raw (LOOKAHEAD of them in flight); T::dot gives MMVQ's (sc_lo sumi_lo + sc_hi sumi_hi + min terms)
// from them: the integer sums and float operations of decode() and gemv_groups, so the same products bit for bit,
// in fewer instructions (`git show 13e6adb:docs/reports/kernels-at-the-limit.md`, eighth session).  Q4_K and Q6_K measured slower this
// way at K = 4096 (their raw fields take more registers than decode()'s words), so they keep gemv_groups.
// Super-block s + i of a plane of B bytes a super-block: one wide multiply-add a plane, i an immediate offset.
template <int B>
__device__ __forceinline__ const u8* at(const u8* plane, unsigned s, int i) { return plane + size_t(s) * B + B * i; }
__device__ __forceinline__ unsigned ldg_u16(const u8* p) { return __ldg(reinterpret_cast<const unsigned short*>(p)); }
__device__ __forceinline__ int dp4a_us(unsigned w, int a, int c) {  // unsigned bytes of w times signed bytes of a
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(w), "r"(a), "r"(c));
    return d;
}
// Σ over 4 words of the values that `mask` (complemented words first where NOT) keeps, times 2^shift
template <bool NOT = false>
__device__ __forceinline__ int masked_dot4(const int* w, const int* a, unsigned mask) {
    int s = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) s = dp4a_us((NOT ? ~unsigned(w[q]) : unsigned(w[q])) & mask, a[q], s);
    return s;
}
__device__ __forceinline__ float half_bits(unsigned h) { return __half2float(__ushort_as_half((unsigned short)h)); }

// MMVQ's sum of one sub-block before d_a: sc[h] sumi of half h (G16) or sc[0] of all 32, and (MIN) the min factors
// cf times Σq_a of the same values of a (the 8 activation words); gemv_groups and gemv_k1 both end in it.  (Its
// instruction order is gemv_groups' before it was shared: Q4_K ran 9% slower at K = 14336 with Σq_a taken first.)
template <typename T>
__device__ __forceinline__ float group_sum(const float* sc, const float* cf, int lo, int hi, const int* a) {
    float v = T::G16 ? fmaf(sc[0], float(lo), sc[1] * float(hi)) : sc[0] * float(lo + hi);
    if constexpr (T::MIN) {
        int ulo = 0, uhi = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            ulo = __dp4a(0x01010101, a[q], ulo);
            uhi = __dp4a(0x01010101, a[q + 4], uhi);
        }
        v += T::G16 ? fmaf(cf[0], float(ulo), cf[1] * float(uhi)) : cf[0] * float(ulo + uhi);
    }
    return v;
}

// Whether gemv's M = 1 kernel for a format is gemv_k1 (its M1_LANES, with T::Lane, load and dot) or gemv_groups
template <typename T, typename = void> struct UsesK1 { static constexpr bool value = false; };
template <typename T> struct UsesK1<T, decltype(void(T::M1_LANES))> { static constexpr bool value = T::M1_LANES; };

// The K-quants' values come from two of their planes: QS_BYTES a super-block of low bits in p0 (the 32 bytes of
// sub-block j at qs_at(j)) and HI_BYTES of high bits in plane HI (at hi_at(j); 0: none); word(r, h, j) makes
// values 4i.. of sub-block j from int i of each run.  scales<Ld>() gives sub-block j's MMVQ scale(s) and min
// factor from the planes scale_bytes(p) > 0 names (bytes a super-block).  gemv_groups decodes a whole sub-block
// from global memory (decode); gemv.cu's skinny MMA reads the value runs, a thread's two words, and the scale
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
    static constexpr bool M1_LANES = FIFTH;  // gemv_k1 for Q5_K; Q4_K was 9% slower there at K = 4096
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
    // gemv_k1: sub-block j is nibble j & 1 of run j / 2 (and bit j of qh)
    struct Lane {
        unsigned m, mh;
        int j, sh, qs;
        __device__ explicit Lane(int j_) : m(0x0F0F0F0Fu << 4 * (j_ & 1)), mh(0x01010101u << j_), j(j_), sh(4 * (j_ & 1)), qs(32 * (j_ >> 1)) {}
    };
    struct Raw {
        int r[8], h[FIFTH ? 8 : 1];
        int a, b, c;
        unsigned d, dmin;
    };
    __device__ static void load(const GPlanes& P, unsigned s, int i, const Lane& L, Raw& x) {
        load32(at<128>(P.p0, s, i) + L.qs, x.r);
        if constexpr (FIFTH) load32(at<32>(P.p4, s, i), x.h);
        const u8* q = at<12>(P.p1, s, i);
        x.a = __ldg(q + (L.j & 3));
        x.b = __ldg(q + L.j + 4);
        x.c = __ldg(q + L.j);
        x.d = ldg_u16(at<2>(P.p2, s, i));
        x.dmin = ldg_u16(at<2>(P.p3, s, i));
    }
    __device__ static float dot(const Raw& x, const int* a, const Lane& L) {
        int sumi = (masked_dot4(x.r, a, L.m) + masked_dot4(x.r + 4, a + 4, L.m)) >> L.sh;
        if constexpr (FIFTH) sumi += ((masked_dot4(x.h, a, L.mh) + masked_dot4(x.h + 4, a + 4, L.mh)) >> L.j) << 4;
        int scv, mv;
        scale_min_k4_of(x.a, x.b, x.c, L.j, scv, mv);
        const float sc[1] = {half_bits(x.d) * float(scv)}, cf[1] = {-(half_bits(x.dmin) * float(mv))};
        return group_sum<QK_45>(sc, cf, sumi, 0, a);
    }
};
using Q4_K = QK_45<false>;
using Q5_K = QK_45<true>;

// Planes: p0 qs [64], p1 scales [16] (4-bit scale, 4-bit min per 16 values), p2 d, p3 dmin
struct Q2_K {
    static constexpr int SUBS = 8;
    static constexpr int LOOKAHEAD = 1;
    static constexpr bool M1_LANES = true;
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
    // gemv_k1: sub-block j is bit pair j & 3 of run j / 4; its two scale bytes at 2j
    struct Lane {
        unsigned m;
        int sh, qs, sc;
        __device__ explicit Lane(int j) : m(0x03030303u << 2 * (j & 3)), sh(2 * (j & 3)), qs(32 * (j >> 2)), sc(2 * j) {}
    };
    struct Raw {
        int r[8];
        unsigned s, d, dmin;
    };
    __device__ static void load(const GPlanes& P, unsigned s, int i, const Lane& L, Raw& x) {
        load32(at<64>(P.p0, s, i) + L.qs, x.r);
        x.s = ldg_u16(at<16>(P.p1, s, i) + L.sc);
        x.d = ldg_u16(at<2>(P.p2, s, i));
        x.dmin = ldg_u16(at<2>(P.p3, s, i));
    }
    __device__ static float dot(const Raw& x, const int* a, const Lane& L) {
        const float d = half_bits(x.d), dmin = half_bits(x.dmin);
        float sc[2], cf[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int b = (x.s >> (8 * h)) & 0xFF;
            sc[h] = d * float(b & 0xF);
            cf[h] = -(dmin * float(b >> 4));
        }
        return group_sum<Q2_K>(sc, cf, masked_dot4(x.r, a, L.m) >> L.sh, masked_dot4(x.r + 4, a + 4, L.m) >> L.sh, a);
    }
};

// Planes: p0 qs [64] (low 2 bits), p1 hmask [32] (bit 4n + jj of byte l), p2 scales [12] (6-bit), p3 d
struct Q3_K {
    static constexpr int SUBS = 8;
    static constexpr int LOOKAHEAD = 1;
    static constexpr bool M1_LANES = true;
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
    // gemv_k1: sub-block j is bit pair j & 3 of run j / 4 plus 4 (bit j of hmask) - 4, i.e. the pair minus 4 where
    // that bit is clear.  Its halves' scales 2j and 2j + 1: low nibbles in bytes 2j & 7 and the next (shifted by
    // 4 (j / 4)), high pairs in bytes 8 + (2j & 3) and the next (shifted by 2 (j / 2)): two 16-bit loads.
    struct Lane {
        unsigned m, mh;
        int sh, j, qs, lo4, hi2, snib, spair;
        __device__ explicit Lane(int j_)
            : m(0x03030303u << 2 * (j_ & 3)), mh(0x01010101u << j_), sh(2 * (j_ & 3)), j(j_), qs(32 * (j_ >> 2)),
              lo4((2 * j_) & 7), hi2(8 + ((2 * j_) & 3)), snib(4 * (j_ >> 2)), spair(2 * (j_ >> 1)) {}
    };
    struct Raw {
        int r[8], h[8];
        unsigned lo4, hi2, d;
    };
    __device__ static void load(const GPlanes& P, unsigned s, int i, const Lane& L, Raw& x) {
        load32(at<64>(P.p0, s, i) + L.qs, x.r);
        load32(at<32>(P.p1, s, i), x.h);
        x.lo4 = ldg_u16(at<12>(P.p2, s, i) + L.lo4);
        x.hi2 = ldg_u16(at<12>(P.p2, s, i) + L.hi2);
        x.d = ldg_u16(at<2>(P.p3, s, i));
    }
    __device__ static float dot(const Raw& x, const int* a, const Lane& L) {
        int sumi[2];
#pragma unroll
        for (int h = 0; h < 2; ++h)
            sumi[h] = (masked_dot4(x.r + 4 * h, a + 4 * h, L.m) >> L.sh) -
                      ((masked_dot4<true>(x.h + 4 * h, a + 4 * h, L.mh) >> L.j) << 2);
        const unsigned v = ((x.lo4 >> L.snib) & 0x0F0Fu) | (((x.hi2 >> L.spair) & 0x0303u) << 4);
        const float d = half_bits(x.d);
        const float sc[2] = {d * float(int(v & 0xFF) - 32), d * float(int(v >> 8) - 32)};
        return group_sum<Q3_K>(sc, nullptr, sumi[0], sumi[1], a);
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

// The K-quants as gemv's chunked rows (common.cuh ChunkedRows; layouts.py K_ROWS, made at upload) for its M = 1
// stream: each 32-value sub-block a legacy block of 16 nibble bytes in Q4_0's order (byte l: value l low, value
// l + 16 high) and its scales unpacked to two bytes (Scale), the super-block's float fields once after a chunk's
// scales (SUPER_BYTES).  words() gives the sub-block's 8 value words from its nibbles and high bits, sum() MMVQ's
// sum before d_a from them: gemv_groups' (gemv_k1's) integer sums and float operations, so its products bit for bit.
// Q4_KR and Q5_KR: Scale sc | m << 8 (the 6-bit scale and min), super (d, dmin); Q5_KR's fifth bits as Q5_0's (a
// uint32 a sub-block, bit l: value l's).  148 and 180 bytes a super-block against 144 and 176, read in 3 and 4 loads
// a sub-block where gemv_groups' decode makes 7 (a 32-byte run shared with the neighbour sub-block, three scale
// bytes, d and dmin) and gemv_k1 9 (its high-bit run too).
template <bool FIFTH>
struct QK_45R {
    static constexpr int QS_BYTES = 16, OFFSET = 0, SUPER_BYTES = 4;
    static constexpr bool QH = FIFTH, MIN = false;  // (MIN: the legacy epilogue's flag; sum() adds the minimum)
    using Scale = unsigned short;
    __device__ static void words(int4 v, unsigned qh, int* w) {
        load_split_words<QK_45R>(reinterpret_cast<const u8*>(&v), qh, w);
    }
    __device__ static float sum(unsigned short scm, unsigned dd, const int* w, const int* a) {
        const float sc[1] = {half_of(dd, 0) * float(scm & 0xFF)}, cf[1] = {-(half_of(dd, 1) * float(scm >> 8))};
        return group_sum<Q4_K>(sc, cf, dot8<true>(w, a), 0, a);
    }
};
using Q4_KR = QK_45R<false>;
using Q5_KR = QK_45R<true>;
// Q6_KR: two high bits a value in 8 bytes (value 4i + b's at bits 2i of byte b of word 0 for values 0-15, of word 1
// for values 16-31), Scale the two int8 scales of values 0-15 and 16-31, super d; 212 bytes against 210, 4 loads
// a sub-block where gemv_groups' decode makes 7
struct Q6_KR {
    static constexpr int QS_BYTES = 16, OFFSET = 0, SUPER_BYTES = 2, HIGH_BYTES = 8;
    static constexpr bool QH = false, MIN = false;
    using Scale = unsigned short;
    __device__ static void words(int4 v, uint2 h, int* w) {
        const int p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = bytes_minus<32>((p[i] & 0x0F0F0F0F) | (((h.x >> (2 * i)) & 0x03030303) << 4));
            w[i + 4] = bytes_minus<32>(((p[i] >> 4) & 0x0F0F0F0F) | (((h.y >> (2 * i)) & 0x03030303) << 4));
        }
    }
    __device__ static float sum(unsigned short scs, unsigned d, const int* w, const int* a) {
        int lo = 0, hi = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            lo = __dp4a(w[q], a[q], lo);
            hi = __dp4a(w[q + 4], a[q + 4], hi);
        }
        const float dd = half_bits(d), sc[2] = {dd * float(i8(scs & 0xFF)), dd * float(i8(scs >> 8))}, cf[2] = {};
        return group_sum<Q6_K>(sc, cf, lo, hi, a);
    }
};

// The code-book formats are also read by gemv.cu's skinny MMA (SkinnyCodes; launch.py says from which M): 16 bytes
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

// IQ4_XS's sub-blocks as gemv's chunked rows too (layouts.py K_ROWS), as the K-quants' above: its 16 code bytes as
// gemv_groups reads them (paired nibbles, groups.py), Scale its 6-bit scale minus 32 as an int8, super d; 138 bytes
// a super-block against 136, streamed by gemv's legacy loop.  The same integer sums and float operations as
// gemv_groups' IQ4_XS, so its products bit for bit.
struct IQ4_XSR {
    static constexpr int QS_BYTES = 16, OFFSET = 0, SUPER_BYTES = 2;
    static constexpr bool QH = false, MIN = false;
    using Scale = unsigned char;
    __device__ static void words(int4 v, unsigned, int* w) { IQ4_XS::Codes::words(v, w); }
    __device__ static float sum(unsigned char ls, unsigned d, const int* w, const int* a) {
        const float sc[1] = {half_bits(d) * float(int(i8(ls)))}, cf[1] = {};
        return group_sum<IQ4_XS>(sc, cf, dot8<true>(w, a), 0, a);
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
// the K-quants gemv.cu's skinny MMA takes (SkinnyGroups): one scale a group of 32 with a min, or two without
#define QGEMM_FOR_SKINNY_K_TYPES(MACRO) MACRO(q3_k, Q3_K) MACRO(q4_k, Q4_K) MACRO(q5_k, Q5_K) MACRO(q6_k, Q6_K)
