//! The request core driven by hand: no driver, no I/O, time passed in.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::grpc::{self, Heartbeat, JoinRequest};
use proto::Cause;
use types::{ModelIdentity, RequestId, WorkerId};

use super::*;
use crate::planner::Signals;
use crate::routing::Routing;

fn identity() -> ModelIdentity {
    ModelIdentity {
        model: "m".into(),
        kv_dtype: "f16".into(),
        block_size: 16,
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 8,
        windows: vec![],
    }
}

/// What a request core reads besides the table: the planner's signals, the settings and the
/// request ids.
struct Core {
    signals: Arc<Signals>,
    settings: Settings,
    ids: Box<dyn FnMut() -> RequestId>,
}

impl Core {
    fn new(settings: Settings) -> Core {
        let mut n = 0;
        Core {
            signals: Arc::new(Signals::new(Duration::from_secs(10))),
            settings,
            ids: Box::new(move || {
                n += 1;
                RequestId(n)
            }),
        }
    }

    fn cx<'a>(&'a mut self, table: &'a mut Table) -> Cx<'a> {
        Cx {
            table,
            signals: &self.signals,
            settings: &self.settings,
            next_id: &mut *self.ids,
        }
    }
}

fn opens(actions: &[Action]) -> Option<WorkerId> {
    actions.iter().find_map(|a| match a {
        Action::Open { worker, .. } => Some(*worker),
        _ => None,
    })
}

/// A request waiting for room is refused again after each of the worker's heartbeats; it
/// keeps one entry for the worker (a list growing by one a heartbeat made each retry slower —
/// the simulator's fault scenario ran 3.5× slower with it).
#[test]
fn a_request_refused_again_and_again_keeps_one_entry_for_the_worker() {
    let t0 = Instant::now();
    let mut table = Table::new(identity(), Liveness::default(), Routing::default());
    let w = decode_worker(&mut table, "decode-0", t0);
    let mut core = Core::new(Settings::default());
    let mut cx = core.cx(&mut table);
    let params = Params {
        max_tokens: Some(4),
        ..Default::default()
    };
    let (mut r, a) = Request::start(vec![1, 2, 3], params, None, t0, &mut cx);
    assert_eq!(opens(&a), Some(w));
    for k in 1..=50u64 {
        let t = t0 + Duration::from_millis(250 * k);
        let a = r.handle(t, Input::OpenFailed(Cause::Full, "full".into()), &mut cx);
        assert_eq!(opens(&a), None, "not asked again before its next heartbeat");
        let beat = Heartbeat {
            worker_id: w.0,
            ..Default::default()
        };
        cx.table.beat(beat, t).unwrap();
        let a = r.handle(t, Input::Changed, &mut cx);
        assert_eq!(opens(&a), Some(w), "asked again after heartbeat {k}");
    }
    let Phase::Reserving { refused, .. } = r.phase() else {
        panic!("still reserving: {:?}", r.phase());
    };
    assert_eq!(refused, &vec![(w, 49)]);
}

/// The prefill pool's demand is counted as requests arrive, not as they are sent: a request
/// refused for room on its decode worker counts its prompt (less the last token, which decode
/// computes) while nothing is sent to the prefill pool; a colocated cluster counts nothing.
#[test]
fn the_prefill_demand_counts_a_request_on_arrival_while_it_waits_for_room() {
    let t0 = Instant::now();
    let mut table = Table::new(identity(), Liveness::default(), Routing::default());
    let w = decode_worker(&mut table, "decode-0", t0);
    peer_worker(&mut table, grpc::Role::Prefill, "prefill-0", "", t0);
    let mut core = Core::new(Settings::default());
    let mut cx = core.cx(&mut table);
    let (mut r, a) = Request::start(vec![7; 40], Params::default(), None, t0, &mut cx);
    assert_eq!(opens(&a), Some(w));
    r.handle(t0, Input::OpenFailed(Cause::Full, "full".into()), &mut cx);
    assert!(
        matches!(r.phase(), Phase::Reserving { .. }),
        "{:?}",
        r.phase()
    );
    let s = &core.signals;
    assert_eq!(s.prefill_arrived_tokens.load(Ordering::SeqCst), 39);
    assert_eq!(s.prefill_pending_tokens.load(Ordering::SeqCst), 0);

    let mut table = Table::new(identity(), Liveness::default(), Routing::default());
    decode_worker(&mut table, "decode-0", t0);
    let mut core = Core::new(Settings::default());
    Request::start(
        vec![7; 40],
        Params::default(),
        None,
        t0,
        &mut core.cx(&mut table),
    );
    assert_eq!(
        core.signals.prefill_arrived_tokens.load(Ordering::SeqCst),
        0
    );
}

