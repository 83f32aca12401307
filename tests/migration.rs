//! Nothing lost, nothing hung (issue 13), on real clusters of the real engine: a decode worker
//! killed, frozen or sent `SIGTERM` mid-stream, a prefill worker killed or frozen mid-prefill. Every stream
//! completes with exactly the tokens of an unfailed run, or — past the migration limit — ends
//! with an error event; reserved KV is freed; the path taken is asserted from the router's
//! metrics (migrations, recomputes, transfers).

use std::time::{Duration, Instant};

use engine::{Engine, EngineConfig, SamplingParams};
use serde_json::{json, Value};
use tandem_tests::cluster::{metric_at, metric_sum, request, Cluster, Response};
use tandem_tests::load_model;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// What the engine alone generates for a chat message (the unfailed run), as text.
fn engine_text(message: &str, params: SamplingParams) -> String {
    tandem_tests::engine_chat(message, params).0
}

/// Opens a streamed chat completion of `message` with `params` (as JSON fields).
fn open_stream(c: &Cluster, message: &str, params: Value) -> Response {
    let mut body = json!({"model": MODEL, "stream": true,
                          "messages": [{"role": "user", "content": message}]});
    body.as_object_mut()
        .unwrap()
        .extend(params.as_object().unwrap().clone());
    let r = request(
        c.http,
        "POST",
        "/v1/chat/completions",
        "application/json",
        &body.to_string(),
    );
    let r = r.unwrap();
    assert_eq!(r.status, 200);
    r
}

/// The text of the next `n` content chunks (fewer if the stream ends).
fn read_chunks(r: &mut Response, n: usize) -> String {
    let mut text = String::new();
    for _ in 0..n {
        match r.next_event() {
            Some((name, data)) if data != "[DONE]" => {
                assert_eq!(name, "message", "{data}");
                let v: Value = serde_json::from_str(&data).unwrap();
                text += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
            }
            _ => break,
        }
    }
    text
}

/// The rest of a stream: its text, and the error event's message if it ended with one.
fn read_rest(r: &mut Response) -> (String, Option<String>) {
    let mut text = String::new();
    while let Some((name, data)) = r.next_event() {
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        if name == "error" {
            return (text, v["error"]["message"].as_str().map(String::from));
        }
        text += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
    }
    (text, None)
}

/// The rest of a stream that must end well: its text and the longest wait for an event.
fn read_timed(r: &mut Response) -> (String, Duration) {
    let (mut text, mut gap) = (String::new(), Duration::ZERO);
    let mut t = Instant::now();
    while let Some((name, data)) = r.next_event() {
        gap = gap.max(t.elapsed());
        t = Instant::now();
        if data == "[DONE]" {
            return (text, gap);
        }
        assert_eq!(name, "message", "{data}");
        let v: Value = serde_json::from_str(&data).unwrap();
        text += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
    }
    panic!("the stream ended without [DONE]");
}

