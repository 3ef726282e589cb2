// bitsandbytes' NF4 / FP4 (kernels/bnb4.py): the blockwise dequantization and a GEMV on the packed codes.
// Codes are bitsandbytes' order: byte j holds value 2j in its high nibble and 2j+1 in its low one; a block's
// absmax (float32, or with double quantization code8[q] * absmax2[b / 256] + offset) scales blocksize values
// of the flattened matrix, so a 4-byte load (8 values, 8-aligned) always lies in one block.
#include "common.cuh"

__constant__ float BNB4_CODE[2][16] = {
    {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
     -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
     0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f,
     1.0f},
    // FP4: {0, 0.0625, 8, 12, 4, 6, 2, 3} / 12 and their negatives, rounded as float32 divides them
    {0.0f, 0.0052083335f, 0.6666667f, 1.0f, 0.33333334f, 0.5f, 0.16666667f, 0.25f,
     -0.0f, -0.0052083335f, -0.6666667f, -1.0f, -0.33333334f, -0.5f, -0.16666667f, -0.25f}};

// The block scale of flat element e: the absmax, or the double-quantized one decoded as bitsandbytes does
// (a rounded product, then a rounded sum: no FMA).
template <bool DQ>
__device__ __forceinline__ float bnb4_scale(const float* __restrict__ absmax, const u8* __restrict__ qabs,
                                            const float* __restrict__ absmax2, const float* __restrict__ code8,
                                            float offset, int log2_bs, long long e) {
    const long long b = e >> log2_bs;
    if (!DQ) return __ldg(absmax + b);
    return __fadd_rn(__fmul_rn(__ldg(code8 + __ldg(qabs + b)), __ldg(absmax2 + (b >> 8))), offset);
}

// The 8 code-book values of a 4-byte load, in order (high nibble first).
__device__ __forceinline__ void bnb4_decode8(const unsigned u, const float* tab, float v[8]) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        v[2 * b] = tab[(u >> (8 * b + 4)) & 15];
        v[2 * b + 1] = tab[(u >> (8 * b)) & 15];
    }
}

template <int QT>
__device__ __forceinline__ const float* bnb4_table() {
    __shared__ float tab[16];  // 16 words in 16 banks: any lookup pattern is conflict-free
    if (threadIdx.x < 16) tab[threadIdx.x] = BNB4_CODE[QT][threadIdx.x];
    __syncthreads();
    return tab;
}

