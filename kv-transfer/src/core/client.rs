//! The sending (prefill) side of a KV connection, as a state machine.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use proto::ModelIdentity;

use super::{again, layer_sizes, prove, Timeouts};
use crate::frame::Frame;
use crate::TransferError;

/// What the owner of a [`Client`] learns.
#[derive(Debug)]
pub enum ClientEvent {
    /// The handshake succeeded; transfers may begin.
    Connected,
    /// In-place transfers: the receiver's blocks for the request, to write into.
    Granted {
        /// The request.
        request_id: u64,
        /// Block ids in the receiver's pool, in token order.
        blocks: Vec<u32>,
        /// The transport's access to those blocks (see [`Frame::Grant`]).
        access: Vec<u8>,
    },
    /// The receiver has the request's KV in its cache.
    Delivered {
        /// The request.
        request_id: u64,
        /// Payload bytes moved.
        bytes: u64,
    },
    /// The transfer failed; the receiver does not hold the KV.
    Failed {
        /// The request.
        request_id: u64,
        /// Why.
        error: TransferError,
    },
    /// The connection is finished (after `Failed` for each transfer still on it).
    Closed(TransferError),
}

enum State {
    Handshake { deadline: Instant, proved: bool },
    Open,
    Closed,
}

struct Outgoing {
    n_layers: u32,
    /// Each layer's bytes.
    layer_bytes: Vec<u64>,
    blocks: usize,
    next: u32,
    granted: bool,
    bytes: u64,
    deadline: Instant,
    /// When to tell the receiver again that this transfer is alive (while layers remain).
    renew_at: Instant,
}

impl Outgoing {
    /// Whether layers remain to be sent (the receiver's lease on its blocks must be kept).
    fn sending(&self) -> bool {
        self.next < self.n_layers
    }
}

/// The client end of one connection: it proves membership if asked, then sends transfers.
pub struct Client {
    identity: ModelIdentity,
    secret: Option<Arc<Vec<u8>>>,
    timeouts: Timeouts,
    in_place: bool,
    state: State,
    out: VecDeque<Frame>,
    transfers: BTreeMap<u64, Outgoing>,
    events: VecDeque<ClientEvent>,
}

impl Client {
    /// A connection just opened at `now`; its `Hello` is the first frame to transmit.
    /// `in_place` selects RDMA-style transfers (`Grant`/`Written`) instead of inline `Layer`s.
    pub fn new(
        local: &crate::wire::Local,
        timeouts: Timeouts,
        in_place: bool,
        now: Instant,
    ) -> Client {
        let mut out = VecDeque::new();
        out.push_back(Frame::Hello {
            version: proto::PROTOCOL_VERSION,
            identity: local.identity.clone(),
        });
        Client {
            identity: local.identity.clone(),
            secret: local.secret.clone(),
            timeouts,
            in_place,
            state: State::Handshake {
                deadline: now + timeouts.handshake,
                proved: false,
            },
            out,
            transfers: BTreeMap::new(),
            events: VecDeque::new(),
        }
    }

    /// Sets the deadline of transfers begun from now on (their `Begin` to their `Ack`).
    pub fn set_transfer_timeout(&mut self, timeout: std::time::Duration) {
        self.timeouts.transfer = timeout;
    }

    /// Whether transfers may begin.
    pub fn is_open(&self) -> bool {
        matches!(self.state, State::Open)
    }

