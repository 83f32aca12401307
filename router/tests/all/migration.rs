//! Migration against fake workers: a decode worker lost mid-stream (killed, frozen, stalled)
//! is left and the client's stream goes on elsewhere, up to the migration limit.

use crate::fake;

use std::sync::Arc;
use std::time::Duration;

use engine::SamplingParams;
use fake::*;
use proto::grpc::{self};
use proto::Pool;
use router::core::PhaseName as P;
use router::registry::{Liveness, Route};
use router::request;
use router::State;
use types::WorkerId;

/// A prompt of 40 tokens whose first two blocks worker `id` caches by the index (so the `kv`
/// policy picks it first); the fake `Count` workers answer it 540, 541, …
fn cached_prompt(st: &State, id: WorkerId) -> Vec<u32> {
    let prompt: Vec<u32> = (0..40).map(|i| 500 + i).collect();
    cached_on(st, id, &prompt);
    prompt
}

fn counting(fault: Fault) -> Fake {
    Fake::new(
        DecodeScript::Count(fault),
        PrefillScript::Deliver,
        Arc::default(),
    )
}

const MIGRATED: [P; 6] = [
    P::Reserving,
    P::Decoding,
    P::Migrating,
    P::Reserving,
    P::Decoding,
    P::Done,
];

/// Runs `prompt` for 8 tokens and checks it was served by `a` for 3 tokens, then by `b` from
/// the prompt plus those 3, as one stream of exactly what an unfailed run gives.
async fn assert_migrated(st: &Arc<State>, prompt: &[u32], a: &Fake, b: &Fake) {
    let started = request::start(st, prompt.to_vec(), &SamplingParams::greedy(8)).await;
    let (out, end, phases) = finish(started).await;
    end.unwrap();
    assert_eq!(
        out,
        (540..548).collect::<Vec<u32>>(),
        "one uninterrupted stream"
    );
    assert_eq!(phases, MIGRATED);
    let seen = b.seen.lock().unwrap();
    let mut resumed = prompt.to_vec();
    resumed.extend([540, 541, 542]);
    assert_eq!(
        seen.generate[0].2, resumed,
        "the prompt plus the tokens streamed"
    );
    assert_eq!(seen.max_tokens, [5], "the rest of max_tokens");
    assert_eq!(
        seen.params[0].generated, 3,
        "the streamed tokens are output to the penalties"
    );
    drop(seen);
    let old = a.seen.lock().unwrap().generate[0].0;
    assert!(
        a.wait_until(|s| s.cancel.contains(&old)).await,
        "the lost worker is told to release it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_killed_mid_stream_is_left_and_the_stream_goes_on_elsewhere() {
    let st = state(Duration::from_secs(5));
    let (a, b) = (counting(Fault::Die(3)), counting(Fault::None));
    let ida = join(&st, Pool::Decode, &a).await;
    join(&st, Pool::Decode, &b).await;
    let prompt = cached_prompt(&st, ida);
    assert_migrated(&st, &prompt, &a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_decode_worker_is_left_when_its_heartbeats_stop() {
    let live = Liveness {
        heartbeat: Duration::from_millis(400),
        ..Liveness::default()
    };
    let st = state_on(live, Duration::from_secs(5), |_| {});
    let (a, b) = (counting(Fault::Freeze(3)), counting(Fault::None));
    let ida = join(&st, Pool::Decode, &a).await;
    let idb = join(&st, Pool::Decode, &b).await;
    keep_beating(&st, idb, None);
    // `a` beats once (the index hears of its cache) and never again: frozen.
    let prompt = cached_prompt(&st, ida);
    assert_migrated(&st, &prompt, &a, &b).await;
    let ids: Vec<WorkerId> = st.registry.workers().iter().map(|w| w.id).collect();
    assert_eq!(ids, [idb], "the silent worker was dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_tokens_marks_its_worker_stalled_until_its_engine_moves() {
    let live = Liveness {
        stall: Duration::from_millis(300),
        ..Liveness::default()
    };
    let st = state_on(live, Duration::from_secs(5), |_| {});
    let (a, b) = (counting(Fault::Freeze(3)), counting(Fault::None));
    let ida = join(&st, Pool::Decode, &a).await;
    let idb = join(&st, Pool::Decode, &b).await;
    let prompt = cached_prompt(&st, ida);
    // Both heartbeat; `a`'s engine does not move (a wedged engine thread).
    keep_beating(&st, ida, Some(7));
    keep_beating(&st, idb, None);
    assert_migrated(&st, &prompt, &a, &b).await;
    let stalled = |st: &State| {
        st.registry
            .workers()
            .iter()
            .find(|w| w.id == ida)
            .unwrap()
            .stalled
    };
    assert!(stalled(&st), "not routed to");
    assert!(st
        .registry
        .pick(Pool::Decode, &[idb], &Route::default())
        .is_none());
    // Its engine moves again: it is back.
    let beat = grpc::Heartbeat {
        worker_id: ida.0,
        load: Some(grpc::WorkerLoad {
            engine_steps: 8,
            ..Default::default()
        }),
        kv: None,
    };
    st.registry.beat(beat).unwrap();
    assert!(!stalled(&st));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_holding_work_whose_engine_stands_still_is_stalled() {
    let live = Liveness {
        stall: Duration::from_millis(100),
        ..Liveness::default()
    };
    let st = state_on(live, Duration::from_secs(5), |_| {});
    let id = join_at(&st, Pool::Decode, "http://127.0.0.1:9");
    let beat = |steps: u64, running: u32| grpc::Heartbeat {
        worker_id: id.0,
        load: Some(grpc::WorkerLoad {
            engine_steps: steps,
            running,
            ..Default::default()
        }),
        kv: None,
    };
    let any = Route::default();
    let usable = |st: &State| st.registry.pick(Pool::Decode, &[], &any).is_some();
    // Idle for longer than the stall timeout, then given work: not stalled for having idled.
    st.registry.beat(beat(5, 0)).unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    st.registry.beat(beat(5, 0)).unwrap();
    st.registry.beat(beat(5, 1)).unwrap();
    assert!(usable(&st), "work just came");
    // Holding work, no step for longer than the stall timeout.
    tokio::time::sleep(Duration::from_millis(150)).await;
    st.registry.beat(beat(5, 1)).unwrap();
    assert!(!usable(&st), "holding work, no step");
    // Idle again (its load is fresh: it answers), or moving: usable.
    st.registry.beat(beat(5, 0)).unwrap();
    assert!(usable(&st), "idle is not stalled");
    st.registry.beat(beat(5, 1)).unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    st.registry.beat(beat(5, 1)).unwrap();
    assert!(!usable(&st));
    st.registry.beat(beat(6, 1)).unwrap();
    assert!(usable(&st), "moving again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_migration_limit_the_client_gets_an_error_after_its_tokens() {
    let st = state_with(Duration::from_secs(5), |s| s.core.migration_limit = 0);
    let (a, b) = (counting(Fault::Die(3)), counting(Fault::None));
    let ida = join(&st, Pool::Decode, &a).await;
    join(&st, Pool::Decode, &b).await;
    let prompt = cached_prompt(&st, ida);
    let started = request::start(&st, prompt, &SamplingParams::greedy(8)).await;
    let (out, end, phases) = finish(started).await;
    assert_eq!(out, [540, 541, 542]);
    let e = end.unwrap_err().to_string();
    assert!(e.contains("migration_limit = 0"), "{e}");
    assert_eq!(phases, [P::Reserving, P::Decoding, P::Migrating, P::Failed]);
    assert!(b.seen.lock().unwrap().generate.is_empty());
}
