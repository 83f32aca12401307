// The CUDA emulator's cuBLAS (`libcublas.so`): the handle calls and cublasGemmEx for the types
// tandem uses (bf16, f16 or f32 inputs; f32 output; f32 compute), column-major as cuBLAS, with
// f32 accumulation. A test double for the GPU suite on machines without a GPU (see driver.cpp).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

using Status = int;
enum : int { OK = 0, INVALID_VALUE = 7, NOT_SUPPORTED = 15 };
enum : int { R_32F = 0, R_16F = 2, R_16BF = 14 };
enum : int { OP_N = 0, OP_T = 1 };

namespace {

int g_handle;

float load(const void* p, int type, size_t i) {
    uint16_t h;
    switch (type) {
        case R_32F: return static_cast<const float*>(p)[i];
        case R_16BF: {
            std::memcpy(&h, static_cast<const uint16_t*>(p) + i, 2);
            uint32_t u = (uint32_t)h << 16;
            float f;
            std::memcpy(&f, &u, 4);
            return f;
        }
        default: {
            _Float16 v;
            std::memcpy(&v, static_cast<const uint16_t*>(p) + i, 2);
            return (float)v;
        }
    }
}

// op(X) as rows of k contiguous floats: row r, column l of op(X) is X[r + l*ld] for OP_N and
// X[l + r*ld] for OP_T.
std::vector<float> rows_of(const void* x, int type, int op, int rows, int k, int ld) {
    std::vector<float> out((size_t)rows * k);
#pragma omp parallel for
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < k; l++)
            out[(size_t)r * k + l] =
                load(x, type, op == OP_N ? (size_t)r + (size_t)l * ld : (size_t)l + (size_t)r * ld);
    return out;
}

float dot(const float* a, const float* b, int k) {
    float acc[16] = {0};
    int l = 0;
    for (; l + 16 <= k; l += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[l + j] * b[l + j];
    float s = 0;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; l < k; l++) s += a[l] * b[l];
    return s;
}

}  // namespace

#define API extern "C" __attribute__((visibility("default")))

API Status cublasCreate_v2(void** handle) {
    *handle = &g_handle;
    return OK;
}
API Status cublasDestroy_v2(void*) { return OK; }
API Status cublasSetStream_v2(void*, void*) { return OK; }
API Status cublasSetWorkspace_v2(void*, void*, size_t) { return OK; }
API Status cublasSetMathMode(void*, int) { return OK; }

// C = alpha op(A) op(B) + beta C; op(A) m × k, op(B) k × n, C m × n (column-major, f32).
API Status cublasGemmEx(void*, int transa, int transb, int m, int n, int k, const void* alpha,
                        const void* a, int atype, int lda, const void* b, int btype, int ldb,
                        const void* beta, void* c, int ctype, int ldc, int compute, int) {
    auto known = [](int t) { return t == R_32F || t == R_16F || t == R_16BF; };
    if (ctype != R_32F || !known(atype) || !known(btype) || (compute != 68 && compute != 69)) {
        std::fprintf(stderr, "tandem CUDA emulator: cublasGemmEx types %d %d -> %d compute %d "
                             "not emulated\n", atype, btype, ctype, compute);
        return NOT_SUPPORTED;
    }
    if (m < 0 || n < 0 || k < 0 || (transa != OP_N && transa != OP_T) ||
        (transb != OP_N && transb != OP_T) || ldc < m ||
        lda < (transa == OP_N ? m : k) || ldb < (transb == OP_N ? k : n))
        return INVALID_VALUE;
    float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
    // Rows of op(A) (m of them) and columns of op(B) (n of them), each k long.
    std::vector<float> ar = rows_of(a, atype, transa, m, k, lda);
    std::vector<float> bc = rows_of(b, btype, transb == OP_N ? OP_T : OP_N, n, k, ldb);
    float* cf = static_cast<float*>(c);
#pragma omp parallel for
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float v = al * dot(&ar[(size_t)i * k], &bc[(size_t)j * k], k);
            float& out = cf[i + (size_t)j * ldc];
            out = be == 0.0f ? v : v + be * out;
        }
    return OK;
}
