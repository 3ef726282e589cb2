// On-device FP32 -> Q8_1, as llama.cpp's quantize_q8_1: d = amax/127, q = roundf(x/d), ds = (d, sum x).
// The block sum keeps the order of llama.cpp's warp butterfly exactly (lane i adds lane i ^ 16, then ^ 8,
// ^ 4, ^ 2, ^ 1), so it matches the reference bit for bit.  Compiled with -ftz=false (modules.py): a
// block whose d is subnormal gets the reference's d and q too.
#include "common.cuh"
#include "q8_1.cuh"

// x: [M, K] row-major fp32; n_values = M*K (a multiple of 32).  Threads past the end work on zeros
// and write nothing, so every lane takes part in the shuffles.
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, block_q8_1* __restrict__ y,
                                         long long n_values) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const bool active = i < n_values;
    const float4 v = active ? *reinterpret_cast<const float4*>(x + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    const Q8_1Block4 r = quantize4(v);
    if (!active) return;
    block_q8_1& b = y[i / QK];
    reinterpret_cast<int*>(b.qs)[(i % QK) / 4] = r.packed;
    if (i % QK == 0) b.ds = make_half2(__float2half(r.d), __float2half(r.sum));
}

// The same, written straight into the split layout gemv reads: int8 quants qs and half2 (d, sum) ds apart, by row
// ([M, K] and [M, K / 32]), or (`chunked`: the skinny kernel's products) in chunks of K holding the M rows' padded
// parts (common.cuh act_q, act_ds).
extern "C" __global__ void quantize_q8_1_split(const float* __restrict__ x, i8* __restrict__ qs,
                                               __half2* __restrict__ ds, long long n_values, int M, int K,
                                               int chunked) {
    // Launched dependent on the GEMM ahead of it (kernels/cuda/pdl.py): gemv's M = 1 kernel may start its
    // weight loads now, and this kernel waits for the one before it before it reads x or overwrites qs/ds.
    let_dependents_launch();
    wait_for_inputs();
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const bool active = i < n_values;
    const float4 v = active ? *reinterpret_cast<const float4*>(x + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    const Q8_1Block4 r = quantize4(v);
    if (!active) return;
    size_t q = size_t(i), b = size_t(i / QK);
    if (chunked) {
        const int row = int(i / K), k = int(i % K);
        q = act_q(row, k / QK, M) + k % QK;
        b = act_ds(row, k / QK, M);
    }
    *reinterpret_cast<int*>(qs + q) = r.packed;
    if (i % QK == 0) ds[b] = make_half2(__float2half(r.d), __float2half(r.sum));
}

// The layout `mmq` reads, llama.cpp's MMQ activations (its quantize_mmq_q8_1): every array tiled by 64 rows
// and by stages of 4 quant blocks (128 values of K), each (row tile, stage) one contiguous piece, so that the
// GEMM copies a stage with fixed offsets:
//   qs: [M/64][SB][64 x 128] int8, 8 KiB a piece in core-matrix order: byte (r, k) at
//       ((r/8)*8 + k/16)*128 + (r%8)*16 + k%16 (see mmq.cuh)
//   dc: [M/64][SB][4 blocks][64 rows] float2 (d * 2^111, -d * 2^-19): the GEMM's epilogue turns its
//       2^19-biased int32 into d*sumi*2^-38 with one FFMA (mmq.cuh); d is the block's scale in float
//       (llama.cpp's D4 layout, Q8_0 weights) or rounded to half (DS4, Q4_0), per `half_d`
//   sa (weights with a minimum only, else null): [M/64][SB][64 rows][4 blocks] half, the block's sum of x
//       (four values a lane added in order, then a butterfly over the block's 8 lanes) rounded to half as
//       llama.cpp's DS4 stores it: the A operand of mmq's fp16 MMA for the m_w s_a term
// with SB = K/128 rounded up.  Rows past M are never read as data; blocks past K/32 get d = 0 here
// (their quants meet zero weights).  Both products are exact: powers of two times d (|d| < 2^16).

// A block's scales into the mmq layout (its row mr of the row tile whose first piece is `piece`); the last
// block of a row also zeroes the padding blocks of its last stage.
__device__ __forceinline__ void store_mmq_scales(float2* __restrict__ dc, __half* __restrict__ sa, size_t piece, int mr,
                                                 int kb, int KB, int SB, float d, float sum, int half_d) {
    const float dd = half_d ? __half2float(__float2half(d)) : d;
    const size_t at = ((piece + (kb >> 2)) << 8) + ((kb & 3) << 6) + mr;
    dc[at] = make_float2(dd * 0x1p111f, dd * -0x1p-19f);
    const size_t sa_at = ((piece + (kb >> 2)) << 8) + (mr << 2) + (kb & 3);
    if (sa) sa[sa_at] = __float2half(sum);
    if (kb == KB - 1)
        for (int kp = kb + 1; kp < 4 * SB; ++kp) {
            dc[((piece + (kp >> 2)) << 8) + ((kp & 3) << 6) + mr] = make_float2(0.f, 0.f);
            if (sa) sa[((piece + (kp >> 2)) << 8) + (mr << 2) + (kp & 3)] = __float2half(0.f);
        }
}

// Small grids: a warp quantizes G consecutive blocks of 4 consecutive rows (8 lanes a row, as in the kernels
// above): each block's 16-byte quant chunks land as two runs of 4 core-matrix rows, 64 contiguous bytes
// each.  The G blocks' loads are all issued first.  launch.py takes G = 1 while the grid is under a wave
// (parallelism), G = 2 or 4 above (loads in flight): at M = 512, K = 14336, G = 1 ran four waves of one
// load each, latency-bound (17.3 us against 14.9 with G = 4).
template <int G>
__device__ void quantize_mmq(const float* __restrict__ x, i8* __restrict__ qs, float2* __restrict__ dc,
                             __half* __restrict__ sa, int M, int K, int SB, int half_d) {
    const int KB = K / QK, lane = threadIdx.x % WARP;
    const unsigned KG = (KB + G - 1) / G, warp = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int kb0 = int(warp % KG) * G, m = int(warp / KG) * 4 + (lane >> 3);
    float4 v[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int k = (kb0 + g) * QK + (lane & 7) * 4;
        v[g] = m < M && kb0 + g < KB ? *reinterpret_cast<const float4*>(x + (size_t)m * K + k)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const int mr = m & 63;
    const size_t piece = (size_t)(m >> 6) * SB;  // this row tile's first piece
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const Q8_1Block4 r = quantize4<true>(v[g]);
        float sum = 0.0f;
        if (sa) {  // the same in every lane of the warp: all lanes shuffle
            sum = ((v[g].x + v[g].y) + v[g].z) + v[g].w;
#pragma unroll
            for (int off = 4; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        }
        const int kb = kb0 + g, kk = ((kb & 3) << 5) + (lane & 7) * 4;
        if (m >= M || kb >= KB) continue;
        const int within = (((mr >> 3) * 8 + (kk >> 4)) << 7) + ((mr & 7) << 4) + (kk & 15);
        *reinterpret_cast<int*>(qs + ((piece + (kb >> 2)) << 13) + within) = r.packed;
        if ((lane & 7) == 0) store_mmq_scales(dc, sa, piece, mr, kb, KB, SB, r.d, sum, half_d);
    }
}
#define QUANTIZE_MMQ(G, name)                                                                                   \
    extern "C" __global__ void name(const float* x, i8* qs, float2* dc, __half* sa, int M, int K, int SB,        \
                                    int half_d) {                                                               \
        quantize_mmq<G>(x, qs, dc, sa, M, K, SB, half_d);                                                       \
    }
QUANTIZE_MMQ(1, quantize_q8_1_mmq)
QUANTIZE_MMQ(2, quantize_q8_1_mmq2)
QUANTIZE_MMQ(4, quantize_q8_1_mmq4)

// Big grids (launch.py: from ~16 warps an SM): two lanes a block, 16 values each, a quarter of the
// instructions.  Lane h (0 or 1) of a block holds the values p = 4h + 8i + j (i, j = 0..3): one shuffle
// (h = 0 with 1) gives both lanes the block's amax, and one division pair serves 16 values.  Read straight from global memory that layout fetched a quarter of each 128-byte line per
// load (a read-only kernel with it: 3.9 us against 2.3 coalesced at M = 512, K = 4096), so a warp loads
// its 8 rows x 2 blocks coalesced (a half-warp per row: 256 contiguous bytes) and reorders them through
// shared memory, chunk c of row r at c ^ r (no bank conflicts either way).  The two lanes then swap half
// their packed quants so that each stores one natural-order 16-byte chunk: a warp's stores are 4 whole
// 128-byte core matrices.  A warp: rows (lane & 7) of 8, block (lane >> 4) of 2, h = bit 3.
// H100, quantize alone, same buffer: M = 512 K = 4096 4.5 -> 3.9 us, K = 14336 12.4 -> 11.1,
// M = 2048 K = 4096 15.7 -> 14.6; slower on small grids (M = 128 K = 4096 2.3 -> 2.6 us), which keep the
// kernel above.  It writes no sums (sa must be null: launch.py takes the kernels above for formats with a minimum).
extern "C" __global__ void __launch_bounds__(256)
quantize_q8_1_mmq_pair(const float* __restrict__ x, i8* __restrict__ qs, float2* __restrict__ dc, __half* sa, int M,
                       int K, int SB, int half_d) {
    __shared__ float4 stage[8][16][8];  // a warp's 16 (row, block) pairs x 8 chunks of 4 values
    const int KB = K / QK, lane = threadIdx.x % WARP, w = threadIdx.x / WARP, h = (lane >> 3) & 1;
    const unsigned KW = (KB + 1) / 2, warp = blockIdx.x * (blockDim.x / WARP) + w;
    const int m0 = int(warp / KW) * 8, kb0 = int(warp % KW) * 2;
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // rows 2j, 2j + 1: lane (row, block, chunk)
        const int r = 2 * j + (lane >> 4), b = (lane >> 3) & 1, c = lane & 7;
        stage[w][2 * r + b][c ^ r] = m0 + r < M && kb0 + b < KB
            ? *reinterpret_cast<const float4*>(x + (size_t)(m0 + r) * K + (kb0 + b) * QK + c * 4)
            : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncwarp();
    const int r = lane & 7, m = m0 + r, kb = kb0 + (lane >> 4);
    float xs[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 v = stage[w][2 * r + (lane >> 4)][(2 * i + h) ^ r];
        xs[4 * i] = v.x, xs[4 * i + 1] = v.y, xs[4 * i + 2] = v.z, xs[4 * i + 3] = v.w;
    }
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(xs[j]));  // max: any order
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 8));
    int q[16];
    const float d = mmq_quants<16>(xs, amax, q);
    const int w0 = pack4(q), w1 = pack4(q + 4), w2 = pack4(q + 8), w3 = pack4(q + 12);
    // values 0..15 are (h0 w0, h1 w0, h0 w1, h1 w1), values 16..31 (h0 w2, h1 w2, h0 w3, h1 w3)
    const int r0 = __shfl_xor_sync(0xffffffffu, h ? w0 : w2, 8), r1 = __shfl_xor_sync(0xffffffffu, h ? w1 : w3, 8);
    if (m >= M || kb >= KB) return;
    const int mr = m & 63, chunk = ((kb & 3) << 1) + h;
    const size_t piece = (size_t)(m >> 6) * SB;
    const int within = ((((mr >> 3) << 3) + chunk) << 7) + ((mr & 7) << 4);
    *reinterpret_cast<int4*>(qs + ((piece + (kb >> 2)) << 13) + within) = h ? make_int4(r0, w2, r1, w3)
                                                                              : make_int4(w0, r0, w1, r1);
    if (h == 0) store_mmq_scales(dc, nullptr, piece, mr, kb, KB, SB, d, 0.0f, half_d);
}

