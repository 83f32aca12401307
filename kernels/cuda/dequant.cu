// GGUF block formats to bf16, once at load. Blocks of 32 weights, GGML's layouts:
//   Q4_0: f16 d, 16 bytes of 4-bit q (low nibbles are weights 0..15, high 16..31); w = (q - 8) d
//   Q4_1: f16 d, f16 m, 16 bytes of 4-bit q;                                       w = q d + m
//   Q8_0: f16 d, 32 int8 q;                                                        w = q d
// One thread per block of 32; `n_blocks` blocks in row-major order.
#include "common.cuh"

extern "C" __global__ void dequant_q4_0(const unsigned char* src, bf16_t* dst,
                                        unsigned long long n_blocks) {
    unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    const unsigned char* blk = src + b * 18;
    float d = f16_to_f32((f16_t)(blk[0] | (blk[1] << 8)));
    bf16_t* o = dst + b * 32;
    for (int j = 0; j < 16; j++) {
        unsigned char q = blk[2 + j];
        o[j] = f32_to_bf16(((int)(q & 0xf) - 8) * d);
        o[j + 16] = f32_to_bf16(((int)(q >> 4) - 8) * d);
    }
}

extern "C" __global__ void dequant_q4_1(const unsigned char* src, bf16_t* dst,
                                        unsigned long long n_blocks) {
    unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    const unsigned char* blk = src + b * 20;
    float d = f16_to_f32((f16_t)(blk[0] | (blk[1] << 8)));
    float m = f16_to_f32((f16_t)(blk[2] | (blk[3] << 8)));
    bf16_t* o = dst + b * 32;
    for (int j = 0; j < 16; j++) {
        unsigned char q = blk[4 + j];
        o[j] = f32_to_bf16((float)(q & 0xf) * d + m);
        o[j + 16] = f32_to_bf16((float)(q >> 4) * d + m);
    }
}

extern "C" __global__ void dequant_q8_0(const unsigned char* src, bf16_t* dst,
                                        unsigned long long n_blocks) {
    unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    const unsigned char* blk = src + b * 34;
    float d = f16_to_f32((f16_t)(blk[0] | (blk[1] << 8)));
    bf16_t* o = dst + b * 32;
    for (int j = 0; j < 32; j++) o[j] = f32_to_bf16((float)(signed char)blk[2 + j] * d);
}
