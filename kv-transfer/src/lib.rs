//! Point-to-point KV-cache transfer from a prefill worker to a decode worker.
//!
//! This crate will hold the transfer protocol (without I/O) and its transports: TCP, QUIC and
//! RDMA, negotiated per peer (issues 3 and 4). Today it holds the one fact both ends already
//! share: how big a block of KV is on the wire.

/// The shape of one KV block as both ends store it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    /// Token slots per block.
    pub block_size: usize,
    /// Transformer layers.
    pub n_layers: usize,
    /// KV heads per layer.
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Bytes per stored value (2 for f16).
    pub elem_bytes: usize,
}

impl BlockLayout {
    /// Bytes of keys plus values of one block in one layer.
    pub fn bytes_per_layer(&self) -> usize {
        2 * self.block_size * self.n_kv_heads * self.head_dim * self.elem_bytes
    }
    /// Bytes of one block across all layers.
    pub fn bytes_per_block(&self) -> usize {
        self.n_layers * self.bytes_per_layer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_block_is_360_kib() {
        let l = BlockLayout {
            block_size: 16,
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
            elem_bytes: 2,
        };
        assert_eq!(l.bytes_per_layer(), 12288);
        assert_eq!(l.bytes_per_block(), 368640);
    }
}
