// mmq_wgmma: mmq's tiles and stages (mmq.cuh) through Hopper's wgmma (sm_90a; other GPUs compile it empty).
#include "common.cuh"
#include "groups.cuh"
#include "mma.cuh"
#include "mmq.cuh"

// ---- mmq_wgmma: the same tiles and stages through Hopper's wgmma (sm_90a) ------------------------
// Two warpgroups a block, each the 64 x 64 half of the 64 x 128 tile (wgmma.m64n64k32 per quant block, 16
// warps an SM), asynchronously: while the tensor cores do block j+1, the warps run the epilogue of block j.
// Operands are read from shared memory through descriptors (no ldmatrix, no fragments in registers).
//
// mmq's 2^19 bias, made by the tensor cores.  wgmma cannot start from a constant C (mmq's free bias), so
// each quant block takes two wgmmas into one accumulator set: the first (scale-d 0) multiplies two constant
// tiles of -128s, 32 * 128 * 128 = 2^19 in every lane, the second adds the block's product; then mmq's
// two-FFMA epilogue, so its outputs equal mmq's bit for bit.  Measured on the H100 5-10% slower than mmq
// (`git show 13e6adb:docs/reports/kernel-design.md`): the bias doubles the tensor-core work.
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
