// Embedding lookup, RMSNorm, rotary embedding and SiLU·mul. Activations are f32, row-major.
#include "common.cuh"

// out[t, :] = table[ids[t], :] (bf16 table). Grid: one block per token.
extern "C" __global__ void embedding_bf16(const bf16_t* table, const unsigned int* ids,
                                          float* out, int dim) {
    const bf16_t* row = table + (size_t)ids[blockIdx.x] * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = bf16_to_f32(row[i]);
}

// out[r, :] = x[r, :] / sqrt(mean(x[r]^2) + eps) * weight. Grid: one block per row.
extern "C" __global__ void rms_norm(const float* x, const float* weight, float* out, int dim,
                                    float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * weight[i];
}

// In-place rotary embedding of x[t, h, :] at positions[t]. `neox` = 1 rotates the two halves
// of a head (rotate-half, HF checkpoints), 0 rotates adjacent pairs (GGUF's interleaved Q/K).
// Grid: (tokens, heads); threads over the head's pairs.
extern "C" __global__ void rope(float* x, const unsigned int* positions, int n_heads,
                                int head_dim, float base, int neox) {
    int t = blockIdx.x, h = blockIdx.y;
    float* v = x + ((size_t)t * n_heads + h) * head_dim;
    float pos = (float)positions[t];
    int half = head_dim / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float theta = pos * powf(base, -2.0f * (float)i / (float)head_dim);
        float c = cosf(theta), s = sinf(theta);
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}

// gate = silu(gate) * up, elementwise over n values.
extern "C" __global__ void silu_mul(float* gate, const float* up, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = g / (1.0f + __expf(-g)) * up[i];
    }
}

// f32 activations to bf16 (for cuBLAS bf16 GEMMs with f32 accumulation).
extern "C" __global__ void f32_to_bf16_rows(const float* x, bf16_t* out, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(x[i]);
}

// out[i, :] = x[rows[i], :]: the rows the LM head runs on. Grid: one block per gathered row.
extern "C" __global__ void gather_rows(const float* x, const unsigned int* rows, float* out,
                                       int dim) {
    const float* src = x + (size_t)rows[blockIdx.x] * dim;
    float* o = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = src[i];
}

// x += y, elementwise (residual connections).
extern "C" __global__ void add_into(float* x, const float* y, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
