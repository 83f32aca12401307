//! The CUDA backend when tandem is built without the `cuda` feature: the same entry points,
//! each answering that CUDA is not compiled in, so `cfg` stays in `lib.rs`.

use crate::KernelError;

const OFF: &str = "tandem was built without CUDA (cargo feature `cuda`)";

/// Never constructed in this build.
#[derive(Debug)]
pub enum Gpu {}

impl Gpu {
    /// Always fails: CUDA is not compiled in.
    pub fn new(_ordinal: usize) -> Result<Gpu, KernelError> {
        Err(KernelError::Unavailable(OFF.into()))
    }

    /// Unreachable: no GPU exists.
    ///
    /// # Safety
    ///
    /// None needed: it cannot be called.
    pub unsafe fn map_host(
        self: &std::sync::Arc<Self>,
        _at: usize,
        _len: usize,
    ) -> Result<HostMapping, KernelError> {
        match **self {}
    }
}

/// Never constructed in this build.
pub enum HostMapping {}

impl HostMapping {
    /// Unreachable: no mapping exists.
    pub fn device_addr(&self) -> u64 {
        match *self {}
    }
}

/// Always fails: CUDA is not compiled in.
pub fn compile_all(_arch: &'static str) -> Result<Vec<(&'static str, String)>, KernelError> {
    Err(KernelError::Unavailable(OFF.into()))
}

/// The GPU Llama forward when CUDA is not compiled in: never constructed.
pub mod llama {
    use super::{Gpu, KernelError, OFF};
    pub use crate::gpu_types::{GpuBatch, LayerRefs, LlamaShape};
    use crate::Matrix;

    /// Never constructed in this build.
    pub enum GpuLlama {}

    impl GpuLlama {
        /// Always fails: CUDA is not compiled in.
        #[allow(clippy::too_many_arguments)]
        pub fn new(
            _: std::sync::Arc<Gpu>,
            _: LlamaShape,
            _: &Matrix,
            _: &[LayerRefs<'_>],
            _: &[f32],
            _: &Matrix,
            _: usize,
            _: usize,
        ) -> Result<GpuLlama, KernelError> {
            Err(KernelError::Unavailable(OFF.into()))
        }

        /// Unreachable: no model exists.
        pub fn forward_streaming(
            &mut self,
            _: &GpuBatch<'_>,
            _: Option<&mut dyn FnMut(usize, &[f32], &[f32])>,
        ) -> Result<Vec<f32>, KernelError> {
            match *self {}
        }

        /// Unreachable: no model exists.
        ///
        /// # Safety
        ///
        /// None needed: it cannot be called.
        pub unsafe fn map_host_kv(
            &mut self,
            _: &[[(usize, usize); 2]],
            _: Vec<std::sync::Arc<dyn Send + Sync>>,
        ) -> Result<(), KernelError> {
            match *self {}
        }

        /// Unreachable: no model exists.
        ///
        /// # Safety
        ///
        /// None needed: it cannot be called.
        pub unsafe fn page_from_host(&mut self, _: u64, _: u32) -> Result<(), KernelError> {
            match *self {}
        }

        /// Unreachable: no model exists.
        pub fn sync(&self) -> Result<(), KernelError> {
            match *self {}
        }

        /// Unreachable: no model exists.
        pub fn pages_to_host(&mut self, _: &[u32]) -> Result<(), KernelError> {
            match *self {}
        }

        /// Unreachable: no model exists.
        pub fn pages_to_device(&mut self, _: &[u32]) -> Result<(), KernelError> {
            match *self {}
        }

        /// Unreachable: no model exists.
        pub fn upload_kv(
            &mut self,
            _: usize,
            _: &[u32],
            _: &[u16],
            _: usize,
        ) -> Result<(), KernelError> {
            match *self {}
        }
    }
}
