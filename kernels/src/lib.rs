//! Compute kernels for tandem's forward pass.
//!
//! The CPU backend is the default everywhere: quantised matrix multiplication in GGML's block
//! formats (AVX2/FMA/F16C when the CPU has them, portable code otherwise, chosen at run time),
//! RMSNorm, RoPE, SiLU·mul and causal attention over a paged KV cache, multithreaded with rayon.
//! The model code calls them through [`Backend`], so another backend can stand beside the CPU one.

pub mod attention;
pub mod backend;
pub mod matmul;
pub mod ops;
pub mod quant;

pub use attention::{PagedKv, Query};
pub use backend::{Backend, CpuBackend, Device};
pub use matmul::{Backing, Matrix};
pub use ops::RopeStyle;
pub use quant::DType;

#[cfg(target_arch = "x86_64")]
pub(crate) use matmul::avx2::hsum as matmul_hsum;

use std::sync::OnceLock;

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

/// The instruction set the CPU kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
}

/// The instruction set chosen for this process: the best the CPU has, unless the environment
/// variable `TANDEM_ISA=scalar` asks for the portable kernels.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        if std::env::var("TANDEM_ISA").is_ok_and(|v| v == "scalar") {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2;
        }
        Isa::Scalar
    })
}
