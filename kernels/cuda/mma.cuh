// The int8 and fp16 tensor-core MMAs (mma.sync, ldmatrix) that mmq.cuh's tiles and gemv.cu's skinny kernel are
// built from, and the constant-bias trick both read their integer sums back with: an MMA's C is one constant
// register (no per-MMA moves to reset it), and the int32 result read as float bits is the sum plus a bias.
#define MAGIC_I 0x4B400000  // skinny's bias: 1.5 * 2^23 as float bits, F - 12582912 = sumi
#define MAGIC_F 12582912.0f

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

// D = A*B + C_BITS for one half of a quant block (k16: a[0..1], b[0] of a k32 fragment are its values 0..15)
template <int C_BITS>
__device__ __forceinline__ void mma16_s8_const(int* d, const int* a, int b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(b), "r"(C_BITS));
}