/// The cluster store in the table: the first worker announcing a store key sets it; a prefill
/// pick counts the blocks only the store holds as cached, at the store's weight (unmeasured:
/// [`crate::routing::UNMEASURED_STORE_WEIGHT`]), for a worker holding none of them — and
/// nothing once the store's watch is gone.
#[test]
fn a_pick_counts_the_stores_blocks_as_cached_at_its_weight() {
    let t0 = Instant::now();
    let mut table = Table::new(identity(), Liveness::default(), Routing::default());
    let join = JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::Prefill as i32,
        name: "prefill-0".into(),
        identity: Some(identity().into()),
        kv_blocks_total: 64,
        store_model: 0xabc,
        ..Default::default()
    };
    table.join(join, t0).unwrap();
    assert_eq!(table.store_model(), Some(0xabc));
    let blocks: Vec<types::BlockHash> = (1..=4).map(types::BlockHash).collect();
    let snapshot = grpc::KvEvents {
        hashes: vec![1, 2, 3],
        snapshot: true,
        next: 3,
        ..Default::default()
    };
    assert!(!table.index_mut().apply_store(0, &snapshot));
    let route = Route {
        blocks,
        prompt_tokens: 4 * 16 + 1,
        ..Route::default()
    };
    let p = table.pick(proto::Pool::Prefill, |_| true, &route).unwrap();
    let w = crate::routing::UNMEASURED_STORE_WEIGHT;
    assert_eq!(p.cached_tokens, (3.0 * 16.0 * w).round() as usize);
    drop(p);
    table.index_mut().clear_store(0);
    let p = table.pick(proto::Pool::Prefill, |_| true, &route).unwrap();
    assert_eq!(p.cached_tokens, 0);
}

/// Peer fetch as the router weighs it: a prefill pick for a prompt whose first 3 blocks the
/// decode worker holds (and serves) counts them as cached at the fetch's weight and tells the
/// prefill worker to fetch — before any measurement at
/// [`crate::routing::UNMEASURED_PEER_WEIGHT`]; once the worker's heartbeats say a block took
/// longer to fetch than to compute, it computes, except every
/// [`super::table::PEER_PROBE_EVERY`]-th decision (fetched to measure again); all failed
/// fetches weigh nothing; a decode worker that serves no peers, or a prefill worker holding
/// the blocks already, is no decision at all.
#[test]
fn a_prefill_fetches_what_the_decode_worker_holds_while_fetching_is_measured_cheaper() {
    let t0 = Instant::now();
    let mut table = Table::new(identity(), Liveness::default(), Routing::default());
    let p = peer_worker(&mut table, grpc::Role::Prefill, "prefill-0", "", t0);
    let serving = peer_worker(
        &mut table,
        grpc::Role::Decode,
        "decode-0",
        "127.0.0.1:1",
        t0,
    );
    let plain = decode_worker(&mut table, "decode-1", t0);
    let mut route = Route {
        blocks: (1..=4).map(types::BlockHash).collect(),
        prompt_tokens: 4 * 16 + 1,
        peer_blocks: 0,
    };
    assert_eq!(table.peer_source(plain, 3 * 16 + 5, &route), None);
    assert_eq!(
        table.peer_source(serving, 3 * 16 + 5, &route),
        Some((serving, 3 * 16))
    );
    route.peer_blocks = 3;
    let pick = |table: &mut Table, route: &Route| {
        let picked = table.pick(proto::Pool::Prefill, |_| true, route).unwrap();
        (picked.peer, picked.cached_tokens)
    };
    let w = crate::routing::UNMEASURED_PEER_WEIGHT;
    let unmeasured = (3.0 * 16.0 * w).round() as usize;
    assert_eq!(pick(&mut table, &route), (PeerFetch::Cheaper, unmeasured));
    // Measured: 16 tokens compute in 16 ms at 1,000 tokens/s.
    let beat = |table: &mut Table, hits: u64, failures: u64, seconds: f64| {
        let load = grpc::WorkerLoad {
            prompt_tokens_per_s: 1000.0,
            kv_peer_hits: hits,
            kv_peer_fetch_failures: failures,
            kv_peer_load_seconds: seconds,
            ..Default::default()
        };
        let hb = Heartbeat {
            worker_id: p.0,
            load: Some(load),
            ..Default::default()
        };
        table.beat(hb, t0).unwrap();
    };
    beat(&mut table, 10, 0, 0.04);
    let cheap = (3.0 * 16.0 * crate::routing::tier_weight(0.004, 16, 1000.0)).round() as usize;
    assert_eq!(pick(&mut table, &route), (PeerFetch::Cheaper, cheap));
    beat(&mut table, 10, 0, 0.2);
    let decisions: Vec<PeerFetch> = (0..2 * super::table::PEER_PROBE_EVERY)
        .map(|_| pick(&mut table, &route))
        .map(|(d, cached)| {
            assert_eq!(
                cached, 0,
                "a fetch dearer than computing counts for nothing"
            );
            d
        })
        .collect();
    let probes = decisions.iter().filter(|&&d| d == PeerFetch::Probe).count();
    let dearer = decisions
        .iter()
        .filter(|&&d| d == PeerFetch::Dearer)
        .count();
    assert_eq!((probes, dearer), (2, decisions.len() - 2));
    beat(&mut table, 0, 3, 30.0);
    assert_eq!(pick(&mut table, &route).0, PeerFetch::Dearer);
    // The prefill worker holds the 3 blocks itself: nothing to fetch.
    holds(&mut table, p, 3, t0);
    assert_eq!(pick(&mut table, &route), (PeerFetch::Nothing, 3 * 16));
    route.peer_blocks = 0;
    assert_eq!(pick(&mut table, &route).0, PeerFetch::Nothing);
}