// Q2_K's MMQ activations, llama.cpp's D2S6 layout (quantize_mmq_q8_1<D2S6>): one scale per 64 values (amax over
// 16 lanes), rounded to half; a half sum per 16 values (four a lane in order, then a butterfly over 4 lanes)
// for the first 96 values of every 128.  Written into the mmq layout (mmq.cuh MmqSmem, H = 2: a piece of 1536
// bytes per 64 rows and stage): the sums of halves 0-5 as halves [64 rows][8] (6 and 7: zeros), the A operand
// of mmq's fp16 MMA; then halves 6 and 7 as float [2][64] times 2^-38, d * Σq (exact: an 11-bit d times an
// 11-bit sum), the term llama.cpp's vec_dot_q2_K_q8_1_mma forms from their integer sums there.
// A warp a (row, stage of 128 values), 4 values a lane; K is a multiple of 256, so stages are whole.
extern "C" __global__ void quantize_q8_1_mmq_d2s6(const float* __restrict__ x, i8* __restrict__ qs,
                                                  float2* __restrict__ dc, char* __restrict__ sa, int M, int K,
                                                  int SB) {
    const int lane = threadIdx.x % WARP;
    const unsigned warp = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP, stages = K / 128;
    const int m = int(warp / stages), st = int(warp % stages);
    if (m >= M) return;  // whole warps only: the shuffles below see every lane
    const float4 v = *reinterpret_cast<const float4*>(x + (size_t)m * K + st * 128 + lane * 4);
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    float sum = ((v.x + v.y) + v.z) + v.w;
#pragma unroll
    for (int off = 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float xs[4] = {v.x, v.y, v.z, v.w};
    int q[4];
    const float d = __half2float(__float2half(mmq_quants<4>(xs, amax, q)));
    int qsum = q[0] + q[1] + q[2] + q[3];
#pragma unroll
    for (int off = 2; off > 0; off >>= 1) qsum += __shfl_xor_sync(0xffffffffu, qsum, off);
    const int mr = m & 63, kk = lane * 4;
    const size_t piece = (size_t)(m >> 6) * SB + st;
    const int within = (((mr >> 3) * 8 + (kk >> 4)) << 7) + ((mr & 7) << 4) + (kk & 15);
    *reinterpret_cast<int*>(qs + (piece << 13) + within) = pack4(q);
    const int blk = lane >> 3, half = (lane >> 2) & 1;  // block of the stage, half of the block
    if ((lane & 7) == 0) dc[(piece << 8) + (blk << 6) + mr] = make_float2(d * 0x1p111f, d * -0x1p-19f);
    if ((lane & 3) == 0) {
        const int hb = (blk << 1) + half;  // half block 0-7 of the stage
        char* at = sa + piece * 1536;
        reinterpret_cast<__half*>(at)[mr * 8 + hb] = __float2half(hb < 6 ? sum : 0.f);
        if (hb >= 6) reinterpret_cast<float*>(at + 1024)[(hb - 6) * 64 + mr] = d * float(qsum) * 0x1p-38f;
    }
}
