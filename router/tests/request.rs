//! The router's request state machine, registry and HTTP handlers against fake workers
//! (in-process gRPC servers, see `fake/`): every transition, asserted by the phases the request
//! went through and by what the workers were asked.

mod fake;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use engine::SamplingParams;
use fake::{join, join_at, keep_beating, state_on, DecodeScript, Fake, Fault, Kv, PrefillScript};
use http_body_util::BodyExt;
use proto::grpc::{self, JoinRequest};
use proto::Pool;
use router::core::{PhaseName, PhaseName as P};
use router::openai::ApiError;
use router::registry::{Liveness, Registry, Route};
use router::request::{self, Started};
use router::State;
use serde_json::{json, Value};
use tower::ServiceExt;
use types::WorkerId;

const PROMPT: [u32; 6] = [1, 2, 3, 4, 5, 6];

/// A router state over the default model's tokenizer, with no worker yet.
fn state(admission_wait: Duration) -> Arc<State> {
    state_with(admission_wait, |_| {})
}

/// [`state`], with `set` changing its settings first.
fn state_with(admission_wait: Duration, set: impl FnOnce(&mut State)) -> Arc<State> {
    state_on(Liveness::default(), admission_wait, set)
}

fn tokens(t: &[u32]) -> DecodeScript {
    DecodeScript::Tokens(t.to_vec())
}

/// Every token of a started request, how it ended, and its phases.
async fn finish(s: Started) -> (Vec<u32>, Result<(), ApiError>, Vec<PhaseName>) {
    let mut out = Vec::new();
    let mut end = Ok(());
    let mut next = Some(s.first);
    let mut rest = s.rest;
    while let Some(r) = next {
        match r {
            Ok(t) => {
                out.push(t.id);
                if t.finish.is_some() {
                    break;
                }
            }
            Err(e) => {
                end = Err(e);
                break;
            }
        }
        next = rest.recv().await;
    }
    (out, end, s.trace.await.unwrap().phases)
}

async fn run(state: &Arc<State>) -> (Vec<u32>, Result<(), ApiError>, Vec<PhaseName>) {
    finish(request::start(state, PROMPT.to_vec(), &SamplingParams::greedy(8)).await).await
}

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
        blocks: Vec::new(),
        prompt_tokens: 400,
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

// The registry.

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

// The HTTP handlers, driven with `oneshot` over the fakes.

