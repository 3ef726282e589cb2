// Ceilings measured in the bench's own run: a plain loop of int8 mma.sync.m16n8k32 on registers,
// 8 independent accumulators per warp so the tensor cores never wait on a dependency.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) mma_peak(int* out, int iters) {
    const int t = threadIdx.x;
    const int a0 = t * 0x01010101, a1 = a0 ^ 0x5a5a5a5a, a2 = a0 ^ 0x33333333, a3 = a0 ^ 0x0f0f0f0f;
    const int b0 = a0 ^ 0x11111111, b1 = a0 ^ 0x77777777;
    int c[8][4] = {};
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
            asm volatile(
                "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                "{%0,%1,%2,%3};"
                : "+r"(c[j][0]), "+r"(c[j][1]), "+r"(c[j][2]), "+r"(c[j][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    int s = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + t] = s;
}
