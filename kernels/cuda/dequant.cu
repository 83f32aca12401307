// GGUF block formats to bf16, once at load. Blocks of 32 weights, GGML's layouts:
//   Q4_0: f16 d, 16 bytes of 4-bit q (low nibbles are weights 0..15, high 16..31); w = (q - 8) d
//   Q4_1: f16 d, f16 m, 16 bytes of 4-bit q;                                       w = q d + m
//   Q8_0: f16 d, 32 int8 q;                                                        w = q d
// and the K-quants' super-blocks of 256 (see kernels/src/kquant.rs for the CPU reading):
//   Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and minimums, 128 bytes of 4-bit
//         q (sub-blocks 2k and 2k+1 the low and high nibbles of bytes 32k..32k+32);
//         w = (d sc) q - (dmin m)
//   Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 values),
//         f16 d;                                                     w = (d sc) (q - 32)
// One thread per block; `n_blocks` blocks in row-major order.
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

// The 6-bit scale and minimum of sub-block j (0..8) of a Q4_K super-block's 12 scale bytes.
__device__ __forceinline__ void scale_min_k4(int j, const unsigned char* s, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

extern "C" __global__ void dequant_q4_k(const unsigned char* src, bf16_t* dst,
                                        unsigned long long n_blocks) {
    unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    const unsigned char* blk = src + b * 144;
    float d = f16_to_f32((f16_t)(blk[0] | (blk[1] << 8)));
    float dmin = f16_to_f32((f16_t)(blk[2] | (blk[3] << 8)));
    const unsigned char* qs = blk + 16;
    bf16_t* o = dst + b * 256;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, blk + 4, &sc, &m);
        float dj = d * (float)sc, mj = dmin * (float)m;
        const unsigned char* q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int nib = (j % 2 == 0) ? (q[l] & 0x0f) : (q[l] >> 4);
            o[32 * j + l] = f32_to_bf16(dj * (float)nib - mj);
        }
    }
}

extern "C" __global__ void dequant_q6_k(const unsigned char* src, bf16_t* dst,
                                        unsigned long long n_blocks) {
    unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_blocks) return;
    const unsigned char* blk = src + b * 210;
    const unsigned char *ql = blk, *qh = blk + 128;
    const signed char* sc = (const signed char*)(blk + 192);
    float d = f16_to_f32((f16_t)(blk[208] | (blk[209] << 8)));
    bf16_t* o = dst + b * 256;
    for (int n = 0; n < 2; n++) {
        const unsigned char *l4 = ql + 64 * n, *h2 = qh + 32 * n;
        bf16_t* y = o + 128 * n;
        for (int l = 0; l < 32; l++) {
            int q[4] = {(l4[l] & 0x0f) | (((h2[l] >> 0) & 3) << 4),
                        (l4[l + 32] & 0x0f) | (((h2[l] >> 2) & 3) << 4),
                        (l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4),
                        (l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)};
            for (int k = 0; k < 4; k++) {
                int i = 128 * n + 32 * k + l;  // the value's index in the super-block
                float s = d * (float)sc[i / 16];
                y[32 * k + l] = f32_to_bf16(s * (float)(q[k] - 32));
            }
        }
    }
}
