//! Compute kernels for tandem's forward pass.
//!
//! The CPU backend is the default everywhere: quantised matrix multiplication in GGML's block
//! formats (AVX2/FMA/F16C when the CPU has them, portable code otherwise, chosen at run time),
//! RMSNorm, RoPE, SiLU·mul and causal attention over a paged KV cache, multithreaded on the
//! crate's own spinning thread pool ([`for_each`]).
//! The model code calls them through [`Backend`], so another backend can stand beside the CPU one.

pub mod kquant;
pub mod quant;
pub use quant::DType;

#[cfg(feature = "compute")]
pub mod attention;
#[cfg(all(feature = "compute", target_arch = "x86_64"))]
mod attention_avx2;
#[cfg(feature = "compute")]
pub mod backend;
/// CUDA kernels (feature `cuda`; without it, every entry point says so).
#[cfg(feature = "cuda")]
pub mod cuda;
/// CUDA kernels (feature `cuda`; without it, every entry point says so).
#[cfg(all(feature = "compute", not(feature = "cuda")))]
#[path = "cuda_off.rs"]
pub mod cuda;
#[cfg(feature = "compute")]
mod gpu_types;
#[cfg(feature = "compute")]
pub mod matmul;
#[cfg(feature = "compute")]
pub mod mem;
#[cfg(feature = "compute")]
pub mod ops;
#[cfg(feature = "compute")]
pub mod packed;
#[cfg(all(feature = "compute", target_arch = "x86_64"))]
pub(crate) mod x86;

#[cfg(feature = "compute")]
pub use attention::{PagedKv, Query};
#[cfg(feature = "compute")]
pub use backend::{Backend, CpuBackend, Device};
#[cfg(feature = "compute")]
pub use matmul::{Backing, Matrix};

/// Which elements RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: GGUF files (llama.cpp permutes Q/K at conversion).
    Interleaved,
    /// Pairs `(x[i], x[i + d/2])`: Hugging Face checkpoints ("rotate half").
    Halves,
}

/// The activation of a gated feed-forward unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x / (1 + e^-x)` (SwiGLU: Llama, Qwen).
    Silu,
    /// GELU's tanh approximation (GeGLU: Gemma).
    GeluTanh,
}

/// Errors from kernel calls.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// Operand sizes do not fit together.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// The requested backend is not available in this build or on this machine.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
}

#[cfg(feature = "compute")]
mod pool;
#[cfg(feature = "compute")]
pub use pool::{
    avx512, for_each, for_each_chunk_mut, isa, prefetch_weights, set_threads, threads, vnni, Isa,
};
