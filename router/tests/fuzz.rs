//! A fuzz target for the router's HTTP surface: arbitrary methods, paths, headers and bodies —
//! random bytes, random JSON, and valid requests with fields replaced by random values — sent
//! with `oneshot` to the router's app over fake workers (named as such, `fake/`), for
//! `TANDEM_FUZZ_SECS` seconds (10 by default; `TANDEM_FUZZ_SECS=600` for the 10-minute run).
//! Nothing may panic — the handlers nor the request tasks they spawn — and every answer is a
//! well-formed success or an OpenAI error body.
//!
//! `TANDEM_FUZZ_SEED` replays a run.

// Its own test binary, not a module of `all`: its panic hook is the process's, and it fails on
// any panic while it runs — another test's would count.
#[path = "all/fake/mod.rs"]
mod fake;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use fake::{join, keep_beating, state_on, DecodeScript, Fake, Fault, PrefillScript};
use http_body_util::BodyExt;
use proto::Pool;
use router::registry::Liveness;
use serde_json::{json, Map, Value};
use tower::ServiceExt;

/// xorshift64*: the fuzzer's random source, from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
    fn chance(&mut self, in_n: usize) -> bool {
        self.below(in_n) == 0
    }
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "echo",
    "tools",
    "tool_choice",
    "response_format",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "best_of",
    "suffix",
    "role",
    "content",
    "include_usage",
    "type",
    "text",
];

fn string(r: &mut Rng) -> String {
    let pieces = [
        "",
        "hi",
        "user",
        "assistant",
        "system",
        "banana",
        "SmolLM2-135M-Instruct.Q4_1",
        "\u{0}",
        "é",
        "🦀",
        "<|im_start|>",
        "<|im_end|>",
        "\\",
        "\"",
        "null",
        "-1",
        "1e309",
        "text",
    ];
    match r.below(4) {
        0 => "x".repeat(r.below(5000)),
        1 => (0..r.below(40))
            .map(|_| char::from_u32(r.below(0x11_0000) as u32).unwrap_or('?'))
            .collect(),
        _ => (0..1 + r.below(4)).map(|_| *r.pick(&pieces)).collect(),
    }
}

fn number(r: &mut Rng) -> Value {
    match r.below(8) {
        0 => json!(r.next() as i64),
        1 => json!(-(r.below(10) as i64)),
        2 => json!(r.below(3) as f64 * 0.7),
        3 => json!(u64::MAX),
        4 => json!(1e300),
        5 => json!(49_151 + r.below(4) as u64),
        _ => json!(r.below(64)),
    }
}

/// A random JSON value, nested at most `depth` deep.
fn value(r: &mut Rng, depth: usize) -> Value {
    match r.below(if depth == 0 { 5 } else { 7 }) {
        0 => Value::Null,
        1 => json!(r.chance(2)),
        2 | 3 => number(r),
        4 => json!(string(r)),
        5 => Value::Array((0..r.below(6)).map(|_| value(r, depth - 1)).collect()),
        _ => {
            let m: Map<String, Value> = (0..r.below(6))
                .map(|_| (r.pick(FIELDS).to_string(), value(r, depth - 1)))
                .collect();
            Value::Object(m)
        }
    }
}

/// A request a client might mean, before mutation.
fn valid(r: &mut Rng, chat: bool) -> Value {
    let mut v = json!({"max_tokens": 1 + r.below(6), "stream": r.chance(2)});
    if chat {
        v["messages"] = json!([{"role": "user", "content": "hi"}]);
    } else if r.chance(2) {
        v["prompt"] = json!("once upon a time");
    } else {
        v["prompt"] = json!((0..1 + r.below(20)).map(|i| 100 + i).collect::<Vec<_>>());
    }
    v
}

/// A valid request with a few fields replaced, added or removed at random.
fn mutated(r: &mut Rng, chat: bool) -> Value {
    let mut v = valid(r, chat);
    let m = v.as_object_mut().unwrap();
    for _ in 0..1 + r.below(3) {
        let key = r.pick(FIELDS).to_string();
        match r.below(4) {
            0 => {
                m.remove(&key);
            }
            _ => {
                m.insert(key, value(r, 3));
            }
        }
    }
    v
}

fn body(r: &mut Rng, chat: bool) -> Vec<u8> {
    match r.below(10) {
        0 => (0..r.below(300)).map(|_| r.next() as u8).collect(),
        1 => value(r, 4).to_string().into_bytes(),
        2 => {
            let mut b = mutated(r, chat).to_string().into_bytes();
            b.truncate(r.below(b.len() + 1));
            b
        }
        _ => mutated(r, chat).to_string().into_bytes(),
    }
}

