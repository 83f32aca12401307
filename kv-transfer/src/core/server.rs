//! The receiving (decode) side of a KV connection, as a state machine.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use proto::ModelIdentity;

use super::{again, layer_sizes, verify, Timeouts};
use crate::frame::Frame;
use crate::TransferError;

/// A transfer's KV as it reached the receiver.
#[derive(Debug)]
pub enum Received {
    /// Inline: one buffer per layer (keys then values), each checksummed in its frame.
    Inline(Vec<Vec<u8>>),
    /// In place: the bytes are in the granted blocks; one CRC32 per layer to check them by.
    InPlace(Vec<u32>),
}

/// What the owner of a [`Server`] learns.
#[derive(Debug)]
pub enum ServerEvent {
    /// The peer passed the handshake.
    Accepted {
        /// Its KV layout.
        peer: ModelIdentity,
    },
    /// A transfer began: the request's KV is now in flight.
    Begun {
        /// The request.
        request_id: u64,
        /// Tokens it covers.
        n_tokens: u32,
    },
    /// The sender renewed a transfer: it is alive and still computing or sending (the owner
    /// extends the lease on the blocks it reserved for the request).
    Renewed {
        /// The request.
        request_id: u64,
    },
    /// In-place transfers: the owner must answer [`Server::grant`] with the request's blocks.
    GrantNeeded {
        /// The request.
        request_id: u64,
        /// Tokens it covers.
        n_tokens: u32,
    },
    /// Every layer is here; the owner must answer [`Server::verdict`].
    Received {
        /// The request.
        request_id: u64,
        /// Tokens covered.
        n_tokens: u32,
        /// The KV.
        kv: Received,
    },
    /// A transfer ended incomplete (deadline, protocol error, lost connection); whatever was
    /// reserved for it must be freed.
    Abandoned {
        /// The request.
        request_id: u64,
        /// Why.
        error: TransferError,
    },
    /// The connection is finished (after `Abandoned` for each incomplete transfer).
    Closed(TransferError),
}

enum State {
    AwaitHello {
        deadline: Instant,
    },
    AwaitProof {
        deadline: Instant,
        theirs: ModelIdentity,
    },
    Open,
    Closed,
}

struct Incoming {
    n_tokens: u32,
    n_layers: u32,
    /// Each layer's bytes.
    layer_bytes: Vec<u64>,
    layers: Vec<Vec<u8>>,
    crcs: Vec<u32>,
    granted: bool,
    complete: bool,
    deadline: Instant,
    /// When its owner was last told it lives (`Begun` or `Renewed`).
    renewed: Instant,
}

impl Incoming {
    fn arrived(&self) -> usize {
        self.layers.len().max(self.crcs.len())
    }
}

/// Transfers one connection may have begun and not finished (a sender has one per request it
/// is sending; the prefill worker's connection pool opens more connections beyond this).
pub const MAX_OPEN_TRANSFERS: usize = 64;

/// The server end of one connection: it checks the peer, then receives transfers.
pub struct Server {
    identity: ModelIdentity,
    max_kv_tokens: u32,
    tickets: Option<crate::Tickets>,
    secret: Option<Arc<Vec<u8>>>,
    timeouts: Timeouts,
    in_place: bool,
    nonce: [u8; 16],
    state: State,
    out: VecDeque<Frame>,
    transfers: BTreeMap<u64, Incoming>,
    events: VecDeque<ServerEvent>,
}

impl Server {
    /// A connection accepted at `now`. `nonce` (fresh randomness from the caller) is the
    /// challenge when the cluster has a secret.
    pub fn new(
        local: &crate::wire::Local,
        timeouts: Timeouts,
        in_place: bool,
        nonce: [u8; 16],
        now: Instant,
    ) -> Server {
        Server {
            identity: local.identity.clone(),
            max_kv_tokens: local.max_kv_tokens,
            tickets: local.tickets.clone(),
            secret: local.secret.clone(),
            timeouts,
            in_place,
            nonce,
            state: State::AwaitHello {
                deadline: now + timeouts.handshake,
            },
            out: VecDeque::new(),
            transfers: BTreeMap::new(),
            events: VecDeque::new(),
        }
    }

