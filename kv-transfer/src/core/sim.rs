//! A simulated pair: a [`Client`] and a [`Server`] joined by a link with latency, driven on a
//! virtual clock. Frames cross the link as bytes, so corruption is caught where the real
//! drivers catch it; a stalled link delivers nothing; a closed end is seen by the other after
//! the link's delay. The server's owner keeps a [`Ledger`] as the decode worker does.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use engine::ledger::{Holding, Ledger};
use proto::ModelIdentity;
use types::{RequestId, TransferTicket};

use super::*;
use crate::frame::{Frame, HEADER};
use crate::wire::Local;

const MS: Duration = Duration::from_millis(1);

fn identity() -> ModelIdentity {
    ModelIdentity {
        model: "sim".into(),
        kv_dtype: "f16".into(),
        block_size: 16,
        n_layers: 4,
        n_kv_heads: 2,
        head_dim: 8,
        // Two sliding-window layers: their transfers carry 3 tokens at most.
        windows: vec![0, 4, 4, 0],
    }
}

fn decode(bytes: &[u8]) -> Result<Frame, TransferError> {
    let (kind, _, crc) = Frame::header(bytes[..HEADER].try_into().expect("header"))?;
    Ok(Frame::decode(kind, crc, &bytes[HEADER..])?)
}

/// One direction of the link.
#[derive(Default)]
struct Link {
    delay: Duration,
    queue: VecDeque<(Instant, Option<Vec<u8>>)>,
    stalled: bool,
    /// Flip a bit of the n-th frame sent from now (0 = the next one).
    corrupt: Option<usize>,
}

impl Link {
    fn send(&mut self, now: Instant, bytes: Option<Vec<u8>>) {
        let bytes = bytes.map(|mut b| {
            match self.corrupt {
                Some(0) => {
                    let i = b.len() - 1;
                    b[i] ^= 0x10;
                    self.corrupt = None;
                }
                Some(n) => self.corrupt = Some(n - 1),
                None => {}
            }
            b
        });
        self.queue.push_back((now + self.delay, bytes));
    }
    fn next(&self) -> Option<Instant> {
        (!self.stalled)
            .then(|| self.queue.front().map(|(t, _)| *t))
            .flatten()
    }
}

struct Sim {
    now: Instant,
    client: Client,
    server: Server,
    /// The receiver's tickets, when it checks them: [`Sim::begin`] reserves with one.
    tickets: Option<crate::Tickets>,
    c2s: Link,
    s2c: Link,
    /// The server owner's verdict on every received transfer.
    verdict: Result<(), String>,
    ledger: Ledger,
    client_events: Vec<ClientEvent>,
    server_events: Vec<ServerEvent>,
    client_gone: bool,
    server_gone: bool,
    /// The client's process is frozen: it sends, receives and times out nothing.
    client_frozen: bool,
}

/// How long the server's owner extends a reservation on each renewal.
const LEASE: Duration = Duration::from_millis(250);

impl Sim {
    fn new(client: &Local, server: &Local, in_place: bool, delay: Duration) -> Sim {
        let t = Timeouts {
            handshake: 100 * MS,
            transfer: 500 * MS,
            // No renewals but where a test asks for them.
            renew: Duration::from_secs(3600),
        };
        Sim::with_timeouts(client, server, in_place, delay, t)
    }

    fn with_timeouts(
        client: &Local,
        server: &Local,
        in_place: bool,
        delay: Duration,
        t: Timeouts,
    ) -> Sim {
        let now = Instant::now();
        Sim {
            now,
            client: Client::new(client, t, in_place, now),
            server: Server::new(server, t, in_place, [7; 16], now),
            tickets: server.tickets.clone(),
            c2s: Link {
                delay,
                ..Link::default()
            },
            s2c: Link {
                delay,
                ..Link::default()
            },
            verdict: Ok(()),
            ledger: Ledger::new(),
            client_events: vec![],
            server_events: vec![],
            client_gone: false,
            server_gone: false,
            client_frozen: false,
        }
    }

