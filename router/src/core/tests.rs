//! The request core driven by hand: no driver, no I/O, time passed in.

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
    let join = JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::Decode as i32,
        name: "decode-0".into(),
        identity: Some(identity().into()),
        kv_blocks_total: 64,
        ..Default::default()
    };
    let w = table.join(join, t0).unwrap();
    let signals = Arc::new(Signals::new(Duration::from_secs(10)));
    let settings = Settings::default();
    let mut n = 0;
    let mut next_id = || {
        n += 1;
        RequestId(n)
    };
    let mut cx = Cx {
        table: &mut table,
        signals: &signals,
        settings: &settings,
        next_id: &mut next_id,
    };
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
    };
    let p = table.pick(proto::Pool::Prefill, |_| true, &route).unwrap();
    let w = crate::routing::UNMEASURED_STORE_WEIGHT;
    assert_eq!(p.cached_tokens, (3.0 * 16.0 * w).round() as usize);
    drop(p);
    table.index_mut().clear_store(0);
    let p = table.pick(proto::Pool::Prefill, |_| true, &route).unwrap();
    assert_eq!(p.cached_tokens, 0);
}