    /// Whether the peer passed the handshake.
    pub fn is_open(&self) -> bool {
        matches!(self.state, State::Open)
    }

    /// The largest frame the next read may carry: before the handshake is done and while no
    /// transfer waits for a layer, a control frame's; else the biggest next layer that a begun
    /// transfer expects (plus its 12-byte head) — so a peer makes the reader allocate no more
    /// than the transfers it began, each within [`wire::Local::max_kv_tokens`](crate::wire::Local).
    pub fn frame_limit(&self) -> u32 {
        let layer = self
            .transfers
            .values()
            .filter_map(|t| t.layer_bytes.get(t.arrived()))
            .max()
            .map_or(0, |b| b + 12);
        layer
            .min(u64::from(crate::frame::MAX_FRAME))
            .max(u64::from(crate::wire::MAX_CONTROL_FRAME)) as u32
    }

    /// Whether the connection is finished.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed)
    }

    fn refuse(&mut self, why: String) {
        self.out.push_back(Frame::Refuse(why.clone()));
        self.close(TransferError::Refused(why));
    }

    fn check_hello(&self, version: u32, theirs: &ModelIdentity) -> Option<String> {
        if version != proto::PROTOCOL_VERSION {
            return Some(format!(
                "protocol version {version}, this worker speaks {}",
                proto::PROTOCOL_VERSION
            ));
        }
        self.identity
            .incompatibility(theirs)
            .map(|d| format!("incompatible KV layout: {d}"))
    }

    fn accept(&mut self, peer: ModelIdentity) {
        self.out.push_back(Frame::HelloOk);
        self.state = State::Open;
        self.events.push_back(ServerEvent::Accepted { peer });
    }

    /// Takes in a frame from the peer.
    pub fn handle(&mut self, now: Instant, frame: Frame) {
        match (&self.state, frame) {
            (State::Closed, _) => {}
            (
                State::AwaitHello { deadline },
                Frame::Hello {
                    version,
                    identity: theirs,
                },
            ) => {
                let deadline = *deadline;
                if let Some(why) = self.check_hello(version, &theirs) {
                    self.refuse(why);
                } else if self.secret.is_some() {
                    self.out.push_back(Frame::Challenge(self.nonce));
                    self.state = State::AwaitProof { deadline, theirs };
                } else {
                    self.accept(theirs);
                }
            }
            (State::AwaitProof { theirs, .. }, Frame::Proof(tag)) => {
                let theirs = theirs.clone();
                let secret = self.secret.clone().expect("challenged only with a secret");
                if verify(&secret, &self.nonce, &theirs, &tag) {
                    self.accept(theirs);
                } else {
                    self.refuse("authentication failed: wrong cluster secret".into());
                }
            }
            (State::AwaitProof { .. }, other) => self.refuse(format!(
                "authentication failed: expected a proof, got {}",
                other.name()
            )),
            (
                State::Open,
                Frame::Begin {
                    request_id,
                    ticket,
                    n_tokens,
                    n_layers,
                    width,
                },
            ) => self.begin(now, (request_id, ticket), n_tokens, (n_layers, width)),
            (
                State::Open,
                Frame::Layer {
                    request_id,
                    layer,
                    data,
                },
            ) => self.layer(now, request_id, layer, Ok(data)),
            (
                State::Open,
                Frame::Written {
                    request_id,
                    layer,
                    crc,
                },
            ) => self.layer(now, request_id, layer, Err(crc)),
            (State::Open, Frame::Renew { request_id }) => {
                // A live sender's transfer may take as long as it keeps renewing it.
                let until = now + self.timeouts.transfer;
                if let Some(t) = self.transfers.get_mut(&request_id).filter(|t| !t.complete) {
                    t.deadline = t.deadline.max(until);
                    t.renewed = now;
                    self.events.push_back(ServerEvent::Renewed { request_id });
                }
            }
            (_, other) => {
                let what = other.name();
                self.close(TransferError::Protocol(format!(
                    "unexpected {what} from the sender"
                )))
            }
        }
    }

    fn begin(
        &mut self,
        now: Instant,
        (request_id, ticket): (u64, types::TransferTicket),
        n_tokens: u32,
        (n_layers, width): (u32, u32),
    ) {
        let own = self.identity.n_kv_heads * self.identity.head_dim;
        if n_layers != self.identity.n_layers || width != own || n_tokens == 0 {
            return self.close(TransferError::Protocol(format!(
                "request {request_id}: {n_tokens} tokens × {n_layers} layers × width {width} \
                 do not match the handshake ({} layers, width {own})",
                self.identity.n_layers
            )));
        }
        if self.transfers.contains_key(&request_id) {
            return self.close(TransferError::Protocol(format!(
                "request {request_id} began twice"
            )));
        }
        if n_tokens > self.max_kv_tokens {
            return self.close(TransferError::Protocol(format!(
                "request {request_id}: {n_tokens} tokens, more than this receiver's cache holds ({})",
                self.max_kv_tokens
            )));
        }
        if self.transfers.len() >= MAX_OPEN_TRANSFERS {
            return self.close(TransferError::Protocol(format!(
                "request {request_id}: {MAX_OPEN_TRANSFERS} transfers already open on this connection"
            )));
        }
        // Only into a reservation this receiver made, with the ticket it issued for it.
        let id = types::RequestId(request_id);
        if let Some(Err(why)) = self
            .tickets
            .as_ref()
            .map(|t| t.redeem(id, &ticket, n_tokens))
        {
            metrics::counter!("tandem_auth_refused_total", "listener" => "kv", "reason" => "ticket")
                .increment(1);
            return self.refuse(why);
        }
        self.transfers.insert(
            request_id,
            Incoming {
                n_tokens,
                n_layers,
                layer_bytes: layer_sizes(&self.identity, n_tokens),
                layers: Vec::new(),
                crcs: Vec::new(),
                granted: false,
                complete: false,
                deadline: now + self.timeouts.transfer,
                renewed: now,
            },
        );
        self.events.push_back(ServerEvent::Begun {
            request_id,
            n_tokens,
        });
        if self.in_place {
            self.events.push_back(ServerEvent::GrantNeeded {
                request_id,
                n_tokens,
            });
        }
    }

    /// A layer's bytes (inline) or its CRC (in place), at `now`.
    fn layer(&mut self, now: Instant, request_id: u64, layer: u32, kv: Result<Vec<u8>, u32>) {
        let in_place = self.in_place;
        let renew = self.timeouts.renew;
        let Some(t) = self.transfers.get_mut(&request_id) else {
            return self.close(TransferError::Protocol(format!(
                "layer {layer} of request {request_id}, which did not begin"
            )));
        };
        let want = t.layer_bytes.get(t.arrived()).copied().unwrap_or(0);
        let fits = match &kv {
            Ok(data) => !in_place && data.len() as u64 == want,
            Err(_) => in_place && t.granted,
        };
        if t.complete || layer as usize != t.arrived() || !fits {
            let got = match &kv {
                Ok(d) => format!("{} bytes", d.len()),
                Err(_) => "an in-place write".into(),
            };
            let msg = format!(
                "request {request_id}: layer {layer} with {got}; expected layer {} with {want} bytes",
                t.arrived(),
            );
            return self.close(TransferError::Protocol(msg));
        }
        match kv {
            Ok(data) => t.layers.push(data),
            Err(crc) => t.crcs.push(crc),
        }
        // A layer arriving says the sender lives, as a `Renew` does: a sender slowed by this
        // receiver (whose reads fall behind) cannot renew between the frames of a layer it is
        // still writing. At most once a renewal period.
        let last = t.arrived() == t.n_layers as usize;
        if !last && now >= t.renewed + renew {
            t.deadline = t.deadline.max(now + self.timeouts.transfer);
            t.renewed = now;
            self.events.push_back(ServerEvent::Renewed { request_id });
        }
        if last {
            t.complete = true;
            let kv = if in_place {
                Received::InPlace(std::mem::take(&mut t.crcs))
            } else {
                Received::Inline(std::mem::take(&mut t.layers))
            };
            let n_tokens = t.n_tokens;
            self.events.push_back(ServerEvent::Received {
                request_id,
                n_tokens,
                kv,
            });
        }
    }

    /// In-place transfers: the blocks the request's KV is to be written into, and the
    /// transport's access to them alone (`access`, opaque here).
    pub fn grant(
        &mut self,
        request_id: u64,
        blocks: Vec<u32>,
        access: Vec<u8>,
    ) -> Result<(), TransferError> {
        let in_place = self.in_place;
        match self.transfers.get_mut(&request_id) {
            Some(t) if in_place && !t.granted => {
                t.granted = true;
                self.out.push_back(Frame::Grant {
                    request_id,
                    blocks,
                    access,
                });
                Ok(())
            }
            _ => Err(TransferError::Protocol(format!(
                "request {request_id} is not waiting for a grant"
            ))),
        }
    }

    /// The owner's verdict on a received transfer: `Ok` once its KV is admitted, or why not.
    /// Queues the `Ack` (or NACK).
    pub fn verdict(&mut self, request_id: u64, verdict: Result<(), String>) {
        if self.is_closed() {
            return;
        }
        match self.transfers.get(&request_id) {
            Some(t) if t.complete => {
                self.transfers.remove(&request_id);
                self.out.push_back(Frame::Ack {
                    request_id,
                    ok: verdict.is_ok(),
                    message: verdict.err().unwrap_or_default(),
                });
            }
            _ => self.close(TransferError::Protocol(format!(
                "verdict on request {request_id}, which has not been received"
            ))),
        }
    }

    /// The transport failed, or the peer closed it (EOF between transfers closes cleanly).
    pub fn handle_error(&mut self, error: TransferError) {
        self.close(error);
    }

    /// Fires the deadlines that have passed by `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        match &self.state {
            State::AwaitHello { deadline } | State::AwaitProof { deadline, .. }
                if *deadline <= now =>
            {
                self.close(TransferError::Timeout(format!(
                    "no handshake within {:?}",
                    self.timeouts.handshake
                )))
            }
            State::Open => {
                let late = self
                    .transfers
                    .iter()
                    .find(|(_, t)| !t.complete && t.deadline <= now);
                if let Some((&id, t)) = late {
                    let msg = format!(
                        "request {id}: {} of {} layers arrived within {:?}",
                        t.arrived(),
                        t.n_layers,
                        self.timeouts.transfer
                    );
                    self.close(TransferError::Timeout(msg));
                }
            }
            _ => {}
        }
    }

    /// When [`Server::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::AwaitHello { deadline } | State::AwaitProof { deadline, .. } => Some(*deadline),
            State::Open => self
                .transfers
                .values()
                .filter(|t| !t.complete)
                .map(|t| t.deadline)
                .min(),
            State::Closed => None,
        }
    }

    /// The next frame to send (frames queued before a close, such as `Refuse`, still come).
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.out.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<ServerEvent> {
        self.events.pop_front()
    }

    fn close(&mut self, error: TransferError) {
        if self.is_closed() {
            return;
        }
        self.state = State::Closed;
        for (request_id, t) in std::mem::take(&mut self.transfers) {
            if !t.complete {
                self.events.push_back(ServerEvent::Abandoned {
                    request_id,
                    error: again(&error),
                });
            }
        }
        self.events.push_back(ServerEvent::Closed(error));
    }
}
