// A batch's rows read from, and written to, page-locked host memory the device addresses directly: a replayed
// product (graphs.py) gathers each request's X rows from where its front wrote them and scatters its Y rows back
// there, so that the host copies no row.  `table` (page-locked too) holds the batch's m X row addresses, then its
// m Y row addresses.  One block a row.  The copies are exact; their numpy twin is a plain row copy.

// Vector loads where the row's address and length allow them, else one float at a time.
__device__ __forceinline__ bool aligned16(const void* p, int len) {
    return ((reinterpret_cast<unsigned long long>(p) & 15) == 0) && ((len & 3) == 0);
}

extern "C" __global__ void __launch_bounds__(1024) gather_rows(const unsigned long long* __restrict__ table,
                                                                 float* __restrict__ x, int k) {
    const float* src = reinterpret_cast<const float*>(table[blockIdx.x]);
    float* dst = x + static_cast<size_t>(blockIdx.x) * k;
    if (aligned16(src, k) && aligned16(dst, k)) {
        const float4* s4 = reinterpret_cast<const float4*>(src);
        float4* d4 = reinterpret_cast<float4*>(dst);
        for (int i = threadIdx.x; i < k / 4; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (int i = threadIdx.x; i < k; i += blockDim.x) dst[i] = src[i];
    }
}

// Also clears *finite where a value is NaN or infinite (set to 1 by the host before the launch): the product's
// check for overflow, made as its rows go out.
extern "C" __global__ void __launch_bounds__(1024) scatter_rows(const float* __restrict__ y,
                                                                  const unsigned long long* __restrict__ table,
                                                                  int m, int n, int* __restrict__ finite) {
    float* dst = reinterpret_cast<float*>(table[m + blockIdx.x]);
    const float* src = y + static_cast<size_t>(blockIdx.x) * n;
    bool bad = false;
    if (aligned16(src, n) && aligned16(dst, n)) {
        const float4* s4 = reinterpret_cast<const float4*>(src);
        float4* d4 = reinterpret_cast<float4*>(dst);
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
            const float4 v = s4[i];
            bad |= !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w));
            d4[i] = v;
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = src[i];
            bad |= !isfinite(v);
            dst[i] = v;
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) *finite = 0;
}