fn request(r: &mut Rng) -> Request<Body> {
    let paths = [
        "/v1/chat/completions",
        "/v1/chat/completions",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/debug/workers",
        "/v1/nothing",
        "/%ff%00",
        "/v1/chat/completions?x=1",
    ];
    let path = *r.pick(&paths);
    let chat = path.contains("chat");
    let method = *r.pick(&["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH"]);
    let types = [
        "application/json",
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "",
    ];
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", *r.pick(&types));
    if r.chance(8) {
        b = b.header(
            "authorization",
            format!("Bearer {}", string(r).replace(['\r', '\n', '\0'], "")),
        );
    }
    if r.chance(10) {
        b = b.header("x-padding", "p".repeat(r.below(40_000)));
    }
    let built = b.body(Body::from(body(r, chat)));
    built.unwrap_or_else(|_| Request::new(Body::empty()))
}

/// Checks one answer: an OpenAI error body for every error; JSON or a stream ending in
/// `[DONE]` (or an error event) for a success.
fn check(status: u16, bytes: &[u8], what: &str) {
    let text = String::from_utf8_lossy(bytes);
    let is_error = serde_json::from_slice::<Value>(bytes).is_ok_and(|v| v.get("error").is_some());
    if what.ends_with("GET /health") && !is_error {
        // A probe's answer: 200 or 503 with the pools' state.
        let v: Value = serde_json::from_slice(bytes).unwrap_or_default();
        assert!(v["status"].is_string(), "{what}: {text}");
        return;
    }
    if status >= 400 {
        let v: Value = serde_json::from_slice(bytes).unwrap_or_else(|e| {
            panic!("{what}: status {status} without a JSON error body ({e}): {text}")
        });
        assert!(v["error"]["message"].is_string(), "{what}: {text}");
        assert!(
            v["error"]["type"].is_string() && v["error"]["code"].is_string(),
            "{what}: {text}"
        );
        return;
    }
    if text.starts_with("data:") || text.starts_with("event:") {
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "{what}: a stream must end: {text}"
        );
    } else if text.starts_with("<!doctype html>") {
        // The status page (GET / or /status).
        assert!(text.contains("tandem-status"), "{what}: {text}");
    } else if !text.is_empty() && !text.starts_with('#') {
        serde_json::from_slice::<Value>(bytes).unwrap_or_else(|e| panic!("{what}: {e}: {text}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_requests_never_panic_the_router_and_every_error_is_an_openai_body() {
    let secs: u64 = std::env::var("TANDEM_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let seed: u64 = std::env::var("TANDEM_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    // Panics on any thread (a request task included) are counted, not only the test's own.
    let panics = Arc::new(AtomicUsize::new(0));
    let seen = panics.clone();
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        seen.fetch_add(1, Ordering::SeqCst);
        default(info);
    }));
    let st = state_on(Liveness::default(), Duration::from_secs(2), |s| {
        s.limits.max_body_bytes = 64 << 10;
        s.core.request_timeout = Duration::from_secs(5);
    });
    // One colocated decode worker: it counts on from each prompt (a fake; no reservations).
    let d = Fake::new(
        DecodeScript::Count(Fault::None),
        PrefillScript::Deliver,
        Arc::default(),
    );
    let id = join(&st, Pool::Decode, &d).await;
    keep_beating(&st, id, None);
    let app = router::app(st.clone());
    let mut r = Rng(seed);
    let (t0, mut n, mut ok, mut slowest) = (Instant::now(), 0u64, 0u64, Duration::ZERO);
    while t0.elapsed() < Duration::from_secs(secs) {
        let req = request(&mut r);
        let what = format!("seed {seed}, request {n}: {} {}", req.method(), req.uri());
        let t = Instant::now();
        let resp = app.clone().oneshot(req).await.expect("infallible");
        let status = resp.status().as_u16();
        let bytes = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
            .await
            .unwrap_or_else(|_| panic!("{what}: the body did not end within 10 s"))
            .expect("a body")
            .to_bytes();
        check(status, &bytes, &what);
        slowest = slowest.max(t.elapsed());
        ok += (status < 300) as u64;
        n += 1;
    }
    eprintln!("{n} requests in {secs} s ({ok} served, the slowest {slowest:?}), seed {seed}");
    assert_eq!(
        st.registry.count(Pool::Decode),
        1,
        "no request made the router drop its worker"
    );
    assert_eq!(
        panics.load(Ordering::SeqCst),
        0,
        "seed {seed}: something panicked"
    );
    assert!(
        ok > 0 && ok < n,
        "seed {seed}: both successes ({ok}) and errors ({n})"
    );
}
