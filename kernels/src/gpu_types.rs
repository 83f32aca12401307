//! The plain descriptions the GPU forward takes, shared by the CUDA build and the build without
//! it (whose `GpuLlama` cannot be constructed), so neither spells them out twice.

use crate::{Matrix, RopeStyle};

/// The model's dimensions.
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

/// One block's weights, borrowed from the host model.
pub struct LayerRefs<'a> {
    /// RMSNorm before attention.
    pub attn_norm: &'a [f32],
    /// Projections.
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

/// One step's batch: every token with its position and cache slot, and for each token its
/// sequence's row in `block_tables` (`[n_seqs, max_blocks]`).
pub struct GpuBatch<'a> {
    /// Token ids.
    pub tokens: &'a [u32],
    /// Their positions.
    pub positions: &'a [u32],
    /// Their cache slots (block × block_size + offset).
    pub slots: &'a [u32],
    /// Their sequence's index into `block_tables`.
    pub seq: &'a [u32],
    /// Block tables, `max_blocks` entries a sequence.
    pub block_tables: &'a [u32],
    /// Entries per block table.
    pub max_blocks: usize,
    /// The tokens (indices into `tokens`) whose logits the step returns, in this order: the
    /// last token of each sequence that samples one (the LM head runs on these rows alone).
    pub logit_rows: &'a [u32],
}