/// Where a prefill worker fetches from: the request's decode worker, which holds the prompt's
/// first blocks for it, unless another decode worker serving peers holds a longer run in its
/// pool (by the KV index); a decode worker that serves none is never named.
#[test]
fn a_prefill_fetches_from_the_decode_worker_holding_the_longest_run() {
    let t0 = Instant::now();
    let mut table = Table::new(identity(), Liveness::default(), Routing::default());
    let decode = grpc::Role::Decode;
    let request = peer_worker(&mut table, decode, "decode-0", "127.0.0.1:1", t0);
    let more = peer_worker(&mut table, decode, "decode-1", "127.0.0.1:2", t0);
    let silent = peer_worker(&mut table, decode, "decode-2", "", t0);
    let route = Route {
        blocks: (1..=6).map(types::BlockHash).collect(),
        prompt_tokens: 6 * 16 + 1,
        peer_blocks: 0,
    };
    holds(&mut table, silent, 6, t0);
    assert_eq!(table.peer_source(request, 33, &route), Some((request, 32)));
    holds(&mut table, more, 4, t0);
    assert_eq!(table.peer_source(request, 33, &route), Some((more, 64)));
    assert_eq!(table.peer_source(request, 64, &route), Some((request, 64)));
    assert_eq!(table.peer_source(silent, 0, &route), Some((more, 64)));
    // A decode worker serves its host tier's blocks too (G2, not G3): blocks 1..=5, the last
    // two in host memory, are a run of 5 (80 tokens, past the other's 64); on disk, of 3.
    let tiered = peer_worker(&mut table, decode, "decode-3", "127.0.0.1:3", t0);
    for (tier, want) in [(1, Some((tiered, 80))), (2, Some((more, 64)))] {
        let kv = grpc::KvEvents {
            hashes: (1..=5).collect(),
            stored: vec![true; 5],
            tiers: vec![0, 0, 0, tier, tier],
            snapshot: true,
            next: 5,
            ..Default::default()
        };
        let hb = Heartbeat {
            worker_id: tiered.0,
            kv: Some(kv),
            ..Default::default()
        };
        table.beat(hb, t0).unwrap();
        assert_eq!(table.peer_source(silent, 0, &route), want, "tier {tier}");
    }
}

/// A worker of `role` of the test table, serving peers at `peer` (empty: not).
fn peer_worker(
    table: &mut Table,
    role: grpc::Role,
    name: &str,
    peer: &str,
    t0: Instant,
) -> WorkerId {
    let join = JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: role as i32,
        name: name.into(),
        identity: Some(identity().into()),
        kv_blocks_total: 64,
        peer_endpoint: peer.into(),
        ..Default::default()
    };
    table.join(join, t0).unwrap()
}

/// Worker `w`'s heartbeat saying its pool holds blocks 1..=`blocks` (and nothing else).
fn holds(table: &mut Table, w: WorkerId, blocks: u64, t0: Instant) {
    let kv = grpc::KvEvents {
        hashes: (1..=blocks).collect(),
        stored: vec![true; blocks as usize],
        snapshot: true,
        next: blocks,
        ..Default::default()
    };
    let hb = Heartbeat {
        worker_id: w.0,
        kv: Some(kv),
        ..Default::default()
    };
    table.beat(hb, t0).unwrap();
}