    fn open(delay: Duration) -> Sim {
        let l = Local::open(identity());
        let mut s = Sim::new(&l, &l, false, delay);
        s.run_for(10 * delay + MS);
        assert!(s.client.is_open() && s.server.is_open());
        s
    }

    /// Moves frames and events, then advances the clock event by event up to `now + d`.
    fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            self.pump();
            let client = self.client.poll_timeout().filter(|_| !self.client_frozen);
            let next = [
                self.c2s.next(),
                self.s2c.next(),
                client,
                self.server.poll_timeout(),
            ]
            .into_iter()
            .flatten()
            .min();
            match next {
                Some(t) if t <= end => self.now = self.now.max(t),
                _ => break,
            }
            self.deliver();
            if !self.client_frozen {
                self.client.handle_timeout(self.now);
            }
            self.server.handle_timeout(self.now);
        }
        self.now = end;
    }

    fn deliver(&mut self) {
        while self.c2s.next().is_some_and(|t| t <= self.now) {
            match self.c2s.queue.pop_front().expect("next").1 {
                Some(b) => match decode(&b) {
                    Ok(f) => self.server.handle(self.now, f),
                    Err(e) => self.server.handle_error(e),
                },
                None => self
                    .server
                    .handle_error(TransferError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            }
        }
        while self.s2c.next().is_some_and(|t| t <= self.now) {
            match self.s2c.queue.pop_front().expect("next").1 {
                Some(b) => match decode(&b) {
                    Ok(f) => self.client.handle(self.now, f),
                    Err(e) => self.client.handle_error(e),
                },
                None => self.client.handle_error(TransferError::Io(
                    std::io::ErrorKind::ConnectionReset.into(),
                )),
            }
        }
    }

    /// Transmits queued frames, closes the link of an end that closed, and plays the server's
    /// owner: grants blocks, records the ledger, gives verdicts.
    fn pump(&mut self) {
        while let Some(f) = self.client.poll_transmit() {
            self.c2s.send(self.now, Some(f.encode()));
        }
        while let Some(f) = self.server.poll_transmit() {
            self.s2c.send(self.now, Some(f.encode()));
        }
        while let Some(e) = self.server.poll_event() {
            match &e {
                ServerEvent::Begun { request_id, .. } => {
                    assert!(
                        self.ledger.in_flight(RequestId(*request_id)),
                        "KV for an unreserved request"
                    );
                }
                ServerEvent::GrantNeeded {
                    request_id,
                    n_tokens,
                } => {
                    let blocks = (0..n_tokens.div_ceil(16)).collect();
                    let access = vec![9; 4];
                    self.server
                        .grant(*request_id, blocks, access)
                        .expect("grant");
                }
                ServerEvent::Received { request_id, .. } => {
                    if self.verdict.is_ok() {
                        self.ledger.commit(RequestId(*request_id));
                    } else {
                        self.ledger.free(RequestId(*request_id));
                    }
                    self.server.verdict(*request_id, self.verdict.clone());
                }
                ServerEvent::Abandoned { request_id, .. } => {
                    assert_eq!(
                        self.ledger.free(RequestId(*request_id)),
                        Some(Holding::InFlight)
                    );
                }
                ServerEvent::Renewed { request_id } => {
                    assert!(self.ledger.renew(RequestId(*request_id), self.now + LEASE));
                }
                ServerEvent::Closed(_) | ServerEvent::Accepted { .. } => {}
            }
            self.server_events.push(e);
        }
        while let Some(e) = self.client.poll_event() {
            self.client_events.push(e);
        }
        // Frames the closing end queued went out first; then the other end sees it close.
        if self.server.is_closed() && !self.server_gone {
            self.server_gone = true;
            self.s2c.send(self.now, None);
        }
        if self.client.is_closed() && !self.client_gone {
            self.client_gone = true;
            self.c2s.send(self.now, None);
        }
        while let Some(f) = self.server.poll_transmit() {
            self.s2c.send(self.now, Some(f.encode()));
        }
    }

    /// The decode side reserves, then the prefill side begins a transfer.
    fn begin(&mut self, request_id: u64, n_tokens: u32) {
        let lease = self.now + Duration::from_secs(1);
        let id = RequestId(request_id);
        assert!(self.ledger.reserve(id, n_tokens.div_ceil(16), Some(lease)));
        let ticket = self.tickets.as_ref().map(|t| t.issue(id, n_tokens));
        self.client
            .begin(
                self.now,
                (request_id, ticket.unwrap_or_default()),
                n_tokens,
                16,
            )
            .unwrap();
    }

    /// Sends layer `l` of a request inline (as the TCP driver does).
    fn send_layer(&mut self, request_id: u64, l: u32, n_tokens: u32) {
        let data = vec![l as u8; layer_bytes(&identity(), l as usize, n_tokens) as usize];
        // Frames the client queued (its Begin) leave before the layer, as in the drivers.
        while let Some(f) = self.client.poll_transmit() {
            self.c2s.send(self.now, Some(f.encode()));
        }
        self.client.layer(request_id, l, data.len() as u64).unwrap();
        let f = Frame::Layer {
            request_id,
            layer: l,
            data,
        };
        self.c2s.send(self.now, Some(f.encode()));
    }

    fn delivered(&self) -> Vec<u64> {
        self.client_events
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Delivered { request_id, .. } => Some(*request_id),
                _ => None,
            })
            .collect()
    }

    fn failures(&self) -> Vec<String> {
        self.client_events
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Failed { request_id, error } => Some(format!("{request_id}: {error}")),
                _ => None,
            })
            .collect()
    }
}

