// Causal attention over the paged KV cache, for prefill chunks and decode steps alike: one
// thread block per (query token, head), keys in tiles of blockDim with an online softmax
// (flash-style: no score matrix is materialised), GQA by mapping query heads onto KV heads,
// any number of sequences per launch. Queries attend to keys 0..=q_pos of their sequence.
//
// q, out: [n_q, n_heads, head_dim] f32. k_cache, v_cache: [num_blocks * block_size, n_kv_heads
// * head_dim] f16. block_tables: [n_seqs, max_blocks] u32. blockDim >= head_dim, <= 1024.
#include "common.cuh"

extern "C" __global__ void paged_attention(
    const float* q, float* out, const f16_t* k_cache, const f16_t* v_cache,
    const unsigned int* block_tables, const unsigned int* q_seq, const unsigned int* q_pos,
    int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks, float scale) {
    extern __shared__ float smem[];
    float* qs = smem;                       // head_dim
    float* p = smem + head_dim;             // blockDim: this tile's probabilities
    __shared__ float scratch[32];
    __shared__ float run_max, run_sum, tile_scale;

    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int kvh = h / (n_heads / n_kv_heads);
    int width = n_kv_heads * head_dim;
    const unsigned int* table = block_tables + (size_t)q_seq[t] * max_blocks;
    int n_keys = (int)q_pos[t] + 1;
    const float* qv = q + ((size_t)t * n_heads + h) * head_dim;
    for (int d = tid; d < head_dim; d += blockDim.x) qs[d] = qv[d];
    if (tid == 0) { run_max = -INFINITY; run_sum = 0.0f; }
    float acc = 0.0f;  // thread d < head_dim owns output dimension d
    __syncthreads();

    for (int base = 0; base < n_keys; base += blockDim.x) {
        int j = base + tid;
        float s = -INFINITY;
        if (j < n_keys) {
            size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
            const f16_t* kr = k_cache + slot * width + kvh * head_dim;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; d++) dot += qs[d] * f16_to_f32(kr[d]);
            s = dot * scale;
        }
        // Tile max, then the running max.
        float m = warp_max(s);
        int lane = tid & 31, warp = tid >> 5;
        __syncthreads();
        if (lane == 0) scratch[warp] = m;
        __syncthreads();
        if (tid == 0) {
            float tm = -INFINITY;
            for (int w = 0; w < (int)((blockDim.x + 31) >> 5); w++) tm = fmaxf(tm, scratch[w]);
            float nm = fmaxf(run_max, tm);
            tile_scale = (run_max == -INFINITY) ? 0.0f : __expf(run_max - nm);
            run_max = nm;
        }
        __syncthreads();
        float e = (j < n_keys) ? __expf(s - run_max) : 0.0f;
        p[tid] = e;
        float tile_sum = block_sum(e, scratch);
        if (tid == 0) run_sum = run_sum * tile_scale + tile_sum;
        if (tid < head_dim) {
            acc *= tile_scale;
            int n = min((int)blockDim.x, n_keys - base);
            for (int i = 0; i < n; i++) {
                int jj = base + i;
                size_t slot = (size_t)table[jj / block_size] * block_size + jj % block_size;
                acc += p[i] * f16_to_f32(v_cache[slot * width + kvh * head_dim + tid]);
            }
        }
        __syncthreads();
    }
    if (tid < head_dim) out[((size_t)t * n_heads + h) * head_dim + tid] = acc / run_sum;
}