/// A decode worker of the test table.
fn decode_worker(table: &mut Table, name: &str, t0: Instant) -> WorkerId {
    let join = JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::Decode as i32,
        name: name.into(),
        identity: Some(identity().into()),
        kv_blocks_total: 64,
        ..Default::default()
    };
    table.join(join, t0).unwrap()
}

/// A table with one decode worker (`decode-a`), a core that colocates (no remote prefill),
/// and a request's parameters (8 tokens).
fn colocated(t0: Instant) -> (Table, WorkerId, Core, Params) {
    let mut table = Table::new(identity(), Liveness::default(), Routing::default());
    let a = decode_worker(&mut table, "decode-a", t0);
    let core = Core::new(Settings {
        disaggregated: false,
        ..Settings::default()
    });
    let params = Params {
        max_tokens: Some(8),
        ..Default::default()
    };
    (table, a, core, params)
}

/// A live move, step by step: told to leave, the request asks its decode worker to pause it;
/// paused after the tokens its stream carried, it parks that stream, reserves on the other
/// worker with the prompt plus those tokens (a remote prefill, nothing computed there), has the
/// old worker hand its KV over, and releases it there once the handoff answers — counted as a
/// move, not a migration or a recomputation. A second request whose handoff fails is computed
/// on its new worker ("recomputed: move failed"), the old one released.
#[test]
fn a_request_told_to_leave_is_paused_reserved_elsewhere_and_handed_over() {
    let t0 = Instant::now();
    let (mut table, a, mut core, params) = colocated(t0);
    let mut cx = core.cx(&mut table);
    let start = |cx: &mut Cx<'_>| {
        let (mut r, acts) = Request::start(vec![1, 2, 3], params, None, t0, cx);
        assert_eq!(opens(&acts), Some(a));
        r.handle(t0, Input::Opened(None), cx);
        for t in [7, 8] {
            let acts = r.handle(
                t0,
                Input::Token {
                    id: t,
                    finish: None,
                },
                cx,
            );
            assert!(matches!(acts[..], [.., Action::Emit]), "{acts:?}");
        }
        r
    };
    let mut r = start(&mut cx);
    let old = r.id();
    // Alone in its pool, it stays.
    let acts = r.handle(t0, Input::Leave(MoveWhy::Draining), &mut cx);
    assert!(acts.is_empty(), "nowhere to go: {acts:?}");
    let b = decode_worker(cx.table, "decode-b", t0);
    let room = |free| Heartbeat {
        worker_id: b.0,
        load: Some(grpc::WorkerLoad {
            kv_blocks_free: free,
            kv_blocks_total: 64,
            ..Default::default()
        }),
        ..Default::default()
    };
    // Nor while the other has no room for it, by its last heartbeat.
    cx.table.beat(room(0), t0).unwrap();
    let acts = r.handle(t0, Input::Leave(MoveWhy::Draining), &mut cx);
    assert!(acts.is_empty(), "no room elsewhere: {acts:?}");
    cx.table.beat(room(64), t0).unwrap();
    let acts = r.handle(t0, Input::Leave(MoveWhy::Draining), &mut cx);
    assert!(
        matches!(acts[..], [Action::Pause { worker, request }] if worker == a && request == old),
        "{acts:?}"
    );
    // A token already on the way is passed on; then the pause.
    r.handle(
        t0,
        Input::Token {
            id: 9,
            finish: None,
        },
        &mut cx,
    );
    let acts = r.handle(t0, Input::Paused { generated: 3 }, &mut cx);
    assert!(acts
        .iter()
        .any(|x| matches!(x, Action::Park { request } if *request == old)));
    assert!(acts
        .iter()
        .any(|x| matches!(x, Action::Note(Note::Moved(MoveWhy::Draining)))));
    assert!(
        acts.iter().any(
            |x| matches!(x, Action::Open { worker, remote: true, local_max: 0 } if *worker == b)
        ),
        "reserved on the other worker for the old one's KV: {acts:?}"
    );
    assert_eq!(r.prompt(), &[1, 2, 3, 7, 8, 9]);
    assert_eq!(r.params().generated, 3);
    assert_eq!(r.params().max_tokens, Some(5));
    let ticket = types::TransferTicket::default();
    let reserved = Reservation {
        cached_tokens: 0,
        local: false,
        ticket,
    };
    let acts = r.handle(t0, Input::Opened(Some(reserved)), &mut cx);
    assert!(
        acts.iter().any(|x| matches!(x, Action::Handoff { from, request, decode, skip: 0, .. } if *from == a && *request == old && *decode == b)),
        "{acts:?}"
    );
    assert_eq!(
        cx.table.get(a).unwrap().in_flight(),
        1,
        "held on the old worker"
    );
    let acts = r.handle(t0, Input::PrefillDone, &mut cx);
    assert!(
        acts.iter().any(|x| matches!(x, Action::Release { pool: proto::Pool::Decode, worker, request } if *worker == a && *request == old)),
        "{acts:?}"
    );
    assert_eq!(
        cx.table.get(a).unwrap().in_flight(),
        0,
        "let go on the old worker"
    );
    assert!(matches!(r.phase(), Phase::Decoding { decode } if decode.worker == b));
    let acts = r.handle(
        t0,
        Input::Token {
            id: 10,
            finish: Some(engine::FinishReason::Length),
        },
        &mut cx,
    );
    assert!(
        matches!(
            acts[..],
            [Action::Emit, Action::Note(Note::Entered(PhaseName::Done))]
        ),
        "{acts:?}"
    );

    // A handoff that fails: computed on the new worker, the old one let go.
    let mut r = start(&mut cx);
    let old = r.id();
    r.handle(t0, Input::Leave(MoveWhy::Rebalance), &mut cx);
    r.handle(t0, Input::Paused { generated: 2 }, &mut cx);
    r.handle(t0, Input::Opened(Some(reserved)), &mut cx);
    let failed = Input::PrefillFailed(Cause::KvTransfer, "broke".into());
    let acts = r.handle(t0, failed, &mut cx);
    assert!(
        acts.iter()
            .any(|x| matches!(x, Action::Note(Note::Recomputed(Recompute::MoveFailed)))),
        "{acts:?}"
    );
    assert!(
        acts.iter().any(|x| matches!(x, Action::Release { pool: proto::Pool::Decode, worker, request } if *worker == a && *request == old)),
        "{acts:?}"
    );
    assert!(
        acts.iter()
            .any(|x| matches!(x, Action::Open { worker, remote: false, .. } if *worker == b)),
        "{acts:?}"
    );
    assert_eq!(cx.table.get(a).unwrap().in_flight(), 0);

    // A move that finds no room in time resumes where it was, under its old id.
    let mut r = start(&mut cx);
    let old = r.id();
    r.handle(t0, Input::Leave(MoveWhy::Rebalance), &mut cx);
    r.handle(t0, Input::Paused { generated: 2 }, &mut cx);
    let t = t0 + Duration::from_millis(1);
    r.handle(t, Input::OpenFailed(Cause::Full, "full".into()), &mut cx);
    assert!(matches!(r.phase(), Phase::Reserving { .. }));
    let acts = r.handle(r.admit_by(), Input::AdmissionDeadline, &mut cx);
    assert!(
        acts.iter().any(
            |x| matches!(x, Action::Resume { worker, request } if *worker == a && *request == old)
        ),
        "{acts:?}"
    );
    assert!(matches!(r.phase(), Phase::Decoding { decode } if decode.worker == a));
    assert_eq!(r.id(), old);
    assert_eq!(
        cx.table.get(a).unwrap().in_flight(),
        1,
        "still held where it was"
    );
}

