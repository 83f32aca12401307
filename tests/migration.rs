//! Nothing lost, nothing hung (issue 13), on real clusters of the real engine: a decode worker
//! killed, frozen or sent `SIGTERM` mid-stream, a prefill worker killed or frozen mid-prefill. Every stream
//! completes with exactly the tokens of an unfailed run, or — past the migration limit — ends
//! with an error event; reserved KV is freed; the path taken is asserted from the router's
//! metrics (migrations, recomputes, transfers).

use std::time::{Duration, Instant};

use engine::{Engine, EngineConfig, SamplingParams};
use serde_json::{json, Value};
use tandem_tests::cluster::{metric_at, metric_sum, Cluster, Response};
use tandem_tests::load_model;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// What the engine alone generates for a chat message (the unfailed run), as text.
fn engine_text(message: &str, params: SamplingParams) -> String {
    tandem_tests::engine_chat(message, params).0
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
        let mut r = c.open_chat(MODEL, message, params);
        let mut text = r.read_chunks(6);
        c.kill_worker(&c.serving());
        let (rest, error) = read_rest(&mut r);
        assert_eq!(error, None);
        text += &rest;
        let structured = engine_params.constraint.is_some();
        assert_eq!(
            text,
            engine_text(message, engine_params),
            "stream {k}; {}",
            c.paths()
        );
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
    let mut r = c.open_chat(
        MODEL,
        "Tell me a very long story.",
        json!({"max_tokens": 400}),
    );
    r.read_chunks(5);
    c.kill_worker(&c.serving());
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
        .map(|_| c.open_chat(MODEL, message, params.clone()))
        .collect();
    let texts: Vec<String> = streams.iter_mut().map(|r| r.read_chunks(3)).collect();
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
        assert_eq!(prefix + &rest, want, "stream {i}; {}", c.paths());
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
        let mut r = c.open_chat(MODEL, message, params);
        let mut text = r.read_chunks(4);
        let drained = c.serving();
        c.signal_worker(&drained, libc::SIGTERM);
        let signalled = Instant::now();
        // The stream is read meanwhile: the worker's exit waits on nothing of the client's.
        let ((rest, gap), (status, exited)) = std::thread::scope(|s| {
            let reader = s.spawn(|| read_timed(&mut r));
            let status = c.wait_exit(&drained, Duration::from_secs(10));
            (reader.join().unwrap(), (status, signalled.elapsed()))
        });
        text += &rest;
        assert_eq!(
            text,
            engine_text(message, engine_params),
            "stream {k}; {}",
            c.paths()
        );
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
    let mut r = c.open_chat(MODEL, "Hi", json!({"temperature": 0, "max_tokens": 8}));
    let (_, error) = read_rest(&mut r);
    assert_eq!(error, None);
    c.signal_worker("prefill-0", libc::SIGTERM);
    assert!(c.wait_exit("prefill-0", Duration::from_secs(5)).success());
    c.wait_all_free(Duration::from_secs(5));
}

