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
}

/// Always fails: CUDA is not compiled in.
pub fn compile_all(_arch: &'static str) -> Result<Vec<(&'static str, String)>, KernelError> {
    Err(KernelError::Unavailable(OFF.into()))
}

/// The GPU Llama forward when CUDA is not compiled in: never constructed.
pub mod llama {
    use super::{Gpu, KernelError, OFF};
    use crate::{Matrix, RopeStyle};

    /// The model's dimensions (see the CUDA build).
    #[derive(Debug, Clone, Copy)]
    pub struct LlamaShape {
        /// Hidden size.
        pub dim: usize,
        /// Transformer blocks.
        pub n_layers: usize,
        /// Query heads.
        pub n_heads: usize,
        /// KV heads.
        pub n_kv_heads: usize,
        /// Values per head.
        pub head_dim: usize,
        /// Feed-forward width.
        pub hidden: usize,
        /// Vocabulary.
        pub vocab: usize,
        /// RMSNorm epsilon.
        pub eps: f32,
        /// RoPE base.
        pub rope_base: f32,
        /// RoPE pair layout.
        pub rope_style: RopeStyle,
    }

    /// One block's weights (see the CUDA build).
    pub struct LayerRefs<'a> {
        /// RMSNorm before attention.
        pub attn_norm: &'a [f32],
        /// Query projection.
        pub wq: &'a Matrix,
        /// Key projection.
        pub wk: &'a Matrix,
        /// Value projection.
        pub wv: &'a Matrix,
        /// Output projection.
        pub wo: &'a Matrix,
        /// RMSNorm before the feed-forward block.
        pub ffn_norm: &'a [f32],
        /// SwiGLU gate.
        pub w_gate: &'a Matrix,
        /// SwiGLU up.
        pub w_up: &'a Matrix,
        /// Down projection.
        pub w_down: &'a Matrix,
    }

    /// One step's batch (see the CUDA build).
    pub struct GpuBatch<'a> {
        /// Token ids.
        pub tokens: &'a [u32],
        /// Their positions.
        pub positions: &'a [u32],
        /// Their cache slots.
        pub slots: &'a [u32],
        /// Their sequence's row in `block_tables`.
        pub seq: &'a [u32],
        /// Block tables.
        pub block_tables: &'a [u32],
        /// Entries per block table.
        pub max_blocks: usize,
    }

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