async fn call(
    st: &Arc<State>,
    method: &str,
    uri: &str,
    body: Option<Value>,
) -> (StatusCode, String) {
    let mut req = Request::builder().method(method).uri(uri);
    let body = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Body::from(b.to_string())
        }
        None => Body::empty(),
    };
    let resp = router::app(st.clone())
        .oneshot(req.body(body).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// Token ids the fake decode worker answers with: "Hello world" in this tokenizer.
fn hello(st: &State) -> Vec<u32> {
    st.tokenizer.encode("Hello world").unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_answers_with_the_workers_tokens_as_text() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(tokens(&hello(&st)), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    let body = json!({"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
    let (code, text) = call(&st, "POST", "/v1/chat/completions", Some(body)).await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello world");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], hello(&st).len());
    let prompt = &d.seen.lock().unwrap().generate[0].2;
    assert_eq!(
        v["usage"]["prompt_tokens"],
        prompt.len(),
        "the rendered chat template"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_completions_end_with_usage_of_their_own_object_and_done() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(tokens(&hello(&st)), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    let body = json!({"prompt": "Say hello", "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}});
    let (code, text) = call(&st, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let usage = chunks.last().unwrap();
    assert_eq!(
        usage["object"], "text_completion",
        "the usage chunk is a completion chunk"
    );
    assert_eq!(usage["usage"]["completion_tokens"], hello(&st).len());
    let said: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(said, "Hello world");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_without_reaching_a_worker() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            json!({"model": "other", "messages": msgs}),
            StatusCode::NOT_FOUND,
            "model_not_found",
        ),
        (
            json!({"messages": msgs, "max_tokens": 0}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"messages": msgs, "temperature": 3}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"messages": []}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"messages": msgs, "n": 0}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"messages": msgs, "n": 17}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
    ];
    for (body, want, code) in cases {
        let (got, text) = call(&st, "POST", "/v1/chat/completions", Some(body.clone())).await;
        assert_eq!(got, want, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], code, "{text}");
    }
    let (got, _) = call(&st, "GET", "/v1/nothing", None).await;
    assert_eq!(got, StatusCode::NOT_FOUND);
    assert!(d.seen.lock().unwrap().generate.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_the_server_does_not_implement_are_refused_not_ignored() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let with = |k: &str, v: Value| {
        let mut b = json!({"messages": msgs, "max_tokens": 1});
        b[k] = v;
        b
    };
    let refused = [
        with("top_logprobs", json!(3)),
        with("top_logprobs", json!(21)),
        with(
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        with("response_format", json!({"type": "xml"})),
        with(
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
        ),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "response_format": {"type": "json_object"}, "guided_regex": "a+"}),
        with("presence_penalty", json!(2.5)),
        with("frequency_penalty", json!(-3)),
        with("repetition_penalty", json!(0)),
        with("logit_bias", json!({"abc": -100})),
        with("logit_bias", json!({"7": 101})),
        with("logit_bias", json!({"99999999": 1})),
        with("min_p", json!(1.5)),
        with("min_tokens", json!(5)),
        with("stop_token_ids", json!([99_999_999])),
        with("temprature", json!(0.5)),
        json!({"messages": [{"role": "banana", "content": "hi"}], "max_tokens": 1}),
    ];
    for body in refused {
        let (got, text) = call(&st, "POST", "/v1/chat/completions", Some(body.clone())).await;
        assert_eq!(got, StatusCode::BAD_REQUEST, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
    }
    assert!(
        d.seen.lock().unwrap().generate.is_empty(),
        "none reached a worker"
    );
    // Defaults that ask for nothing, metadata and the developer role are served.
    let served = [
        with("logprobs", json!(false)),
        with("logprobs", json!(true)),
        with("presence_penalty", json!(0)),
        with("tools", json!([])),
        with("response_format", json!({"type": "text"})),
        with("user", json!("someone")),
        with("logprobs", Value::Null),
        json!({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 1}),
    ];
    for body in served {
        let (got, text) = call(&st, "POST", "/v1/chat/completions", Some(body.clone())).await;
        assert_eq!(got, StatusCode::OK, "{body}: {text}");
    }
    let tools = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "tools": [{"type": "function", "function": {"name": "f"}}]});
    let (got, text) = call(&st, "POST", "/v1/chat/completions", Some(tools)).await;
    assert_eq!(got, StatusCode::BAD_REQUEST, "{text}");
    assert!(
        text.contains("does not render tools"),
        "SmolLM2's template has none: {text}"
    );
    for body in [
        json!({"prompt": "hi", "max_tokens": 1, "suffix": "!"}),
        json!({"prompt": "hi", "max_tokens": 1, "n": 2, "best_of": 1}),
        json!({"prompt": "hi", "max_tokens": 1, "best_of": 3, "stream": true}),
    ] {
        let (got, text) = call(&st, "POST", "/v1/completions", Some(body.clone())).await;
        assert_eq!(got, StatusCode::BAD_REQUEST, "{body}: {text}");
        let key = if body.get("suffix").is_some() {
            "suffix"
        } else {
            "best_of"
        };
        assert!(text.contains(key), "{text}");
    }
}

/// `echo`: the text starts with the prompt; with `logprobs` the decode worker computes the
/// prompt itself (its log-probabilities need every position), so no prefill worker is asked
/// even though one has joined; a prompt of token ids in a list (as lm-evaluation-harness sends
/// it) is one prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_starts_with_the_prompt_and_prompt_logprobs_stay_on_the_decode_worker() {
    let st = state(Duration::from_secs(5));
    let kv = Arc::new(Kv::default());
    let d = Fake::new(tokens(&[7, 8]), PrefillScript::Deliver, kv.clone());
    let p = Fake::new(tokens(&[]), PrefillScript::Deliver, kv);
    join(&st, Pool::Decode, &d).await;
    join(&st, Pool::Prefill, &p).await;
    let body = json!({"prompt": "hello there", "max_tokens": 2, "echo": true});
    let (got, text) = call(&st, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(got, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("hello there"),
        "{v}"
    );
    let ids = st.tokenizer.encode("hello there").unwrap();
    let body = json!({"prompt": [ids], "max_tokens": 2, "echo": true, "logprobs": 1});
    let (got, text) = call(&st, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(got, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let lp = &v["choices"][0]["logprobs"];
    // The prompt's entries (this fake sends no log-probabilities of its own).
    let pieces: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(pieces.concat(), "hello there", "{v}");
    assert_eq!(lp["text_offset"][1], json!("hello".len()));
    assert_eq!(
        lp["token_logprobs"][0],
        Value::Null,
        "the first prompt token has none"
    );
    let (dg, pf) = (d.seen.lock().unwrap(), p.seen.lock().unwrap());
    assert_eq!(
        (dg.generate[0].1, dg.generate[1].1),
        (true, false),
        "remote prefill only without prompt logprobs"
    );
    assert!(dg.params[1].prompt_logprobs && !dg.params[0].prompt_logprobs);
    assert_eq!(dg.generate[1].2, ids);
    assert_eq!(
        pf.prefill.len(),
        1,
        "only the plain echo went through the prefill pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_controls_reach_the_decode_worker_as_sent() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    let body = json!({"prompt": "hi", "max_tokens": 3, "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "repetition_penalty": 1.1, "logit_bias": {"7": 5, "11": -100},
        "min_p": 0.05, "min_tokens": 2, "stop_token_ids": [9]});
    let (got, text) = call(&st, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(got, StatusCode::OK, "{text}");
    let p = d.seen.lock().unwrap().params[0].clone();
    assert_eq!(
        (
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty
        ),
        (0.5, -0.25, 1.1)
    );
    assert_eq!(p.logit_bias, [(7, 5.0), (11, -100.0)].into_iter().collect());
    assert_eq!((p.min_p, p.min_tokens, p.generated), (0.05, 2, 0));
    assert_eq!(p.stop_token_ids, [9]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_and_headers_get_openai_errors() {
    let st = state_with(Duration::from_secs(5), |s| {
        s.limits.max_body_bytes = 2048;
        s.limits.max_header_bytes = 1024;
    });
    let big = json!({"prompt": "x".repeat(4096), "max_tokens": 1});
    let (got, text) = call(&st, "POST", "/v1/completions", Some(big)).await;
    assert_eq!(got, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "payload_too_large");
    let req = Request::builder()
        .method("GET")
        .uri("/health")
        .header("x-padding", "y".repeat(2000))
        .body(Body::empty())
        .unwrap();
    let resp = router::app(st.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["error"]["code"], "headers_too_large");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_api_keys_a_request_needs_a_known_one() {
    let keys: std::collections::HashSet<String> = ["sk-good".to_string()].into();
    let st = state_with(Duration::from_secs(5), |s| {
        s.limits.api_keys = Some(Arc::new(keys))
    });
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    let ask = |key: Option<&str>| {
        let mut req = Request::builder()
            .method("POST")
            .uri("/v1/completions")
            .header("content-type", "application/json");
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let body = json!({"prompt": "hi", "max_tokens": 1}).to_string();
        req.body(Body::from(body)).unwrap()
    };
    for (key, want) in [
        (None, StatusCode::UNAUTHORIZED),
        (Some("sk-bad"), StatusCode::UNAUTHORIZED),
        (Some("sk-good"), StatusCode::OK),
    ] {
        let resp = router::app(st.clone()).oneshot(ask(key)).await.unwrap();
        assert_eq!(resp.status(), want, "{key:?}");
    }
    let (got, _) = call(&st, "GET", "/health", None).await;
    assert_ne!(got, StatusCode::UNAUTHORIZED, "probes need no key");
    let (got, _) = call(&st, "GET", "/debug/workers", None).await;
    assert_eq!(got, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_deadline_gets_a_504_and_is_released_on_its_worker() {
    let st = state_with(Duration::from_secs(5), |s| {
        s.core.request_timeout = Duration::from_millis(300)
    });
    let d = Fake::new(
        DecodeScript::Slow(vec![1; 20]),
        PrefillScript::Deliver,
        Arc::default(),
    );
    join(&st, Pool::Decode, &d).await;
    let body = json!({"prompt": "hi", "max_tokens": 20});
    let (got, text) = call(&st, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(got, StatusCode::GATEWAY_TIMEOUT, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "timeout");
    let id = d.seen.lock().unwrap().generate[0].0;
    assert!(d.wait_until(|s| s.cancel.contains(&id)).await, "released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_models_and_debug_workers() {
    let st = state(Duration::from_secs(5));
    let (code, _) = call(&st, "GET", "/health", None).await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "no worker yet");
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    let p = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    join(&st, Pool::Prefill, &p).await;
    let (code, text) = call(&st, "GET", "/health", None).await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let (_, text) = call(&st, "GET", "/v1/models", None).await;
    assert!(text.contains("SmolLM2-135M-Instruct.Q4_1"));
    let (_, text) = call(&st, "GET", "/debug/workers", None).await;
    let v: Value = serde_json::from_str(&text).unwrap();
    let ws = v["workers"].as_array().unwrap();
    assert_eq!(ws.len(), 2);
    assert_eq!(ws[0]["role"], "decode");
    assert_eq!(
        ws[0]["stats"]["kv_blocks_total"], 64,
        "live stats from the Worker service"
    );
    assert_eq!(ws[0]["kv_offers"][0][0], "tcp");
}

// Routing by the KV index.

/// Tells the registry, as worker `id`'s heartbeat would, that its cache holds `prompt`'s blocks.
fn cached_on(st: &State, id: WorkerId, prompt: &[u32]) {
    let blocks =
        engine::block_hash::prompt_hashes(st.core.block_seed, 16, &prompt[..prompt.len() - 1]);
    let kv = grpc::KvEvents {
        first: 0,
        next: blocks.len() as u64,
        hashes: blocks.iter().map(|b| b.0).collect(),
        stored: Vec::new(),
        snapshot: true,
    };
    let beat = grpc::Heartbeat {
        worker_id: id.0,
        load: Some(grpc::WorkerLoad::default()),
        kv: Some(kv),
    };
    assert!(
        !st.registry.beat(beat).unwrap(),
        "a snapshot needs no resync"
    );
}

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

// Migration: a decode worker lost mid-stream.

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

/// vLLM's tokenizer endpoints (lm-evaluation-harness counts tokens through them): text to the
/// model's tokens and back, the special tokens and context; bad input is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizer_endpoints_round_trip_and_refuse_bad_input() {
    let st = state(Duration::from_secs(5));
    let text = "Hello, world! 123";
    let body = json!({"prompt": text, "add_special_tokens": false});
    let (got, out) = call(&st, "POST", "/tokenize", Some(body)).await;
    assert_eq!(got, StatusCode::OK, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(ids, st.tokenizer.encode_with(text, false).unwrap());
    assert_eq!(v["count"], json!(ids.len()));
    assert_eq!(v["max_model_len"], json!(st.context_len));
    let (got, out) = call(&st, "POST", "/detokenize", Some(json!({"tokens": ids}))).await;
    assert_eq!(got, StatusCode::OK, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["prompt"], text);
    let (got, out) = call(&st, "GET", "/tokenizer_info", None).await;
    assert_eq!(got, StatusCode::OK, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["eos_token"].is_string(), "{v}");
    let bad = [
        ("/detokenize", json!({"tokens": [u32::MAX]})),
        ("/tokenize", json!({"prompt": "x", "messages": []})),
        ("/tokenize", json!({"text": "x"})),
        ("/tokenize", json!({"prompt": "x", "model": "nope"})),
    ];
    for (path, body) in bad {
        let (got, out) = call(&st, "POST", path, Some(body.clone())).await;
        assert!(got.is_client_error(), "{path} {body}: {got} {out}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert!(v["error"]["message"].is_string(), "{out}");
    }
}

/// `response_format` and the `guided_*` extensions reach the decode worker as one constraint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_formats_reach_the_decode_worker_as_constraints() {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let bodies = [
        json!({"messages": msgs, "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}),
        json!({"messages": msgs, "max_tokens": 2, "response_format": {"type": "json_object"}}),
        json!({"prompt": "hi", "max_tokens": 2, "guided_regex": "[0-9]+"}),
        json!({"prompt": "hi", "max_tokens": 2, "guided_choice": ["yes", "no"]}),
        json!({"messages": msgs, "max_tokens": 2, "response_format": {"type": "text"}}),
    ];
    for body in &bodies {
        let path = if body.get("prompt").is_some() {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let (got, text) = call(&st, "POST", path, Some(body.clone())).await;
        assert_eq!(got, StatusCode::OK, "{body}: {text}");
    }
    let seen: Vec<Value> = d
        .seen
        .lock()
        .unwrap()
        .params
        .iter()
        .map(|p| {
            if p.constraint.is_empty() {
                Value::Null
            } else {
                serde_json::from_str(&p.constraint).unwrap()
            }
        })
        .collect();
    assert_eq!(
        seen,
        [
            json!({"json_schema": schema}),
            json!({"json_schema": {"type": "object"}}),
            json!({"regex": "[0-9]+"}),
            json!({"choice": ["yes", "no"]}),
            Value::Null,
        ]
    );
}

/// `n = 3`: three choices with their indices, whole and streamed; the first goes through the
/// prefill pool, the other two to the same decode worker with their own seeds and no prefill
/// (the prompt's KV is cached there by then); usage counts every choice's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_the_first_ones_decode_worker() {
    let st = state(Duration::from_secs(5));
    let kv = Arc::new(Kv::default());
    let d1 = Fake::new(tokens(&[7, 8]), PrefillScript::Deliver, kv.clone());
    let d2 = Fake::new(tokens(&[7, 8]), PrefillScript::Deliver, kv.clone());
    let p = Fake::new(tokens(&[]), PrefillScript::Deliver, kv);
    join(&st, Pool::Decode, &d1).await;
    join(&st, Pool::Decode, &d2).await;
    join(&st, Pool::Prefill, &p).await;
    let body = json!({"prompt": "hello there my friend", "max_tokens": 2, "n": 3, "seed": 10, "temperature": 1});
    let (got, text) = call(&st, "POST", "/v1/completions", Some(body.clone())).await;
    assert_eq!(got, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let idx: Vec<u64> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(idx, [0, 1, 2]);
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    let (s1, s2) = (
        d1.seen.lock().unwrap().clone(),
        d2.seen.lock().unwrap().clone(),
    );
    let (mine, other) = if s1.generate.len() == 3 {
        (s1, s2)
    } else {
        (s2, s1)
    };
    assert!(other.generate.is_empty(), "all three on one decode worker");
    let remote: Vec<bool> = mine.generate.iter().map(|g| g.1).collect();
    assert_eq!(
        remote,
        [true, false, false],
        "only the first through the prefill pool"
    );
    let mut seeds: Vec<u64> = mine.params.iter().map(|p| p.seed).collect();
    seeds.sort_unstable();
    assert_eq!(seeds, [10, 11, 12]);
    assert_eq!(p.seen.lock().unwrap().prefill.len(), 1);
    // Streamed: chunks of every index, each choice's finish, [DONE] once at the end.
    let mut body = body;
    body["stream"] = json!(true);
    let (got, text) = call(&st, "POST", "/v1/completions", Some(body)).await;
    assert_eq!(got, StatusCode::OK, "{text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1);
    let mut finished = Vec::new();
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        if !c["finish_reason"].is_null() {
            finished.push(c["index"].as_u64().unwrap());
        }
    }
    finished.sort_unstable();
    assert_eq!(finished, [0, 1, 2]);
}
