//! Point-to-point KV-cache transfer from a prefill worker to a decode worker.
//!
//! [`frame`] is the wire format (no I/O): a handshake that carries the protocol version and the
//! model identity (so mismatched peers are refused before any KV moves), per-request `Begin`,
//! one checksummed frame per layer, and an ack once the receiver has the KV in its cache.
//! [`tcp`] is the first transport. The KV of a request travels as one buffer per layer: all keys
//! of its tokens, then all values, f16 little-endian — independent of either side's block ids.

pub mod frame;
pub mod tcp;

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The socket failed.
    #[error("KV transfer I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something out of protocol.
    #[error("KV transfer protocol: {0}")]
    Protocol(String),
    /// A frame was malformed or corrupted.
    #[error(transparent)]
    Frame(#[from] frame::FrameError),
    /// The peer refused the connection or the KV.
    #[error("KV transfer refused: {0}")]
    Refused(String),
    /// A deadline passed.
    #[error("KV transfer timed out: {0}")]
    Timeout(String),
}

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
