//! Point-to-point KV-cache transfer from a prefill worker to a decode worker.
//!
//! [`frame`] is the wire format (no I/O): a handshake that carries the protocol version and the
//! model identity (so mismatched peers are refused before any KV moves), per-request `Begin`,
//! one checksummed frame per layer, and an ack once the receiver has the KV in its cache.
//! [`wire`] runs that protocol over any byte stream; [`tcp`] and [`quic`] are the transports,
//! [`negotiate`] picks one per peer. The KV of a request travels as one buffer per layer: all
//! keys of its tokens, then all values, f16 little-endian — independent of either side's block
//! ids.

pub mod core;
pub mod frame;
pub mod negotiate;
pub mod quic;
/// One-sided RDMA WRITE transfers (feature `rdma`; without it, every call says so).
#[cfg(feature = "rdma")]
pub mod rdma;
/// One-sided RDMA WRITE transfers (feature `rdma`; without it, every call says so).
#[cfg(not(feature = "rdma"))]
#[path = "rdma_off.rs"]
pub mod rdma;
pub mod stream;
pub mod tcp;
pub mod tickets;
pub mod wire;

use std::time::Duration;

use types::RequestId;

pub use core::Timeouts;
pub use negotiate::Offer;
pub use tickets::Tickets;
pub use types::TransferTicket;
pub use wire::{IncomingKv, KvEvent, Layer, Layers, Local};

/// A way to move KV between workers (the config's names: `rdma`, `quic`, `tcp`).
pub use proto::config::Transport;

/// Whose certificates a KV listener takes under mutual TLS: prefill workers sending a prompt's
/// KV, decode workers handing a running sequence off (a live move). Either sends only under a
/// reservation's ticket, which the router gives the one sender it picked.
pub const KV_SENDERS: [pki::Role; 2] = [pki::Role::Prefill, pki::Role::Decode];

/// What one transfer cost.
#[derive(Debug, Clone, Copy)]
pub struct TransferStats {
    /// Payload bytes sent.
    pub bytes: u64,
    /// From the first byte written to the receiver's ack.
    pub elapsed: Duration,
    /// How it travelled.
    pub transport: Transport,
}

/// A connection to one decode worker over the negotiated transport (enum dispatch).
pub enum KvSender {
    /// TCP.
    Tcp(tcp::TcpKvSender),
    /// QUIC.
    Quic(quic::QuicKvSender),
    /// RDMA (one-sided writes; a TCP side channel carries the protocol).
    Rdma(rdma::RdmaKvSender),
}

impl KvSender {
    /// Connects over the transport of `offer`.
    pub async fn connect(
        offer: &Offer,
        local: &wire::Local,
        timeout: Duration,
    ) -> Result<KvSender, TransferError> {
        match offer.transport {
            Transport::Tcp => Ok(KvSender::Tcp(
                tcp::TcpKvSender::connect(&offer.endpoint, local, timeout).await?,
            )),
            Transport::Quic => Ok(KvSender::Quic(
                quic::QuicKvSender::connect(&offer.endpoint, &offer.cert_der, local, timeout)
                    .await?,
            )),
            Transport::Rdma => Ok(KvSender::Rdma(
                rdma::RdmaKvSender::connect(&offer.endpoint, local, timeout).await?,
            )),
        }
    }

    /// Whether the connection can carry another transfer (a failed one closes it).
    pub fn is_open(&self) -> bool {
        match self {
            KvSender::Tcp(s) => s.is_open(),
            KvSender::Quic(_) | KvSender::Rdma(_) => true,
        }
    }

    /// Sends one request's KV and waits for the receiver's ack, within `timeout`.
    pub async fn send(
        &mut self,
        (request_id, ticket): (RequestId, TransferTicket),
        n_tokens: u32,
        width: u32,
        layers: crate::wire::Layers<'_>,
        timeout: Duration,
    ) -> Result<TransferStats, TransferError> {
        match self {
            KvSender::Tcp(s) => {
                s.send((request_id.0, ticket), n_tokens, width, layers, timeout)
                    .await
            }
            KvSender::Quic(s) => {
                s.send((request_id.0, ticket), n_tokens, width, layers, timeout)
                    .await
            }
            KvSender::Rdma(s) => {
                s.send((request_id.0, ticket), n_tokens, width, layers, timeout)
                    .await
            }
        }
    }
}

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

pub use types::KvRegions;

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