#[test]
fn handshake_and_interleaved_transfers_arrive_whole_after_exact_virtual_delays() {
    let mut s = Sim::open(2 * MS);
    // Hello out, HelloOk back: one round trip.
    assert!(matches!(s.client_events[0], ClientEvent::Connected));
    let t0 = s.now;
    s.begin(1, 20);
    s.begin(2, 3);
    for l in 0..4 {
        s.send_layer(1, l, 20);
        s.send_layer(2, l, 3);
    }
    s.run_for(3 * MS);
    assert!(s.delivered().is_empty(), "acks need a full round trip");
    s.run_for(2 * MS);
    assert_eq!(s.delivered(), vec![1, 2]);
    assert_eq!(s.now - t0, 5 * MS);
    let bytes: Vec<u64> = s
        .client_events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Delivered { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .collect();
    // Width 16; the windowed layers 1 and 2 carry 3 of request 1's 20 tokens.
    assert_eq!(bytes, vec![4 * (20 + 3 + 3 + 20) * 16, 4 * 3 * 64]);
    let received: Vec<usize> = s
        .server_events
        .iter()
        .filter_map(|e| match e {
            ServerEvent::Received {
                kv: Received::Inline(layers),
                ..
            } => Some(layers.len()),
            _ => None,
        })
        .collect();
    assert_eq!(received, vec![4, 4]);
    for id in [1, 2] {
        assert_eq!(s.ledger.free(RequestId(id)), Some(Holding::Committed));
    }
    assert!(s.ledger.is_empty());
}

#[test]
fn the_cluster_secret_is_proven_and_outsiders_never_reach_a_transfer() {
    let secret = Some(std::sync::Arc::new(b"s3cret".to_vec()));
    let member = Local {
        identity: identity(),
        secret: secret.clone(),
        security: pki::Security::Insecure,
        max_kv_tokens: u32::MAX,
        tickets: None,
    };
    let mut s = Sim::new(&member, &member, false, MS);
    s.run_for(10 * MS);
    assert!(s.client.is_open(), "a member passes the challenge");

    for outsider in [
        Local {
            identity: identity(),
            secret: Some(std::sync::Arc::new(b"guess".to_vec())),
            security: pki::Security::Insecure,
            max_kv_tokens: u32::MAX,
            tickets: None,
        },
        Local::open(identity()),
    ] {
        let mut s = Sim::new(&outsider, &member, false, MS);
        s.run_for(10 * MS);
        assert!(s.client.is_closed() && s.server.is_closed());
        let closed = format!("{:?}", s.client_events.last().unwrap());
        assert!(
            closed.contains("wrong cluster secret") || closed.contains("none is configured"),
            "{closed}"
        );
        assert!(
            !s.server_events
                .iter()
                .any(|e| matches!(e, ServerEvent::Accepted { .. } | ServerEvent::Begun { .. })),
            "the outsider got no further than the handshake"
        );
    }
}

#[test]
fn a_mismatched_layout_or_version_is_refused_with_the_difference() {
    let mut other = identity();
    other.block_size = 32;
    let mut s = Sim::new(&Local::open(other), &Local::open(identity()), false, MS);
    s.run_for(10 * MS);
    let closed = format!("{:?}", s.client_events.last().unwrap());
    assert!(
        closed.contains("Refused") && closed.contains("block_size"),
        "{closed}"
    );

    // A peer that says nothing is dropped at the handshake deadline.
    let l = Local::open(identity());
    let mut s = Sim::new(&l, &l, false, MS);
    s.c2s.stalled = true;
    s.run_for(99 * MS);
    assert!(!s.server.is_closed());
    s.run_for(MS);
    assert!(s.server.is_closed() && s.client.is_closed());
    assert!(format!("{:?}", s.server_events.last().unwrap()).contains("no handshake"));
}

#[test]
fn a_stalled_transfer_ends_at_its_deadline_on_both_sides_and_frees_the_reservation() {
    let mut s = Sim::open(MS);
    let t0 = s.now;
    s.begin(9, 40);
    s.send_layer(9, 0, 40);
    s.run_for(5 * MS);
    s.c2s.stalled = true; // the prefill side's writes stop arriving
    s.send_layer(9, 1, 40);
    s.run_for(480 * MS);
    assert!(s
        .client_events
        .iter()
        .all(|e| !matches!(e, ClientEvent::Failed { .. })));
    s.run_for(20 * MS);
    // Both deadlines are the transfer timeout from Begin: 500 ms of virtual time, exactly.
    assert_eq!(s.now - t0, 505 * MS);
    assert!(s.failures()[0].contains("timed out"), "{:?}", s.failures());
    let abandoned = s
        .server_events
        .iter()
        .any(|e| matches!(e, ServerEvent::Abandoned { request_id: 9, error } if error.to_string().contains("1 of 4 layers")));
    assert!(abandoned, "{:?}", s.server_events);
    assert!(s.ledger.is_empty(), "the reservation was freed");
}

#[test]
fn a_waiting_sender_keeps_the_reservation_and_a_frozen_one_lets_it_lapse() {
    let l = Local::open(identity());
    let t = Timeouts {
        handshake: 100 * MS,
        transfer: Duration::from_secs(10),
        renew: 100 * MS,
    };
    let mut s = Sim::with_timeouts(&l, &l, false, MS, t);
    s.run_for(20 * MS);
    assert!(s.client.is_open());
    s.begin(1, 20);
    s.ledger.renew(RequestId(1), s.now + LEASE);
    // Two seconds of a prompt queued or computing, no layer yet: renewed all along.
    s.run_for(Duration::from_secs(2));
    let renewals = s
        .server_events
        .iter()
        .filter(|e| matches!(e, ServerEvent::Renewed { request_id: 1 }))
        .count();
    assert!((19..=21).contains(&renewals), "every 100 ms: {renewals}");
    assert!(s.ledger.expired(s.now).is_empty(), "the lease is kept");
    // The sender freezes: the lease lapses 250 ms after the last renewal arrived (at most
    // 100 ms + the link's 1 ms before), long before the transfer's 10 s deadline.
    s.client_frozen = true;
    let frozen = s.now;
    s.run_for(LEASE + 2 * MS);
    assert_eq!(s.ledger.expired(s.now), [RequestId(1)]);
    assert!(
        s.ledger.expired(frozen + 140 * MS).is_empty(),
        "not before the lease"
    );
}

/// A sender slowed by the receiver writes no `Renew` while a layer is on its way: each layer
/// that arrives renews the transfer (at most once a renewal period), so one slower than the
/// transfer's timeout from its `Begin`, but moving, keeps its deadline and its reservation.
#[test]
fn layers_that_keep_arriving_renew_the_transfer_as_renewals_do() {
    let l = Local::open(identity());
    let t = Timeouts {
        handshake: 100 * MS,
        transfer: Duration::from_secs(10),
        // The sender renews never (its writes blocked); the receiver's renewal period 100 ms.
        renew: Duration::from_secs(3600),
    };
    let mut s = Sim::with_timeouts(&l, &l, false, MS, t);
    let server = Timeouts {
        transfer: 500 * MS,
        renew: 100 * MS,
        ..t
    };
    s.server = Server::new(&l, server, false, [7; 16], s.now);
    s.run_for(20 * MS);
    assert!(s.client.is_open() && s.server.is_open());
    let t0 = s.now;
    s.begin(1, 20);
    s.ledger.renew(RequestId(1), s.now + LEASE);
    // A layer every 200 ms: 800 ms in all, past the receiver's 500 ms transfer timeout and its
    // 250 ms lease.
    for l in 0..4 {
        s.send_layer(1, l, 20);
        s.run_for(200 * MS);
    }
    assert!(s.now - t0 >= 800 * MS);
    assert_eq!(s.delivered(), vec![1], "{:?}", s.failures());
    let renewals = s
        .server_events
        .iter()
        .filter(|e| matches!(e, ServerEvent::Renewed { request_id: 1 }))
        .count();
    assert_eq!(
        renewals, 2,
        "layers 1 and 2 renewed it (layer 3 completes it)"
    );
    assert!(
        s.ledger.expired(t0 + 790 * MS).is_empty(),
        "the lease was kept"
    );
}

#[test]
fn a_corrupted_layer_is_caught_before_admission_and_fails_the_transfer() {
    let mut s = Sim::open(MS);
    s.begin(3, 16);
    s.c2s.corrupt = Some(2); // Begin, layer 0, then layer 1 corrupted
    for l in 0..4 {
        s.send_layer(3, l, 16);
    }
    s.run_for(10 * MS);
    assert!(s.delivered().is_empty());
    assert!(
        s.failures()[0].contains("3: KV transfer I/O"),
        "{:?}",
        s.failures()
    );
    assert!(s.server_events.iter().any(
        |e| matches!(e, ServerEvent::Closed(TransferError::Frame(f)) if f.0.contains("checksum"))
    ));
    assert!(!s
        .server_events
        .iter()
        .any(|e| matches!(e, ServerEvent::Received { .. })));
    assert!(s.ledger.is_empty());
}

#[test]
fn a_refused_transfer_is_a_nack_and_the_connection_stays_usable() {
    let mut s = Sim::open(MS);
    s.verdict = Err("request 4 is not waiting for KV here".into());
    s.begin(4, 5);
    for l in 0..4 {
        s.send_layer(4, l, 5);
    }
    s.run_for(5 * MS);
    assert!(
        s.failures()[0].contains("not waiting"),
        "{:?}",
        s.failures()
    );
    assert!(s.client.is_open());
    s.verdict = Ok(());
    s.begin(5, 5);
    for l in 0..4 {
        s.send_layer(5, l, 5);
    }
    s.run_for(5 * MS);
    assert_eq!(s.delivered(), vec![5]);
    s.ledger.free(RequestId(5));
    assert!(s.ledger.is_empty());
}

#[test]
fn out_of_protocol_frames_close_the_connection_without_admitting_anything() {
    // A layer out of order.
    let mut s = Sim::open(MS);
    s.begin(6, 5);
    s.client.layer(6, 0, 320).unwrap();
    let bad = Frame::Layer {
        request_id: 6,
        layer: 2,
        data: vec![0; 320],
    };
    while let Some(f) = s.client.poll_transmit() {
        s.c2s.send(s.now, Some(f.encode()));
    }
    s.c2s.send(s.now, Some(bad.encode()));
    s.run_for(5 * MS);
    assert!(s.server.is_closed());
    assert!(s.failures()[0].starts_with("6:"));
    // The sender's own misuse is refused locally and sends nothing.
    let mut s = Sim::open(MS);
    s.begin(7, 5);
    assert!(s.client.layer(7, 1, 320).is_err());
    assert!(s.client.layer(7, 0, 321).is_err());
    let no_ticket = TransferTicket::default();
    assert!(s.client.begin(s.now, (7, no_ticket), 5, 16).is_err());
    assert!(s.client.begin(s.now, (8, no_ticket), 5, 99).is_err());
    assert!(s.client.written(7, 0, 0).is_err(), "inline connection");
}

#[test]
fn in_place_transfers_grant_blocks_then_carry_only_checksums() {
    let l = Local::open(identity());
    let mut s = Sim::new(&l, &l, true, MS);
    s.run_for(5 * MS);
    s.begin(11, 40);
    assert!(
        s.client.written(11, 0, 1).is_err(),
        "nothing may be written before the grant"
    );
    s.run_for(2 * MS);
    let blocks = s.client_events.iter().find_map(|e| match e {
        ClientEvent::Granted {
            request_id: 11,
            blocks,
            access,
        } => Some((blocks.clone(), access.clone())),
        _ => None,
    });
    assert_eq!(
        blocks,
        Some((vec![0, 1, 2], vec![9; 4])),
        "the blocks and their access"
    );
    for layer in 0..4 {
        s.client.written(11, layer, 100 + layer).unwrap();
    }
    s.run_for(2 * MS);
    let crcs = s.server_events.iter().find_map(|e| match e {
        ServerEvent::Received {
            kv: Received::InPlace(c),
            ..
        } => Some(c.clone()),
        _ => None,
    });
    assert_eq!(crcs, Some(vec![100, 101, 102, 103]));
    assert_eq!(s.delivered(), vec![11]);
    assert_eq!(s.ledger.free(RequestId(11)), Some(Holding::Committed));
}

#[test]
fn a_lost_connection_fails_every_transfer_on_it_and_abandons_every_incomplete_one() {
    let mut s = Sim::open(MS);
    s.begin(1, 5);
    s.begin(2, 5);
    s.send_layer(1, 0, 5);
    s.run_for(3 * MS);
    s.client
        .handle_error(TransferError::Io(std::io::ErrorKind::BrokenPipe.into()));
    s.run_for(3 * MS);
    assert_eq!(s.failures().len(), 2);
    assert!(s.server.is_closed());
    let abandoned = s
        .server_events
        .iter()
        .filter(|e| matches!(e, ServerEvent::Abandoned { .. }))
        .count();
    assert_eq!(abandoned, 2);
    assert!(s.ledger.is_empty());
    assert!(s.client.poll_timeout().is_none() && s.server.poll_timeout().is_none());
}

/// With tickets, a transfer begins only into a reservation the receiver made, with that
/// reservation's ticket, once: a sender with a wrong, a spent or no ticket is refused before any
/// layer is read, and the receiver's reservations are untouched.
#[test]
fn a_transfer_begins_only_with_the_ticket_of_its_reservation() {
    let receiver = Local {
        tickets: Some(crate::Tickets::default()),
        ..Local::open(identity())
    };
    let mut s = Sim::new(&Local::open(identity()), &receiver, false, MS);
    s.run_for(10 * MS);
    s.begin(1, 20);
    for l in 0..identity().n_layers {
        s.send_layer(1, l, 20);
    }
    s.run_for(20 * MS);
    assert_eq!(
        s.delivered(),
        vec![1],
        "its own ticket opens its reservation"
    );

    let tickets = receiver.tickets.clone().unwrap();
    let flipped = |mut t: TransferTicket| {
        t.0[0] ^= 1;
        t
    };
    type Attempt =
        fn(TransferTicket, fn(TransferTicket) -> TransferTicket) -> (u64, TransferTicket, u32);
    let attempts: [Attempt; 4] = [
        |t, flip| (2, flip(t), 20),                // a guess
        |t, _| (3, t, 20),                         // another reservation's ticket
        |t, _| (2, t, 21),                         // more tokens than reserved
        |_, _| (2, TransferTicket::default(), 20), // none
    ];
    for attempt in attempts {
        let mut s = Sim::new(&Local::open(identity()), &receiver, false, MS);
        s.run_for(10 * MS);
        let (request_id, ticket, n_tokens) = attempt(tickets.issue(RequestId(2), 20), flipped);
        s.client
            .begin(s.now, (request_id, ticket), n_tokens, 16)
            .unwrap();
        s.run_for(10 * MS);
        assert!(s.server.is_closed(), "{request_id}/{n_tokens} refused");
        let begun = |e: &ServerEvent| matches!(e, ServerEvent::Begun { .. });
        assert!(!s.server_events.iter().any(begun), "{:?}", s.server_events);
        assert!(s.failures()[0].contains("refused"), "{:?}", s.failures());
    }
}

/// A peer makes the receiver read no frame bigger than a layer of a transfer it began, and may
/// not begin one bigger than the receiver's cache.
#[test]
fn frames_are_bounded_by_the_transfers_begun_and_the_cache() {
    let receiver = Local {
        max_kv_tokens: 64,
        ..Local::open(identity())
    };
    let t0 = Instant::now();
    let mut server = Server::new(&receiver, Timeouts::default(), false, [3; 16], t0);
    assert_eq!(server.frame_limit(), crate::wire::MAX_CONTROL_FRAME);
    let hello = Frame::Hello {
        version: proto::PROTOCOL_VERSION,
        identity: identity(),
    };
    server.handle(t0, hello);
    assert!(server.is_open());
    assert_eq!(
        server.frame_limit(),
        crate::wire::MAX_CONTROL_FRAME,
        "no transfer begun"
    );
    let width = identity().n_kv_heads * identity().head_dim;
    let begin = |request_id, n_tokens| Frame::Begin {
        request_id,
        ticket: TransferTicket::default(),
        n_tokens,
        n_layers: identity().n_layers,
        width,
    };
    server.handle(t0, begin(1, 64));
    let layer = super::layer_bytes(&identity(), 0, 64) + 12;
    assert_eq!(
        u64::from(server.frame_limit()),
        layer.max(crate::wire::MAX_CONTROL_FRAME.into())
    );
    server.handle(t0, begin(2, 65));
    assert!(
        server.is_closed(),
        "a transfer bigger than the cache is refused"
    );
}

mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// A stranger feeding the receiver arbitrary frames (decoded from arbitrary bytes, as a
        /// driver would) never panics it and never gets past the handshake without the secret:
        /// no transfer begins, nothing is received, no KV pool is touched.
        #[test]
        fn arbitrary_frames_never_panic_the_receiver_nor_reach_the_pool(
            chunks in proptest::collection::vec((any::<u8>(), proptest::collection::vec(any::<u8>(), 0..96)), 0..24),
            ticks in proptest::collection::vec(0u64..400, 0..24),
        ) {
            let member = Local {
                identity: identity(),
                secret: Some(std::sync::Arc::new(b"s3cret".to_vec())),
                security: pki::Security::Insecure,
                max_kv_tokens: u32::MAX,
                tickets: None,
            };
            let t0 = Instant::now();
            let mut server = Server::new(&member, Timeouts::default(), false, [3; 16], t0);
            let mut now = t0;
            for (i, (kind, payload)) in chunks.into_iter().enumerate() {
                now += Duration::from_millis(ticks.get(i).copied().unwrap_or(1));
                // Half the frames carry an honest checksum, so they reach the state machine.
                let crc = if i % 2 == 0 { crc32fast::hash(&payload) } else { 0 };
                match Frame::decode(kind, crc, &payload) {
                    Ok(f) => server.handle(now, f),
                    Err(e) => server.handle_error(e.into()),
                }
                server.handle_timeout(now);
                while server.poll_transmit().is_some() {}
            }
            while let Some(e) = server.poll_event() {
                prop_assert!(
                    !matches!(e, ServerEvent::Accepted { .. } | ServerEvent::Begun { .. } | ServerEvent::Received { .. } | ServerEvent::GrantNeeded { .. }),
                    "a stranger got through: {e:?}"
                );
            }
        }
    }
}