/// Under load: eight streams (greedy and seeded, 200 tokens each) over four decode workers, two
/// of which are sent `SIGTERM` at once. Every stream ends with exactly its undisturbed tokens;
/// the sequences those two held all move live (one move each, by the router's count; none
/// migrated, none recomputed, none failed) and both workers exit within 10 s.
#[test]
fn two_of_four_decode_workers_drained_under_load_move_every_stream_exactly() {
    let mut c = Cluster::start(EXE.as_ref(), 1, 4);
    let n = 200;
    let messages = [
        "Tell me a story about a lighthouse keeper.",
        "Write a poem about the sea.",
        "Explain how a bicycle works.",
        "Describe a walk through a forest in autumn.",
    ];
    let cases: Vec<(&str, Value, SamplingParams)> = (0..8)
        .map(|i| {
            let message = messages[i % 4];
            match i % 2 {
                0 => (
                    message,
                    json!({"temperature": 0, "max_tokens": n, "ignore_eos": true}),
                    SamplingParams {
                        ignore_eos: true,
                        ..SamplingParams::greedy(n)
                    },
                ),
                _ => (
                    message,
                    json!({"temperature": 0.9, "seed": i, "max_tokens": n, "ignore_eos": true}),
                    SamplingParams {
                        max_tokens: Some(n),
                        temperature: 0.9,
                        seed: i as u64,
                        ignore_eos: true,
                        ..Default::default()
                    },
                ),
            }
        })
        .collect();
    let mut streams: Vec<(Response, String)> = cases
        .iter()
        .map(|(m, p, _)| {
            let mut r = c.open_chat(MODEL, m, p.clone());
            let text = r.read_chunks(2);
            (r, text)
        })
        .collect();
    // Every stream has started; the two busiest decode workers go, with what they hold — read
    // once the workers' heartbeats count every stream (a stream begun since a worker's last
    // heartbeat is not in its stats yet).
    let running = |w: &Value| w["stats"]["running"].as_u64().unwrap_or(0);
    let decoding = || -> u64 {
        let ws = c.workers();
        ws.iter()
            .filter(|w| w["role"] == "decode")
            .map(running)
            .sum()
    };
    let all = streams.len() as u64;
    tandem_tests::wait_until("every stream counted", Duration::from_secs(10), || {
        decoding() == all
    });
    let mut busy: Vec<Value> = c
        .workers()
        .into_iter()
        .filter(|w| w["role"] == "decode")
        .collect();
    busy.sort_by_key(|w| std::cmp::Reverse(running(w)));
    let drained: Vec<(String, u64)> = busy[..2]
        .iter()
        .map(|w| (w["name"].as_str().unwrap().to_string(), running(w)))
        .collect();
    let held: u64 = drained.iter().map(|(_, r)| r).sum();
    assert!(held >= 2, "the two busiest hold streams: {drained:?}");
    let signalled = Instant::now();
    for (name, _) in &drained {
        c.signal_worker(name, libc::SIGTERM);
    }
    let (texts, exits) = std::thread::scope(|s| {
        let readers: Vec<_> = streams
            .iter_mut()
            .map(|(r, text)| {
                s.spawn(move || {
                    let (rest, gap) = read_timed(r);
                    (format!("{text}{rest}"), gap)
                })
            })
            .collect();
        let exits: Vec<_> = drained
            .iter()
            .map(|(name, _)| {
                let status = c.wait_exit(name, Duration::from_secs(10));
                (status, signalled.elapsed())
            })
            .collect();
        let texts: Vec<_> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        (texts, exits)
    });
    for ((text, gap), (message, _, params)) in texts.iter().zip(&cases) {
        assert_eq!(
            text,
            &engine_text(message, params.clone()),
            "{message} {params:?}; {}",
            c.paths()
        );
        eprintln!("longest gap {gap:?}");
    }
    for (status, after) in &exits {
        assert!(status.success(), "{status:?}");
        eprintln!("exited {after:?} after SIGTERM");
    }
    let count = |series: &str| metric_at(c.operator, series);
    assert_eq!(
        count("tandem_router_moves_total{why=\"draining\"}"),
        held as f64,
        "each stream the drained workers held moved once: {drained:?}"
    );
    assert_eq!(count("tandem_router_migrations_total"), 0.0);
    assert_eq!(
        count("tandem_kv_transfer_failures_total"),
        0.0,
        "nothing recomputed"
    );
    let took = metric_sum(c.operator, "tandem_router_move_transfer_seconds_sum");
    let moved = metric_sum(c.operator, "tandem_router_moved_kv_bytes_total");
    // The bound a moved stream's longest gap is held to: its transfer plus two decode steps
    // (the receivers' mean step, as their metrics measured it).
    let (mut sum, mut steps) = (0.0, 0.0);
    for w in c.workers().iter().filter(|w| w["role"] == "decode") {
        let at: std::net::SocketAddr = w["metrics_endpoint"].as_str().unwrap().parse().unwrap();
        sum += metric_sum(at, "tandem_decode_step_seconds_sum");
        steps += metric_sum(at, "tandem_decode_step_seconds_count");
    }
    let step = sum / steps.max(1.0);
    let longest = texts.iter().map(|(_, g)| *g).max().unwrap();
    eprintln!(
        "{held} moves: {moved} KV bytes, {:.1} ms a transfer; a decode step {:.1} ms; \
         longest gap {longest:?} (bound: a transfer plus two steps, {:.1} ms)",
        took / held as f64 * 1e3,
        step * 1e3,
        (took / held as f64 + 2.0 * step) * 1e3
    );
    c.wait_all_free(Duration::from_secs(5));
}