/// The decode worker running the cluster's one stream, once it runs.
fn serving(c: &Cluster) -> String {
    let t0 = Instant::now();
    loop {
        if let [one] = c.decoding().as_slice() {
            return one.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "a decode worker runs the stream"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_decode_worker_killed_mid_stream_is_invisible_to_the_client_greedy_seeded_penalised_and_structured(
) {
    let mut c = Cluster::start(EXE.as_ref(), 1, 2);
    let greedy = (
        "Tell me a story about a lighthouse keeper.",
        json!({"temperature": 0, "max_tokens": 40}),
        SamplingParams::greedy(40),
    );
    let seeded = (
        "Write a poem about the sea.",
        json!({"temperature": 0.8, "top_p": 0.95, "seed": 42, "max_tokens": 40}),
        SamplingParams {
            max_tokens: Some(40),
            temperature: 0.8,
            top_p: 0.95,
            seed: 42,
            ..Default::default()
        },
    );
    // Penalties count the output: after a migration the streamed tokens, now part of the
    // resumed prompt, still count as output (the router says how many there are).
    let penalised = (
        "Tell me a story about a lighthouse keeper.",
        json!({"temperature": 0, "max_tokens": 40, "presence_penalty": 1.2, "frequency_penalty": 0.8}),
        SamplingParams {
            presence_penalty: 1.2,
            frequency_penalty: 0.8,
            ..SamplingParams::greedy(40)
        },
    );
    // A grammar resumes where it was: the resumed worker's guide replays the streamed tokens.
    let schema = tandem_tests::structured::schema();
    let structured = (
        "Describe a lighthouse keeper as JSON.",
        json!({"temperature": 0.8, "seed": 3, "max_tokens": 120,
               "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}),
        SamplingParams {
            temperature: 0.8,
            seed: 3,
            constraint: Some(engine::sampler::Constraint::JsonSchema(schema.clone())),
            ..SamplingParams::greedy(120)
        },
    );
    let cases = [greedy, seeded, penalised, structured];
    for (k, (message, params, engine_params)) in cases.into_iter().enumerate() {
        let mut r = open_stream(&c, message, params);
        let mut text = read_chunks(&mut r, 6);
        c.kill_worker(&serving(&c));
        let (rest, error) = read_rest(&mut r);
        assert_eq!(error, None);
        text += &rest;
        let structured = engine_params.constraint.is_some();
        assert_eq!(text, engine_text(message, engine_params), "stream {k}");
        if structured {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert!(tandem_tests::structured::valid(&v), "{v}");
        }
        let migrations = metric_at(c.operator, "tandem_router_migrations_total");
        assert_eq!(migrations, (k + 1) as f64, "the stream moved once");
        // The other decode worker served the rest; a new one joins for the next stream.
        let cfg = c.config(&Cluster::of(1, 1));
        c.add_worker("decode", &format!("decode-new-{k}"), &cfg);
        c.wait_for(1, 2);
    }
    c.wait_all_free(Duration::from_secs(5));
}

#[test]
fn past_the_migration_limit_a_killed_decode_worker_ends_the_stream_with_an_error_event() {
    let mut c = Cluster::of(1, 2)
        .router("migration_limit = 0")
        .start(EXE.as_ref());
    let mut r = open_stream(&c, "Tell me a very long story.", json!({"max_tokens": 400}));
    read_chunks(&mut r, 5);
    c.kill_worker(&serving(&c));
    let t0 = Instant::now();
    let (_, error) = read_rest(&mut r);
    let error = error.expect("an error event, never silence");
    assert!(error.contains("migration_limit = 0"), "{error}");
    assert!(t0.elapsed() < Duration::from_secs(10), "promptly");
    assert_eq!(metric_at(c.operator, "tandem_router_migrations_total"), 0.0);
}

#[test]
fn a_frozen_decode_worker_hands_its_eight_streams_over_and_rejoins_when_thawed() {
    let mut c = Cluster::start(EXE.as_ref(), 1, 1);
    let message = "Tell me a story about a lighthouse keeper.";
    // Long enough answers (200 tokens) to still be running once a second worker has joined.
    let params = json!({"temperature": 0, "max_tokens": 200, "ignore_eos": true});
    let mut streams: Vec<Response> = (0..8)
        .map(|_| open_stream(&c, message, params.clone()))
        .collect();
    let texts: Vec<String> = streams.iter_mut().map(|r| read_chunks(r, 3)).collect();
    let cfg = c.config(&Cluster::of(1, 1));
    c.add_worker("decode", "decode-1", &cfg);
    c.wait_for(1, 2);
    let running = |c: &Cluster, name: &str| {
        let ws = c.workers();
        let w = ws.iter().find(|w| w["name"] == name).expect("joined");
        w["stats"]["running"].as_u64().unwrap_or(0)
    };
    assert_eq!(running(&c, "decode-0"), 8, "decode-0 holds the 8 streams");
    c.signal_worker("decode-0", libc::SIGSTOP);
    let frozen = Instant::now();
    // Each stream read to its end on a thread of its own; its longest wait for a chunk is the
    // handover.
    let readers: Vec<_> = streams
        .into_iter()
        .map(|mut r| std::thread::spawn(move || read_timed(&mut r)))
        .collect();
    let want = engine_text(
        message,
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(200)
        },
    );
    let mut gaps = Vec::new();
    for (i, (t, prefix)) in readers.into_iter().zip(texts).enumerate() {
        let (rest, gap) = t.join().unwrap();
        assert_eq!(prefix + &rest, want, "stream {i}");
        gaps.push(gap);
    }
    let longest = gaps.iter().max().unwrap();
    eprintln!("the longest wait for a token after the freeze, per stream: {gaps:?}");
    assert!(
        *longest < Duration::from_secs(5),
        "every stream moved on within 5 s of the freeze ({gaps:?}, {:?} in all)",
        frozen.elapsed()
    );
    assert_eq!(metric_at(c.operator, "tandem_router_migrations_total"), 8.0);
    // Thawed, it rejoins (its old streams released) and serves again.
    c.signal_worker("decode-0", libc::SIGCONT);
    c.wait_for(1, 2);
    c.wait_all_free(Duration::from_secs(10));
}

/// A decode worker sent `SIGTERM` mid-stream (how Kubernetes deletes a pod) moves the stream
/// live: its heartbeat says it drains, the router has it pause the sequence and hand its KV to
/// the other decode worker, where it goes on — exactly the tokens of an undisturbed run, greedy,
/// seeded and penalised, nothing computed again (no migration, no recomputation; the KV bytes
/// moved are counted) — admits nothing new, and exits 0 within 10 s, long before its 300-token
/// stream would have ended there. A new decode worker joins for each round.
#[test]
fn a_worker_sent_sigterm_moves_its_stream_live_and_exits() {
    let mut c = Cluster::start(EXE.as_ref(), 1, 2);
    let n = 300;
    let cases = [
        (
            "Tell me a story about a lighthouse keeper.",
            json!({"temperature": 0, "max_tokens": n, "ignore_eos": true}),
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(n)
            },
        ),
        (
            "Write a poem about the sea.",
            json!({"temperature": 0.8, "top_p": 0.95, "seed": 42, "max_tokens": n, "ignore_eos": true}),
            SamplingParams {
                max_tokens: Some(n),
                temperature: 0.8,
                top_p: 0.95,
                seed: 42,
                ignore_eos: true,
                ..Default::default()
            },
        ),
        (
            "Tell me a story about a lighthouse keeper.",
            json!({"temperature": 0, "max_tokens": n, "ignore_eos": true,
                   "presence_penalty": 1.2, "frequency_penalty": 0.8}),
            SamplingParams {
                presence_penalty: 1.2,
                frequency_penalty: 0.8,
                ignore_eos: true,
                ..SamplingParams::greedy(n)
            },
        ),
    ];
    let count = |c: &Cluster, series: &str| metric_at(c.operator, series);
    for (k, (message, params, engine_params)) in cases.into_iter().enumerate() {
        let mut r = open_stream(&c, message, params);
        let mut text = read_chunks(&mut r, 4);
        let drained = serving(&c);
        c.signal_worker(&drained, libc::SIGTERM);
        let signalled = Instant::now();
        // The stream is read meanwhile: the worker's exit waits on nothing of the client's.
        let ((rest, gap), (status, exited)) = std::thread::scope(|s| {
            let reader = s.spawn(|| read_timed(&mut r));
            let status = c.wait_exit(&drained, Duration::from_secs(10));
            (reader.join().unwrap(), (status, signalled.elapsed()))
        });
        text += &rest;
        assert_eq!(text, engine_text(message, engine_params), "stream {k}");
        assert!(status.success(), "{status:?}");
        let moved = metric_sum(c.operator, "tandem_router_moved_kv_bytes_total");
        let took = metric_sum(c.operator, "tandem_router_move_transfer_seconds_sum");
        eprintln!(
            "stream {k}: {drained} exited {exited:?} after SIGTERM; longest gap {gap:?}; \
             {moved} KV bytes moved in {took:.4} s so far"
        );
        let moves = count(&c, "tandem_router_moves_total{why=\"draining\"}");
        assert_eq!(moves, (k + 1) as f64, "moved live once a round");
        assert!(moved > 0.0, "its KV moved, not computed again");
        assert_eq!(count(&c, "tandem_router_migrations_total"), 0.0);
        assert_eq!(
            count(&c, "tandem_kv_transfer_failures_total"),
            0.0,
            "nothing recomputed"
        );
        let cfg = c.config(&Cluster::of(1, 1));
        c.add_worker("decode", &format!("decode-new-{k}"), &cfg);
        c.wait_for(1, 2);
    }
    // A new request after it all is served; the prefill worker, idle, drains at once.
    let mut r = open_stream(&c, "Hi", json!({"temperature": 0, "max_tokens": 8}));
    let (_, error) = read_rest(&mut r);
    assert_eq!(error, None);
    c.signal_worker("prefill-0", libc::SIGTERM);
    assert!(c.wait_exit("prefill-0", Duration::from_secs(5)).success());
    c.wait_all_free(Duration::from_secs(5));
}

/// A worker still holding a stream at its drain deadline (`drain_timeout_ms`) exits then: the
/// stream goes on on the other decode worker and ends with exactly the undisturbed tokens —
/// migrated when the worker left before the router could move it live (100 ms is less than a
/// heartbeat), or moved.
#[test]
fn past_its_drain_deadline_a_worker_exits_and_its_stream_moves() {
    let mut c = Cluster::of(1, 2)
        .pools(["", "drain_timeout_ms = 100"])
        .start(EXE.as_ref());
    let message = "Write a poem about the sea.";
    // 400 tokens: far more than 100 ms of decoding.
    let params = json!({"temperature": 0, "max_tokens": 400, "ignore_eos": true});
    let mut r = open_stream(&c, message, params);
    let mut text = read_chunks(&mut r, 4);
    let drained = serving(&c);
    c.signal_worker(&drained, libc::SIGTERM);
    assert!(c.wait_exit(&drained, Duration::from_secs(10)).success());
    let (rest, error) = read_rest(&mut r);
    assert_eq!(error, None);
    text += &rest;
    let want = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(400)
    };
    assert_eq!(text, engine_text(message, want));
    let migrations = metric_at(c.operator, "tandem_router_migrations_total");
    let moves = metric_at(c.operator, "tandem_router_moves_total{why=\"draining\"}");
    assert_eq!(migrations + moves, 1.0, "left its worker once");
}

/// What the engine alone generates for `prompt` (token ids), `n` tokens whatever is sampled.
fn cold(prompt: &[u32], n: usize) -> String {
    let (model, tok) = load_model();
    let mut e = Engine::new(model, EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    };
    e.add(engine::RequestId(0), prompt.to_vec(), params)
        .unwrap();
    let out = e
        .run_to_completion()
        .unwrap()
        .remove(&engine::RequestId(0))
        .unwrap();
    tok.decode(&out, true).unwrap()
}

/// The decode worker's blocks held for remote KV (reserved or on the wire).
fn reserved(c: &Cluster) -> u64 {
    c.workers()
        .iter()
        .filter(|w| w["role"] == "decode")
        .map(|w| {
            let s = &w["stats"];
            s["kv_blocks_reserved"].as_u64().unwrap_or(0)
                + s["kv_blocks_in_flight"].as_u64().unwrap_or(0)
        })
        .sum()
}

#[test]
fn a_prefill_worker_killed_or_frozen_mid_prefill_frees_the_reservation_and_the_request_completes() {
    let prompt: Vec<u32> = (0..1200).map(|i| 300 + (i * 7919) % 40_000).collect();
    let want = cold(&prompt, 8);
    for signal in [libc::SIGKILL, libc::SIGSTOP] {
        let c = Cluster::start(EXE.as_ref(), 1, 1);
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": true,
                          "temperature": 0});
        let http = c.http;
        let asked = std::thread::spawn(move || {
            tandem_tests::cluster::post_json(http, "/v1/completions", &body)
        });
        // The decode worker has reserved the prompt's blocks; the prefill (seconds of compute
        // here) is under way when its worker dies or freezes.
        let t0 = Instant::now();
        while reserved(&c) == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the decode worker reserves"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        c.signal_worker("prefill-0", signal);
        let hit = Instant::now();
        while reserved(&c) > 0 {
            // The lease (3 s) bounds it when the sender freezes; a dead one's connection ends.
            assert!(
                hit.elapsed() < Duration::from_secs(5),
                "signal {signal}: freed within the lease"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (status, v) = asked.join().unwrap();
        assert_eq!(status, 200, "signal {signal}: {v}");
        assert_eq!(v["choices"][0]["text"], want.as_str(), "signal {signal}");
        let recomputed = metric_at(
            c.operator,
            "tandem_router_request_phases_total{phase=\"recomputing\"}",
        );
        assert_eq!(
            recomputed, 1.0,
            "signal {signal}: computed again on the decode worker"
        );
        if signal == libc::SIGSTOP {
            c.signal_worker("prefill-0", libc::SIGCONT);
        }
        c.wait_all_free(Duration::from_secs(10));
    }
}
