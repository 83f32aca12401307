// KV cache writes, and packing between the paged pool and contiguous staging buffers in the
// transfer's wire layout (one layer: all keys of the sequence's tokens, then all values, f16).
#include "common.cuh"

// Rows t of k and v (f32, [n, width]) into cache slots slots[t] as f16. Grid: one block per row.
extern "C" __global__ void store_kv(f16_t* k_cache, f16_t* v_cache, const unsigned int* slots,
                                    const float* k, const float* v, int width) {
    size_t dst = (size_t)slots[blockIdx.x] * width, src = (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_cache[dst + i] = f32_to_f16(k[src + i]);
        v_cache[dst + i] = f32_to_f16(v[src + i]);
    }
}

// One layer of tokens 0..n of a sequence (block table `table`) into `staging` ([2, n, width]).
// Grid: one block per token.
extern "C" __global__ void pack_kv(const f16_t* k_cache, const f16_t* v_cache,
                                   const unsigned int* table, f16_t* staging, int n, int width,
                                   int block_size) {
    int p = blockIdx.x;
    size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        staging[(size_t)p * width + i] = k_cache[slot * width + i];
        staging[((size_t)n + p) * width + i] = v_cache[slot * width + i];
    }
}

// The reverse of pack_kv: a received layer into the sequence's blocks.
extern "C" __global__ void unpack_kv(f16_t* k_cache, f16_t* v_cache, const unsigned int* table,
                                     const f16_t* staging, int n, int width, int block_size) {
    int p = blockIdx.x;
    size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_cache[slot * width + i] = staging[(size_t)p * width + i];
        v_cache[slot * width + i] = staging[((size_t)n + p) * width + i];
    }
}