/// A decode pool driven to a KV imbalance — six 600-token streams on one decode worker, then
/// two empty ones join (max/mean 3) — with `[router] kv_rebalance = 1.3` brings it under 1.3
/// within a minute by live moves (the router's rebalances and moves counted), every stream
/// exact; without it, it stays uneven (nothing moves). Each arm's ITL p99, from the router's
/// histogram, is printed side by side.
#[test]
fn an_uneven_decode_pool_is_rebalanced_by_live_moves() {
    for rebalance in [false, true] {
        let line = if rebalance { "kv_rebalance = 1.3" } else { "" };
        let mut c = Cluster::of(1, 1).router(line).start(EXE.as_ref());
        let n = 600;
        let messages = [
            "Tell me a story about a lighthouse keeper.",
            "Write a poem about the sea.",
        ];
        let mut streams: Vec<(Response, String, SamplingParams, &str)> = (0..6)
            .map(|i| {
                let message = messages[i % 2];
                let params =
                    json!({"temperature": 0.7, "seed": i, "max_tokens": n, "ignore_eos": true});
                let mut r = c.open_chat(MODEL, message, params);
                let text = r.read_chunks(1);
                let want = SamplingParams {
                    max_tokens: Some(n),
                    temperature: 0.7,
                    seed: i as u64,
                    ignore_eos: true,
                    ..Default::default()
                };
                (r, text, want, message)
            })
            .collect();
        let cfg = c.config(&Cluster::of(1, 1));
        for k in 0..2 {
            c.add_worker("decode", &format!("decode-new-{k}"), &cfg);
        }
        c.wait_for(1, 3);
        let ratio = |c: &Cluster| {
            let used: Vec<f64> = c
                .workers()
                .iter()
                .filter(|w| w["role"] == "decode")
                .map(|w| {
                    let s = &w["stats"];
                    let total = s["kv_blocks_total"].as_f64().unwrap_or(0.0);
                    total - s["kv_blocks_free"].as_f64().unwrap_or(0.0)
                })
                .collect();
            let mean = used.iter().sum::<f64>() / used.len() as f64;
            used.iter().cloned().fold(0.0, f64::max) / mean.max(1e-9)
        };
        let uneven = ratio(&c);
        assert!(uneven >= 2.0, "driven uneven: max/mean {uneven:.2}");
        let t0 = Instant::now();
        let texts = std::thread::scope(|s| {
            let readers: Vec<_> = streams
                .iter_mut()
                .map(|(r, text, _, _)| s.spawn(move || format!("{text}{}", read_timed(r).0)))
                .collect();
            if rebalance {
                tandem_tests::wait_until("max/mean under 1.3", Duration::from_secs(60), || {
                    ratio(&c) < 1.3
                });
                eprintln!(
                    "rebalanced from {uneven:.2} to under 1.3 in {:?}",
                    t0.elapsed()
                );
            }
            readers
                .into_iter()
                .map(|r| r.join().unwrap())
                .collect::<Vec<_>>()
        });
        for (text, (_, _, want, message)) in texts.iter().zip(&streams) {
            assert_eq!(
                text,
                &engine_text(message, want.clone()),
                "{message} {want:?}; {}",
                c.paths()
            );
        }
        let count = |series: &str| metric_at(c.operator, series);
        let moves = count("tandem_router_moves_total{why=\"rebalance\"}");
        let rebalances = count("tandem_router_rebalances_total");
        match rebalance {
            true => assert!(moves >= 2.0 && rebalances >= 1.0, "{moves} moves"),
            false => assert_eq!(moves + rebalances, 0.0),
        }
        assert_eq!(count("tandem_router_migrations_total"), 0.0);
        assert_eq!(
            count("tandem_kv_transfer_failures_total"),
            0.0,
            "nothing recomputed"
        );
        eprintln!(
            "kv_rebalance {}: {moves} moves; ITL p99 {:.1} ms",
            if rebalance { "1.3" } else { "off" },
            itl_p99(&c) * 1e3
        );
        c.wait_all_free(Duration::from_secs(5));
    }
}

/// The router's ITL p99, from its histogram's buckets (the upper bound of the bucket it falls
/// in).
fn itl_p99(c: &Cluster) -> f64 {
    let (_, text) = tandem_tests::cluster::get(c.operator, "/metrics").unwrap();
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("tandem_router_itl_seconds_bucket{le=\"")?;
            let (le, count) = rest.split_once("\"} ")?;
            Some((
                le.parse().unwrap_or(f64::INFINITY),
                count.trim().parse().ok()?,
            ))
        })
        .collect();
    let total = buckets.last().map_or(0.0, |b| b.1);
    buckets
        .iter()
        .find(|(_, n)| *n >= 0.99 * total)
        .map_or(f64::NAN, |b| b.0)
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
    let mut r = c.open_chat(MODEL, message, params);
    let mut text = r.read_chunks(4);
    let drained = c.serving();
    c.signal_worker(&drained, libc::SIGTERM);
    assert!(c.wait_exit(&drained, Duration::from_secs(10)).success());
    let (rest, error) = read_rest(&mut r);
    assert_eq!(error, None);
    text += &rest;
    let want = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(400)
    };
    assert_eq!(text, engine_text(message, want), "{}", c.paths());
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
