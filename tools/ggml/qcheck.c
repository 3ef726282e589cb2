// qcheck TYPE N K M1,M2,... SEED OUTDIR  (built and run by tools/ggml_harness.py: qgemm ggml products)
// Quantizes deterministic Gaussian weights [N, K] with ggml's own quantizer, multiplies them with
// deterministic activations on the GPU backend (CPU if none) through ggml_mul_mat, and writes
//   OUTDIR/TYPE.w.bin   the quantized rows (GGUF block bytes, row-major [N, K])
//   OUTDIR/x.f32        activations [Mmax, K] (the same for every type and seed)
//   OUTDIR/TYPE.M.y.f32 the product [M, N] for each M
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t st;
static double urand(void) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; return ((st >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
static float nrand(void) { double u = urand(), v = urand(); return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v)); }

static void dump(const char *dir, const char *name, const void *p, size_t n) {
    char path[1024]; snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb"); if (!f || fwrite(p, 1, n, f) != n) { fprintf(stderr, "write %s failed\n", path); exit(1); } fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: qcheck TYPE N K M1,M2 SEED OUTDIR\n"); return 2; }
    const char *tname = argv[1]; int64_t N = atoll(argv[2]), K = atoll(argv[3]);
    st = 0x9E3779B97F4A7C15ull ^ (strtoull(argv[5], 0, 10) * 0x100000001B3ull); const char *out = argv[6];
    int type = -1;
    for (int t = 0; t < GGML_TYPE_COUNT; t++) { const char *nm = ggml_type_name((enum ggml_type)t); if (nm && !strcmp(nm, tname)) { type = t; break; } }
    if (type < 0) { fprintf(stderr, "unknown type %s\n", tname); return 2; }
    int ms[32], nm = 0, mmax = 0;
    for (char *tok = strtok(argv[4], ","); tok && nm < 32; tok = strtok(NULL, ",")) { ms[nm] = atoi(tok); if (ms[nm] > mmax) mmax = ms[nm]; nm++; }

    uint64_t wstate = st;
    st = 0xD1B54A32D192ED03ull;  // activations: one stream for every type, so one x file serves all
    float *x = malloc(sizeof(float) * mmax * K);
    for (int64_t i = 0; i < (int64_t)mmax * K; i++) x[i] = nrand() * (urand() < 0.01 ? 20.0f : 1.0f);
    st = wstate;
    float *wf = malloc(sizeof(float) * N * K);
    for (int64_t r = 0; r < N; r++) { float sc = 0.02f * (0.25f + 2.0f * (float)urand()); for (int64_t c = 0; c < K; c++) wf[r * K + c] = sc * nrand(); }
    size_t row = ggml_row_size((enum ggml_type)type, K);
    void *wq = malloc(row * N);
    ggml_quantize_init((enum ggml_type)type);
    if (type == GGML_TYPE_F32) memcpy(wq, wf, row * N);
    else ggml_quantize_chunk((enum ggml_type)type, wf, wq, 0, N, K, NULL);

    ggml_backend_t be = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_GPU, NULL);
    if (!be) be = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
    fprintf(stderr, "%s N=%lld K=%lld backend=%s\n", tname, (long long)N, (long long)K, ggml_backend_name(be));
    char name[256];
    snprintf(name, sizeof name, "%s.w.bin", tname); dump(out, name, wq, row * N);
    dump(out, "x.f32", x, sizeof(float) * mmax * K);
    for (int j = 0; j < nm; j++) {
        int M = ms[j];
        struct ggml_init_params ip = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true };
        struct ggml_context *ctx = ggml_init(ip);
        struct ggml_tensor *W = ggml_new_tensor_2d(ctx, (enum ggml_type)type, K, N);
        struct ggml_tensor *X = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, M);
        struct ggml_tensor *Y = ggml_mul_mat(ctx, W, X);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
        ggml_backend_tensor_set(W, wq, 0, row * N);
        ggml_backend_tensor_set(X, x, 0, sizeof(float) * M * K);
        struct ggml_cgraph *gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, Y);
        if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) { fprintf(stderr, "compute failed\n"); return 1; }
        float *y = malloc(sizeof(float) * M * N);
        ggml_backend_tensor_get(Y, y, 0, sizeof(float) * M * N);
        snprintf(name, sizeof name, "%s.%d.y.f32", tname, M); dump(out, name, y, sizeof(float) * M * N);
        free(y); ggml_backend_buffer_free(buf); ggml_free(ctx);
    }
    ggml_backend_free(be);
    return 0;
}
