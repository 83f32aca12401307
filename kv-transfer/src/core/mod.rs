//! The KV-transfer protocol as state machines that do no I/O (the quinn-proto way).
//!
//! [`Client`] (the prefill side of a connection) and [`Server`] (the decode side) take in frames
//! and the current time, and give out frames to send ([`Client::poll_transmit`]), events for
//! their owner (`poll_event`) and the next instant at which they must be woken
//! (`poll_timeout`). Nothing here touches a socket, a clock or a random source: the drivers in
//! [`crate::wire`] feed them real streams and `Instant::now()`, and the tests in `sim` feed a
//! simulated link on a virtual clock, so handshakes, refusals, stalls, corruption and deadlines
//! are checked deterministically.
//!
//! One protocol serves two kinds of transfer, fixed per connection:
//! - *inline* (TCP, QUIC): `Begin`, one checksummed `Layer` per layer carrying the bytes, `Ack`;
//! - *in place* (RDMA): `Begin`, `Grant` (the receiver's block ids), then for each layer the
//!   sender writes the bytes straight into those blocks and sends `Written` with their CRC32,
//!   which the receiver checks against its cache before admitting; `Ack`.
//!
//! A stream cannot resynchronise after a partial frame, so every deadline or protocol error
//! closes the connection and fails (client) or abandons (server) every transfer on it.

pub mod client;
pub mod server;
#[cfg(test)]
mod sim;

use std::time::Duration;

pub use client::{Client, ClientEvent};
pub use server::{Received, Server, ServerEvent};

use crate::frame::Frame;
use crate::TransferError;
use proto::ModelIdentity;

/// How long each phase of a connection may take.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// From connecting to the handshake's end (Hello, challenge, proof, verdict).
    pub handshake: Duration,
    /// From a transfer's `Begin` to its `Ack` (client) or to its last layer (server).
    pub transfer: Duration,
    /// Client: how often a transfer whose layers are not all sent yet renews the receiver's
    /// lease on its blocks (`Renew`), while the prompt waits or computes.
    pub renew: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            handshake: Duration::from_secs(5),
            transfer: Duration::from_secs(30),
            renew: Duration::from_secs(1),
        }
    }
}

const PROOF_CONTEXT: &[u8] = b"tandem-kv-v1";

/// What the HMAC of the handshake covers: a context string, the server's nonce and the
/// client's Hello, so a proof cannot be replayed for another nonce or another KV layout.
fn proof_message(nonce: &[u8; 16], identity: &ModelIdentity) -> Vec<u8> {
    let mut m = PROOF_CONTEXT.to_vec();
    m.extend(nonce);
    m.extend(
        Frame::Hello {
            version: proto::PROTOCOL_VERSION,
            identity: identity.clone(),
        }
        .encode(),
    );
    m
}

fn prove(secret: &[u8], nonce: &[u8; 16], identity: &ModelIdentity) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    ring::hmac::sign(&key, &proof_message(nonce, identity))
        .as_ref()
        .to_vec()
}

fn verify(secret: &[u8], nonce: &[u8; 16], identity: &ModelIdentity, tag: &[u8]) -> bool {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    ring::hmac::verify(&key, &proof_message(nonce, identity), tag).is_ok()
}

/// Bytes of layer `layer` of a transfer of `n_tokens` tokens in the wire layout (keys then
/// values, f16): a layer with an attention window carries the tokens a query after the last
/// one sees, its window less one.
pub fn layer_bytes(identity: &ModelIdentity, layer: usize, n_tokens: u32) -> u64 {
    let tokens = match identity.windows.get(layer) {
        Some(&w) if w > 0 => n_tokens.min(w - 1),
        _ => n_tokens,
    };
    4 * tokens as u64 * identity.n_kv_heads as u64 * identity.head_dim as u64
}

/// [`layer_bytes`] of every layer.
fn layer_sizes(identity: &ModelIdentity, n_tokens: u32) -> Vec<u64> {
    (0..identity.n_layers as usize)
        .map(|l| layer_bytes(identity, l, n_tokens))
        .collect()
}

/// The same error again, for each of the transfers a connection failure ends.
fn again(e: &TransferError) -> TransferError {
    match e {
        TransferError::Io(io) => TransferError::Io(std::io::Error::new(io.kind(), io.to_string())),
        TransferError::Protocol(m) => TransferError::Protocol(m.clone()),
        TransferError::Frame(f) => TransferError::Frame(f.clone()),
        TransferError::Refused(m) => TransferError::Refused(m.clone()),
        TransferError::Timeout(m) => TransferError::Timeout(m.clone()),
    }
}