// Y[M, N] = X[M, K] W^T for M <= MR: a warp per weight row; lane l takes 8 values at a time (4 bytes of codes,
// 8 in flight), so that a warp's activation loads are 1 KiB contiguous; each word is decoded once for every
// activation row: sum_j code_j x_j over the 8 values, times their block's scale (bitsandbytes' sum of
// x_j (code_j absmax) in another rounding order).
template <int QT, bool DQ, int MR>
__device__ void gemv_bnb4(const unsigned* __restrict__ W, const float* __restrict__ absmax,
                          const u8* __restrict__ qabs, const float* __restrict__ absmax2,
                          const float* __restrict__ code8, float offset, int log2_bs, const float* __restrict__ X,
                          float* __restrict__ Y, int M, int N, int K) {
    const float* tab = bnb4_table<QT>();
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, n = blockIdx.x * (blockDim.x / WARP) + warp;
    if (n >= N) return;
    const int words = K / 8;
    const unsigned* row = W + (size_t)n * words;
    float acc[MR];
#pragma unroll
    for (int r = 0; r < MR; ++r) acc[r] = 0.0f;
#pragma unroll 8
    for (int c = lane; c < words; c += WARP) {
        const unsigned u = load_once<false>(row + c);  // streamed once
        const float sc = bnb4_scale<DQ>(absmax, qabs, absmax2, code8, offset, log2_bs, (long long)n * K + 8LL * c);
        float v[8];
        bnb4_decode8(u, tab, v);
#pragma unroll
        for (int r = 0; r < MR; ++r) {
            if (r >= M) break;
            const float4* x = reinterpret_cast<const float4*>(X + (size_t)r * K) + 2 * c;
            const float4 a = __ldg(x), b = __ldg(x + 1);
            float p = v[0] * a.x;
            p = fmaf(v[1], a.y, p);
            p = fmaf(v[2], a.z, p);
            p = fmaf(v[3], a.w, p);
            p = fmaf(v[4], b.x, p);
            p = fmaf(v[5], b.y, p);
            p = fmaf(v[6], b.z, p);
            p = fmaf(v[7], b.w, p);
            acc[r] = fmaf(sc, p, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MR; ++r) {
        if (r >= M) break;
        const float s = warp_sum(acc[r]);
        if (lane == 0) Y[(size_t)r * N + n] = s;
    }
}

// Lane l of a warp holds p[0..R-1] (R a power of two <= 32); returns the warp's sum of p[l % R].  A
// reduce-scatter: each step swaps half of the rows with the partner lane, so R rows cost R - 1 shuffles
// instead of R butterflies of 5.
template <int R>
__device__ __forceinline__ float warp_sum_rows(float (&p)[R]) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int o = R / 2; o >= 1; o >>= 1) {
        const bool up = lane & o;
#pragma unroll
        for (int i = 0; i < o; ++i) {
            const float give = up ? p[i] : p[i + o];
            const float keep = up ? p[i + o] : p[i];
            p[i] = keep + __shfl_xor_sync(0xffffffffu, give, o);
        }
    }
    float s = p[0];
#pragma unroll
    for (int o = R; o < WARP; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// A byte's two code-book values (high nibble first) at pt[byte * 32 + lane]: a copy of the 256-entry table per
// lane, so that a half-warp's 8-byte lookups fall in 32 distinct banks whatever the bytes (64 KiB of dynamic
// shared memory).
template <int QT>
__device__ __forceinline__ void bnb4_fill_pair_table(float2* pt) {
    for (int i = threadIdx.x; i < 256 * WARP; i += blockDim.x) {
        const int b = i / WARP;
        pt[i] = make_float2(BNB4_CODE[QT][b >> 4], BNB4_CODE[QT][b & 15]);
    }
    __syncthreads();
}

// The M = 1 stream at the bandwidth roofline: a persistent block per SM walks groups of R weight rows with the
// next group's 16-byte code loads in flight while it decodes this one (registers double-buffered); thread t owns
// code column t (32 values, K <= 32 * blockDim) and holds its activations in registers.  A byte is decoded by
// one PRMT (the byte and the lane's offset make the address) and one 8-byte lookup into the lane's own copy of
// the 256-entry pair table, so the loop is PRMT + LDS.64 + 2 FFMA per two values.
template <int QT, bool DQ, int R>
__device__ void gemv_bnb4_stream(const uint4* __restrict__ W, const float* __restrict__ absmax,
                                 const u8* __restrict__ qabs, const float* __restrict__ absmax2,
                                 const float* __restrict__ code8, float offset, int log2_bs,
                                 const float* __restrict__ X, float* __restrict__ Y, int N, int K) {
    extern __shared__ float2 pairs_smem[];
    __shared__ float part[2][512 / WARP][R];
    bnb4_fill_pair_table<QT>(pairs_smem);
    const char* table = reinterpret_cast<const char*>(pairs_smem);
    const int cols = K / 32, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const bool live = (int)threadIdx.x < cols;
    const int c = min((int)threadIdx.x, cols - 1);  // idle lanes load a real column and multiply it by x = 0
    const unsigned lane8 = 8u * lane;
    float4 x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
        x[j] = live ? __ldg(reinterpret_cast<const float4*>(X) + 8 * c + j) : make_float4(0.f, 0.f, 0.f, 0.f);
    const int groups = (N + R - 1) / R;
    int4 cur[R];
    float csc[R];
    auto fetch = [&](int g, int4 (&u)[R], float (&sc)[R]) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int n = min(g * R + i, N - 1);
            u[i] = load_once<false>(reinterpret_cast<const int4*>(W + (size_t)n * cols + c));
            sc[i] = bnb4_scale<DQ>(absmax, qabs, absmax2, code8, offset, log2_bs, (long long)n * K + 32LL * c);
        }
    };
    int4 nxt[R];
    float nsc[R];
    auto consume = [&](int g, const int4 (&u)[R], const float (&sc)[R], int parity) {
        float p[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const unsigned words[4] = {unsigned(u[i].x), unsigned(u[i].y), unsigned(u[i].z), unsigned(u[i].w)};
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    // address bytes: lane * 8 (the lane's copy), the code byte * 256 (its row of the table)
                    const unsigned off = __byte_perm(words[q], lane8, 0x5504u | (unsigned(b) << 4));
                    const float2 t = *reinterpret_cast<const float2*>(table + off);
                    const float4 a = x[2 * q + b / 2];
                    s = fmaf(t.x, b % 2 ? a.z : a.x, s);
                    s = fmaf(t.y, b % 2 ? a.w : a.y, s);
                }
            }
            p[i] = sc[i] * s;
        }
        const float r = warp_sum_rows<R>(p);
        if (lane < R) part[parity][warp][lane] = r;
        __syncthreads();  // part[parity] written; part[parity ^ 1] free again (read before the previous barrier)
        if (threadIdx.x < R && g * R + threadIdx.x < N) {
            float y = 0.0f;
            for (int w = 0; w < (int)blockDim.x / WARP; ++w) y += part[parity][w][threadIdx.x];
            Y[g * R + threadIdx.x] = y;
        }
    };
    // two register buffers in turn (no copies between them: a copy would wait for the loads in flight)
    const int G = gridDim.x;
    if (blockIdx.x < groups) fetch(blockIdx.x, cur, csc);
    for (int g = blockIdx.x; g < groups; g += 2 * G) {
        if (g + G < groups) fetch(g + G, nxt, nsc);
        consume(g, cur, csc, 0);
        if (g + 2 * G < groups) fetch(g + 2 * G, cur, csc);
        if (g + G < groups) consume(g + G, nxt, nsc, 1);
    }
}

