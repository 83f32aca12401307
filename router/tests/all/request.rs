//! The router's request state machine against fake workers (in-process gRPC servers, see
//! `fake/`): every transition, asserted by the phases the request went through and by what the
//! workers were asked; and routing by the KV index.

use crate::fake;

use std::sync::Arc;
use std::time::Duration;

use engine::SamplingParams;
use fake::*;
use proto::grpc::{self};
use proto::Pool;
use router::core::PhaseName as P;
use router::openai::ApiError;
use router::registry::Route;
use router::request;
use types::WorkerId;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_reserving_then_decoding() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(tokens(&[7, 8, 9]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    let (out, end, phases) = run(&st).await;
    assert_eq!(out, [7, 8, 9]);
    assert!(end.is_ok());
    assert_eq!(phases, [P::Reserving, P::Decoding, P::Done]);
    let seen = d.seen.lock().unwrap();
    assert_eq!(seen.generate.len(), 1);
    assert!(
        !seen.generate[0].1,
        "no prefill pool: the decode worker prefills"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_reserving_prefilling_decoding() {
    let st = state(Duration::from_secs(5));
    let kv = Arc::new(Kv::default());
    let d = Fake::new(tokens(&[7, 8]), PrefillScript::Deliver, kv.clone());
    let p = Fake::new(tokens(&[]), PrefillScript::Deliver, kv);
    join(&st, Pool::Decode, &d).await;
    join(&st, Pool::Prefill, &p).await;
    let (out, end, phases) = run(&st).await;
    assert_eq!((out, end.is_ok()), (vec![7, 8], true));
    assert_eq!(phases, [P::Reserving, P::Prefilling, P::Decoding, P::Done]);
    let (dg, pf) = (d.seen.lock().unwrap(), p.seen.lock().unwrap());
    assert!(
        dg.generate[0].1,
        "the decode worker reserved for a remote prefill"
    );
    assert_eq!(pf.prefill.len(), 1);
    assert_eq!(
        pf.prefill[0].0, dg.generate[0].0,
        "one request id on both workers"
    );
    assert_eq!(
        pf.prefill[0].1,
        PROMPT[..5],
        "the prompt less its last token"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_prefill_pool_leaves_the_prompt_to_its_decode_worker() {
    let st = state_with(Duration::from_secs(5), |s| {
        s.core.local_prefill_busy_max_tokens = 1000
    });
    let kv = Arc::new(Kv::default());
    let d = Fake::new(tokens(&[7, 8]), PrefillScript::Deliver, kv.clone());
    let p = Fake::new(tokens(&[]), PrefillScript::Deliver, kv);
    join(&st, Pool::Decode, &d).await;
    join(&st, Pool::Prefill, &p).await;
    // An idle prefill pool takes the prompt.
    let (_, end, phases) = run(&st).await;
    end.unwrap();
    assert_eq!(phases, [P::Reserving, P::Prefilling, P::Decoding, P::Done]);
    // Its prefill call may answer after the last token: until then its tokens count as queued.
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while st.registry.workers().iter().any(|w| w.in_flight() > 0) {
        assert!(tokio::time::Instant::now() < until, "the prefill call ends");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // 400 tokens queued on the only prefill worker (no measured rate yet: 1,000 tokens/s), i.e.
    // 0.4 s before it could start: the decode worker may compute up to 400 tokens itself.
    let queued = Route {
        prompt_tokens: 400,
        ..Route::default()
    };
    let held = st.registry.pick(Pool::Prefill, &[], &queued).unwrap();
    let (out, end, phases) = run(&st).await;
    end.unwrap();
    assert_eq!(out, [7, 8]);
    assert_eq!(
        phases,
        [P::Reserving, P::Decoding, P::Done],
        "prefilled locally"
    );
    drop(held);
    let (dg, pf) = (d.seen.lock().unwrap(), p.seen.lock().unwrap());
    assert_eq!(
        dg.local_max,
        [0, 400],
        "the wait, in tokens the decode worker computes"
    );
    assert_eq!(
        pf.prefill.len(),
        1,
        "the second prompt never reached the prefill pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_is_recomputed_on_the_decode_worker_and_released_on_both() {
    let st = state(Duration::from_secs(5));
    let kv = Arc::new(Kv::default());
    let d = Fake::new(tokens(&[7, 8]), PrefillScript::Deliver, kv.clone());
    let p = Fake::new(tokens(&[]), PrefillScript::Fail, kv);
    join(&st, Pool::Decode, &d).await;
    join(&st, Pool::Prefill, &p).await;
    let (out, end, phases) = run(&st).await;
    assert_eq!((out, end.is_ok()), (vec![7, 8], true));
    assert_eq!(
        phases,
        [
            P::Reserving,
            P::Prefilling,
            P::Recomputing,
            P::Decoding,
            P::Done
        ]
    );
    let first = d.seen.lock().unwrap().generate[0].0;
    {
        let seen = d.seen.lock().unwrap();
        assert_eq!(seen.generate.len(), 2);
        let (retry, remote, prompt) = &seen.generate[1];
        assert!(
            !remote && prompt == &PROMPT,
            "the whole prompt, on the decode worker"
        );
        assert_ne!(*retry, first, "recomputed under a new id");
    }
    assert!(d.wait_until(|s| s.cancel.contains(&first)).await);
    assert!(p.wait_until(|s| s.cancel.contains(&first)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_lost_on_the_decode_worker_is_recomputed() {
    let st = state(Duration::from_secs(5));
    let kv = Arc::new(Kv::default());
    let d = Fake::new(
        DecodeScript::LoseKv(vec![5]),
        PrefillScript::Deliver,
        kv.clone(),
    );
    let p = Fake::new(tokens(&[]), PrefillScript::Deliver, kv);
    join(&st, Pool::Decode, &d).await;
    join(&st, Pool::Prefill, &p).await;
    let (out, end, phases) = run(&st).await;
    assert_eq!((out, end.is_ok()), (vec![5], true));
    assert_eq!(phases[..3], [P::Reserving, P::Prefilling, P::Recomputing]);
    assert_eq!(phases[3..], [P::Decoding, P::Done]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_worker_is_skipped_for_one_with_room() {
    let st = state(Duration::from_secs(5));
    let full = Fake::new(
        DecodeScript::FullThen(u32::MAX, vec![]),
        PrefillScript::Deliver,
        Arc::default(),
    );
    let room = Fake::new(tokens(&[3]), PrefillScript::Deliver, Arc::default());
    let full_id = join(&st, Pool::Decode, &full).await;
    join(&st, Pool::Decode, &room).await;
    // One request already on the worker with room: the idle, full one is asked first.
    let busy = st
        .registry
        .pick(Pool::Decode, &[full_id], &Route::default());
    let (out, end, phases) = run(&st).await;
    drop(busy);
    assert_eq!((out, end.is_ok()), (vec![3], true));
    assert_eq!(phases, [P::Reserving, P::Decoding, P::Done]);
    assert_eq!(
        full.seen.lock().unwrap().generate.len(),
        1,
        "asked once, then skipped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_room_and_is_woken_by_a_heartbeat() {
    let st = state(Duration::from_secs(20));
    let d = Fake::new(
        DecodeScript::FullThen(1, vec![4]),
        PrefillScript::Deliver,
        Arc::default(),
    );
    let id = join(&st, Pool::Decode, &d).await;
    let waiting = tokio::spawn({
        let st = st.clone();
        async move { run(&st).await }
    });
    assert!(
        d.wait_until(|s| s.generate.len() == 1).await,
        "refused once"
    );
    // Nothing changes in the registry: the request waits, and no timer retries it. (Were it
    // polling, it would have asked again within this grace period.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(d.seen.lock().unwrap().generate.len(), 1);
    let waiting_now = st.registry.with(|t| t.line.len());
    assert_eq!(waiting_now, 1, "counted as waiting for room");
    let beat = grpc::Heartbeat {
        worker_id: id.0,
        load: Some(grpc::WorkerLoad::default()),
        kv: None,
    };
    st.registry.beat(beat).unwrap();
    let (out, end, phases) = waiting.await.unwrap();
    assert_eq!((out, end.is_ok()), (vec![4], true));
    assert_eq!(phases, [P::Reserving, P::Decoding, P::Done]);
    assert_eq!(
        d.seen.lock().unwrap().generate.len(),
        2,
        "asked again after the heartbeat"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_room_within_the_admission_wait_is_unavailable() {
    let st = state(Duration::from_millis(300));
    let (_, end, phases) = run(&st).await;
    assert!(
        matches!(end, Err(ApiError::Unavailable(m)) if m.contains("no decode worker has joined"))
    );
    assert_eq!(phases, [P::Reserving, P::Failed]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_request_is_the_clients_fault() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(
        DecodeScript::BadRequest,
        PrefillScript::Deliver,
        Arc::default(),
    );
    join(&st, Pool::Decode, &d).await;
    let (_, end, phases) = run(&st).await;
    assert!(matches!(end, Err(ApiError::BadRequest(_))));
    assert_eq!(phases, [P::Reserving, P::Failed]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_worker_is_dropped_and_another_serves() {
    let st = state(Duration::from_secs(5));
    // Nothing listens there: bind a port, then free it.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let dead_id = join_at(&st, Pool::Decode, &format!("http://{dead}"));
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    // One request already on the live worker: the idle, dead one is tried first.
    let busy = st
        .registry
        .pick(Pool::Decode, &[dead_id], &Route::default());
    let (out, end, _) = run(&st).await;
    drop(busy);
    assert_eq!((out, end.is_ok()), (vec![1], true));
    let ids: Vec<WorkerId> = st.registry.workers().iter().map(|w| w.id).collect();
    assert!(
        !ids.contains(&dead_id),
        "the unreachable worker is gone: {ids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_is_released_on_the_worker() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(
        DecodeScript::Slow((1..40).collect()),
        PrefillScript::Deliver,
        Arc::default(),
    );
    join(&st, Pool::Decode, &d).await;
    let s = request::start(&st, PROMPT.to_vec(), &SamplingParams::greedy(64)).await;
    assert!(s.first.is_ok());
    drop(s.rest);
    let phases = s.trace.await.unwrap().phases;
    assert_eq!(phases, [P::Reserving, P::Decoding, P::Gone]);
    let id = d.seen.lock().unwrap().generate[0].0;
    assert!(
        d.wait_until(|s| s.cancel.contains(&id)).await,
        "Cancel sent"
    );
    let w = &st.registry.workers()[0];
    assert_eq!(w.in_flight(), 0, "no longer counted against the worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_unique_and_carry_a_per_router_prefix() {
    let (a, b) = (state(Duration::from_secs(1)), state(Duration::from_secs(1)));
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&a, Pool::Decode, &d).await;
    join(&b, Pool::Decode, &d).await;
    for st in [&a, &a, &b] {
        run(st).await.1.unwrap();
    }
    let ids: Vec<u64> = d
        .seen
        .lock()
        .unwrap()
        .generate
        .iter()
        .map(|g| g.0)
        .collect();
    assert_eq!(ids[1], ids[0] + 1);
    assert_ne!(ids[2] >> 32, ids[0] >> 32, "two routers, two prefixes");
}

// Routing by the KV index.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_goes_to_the_decode_worker_caching_its_prefix_unless_it_is_busy() {
    let st = state(Duration::from_secs(5));
    let fakes: Vec<Fake> = (0..3)
        .map(|_| Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default()))
        .collect();
    let mut ids = Vec::new();
    for f in &fakes {
        ids.push(join(&st, Pool::Decode, f).await);
    }
    let prompt: Vec<u32> = (0..40).map(|i| 500 + i).collect();
    cached_on(&st, ids[1], &prompt);
    assert_eq!(st.registry.indexed_blocks(), 2);
    let params = SamplingParams::greedy(1);
    for _ in 0..3 {
        finish(request::start(&st, prompt.clone(), &params).await)
            .await
            .1
            .unwrap();
    }
    let asked = |f: &Fake| f.seen.lock().unwrap().generate.len();
    assert_eq!(
        fakes.iter().map(asked).collect::<Vec<_>>(),
        [0, 3, 0],
        "all to the cache"
    );
    // Busy beyond the slack: the next request goes to an idle worker.
    let any = Route::default();
    let held: Vec<_> = (0..3)
        .map(|_| {
            st.registry
                .pick(Pool::Decode, &[ids[0], ids[2]], &any)
                .unwrap()
        })
        .collect();
    finish(request::start(&st, prompt.clone(), &params).await)
        .await
        .1
        .unwrap();
    assert_eq!(asked(&fakes[1]), 3, "not piled onto the busy worker");
    drop(held);
    // A worker that leaves takes its index entries with it.
    st.registry.remove(ids[1]);
    assert_eq!(st.registry.indexed_blocks(), 0);
}

/// Polls `done` (every 5 ms, up to 5 s) until it holds; whether it did.
async fn eventually(done: impl Fn() -> bool) -> bool {
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while !done() {
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_waiting_for_room_leaves_the_line() {
    let st = state(Duration::from_secs(20));
    let d = Fake::new(
        DecodeScript::FullThen(u32::MAX, Vec::new()),
        PrefillScript::Deliver,
        Arc::default(),
    );
    join(&st, Pool::Decode, &d).await;
    let client = tokio::spawn({
        let st = st.clone();
        async move { run(&st).await }
    });
    let waiting = || st.registry.with(|t| t.line.len());
    assert!(eventually(|| waiting() == 1).await, "waiting for room");
    client.abort();
    assert!(
        eventually(|| waiting() == 0).await,
        "the client went away: its place in the line goes with it"
    );
}
