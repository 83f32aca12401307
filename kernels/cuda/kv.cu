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

// Pages between two copies of the paged pool (KV tiers: the device pool and the engine's host
// cache, page-locked and mapped into the device): page pages[blockIdx.x] of segment blockIdx.y
// (one layer's keys or values; its pool starts at src[seg], resp. dst[seg]), `page_bytes` long.
// One launch moves a batch of pages either way. Grid: (pages, segments).
extern "C" __global__ void copy_pages(const unsigned long long* dst, const unsigned long long* src,
                                      const unsigned int* pages, unsigned long long page_bytes) {
    size_t at = (size_t)pages[blockIdx.x] * page_bytes;
    unsigned char* d = (unsigned char*)dst[blockIdx.y] + at;
    const unsigned char* s = (const unsigned char*)src[blockIdx.y] + at;
    if ((((size_t)d | (size_t)s | (size_t)page_bytes) & 15) == 0) {
        for (size_t i = threadIdx.x; i < page_bytes / 16; i += blockDim.x)
            ((uint4*)d)[i] = ((const uint4*)s)[i];
    } else {
        for (size_t i = threadIdx.x; i < page_bytes; i += blockDim.x) d[i] = s[i];
    }
}

// One page laid out contiguously in host memory mapped into the device (a KV tier's slot: each
// segment's page in turn) into page `page` of every segment's pool, on the device and in the
// host cache (`dev`, `mirror`: their addresses, as in copy_pages): a tier's load in one pass
// over the bus. `src` is an address, not a device allocation. Grid: segments.
extern "C" __global__ void page_from_host(const unsigned long long* dev,
                                          const unsigned long long* mirror,
                                          unsigned long long src, unsigned int page,
                                          unsigned long long page_bytes) {
    const unsigned char* s = (const unsigned char*)src + (size_t)blockIdx.x * page_bytes;
    size_t at = (size_t)page * page_bytes;
    unsigned char* d = (unsigned char*)dev[blockIdx.x] + at;
    unsigned char* m = (unsigned char*)mirror[blockIdx.x] + at;
    if ((((size_t)s | (size_t)d | (size_t)m | (size_t)page_bytes) & 15) == 0) {
        for (size_t i = threadIdx.x; i < page_bytes / 16; i += blockDim.x) {
            uint4 x = ((const uint4*)s)[i];
            ((uint4*)d)[i] = x;
            ((uint4*)m)[i] = x;
        }
    } else {
        for (size_t i = threadIdx.x; i < page_bytes; i += blockDim.x) d[i] = m[i] = s[i];
    }
}
