//! The CUDA backend when tandem is built without the `cuda` feature: the same entry points,
//! each answering that CUDA is not compiled in, so `cfg` stays in `lib.rs`.

use crate::KernelError;

const OFF: &str = "tandem was built without CUDA (cargo feature `cuda`)";

/// Never constructed in this build.
pub enum Gpu {}

impl Gpu {
    /// Always fails: CUDA is not compiled in.
    pub fn new(_ordinal: usize) -> Result<Gpu, KernelError> {
        Err(KernelError::Unavailable(OFF.into()))
    }
}

/// Always fails: CUDA is not compiled in.
pub fn compile_all(_arch: &'static str) -> Result<Vec<(&'static str, String)>, KernelError> {
    Err(KernelError::Unavailable(OFF.into()))
}
