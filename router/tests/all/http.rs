//! The router's HTTP handlers, driven with `oneshot` over fake workers: the OpenAI API's
//! answers, errors, limits and keys, and what reaches the decode worker.

use crate::fake;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use fake::*;
use http_body_util::BodyExt;
use proto::Pool;
use router::State;
use serde_json::{json, Value};
use tower::ServiceExt;

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
    // The operator's endpoints are on their own listener.
    let app = match uri.starts_with("/debug/") {
        true => router::operator(st.clone()),
        false => router::app(st.clone()),
    };
    let resp = app.oneshot(req.body(body).unwrap()).await.unwrap();
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
    let (st, d) = one_decode_worker().await;
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
        (
            json!({"messages": msgs, "stop_token_ids": vec![1; 257]}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            json!({"messages": msgs, "cache_salt": ""}),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            // More text than the context could hold at the longest token: never tokenised.
            json!({"messages": [{"role": "user", "content": "x".repeat(st.context_len * st.max_token_bytes + 1)}]}),
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

/// A chat request of one short message with `k` set to `v`.
fn chat_with(k: &str, v: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    b[k] = v;
    b
}

/// A router with one fake decode worker joined.
async fn one_decode_worker() -> (Arc<State>, Fake) {
    let st = state(Duration::from_secs(5));
    let d = Fake::new(tokens(&[1]), PrefillScript::Deliver, Arc::default());
    join(&st, Pool::Decode, &d).await;
    (st, d)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_the_server_does_not_implement_are_refused_not_ignored() {
    let (st, d) = one_decode_worker().await;
    let with = chat_with;
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
}

/// Defaults that ask for nothing, metadata and the developer role are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameters_that_ask_for_nothing_are_served() {
    let (st, d) = one_decode_worker().await;
    let with = chat_with;
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
    let n = served.len();
    for body in served {
        let (got, text) = call(&st, "POST", "/v1/chat/completions", Some(body.clone())).await;
        assert_eq!(got, StatusCode::OK, "{body}: {text}");
    }
    assert_eq!(d.seen.lock().unwrap().generate.len(), n);
}

/// Tools where the template renders none, and the completions API's `suffix` and `best_of`,
/// are refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_without_a_template_and_suffix_or_best_of_are_refused_by_name() {
    let (st, _d) = one_decode_worker().await;
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
    let (st, d) = one_decode_worker().await;
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
    // What maps the cluster is not on the API's port at all (with a key: not found; without:
    // the key is asked for first); the operator's listener serves it.
    let paths = [
        "/debug/workers",
        "/metrics",
        "/status",
        "/status.json",
        "/prometheus/targets",
        "/",
    ];
    for path in paths {
        for (key, want) in [
            (None, StatusCode::UNAUTHORIZED),
            (Some("sk-good"), StatusCode::NOT_FOUND),
        ] {
            let mut req = Request::builder().uri(path);
            if let Some(k) = key {
                req = req.header("authorization", format!("Bearer {k}"));
            }
            let resp = router::app(st.clone())
                .oneshot(req.body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(resp.status(), want, "{path} {key:?}");
        }
    }
    let (got, _) = call(&st, "GET", "/debug/workers", None).await;
    assert_eq!(got, StatusCode::OK, "on the operator's listener");
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
    let (st, d) = one_decode_worker().await;
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