    /// Whether the connection is finished.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed)
    }

    /// Starts sending the KV of `n_tokens` tokens of `request_id` under the receiver's
    /// `ticket` for it, due by `now` plus the transfer timeout.
    pub fn begin(
        &mut self,
        now: Instant,
        (request_id, ticket): (u64, types::TransferTicket),
        n_tokens: u32,
        width: u32,
    ) -> Result<(), TransferError> {
        if !self.is_open() {
            return Err(TransferError::Protocol(
                "the connection is not open for transfers".into(),
            ));
        }
        let own = self.identity.n_kv_heads * self.identity.head_dim;
        if width != own || n_tokens == 0 {
            return Err(TransferError::Protocol(format!(
                "request {request_id}: {n_tokens} tokens of width {width} (this layout: {own})"
            )));
        }
        if self.transfers.contains_key(&request_id) {
            return Err(TransferError::Protocol(format!(
                "request {request_id} is already being sent on this connection"
            )));
        }
        self.transfers.insert(
            request_id,
            Outgoing {
                n_layers: self.identity.n_layers,
                layer_bytes: layer_sizes(&self.identity, n_tokens),
                blocks: (n_tokens as usize).div_ceil(self.identity.block_size.max(1) as usize),
                next: 0,
                granted: false,
                bytes: 0,
                deadline: now + self.timeouts.transfer,
                renew_at: now + self.timeouts.renew,
            },
        );
        self.out.push_back(Frame::Begin {
            request_id,
            ticket,
            n_tokens,
            n_layers: self.identity.n_layers,
            width,
        });
        Ok(())
    }

    fn next_layer(
        &mut self,
        request_id: u64,
        layer: u32,
        len: u64,
        in_place: bool,
    ) -> Result<(), TransferError> {
        if self.in_place != in_place {
            return Err(TransferError::Protocol(format!(
                "this connection carries {} transfers",
                if self.in_place { "in-place" } else { "inline" }
            )));
        }
        let t = self.transfers.get_mut(&request_id).ok_or_else(|| {
            TransferError::Protocol(format!("request {request_id} is not being sent"))
        })?;
        if in_place && !t.granted {
            return Err(TransferError::Protocol(format!(
                "request {request_id}: no blocks granted yet"
            )));
        }
        let want = t.layer_bytes.get(t.next as usize).copied().unwrap_or(0);
        if layer != t.next || layer >= t.n_layers || len != want {
            return Err(TransferError::Protocol(format!(
                "request {request_id}: layer {layer} of {len} bytes, expected layer {} of {want}",
                t.next
            )));
        }
        t.next += 1;
        t.bytes += len;
        Ok(())
    }

    /// Inline transfers: records that `layer` (of `len` bytes) is written next. The caller
    /// writes the `Layer` frame itself (its bytes do not pass through here) only on `Ok`.
    pub fn layer(&mut self, request_id: u64, layer: u32, len: u64) -> Result<(), TransferError> {
        self.next_layer(request_id, layer, len, false)
    }

    /// In-place transfers: `layer` has been written into the granted blocks (its writes are
    /// complete); queues `Written` with the CRC32 of its bytes in the wire layout.
    pub fn written(&mut self, request_id: u64, layer: u32, crc: u32) -> Result<(), TransferError> {
        let len = self.transfers.get(&request_id).map_or(0, |t| {
            t.layer_bytes.get(layer as usize).copied().unwrap_or(0)
        });
        self.next_layer(request_id, layer, len, true)?;
        self.out.push_back(Frame::Written {
            request_id,
            layer,
            crc,
        });
        Ok(())
    }

    /// Takes in a frame from the peer.
    pub fn handle(&mut self, _now: Instant, frame: Frame) {
        match (&mut self.state, frame) {
            (State::Closed, _) => {}
            (State::Handshake { proved, .. }, Frame::Challenge(nonce)) if !*proved => {
                match &self.secret {
                    Some(secret) => {
                        let tag = prove(secret, &nonce, &self.identity);
                        self.out.push_back(Frame::Proof(tag));
                        *proved = true;
                    }
                    None => self.close(TransferError::Refused(
                        "the peer requires the cluster secret and none is configured here".into(),
                    )),
                }
            }
            (State::Handshake { .. }, Frame::HelloOk) => {
                self.state = State::Open;
                self.events.push_back(ClientEvent::Connected);
            }
            (_, Frame::Refuse(why)) => self.close(TransferError::Refused(why)),
            (
                State::Open,
                Frame::Grant {
                    request_id,
                    blocks,
                    access,
                },
            ) => match self.transfers.get_mut(&request_id) {
                Some(t) if self.in_place && !t.granted && blocks.len() == t.blocks => {
                    t.granted = true;
                    self.events.push_back(ClientEvent::Granted {
                        request_id,
                        blocks,
                        access,
                    });
                }
                _ => self.close(TransferError::Protocol(format!(
                    "unexpected grant of {} blocks for request {request_id}",
                    blocks.len()
                ))),
            },
            (
                State::Open,
                Frame::Ack {
                    request_id,
                    ok,
                    message,
                },
            ) => match self.transfers.get(&request_id) {
                Some(t) if t.next == t.n_layers => {
                    let bytes = t.bytes;
                    self.transfers.remove(&request_id);
                    self.events.push_back(if ok {
                        ClientEvent::Delivered { request_id, bytes }
                    } else {
                        ClientEvent::Failed {
                            request_id,
                            error: TransferError::Refused(message),
                        }
                    });
                }
                _ => self.close(TransferError::Protocol(format!(
                    "ack for request {request_id}, which is not complete on this connection"
                ))),
            },
            (_, other) => {
                let what = other.name();
                self.close(TransferError::Protocol(format!(
                    "unexpected {what} from the receiver"
                )))
            }
        }
    }

    /// The transport failed or the peer closed the connection.
    pub fn handle_error(&mut self, error: TransferError) {
        self.close(error);
    }

    /// Fires the deadlines that have passed by `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        match &self.state {
            State::Handshake { deadline, .. } if *deadline <= now => {
                self.close(TransferError::Timeout(format!(
                    "no handshake within {:?}",
                    self.timeouts.handshake
                )))
            }
            State::Open => {
                if let Some((&id, _)) = self.transfers.iter().find(|(_, t)| t.deadline <= now) {
                    return self.close(TransferError::Timeout(format!(
                        "the KV of request {id} was not acknowledged within {:?}",
                        self.timeouts.transfer
                    )));
                }
                let renew = self.timeouts.renew;
                for (&request_id, t) in &mut self.transfers {
                    if t.sending() && t.renew_at <= now {
                        self.out.push_back(Frame::Renew { request_id });
                        t.renew_at = now + renew;
                    }
                }
            }
            _ => {}
        }
    }

    /// When [`Client::handle_timeout`] must next be called: a deadline, or a transfer's
    /// renewal.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let renew = self.transfers.values().filter(|t| t.sending());
        let renew = renew.map(|t| t.renew_at).min();
        match (self.poll_deadline(), renew) {
            (Some(d), Some(r)) if self.is_open() => Some(d.min(r)),
            (d, _) => d,
        }
    }

    /// The next deadline alone (reads wait for no renewal: a read cut short loses the
    /// stream's framing).
    pub fn poll_deadline(&self) -> Option<Instant> {
        match &self.state {
            State::Handshake { deadline, .. } => Some(*deadline),
            State::Open => self.transfers.values().map(|t| t.deadline).min(),
            State::Closed => None,
        }
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.out.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    fn close(&mut self, error: TransferError) {
        if self.is_closed() {
            return;
        }
        self.state = State::Closed;
        for (request_id, _) in std::mem::take(&mut self.transfers) {
            self.events.push_back(ClientEvent::Failed {
                request_id,
                error: again(&error),
            });
        }
        self.events.push_back(ClientEvent::Closed(error));
    }
}
