//! The control plane fuzzed: joins and heartbeats with arbitrary fields — and arbitrary bytes
//! decoded as its messages — sent to the `Control` service over a real registry. Nothing may
//! panic, and what a worker can make the router hold is capped: the KV index never holds more
//! blocks for a worker than the cache it joined with.
//!
//! `PROPTEST_CASES` sets the cases (256 by default; RELIABILITY.md has the 10-minute run).

use proptest::prelude::*;
use prost::Message;
use proto::grpc::control_server::Control;
use proto::grpc::{self, Heartbeat, JoinRequest, KvEvents};
use router::registry::{ControlService, Registry};
use tonic::Request;

fn identity() -> proto::ModelIdentity {
    proto::ModelIdentity {
        model: "fuzz".into(),
        kv_dtype: "f16".into(),
        block_size: 16,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 8,
        windows: Vec::new(),
    }
}

/// One message to the control plane.
#[derive(Debug, Clone)]
enum Op {
    /// A join of a well-formed worker (its pool, cache size, a chosen id or none).
    Join { decode: bool, blocks: u32, id: u64 },
    /// A heartbeat for the `i`-th id seen (or a guessed one), with KV events.
    Beat {
        i: usize,
        guess: u64,
        events: KvEvents,
    },
    /// Bytes decoded as a join, then as a heartbeat.
    Raw(Vec<u8>),
}

fn events() -> impl Strategy<Value = KvEvents> {
    (
        0u64..8,
        prop::collection::vec(0u64..64, 0..200),
        prop::collection::vec(any::<bool>(), 0..200),
        any::<bool>(),
        0u64..16,
    )
        .prop_map(|(first, hashes, stored, snapshot, next)| KvEvents {
            first,
            tiers: hashes.iter().map(|h| (h % 4) as u32).collect(),
            hashes,
            stored,
            snapshot,
            next,
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (
            any::<bool>(),
            0u32..64,
            prop_oneof![Just(0u64), any::<u64>()]
        )
            .prop_map(|(decode, blocks, id)| Op::Join { decode, blocks, id }),
        (0usize..8, any::<u64>(), events()).prop_map(|(i, guess, events)| Op::Beat {
            i,
            guess,
            events
        }),
        prop::collection::vec(any::<u8>(), 0..256).prop_map(Op::Raw),
    ]
}

fn join_of(decode: bool, blocks: u32, id: u64) -> JoinRequest {
    let role = if decode {
        grpc::Role::Decode
    } else {
        grpc::Role::Prefill
    };
    JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: role as i32,
        name: "fuzz".into(),
        endpoint: "http://127.0.0.1:9".into(),
        identity: Some(identity().into()),
        kv_blocks_total: blocks,
        worker_id: id,
        ..Default::default()
    }
}

proptest! {
    #[test]
    fn arbitrary_control_messages_never_panic_nor_outgrow_the_caps(ops in prop::collection::vec(op(), 0..48)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let registry = Registry::new(identity());
        // No TLS here: the peer checks are tests/security.rs's; this is the messages' handling.
        let svc = ControlService::new(registry.clone(), false);
        let mut ids = Vec::new();
        for op in ops {
            match op {
                Op::Join { decode, blocks, id } => {
                    if let Ok(r) = rt.block_on(svc.join(Request::new(join_of(decode, blocks, id)))) {
                        ids.push(r.into_inner().worker_id);
                    }
                }
                Op::Beat { i, guess, events } => {
                    let worker_id = ids.get(i).copied().unwrap_or(guess);
                    let beat = Heartbeat { worker_id, load: None, kv: Some(events) };
                    let _ = rt.block_on(svc.beat(Request::new(beat)));
                }
                Op::Raw(bytes) => {
                    if let Ok(j) = JoinRequest::decode(&bytes[..]) {
                        let _ = rt.block_on(svc.join(Request::new(j)));
                    }
                    if let Ok(b) = Heartbeat::decode(&bytes[..]) {
                        let _ = rt.block_on(svc.beat(Request::new(b)));
                    }
                }
            }
        }
        let cap: usize = registry.workers().iter().map(|w| w.kv_capacity as usize).sum();
        prop_assert!(registry.indexed_blocks() <= cap, "{} blocks indexed, caches hold {cap}", registry.indexed_blocks());
    }
}