// The float32 matrix bitsandbytes' dequantize_4bit gives (code * absmax, one rounding): a thread per 8 values,
// so that a warp's stores are 1 KiB contiguous.
template <int QT, bool DQ>
__device__ void dequantize_bnb4(const unsigned* __restrict__ W, const float* __restrict__ absmax,
                                const u8* __restrict__ qabs, const float* __restrict__ absmax2,
                                const float* __restrict__ code8, float offset, int log2_bs, float4* __restrict__ out,
                                long long words) {
    const float* tab = bnb4_table<QT>();
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= words) return;
    const float sc = bnb4_scale<DQ>(absmax, qabs, absmax2, code8, offset, log2_bs, 8LL * c);
    float v[8];
    bnb4_decode8(load_once<false>(W + c), tab, v);
    out[2 * c] = make_float4(__fmul_rn(v[0], sc), __fmul_rn(v[1], sc), __fmul_rn(v[2], sc), __fmul_rn(v[3], sc));
    out[2 * c + 1] = make_float4(__fmul_rn(v[4], sc), __fmul_rn(v[5], sc), __fmul_rn(v[6], sc), __fmul_rn(v[7], sc));
}

#define BNB4_ARGS                                                                                             \
    const unsigned *W, const float *absmax, const u8 *qabs, const float *absmax2, const float *code8, float offset, \
        int log2_bs
#define BNB4_PASS W, absmax, qabs, absmax2, code8, offset, log2_bs
#define BNB4_GEMV(name, QT, DQ, MR)                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        name(BNB4_ARGS, const float* X, float* Y, int M, int N, int K) {                                      \
        gemv_bnb4<QT, DQ, MR>(BNB4_PASS, X, Y, M, N, K);                                                      \
    }
// 4 rows a group: on the H100 (N = 4096, NF4) 19.5 us at K = 14336 where 2 rows (two blocks an SM) took 21.3
// and 8 rows 21.7 (`git show 13e6adb:docs/reports/formats-bnb4.md`)
#define BNB4_STREAM_ROWS 4
#define BNB4_STREAM(name, QT, DQ, R)                                                                          \
    extern "C" __global__ void __launch_bounds__(512)                                                         \
        name(BNB4_ARGS, const float* X, float* Y, int M, int N, int K) {                                      \
        gemv_bnb4_stream<QT, DQ, R>(reinterpret_cast<const uint4*>(W), absmax, qabs, absmax2, code8, offset,   \
                                    log2_bs, X, Y, N, K);                                                     \
    }
#define BNB4_KERNELS(t, QT, DQ, dq)                                                                           \
    BNB4_STREAM(gemv_bnb4_stream_##t##dq, QT, DQ, BNB4_STREAM_ROWS)                                          \
    BNB4_GEMV(gemv_bnb4_##t##dq##_1, QT, DQ, 1)                                                               \
    BNB4_GEMV(gemv_bnb4_##t##dq##_2, QT, DQ, 2)                                                               \
    BNB4_GEMV(gemv_bnb4_##t##dq##_4, QT, DQ, 4)                                                               \
    BNB4_GEMV(gemv_bnb4_##t##dq##_8, QT, DQ, 8)                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                                         \
        dequantize_bnb4_##t##dq(BNB4_ARGS, float4* out, long long words) {                                   \
        dequantize_bnb4<QT, DQ>(BNB4_PASS, out, words);                                                      \
    }
BNB4_KERNELS(nf4, 0, false, )
BNB4_KERNELS(nf4, 0, true, _dq)
BNB4_KERNELS(fp4, 1, false, )
BNB4_KERNELS(fp4, 1, true, _dq)
