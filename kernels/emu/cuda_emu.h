// The CUDA emulator's view from inside a kernel: what `kernels/cuda/*.cu` use of CUDA C++
// (thread and block indices, __shared__, __syncthreads, warp shuffles, device math), mapped
// onto the emulator's fibers (`driver.cpp`). A test double for the GPU suite on machines without
// a GPU; it says nothing about speed, and a real GPU run stays the proof (scripts/gpu-check.sh).
//
// Every CUDA thread of a block is a fiber on one host thread; a block's __shared__ variables are
// that host thread's (`static thread_local`), so blocks can run on several host threads at once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem_emu {

/// CUDA's dim3.
struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

/// What every thread of the running block shares.
struct BlockInfo {
    dim3 block_idx, block_dim, grid_dim;
};

/// The running block (per host thread) and the running fiber's thread index.
extern thread_local const BlockInfo* current_block;
extern thread_local const dim3* current_thread;

/// Block-wide barrier: every live thread of the block must reach it (exited threads do not
/// count, as on Volta and later).
void syncthreads();
/// One warp shuffle round: this lane's bits in, lane `lane ^ lane_mask`'s bits out; aborts when
/// `mask` names a lane that is not live (undefined behaviour on a GPU).
std::uint64_t shfl_xor(unsigned int mask, std::uint64_t bits, int lane_mask);
/// The block's dynamic shared memory (`extern __shared__`), filled with 0xff at block start so
/// reads before writes show up as NaN.
void* dynamic_smem();

inline float f16_to_f32(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

inline unsigned short f32_to_f16(float f) {
    _Float16 v = (_Float16)f;  // round to nearest even, as cvt.rn.f16.f32
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}

template <class T>
T shfl(unsigned int mask, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 64 bits");
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = shfl_xor(mask, bits, lane_mask);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

}  // namespace tandem_emu

#define threadIdx (*tandem_emu::current_thread)
#define blockIdx (tandem_emu::current_block->block_idx)
#define blockDim (tandem_emu::current_block->block_dim)
#define gridDim (tandem_emu::current_block->grid_dim)
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local
#define __syncthreads() tandem_emu::syncthreads()

template <class T>
inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask) {
    return tandem_emu::shfl(mask, v, lane_mask);
}

inline float __expf(float x) { return expf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
using std::max;
using std::min;

/// CUDA's 16-byte vector (the kernels move bytes in them).
struct uint4 {
    unsigned int x, y, z, w;
};
