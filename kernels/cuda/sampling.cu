// Sampling on the device: greedy argmax, and temperature / top-k / top-p sampling with a
// uniform draw supplied per row (so the host's seeded RNG decides, as on the CPU path).
// One block (up to 1024 threads) per row of logits.
#include "common.cuh"

// Block-wide argmax of (value, index); ties go to the lower index (as the CPU sampler).
__device__ void block_argmax(float v, int i, float* sv, int* si, float* out_v, int* out_i) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        float bv = sv[0]; int bi = si[0];
        for (int w = 1; w < (int)((blockDim.x + 31) >> 5); w++)
            if (sv[w] > bv || (sv[w] == bv && si[w] < bi)) { bv = sv[w]; bi = si[w]; }
        *out_v = bv; *out_i = bi;
    }
    __syncthreads();
}

extern "C" __global__ void argmax_rows(const float* logits, unsigned int* out, int vocab) {
    __shared__ float sv[32]; __shared__ int si[32]; __shared__ float bv; __shared__ int bi;
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = -INFINITY; int idx = 0x7fffffff;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x)
        if (row[j] > v) { v = row[j]; idx = j; }
    block_argmax(v, idx, sv, si, &bv, &bi);
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned int)bi;
}

// The top `k` (<= 64) logits of each row by repeated argmax, softmax at `temperature` over
// them, cut to the smallest prefix whose mass reaches `top_p`, then the token where the
// cumulative mass passes `uniform[row] * kept mass`.
extern "C" __global__ void sample_top_k_top_p(const float* logits, const float* uniform,
                                              unsigned int* out, int vocab, int k,
                                              float temperature, float top_p) {
    __shared__ float sv[32]; __shared__ int si[32]; __shared__ float bv; __shared__ int bi;
    __shared__ float cand_v[64]; __shared__ int cand_i[64];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    if (k > 64) k = 64;
    if (k > vocab) k = vocab;
    for (int c = 0; c < k; c++) {
        float v = -INFINITY; int idx = 0x7fffffff;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            bool taken = false;
            for (int q = 0; q < c; q++) taken |= (cand_i[q] == j);
            if (!taken && row[j] > v) { v = row[j]; idx = j; }
        }
        block_argmax(v, idx, sv, si, &bv, &bi);
        if (threadIdx.x == 0) { cand_v[c] = bv; cand_i[c] = bi; }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    float m = cand_v[0], total = 0.0f, probs[64];
    for (int c = 0; c < k; c++) { probs[c] = __expf((cand_v[c] - m) / temperature); total += probs[c]; }
    int keep = k; float kept = 0.0f;
    for (int c = 0; c < k; c++) {
        kept += probs[c] / total;
        if (kept >= top_p) { keep = c + 1; break; }
    }
    float mass = 0.0f;
    for (int c = 0; c < keep; c++) mass += probs[c];
    float target = uniform[blockIdx.x] * mass, acc = 0.0f;
    unsigned int chosen = (unsigned int)cand_i[keep - 1];
    for (int c = 0; c < keep; c++) {
        acc += probs[c];
        if (acc > target) { chosen = (unsigned int)cand_i[c]; break; }
    }
    out[blockIdx.x] = chosen;
}
