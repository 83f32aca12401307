// Shared helpers for tandem's CUDA kernels. Header-free on purpose (NVRTC compiles these with no
// include path): bf16 and f16 conversions are written out or done with PTX `cvt`.
#pragma once

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned short bf16_t;
typedef unsigned short f16_t;

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even, NaN kept a NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

#ifdef TANDEM_CUDA_EMU
// The CPU emulator of the GPU suite (kernels/emu) has no PTX: it converts on the host.
__device__ __forceinline__ float f16_to_f32(f16_t h) { return tandem_emu::f16_to_f32(h); }
__device__ __forceinline__ f16_t f32_to_f16(float f) { return tandem_emu::f32_to_f16(f); }
#else
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    float f;
    asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ f16_t f32_to_f16(float f) {
    f16_t h;
    asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}
#endif

// Sum over a warp.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < warps) ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    return scratch[0];
}