/// A preempted request waits in its decode worker's queue for room: while it does, it owes no
/// token (so the driver's stall timer does not take the worker for wedged and move every
/// request off it); its next token starts the clock again.
#[test]
fn a_preempted_request_owes_no_token_until_it_sends_one_again() {
    let t0 = Instant::now();
    let (mut table, a, mut core, params) = colocated(t0);
    let mut cx = core.cx(&mut table);
    let (mut r, acts) = Request::start(vec![1, 2, 3], params, None, t0, &mut cx);
    assert_eq!(opens(&acts), Some(a));
    r.handle(t0, Input::Opened(None), &mut cx);
    assert_eq!(
        r.owes_token_since(),
        None,
        "nothing owed before the first token"
    );
    let token = |id| Input::Token { id, finish: None };
    let t1 = t0 + Duration::from_millis(5);
    r.handle(t1, token(7), &mut cx);
    assert_eq!(r.owes_token_since(), Some(t1));
    let acts = r.handle(t1, Input::Preempted, &mut cx);
    assert!(acts.is_empty(), "it stays where it is: {acts:?}");
    assert_eq!(r.owes_token_since(), None, "waiting for room, not stalled");
    let t2 = t1 + Duration::from_secs(30);
    let acts = r.handle(t2, token(8), &mut cx);
    assert!(matches!(acts[..], [Action::Emit]), "{acts:?}");
    assert_eq!(
        r.owes_token_since(),
        Some(t2),
        "resumed: the clock runs again"
    );
}
