//! The router's registry of workers: joining (its own id, protocol and model checks), picking
//! the least loaded, forgetting the silent.

use crate::fake;

use std::time::Duration;

use fake::*;
use proto::grpc::{self, JoinRequest};
use proto::Pool;
use router::registry::{Registry, Route};
use types::WorkerId;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_its_own_id_joins_once_and_forgetting_it_wakes_its_requests() {
    // A worker registered in etcd comes with its id, through the watch and through Join alike.
    let st = state(Duration::from_secs(60));
    let (config, _) = engine::inspect(&engine::fetch::default_model_path()).unwrap();
    let req = JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::Decode as i32,
        identity: Some(engine::identity_of(&config, 16).into()),
        worker_id: 0xfeed,
        ..Default::default()
    };
    assert_eq!(st.registry.join(req.clone()).unwrap(), WorkerId(0xfeed));
    assert_eq!(st.registry.join(req).unwrap(), WorkerId(0xfeed));
    assert_eq!(st.registry.count(Pool::Decode), 1);
    let registry = st.registry.clone();
    let lost = tokio::spawn(async move { registry.lost(WorkerId(0xfeed)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !lost.is_finished(),
        "the worker is there (heartbeat timeout 60 s)"
    );
    // Its etcd key went: a request waiting on it hears at once, not at the heartbeat timeout.
    st.registry.remove(WorkerId(0xfeed));
    tokio::time::timeout(Duration::from_secs(5), lost)
        .await
        .expect("woken by the removal")
        .unwrap();
    assert_eq!(st.registry.count(Pool::Decode), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_refuses_other_protocols_and_models_and_picks_the_least_loaded() {
    let st = state(Duration::from_secs(1));
    let mut bad = JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION + 1,
        role: grpc::Role::Decode as i32,
        ..Default::default()
    };
    assert!(st.registry.join(bad.clone()).is_err());
    bad.protocol_version = proto::PROTOCOL_VERSION;
    let err = st.registry.join(bad).unwrap_err();
    assert!(err.message().contains("cannot exchange KV"), "{err:?}");
    let (a, b) = (
        join_at(&st, Pool::Decode, "http://a"),
        join_at(&st, Pool::Decode, "http://b"),
    );
    let any = Route::default();
    let p1 = st.registry.pick(Pool::Decode, &[], &any).unwrap();
    let p2 = st.registry.pick(Pool::Decode, &[], &any).unwrap();
    let mut ids = [p1.worker, p2.worker];
    ids.sort();
    assert_eq!(ids, [a, b], "the second pick goes to the idle worker");
    assert!(st.registry.pick(Pool::Decode, &[a, b], &any).is_none());
    st.registry.set_draining(a);
    assert_eq!(st.registry.count(Pool::Decode), 1);
    assert_eq!(st.registry.count(Pool::Prefill), 0);
    let beat = grpc::Heartbeat {
        worker_id: 999,
        load: None,
        kv: None,
    };
    assert_eq!(
        st.registry.beat(beat).unwrap_err().code(),
        tonic::Code::NotFound
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_is_dropped_after_its_timeout() {
    let path = engine::fetch::ensure_default_model().unwrap();
    let (config, _) = engine::inspect(&path).unwrap();
    let identity = engine::identity_of(&config, 16);
    let reg = Registry::with_timeout(identity.clone(), Duration::from_millis(100));
    let mut changes = reg.subscribe();
    let id = reg
        .join(JoinRequest {
            protocol_version: proto::PROTOCOL_VERSION,
            role: grpc::Role::Decode as i32,
            identity: Some(identity.into()),
            ..Default::default()
        })
        .unwrap();
    assert!(changes.has_changed().unwrap(), "a join is a change");
    changes.mark_unchanged();
    std::thread::sleep(Duration::from_millis(150));
    assert!(
        reg.workers().is_empty(),
        "worker {id} missed its heartbeats"
    );
    assert!(
        changes.has_changed().unwrap(),
        "and its leaving is a change"
    );
}
