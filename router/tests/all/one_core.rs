//! One request core, two drivers. A scripted scenario — a refusal, a busy prefill pool, a
//! decode worker dying mid-stream, an admission deadline — runs through the router against
//! fake workers (in-process gRPC servers, `fake/`) and through the simulator (real engines on a
//! virtual clock), and each of its four requests takes the same path in both: the same phases,
//! the same prefill decisions, refused where it should be.

use crate::fake;

use std::sync::Arc;
use std::time::Duration;

use engine::{EngineConfig, MockTiming, SamplingParams};
use fake::*;
use proto::grpc;
use proto::Pool;
use router::core::{PhaseName as P, PrefillDecision as D, Trace};
use router::registry::{Liveness, Route};
use router::request;
use router::State;

/// A distinct prompt of `n` tokens.
fn prompt(base: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| base + i).collect()
}

fn tokens(n: u32) -> DecodeScript {
    DecodeScript::Tokens((1..=n).collect())
}

/// Runs `prompt` for `n` tokens through the router; its trace once it has ended.
async fn trace(st: &Arc<State>, prompt: Vec<u32>, n: usize) -> Trace {
    let s = request::start(st, prompt, &SamplingParams::greedy(n)).await;
    let mut rest = s.rest;
    if let Err(e) = &s.first {
        eprintln!("the request failed: {e}");
    }
    if let Ok(t) = s.first {
        let mut last = t.finish.is_some();
        while !last {
            match rest.recv().await {
                Some(Ok(t)) => last = t.finish.is_some(),
                _ => break,
            }
        }
    }
    s.trace.await.unwrap()
}

fn state(admission_wait: Duration, busy_max: u32) -> Arc<State> {
    state_on(Liveness::default(), admission_wait, |s| {
        s.core.local_prefill_busy_max_tokens = busy_max;
    })
}

/// A refusal: the only decode worker is full, then (after its next heartbeat) has room.
async fn refusal() -> Trace {
    let st = state(Duration::from_secs(3), 0);
    let kv = Arc::new(Kv::default());
    let p = Fake::new(tokens(0), PrefillScript::Deliver, kv.clone());
    let d = Fake::new(
        DecodeScript::FullThen(1, (1..=8).collect()),
        PrefillScript::Deliver,
        kv,
    );
    join(&st, Pool::Prefill, &p).await;
    let id = join(&st, Pool::Decode, &d).await;
    let waiting = tokio::spawn({
        let st = st.clone();
        async move { trace(&st, prompt(1000, 40), 8).await }
    });
    assert!(d.wait_until(|s| s.generate.len() == 1).await, "refused");
    // Its heartbeat after the refusal (one before would be old news of its load).
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    while st.registry.with(|t| t.line.len()) == 0 {
        assert!(tokio::time::Instant::now() < until, "waiting for room");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let beat = grpc::Heartbeat {
        worker_id: id.0,
        load: Some(grpc::WorkerLoad::default()),
        kv: None,
    };
    st.registry.beat(beat).unwrap();
    waiting.await.unwrap()
}

/// A busy prefill pool: 900 prompt tokens queued on the only prefill worker (0.9 s at its
/// rate), so the decode worker prefills a short prompt itself.
async fn busy_prefill_pool() -> Trace {
    let st = state(Duration::from_secs(3), 10_000);
    let kv = Arc::new(Kv::default());
    let p = Fake::new(tokens(0), PrefillScript::Deliver, kv.clone());
    let d = Fake::new(tokens(4), PrefillScript::Deliver, kv);
    join(&st, Pool::Prefill, &p).await;
    join(&st, Pool::Decode, &d).await;
    let queued = Route {
        prompt_tokens: 900,
        ..Route::default()
    };
    let _held = st.registry.pick(Pool::Prefill, &[], &queued).unwrap();
    trace(&st, prompt(3000, 40), 4).await
}

/// A decode worker dies mid-stream: the request moves to another.
async fn dead_decode_worker() -> Trace {
    let st = state(Duration::from_secs(3), 0);
    let kv = Arc::new(Kv::default());
    let p = Fake::new(tokens(0), PrefillScript::Deliver, kv.clone());
    let dies = Fake::new(
        DecodeScript::Count(Fault::Die(3)),
        PrefillScript::Deliver,
        kv.clone(),
    );
    let lives = Fake::new(DecodeScript::Count(Fault::None), PrefillScript::Deliver, kv);
    join(&st, Pool::Prefill, &p).await;
    join(&st, Pool::Decode, &dies).await;
    let running = tokio::spawn({
        let st = st.clone();
        async move { trace(&st, prompt(4000, 40), 100).await }
    });
    assert!(dies.wait_until(|s| !s.generate.is_empty()).await);
    join(&st, Pool::Decode, &lives).await;
    running.await.unwrap()
}

/// An admission deadline: no decode worker has room within the admission wait.
async fn deadline() -> Trace {
    let st = state(Duration::from_millis(300), 0);
    let kv = Arc::new(Kv::default());
    let p = Fake::new(tokens(0), PrefillScript::Deliver, kv.clone());
    let d = Fake::new(
        DecodeScript::FullThen(u32::MAX, Vec::new()),
        PrefillScript::Deliver,
        kv,
    );
    join(&st, Pool::Prefill, &p).await;
    join(&st, Pool::Decode, &d).await;
    trace(&st, prompt(6000, 40), 8).await
}

/// The same four requests in one simulated run: 1 prefill and 1 decode worker of 64 blocks, a
/// mock timing of 1 ms a prompt token and 10 ms a decode step; other requests make the
/// conditions — a long prompt filling the decode worker (the refusal), a long prompt on the
/// prefill worker (the busy pool), the decode worker killed (back 200 ms later), a long output
/// filling it past the admission wait (the deadline).
fn simulated() -> Vec<Trace> {
    let path = engine::fetch::ensure_default_model().expect("the default model");
    let (model, _) = engine::inspect(&path).unwrap();
    let timing = MockTiming {
        step_us: 1000.0,
        prefill_token_us: 1000.0,
        decode_token_us: 9000.0,
        kv_token_ns: 0.0,
        ..MockTiming::CPU_SMOLLM2
    };
    let pool = |blocks| sim::PoolSpec {
        replicas: 1,
        engine: EngineConfig {
            num_blocks: blocks,
            ..EngineConfig::default()
        },
        timing,
        step_overhead: sim::Overhead::default(),
    };
    let cfg = sim::SimConfig {
        model,
        prefill: Some(pool(1024)),
        decode: pool(64),
        routing: Default::default(),
        router: router::core::Settings {
            local_prefill_busy_max_tokens: 10_000,
            admission_wait: Duration::from_secs(3),
            ..Default::default()
        },
        link: sim::Link {
            bandwidth: 2e9,
            latency: Duration::from_micros(200),
            write_ns_per_byte: 0.0,
        },
        scaling: Vec::new(),
        start_up: Duration::from_millis(200),
        hop: Duration::from_micros(100),
        token_delay: Default::default(),
        liveness: sim::Liveness::default(),
        faults: sim::schedule_faults(
            &["kill:decode:1@6300ms".parse().unwrap()],
            1,
            Duration::ZERO,
        ),
        store: None,
        peer_fetch: false,
        kv_rebalance: None,
    };
    let req = |ms, prompt, output| sim::SimRequest {
        at: Duration::from_millis(ms),
        prompt,
        output,
    };
    let reqs = vec![
        req(0, prompt(100, 960), 20),     // fills the decode worker for ~1.2 s
        req(100, prompt(1000, 40), 8),    // refused, then reserved: the refusal
        req(3000, prompt(2000, 900), 4),  // 900 tokens on the prefill worker
        req(3600, prompt(3000, 40), 4),   // the busy prefill pool
        req(6000, prompt(4000, 40), 100), // its decode worker dies at 6.3 s
        req(9000, prompt(5000, 40), 960), // fills the decode worker for ~9.6 s
        req(9100, prompt(6000, 40), 8),   // the deadline
    ];
    let r = sim::Sim::new(cfg, reqs).unwrap().run();
    assert_eq!(r.deaths, 1);
    [1, 3, 4, 6]
        .iter()
        .map(|&i| {
            let o = &r.outcomes[i];
            Trace {
                phases: o.phases.clone(),
                decisions: o.decisions.clone(),
                refusals: o.refusals,
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_and_the_simulator_take_each_request_down_the_same_path() {
    let routed = vec![
        refusal().await,
        busy_prefill_pool().await,
        dead_decode_worker().await,
        deadline().await,
    ];
    let simulated = simulated();
    let remote = [P::Reserving, P::Prefilling, P::Decoding, P::Done];
    let migrated = [
        P::Reserving,
        P::Prefilling,
        P::Decoding,
        P::Migrating,
        P::Reserving,
        P::Prefilling,
        P::Decoding,
        P::Done,
    ];
    let expected: [(&[P], &[D]); 4] = [
        (&remote, &[D::Remote]),
        (
            &[P::Reserving, P::Decoding, P::Done],
            &[D::LocalPrefillPoolBusy],
        ),
        (&migrated, &[D::Remote, D::Remote]),
        (&[P::Reserving, P::Failed], &[]),
    ];
    for (i, (phases, decisions)) in expected.iter().enumerate() {
        for (driver, t) in [("router", &routed[i]), ("simulator", &simulated[i])] {
            assert_eq!(t.phases, *phases, "step {i}, {driver}: {t:?}");
            assert_eq!(t.decisions, *decisions, "step {i}, {driver}: {t:?}");
        }
        // Refused where the scenario refuses (the simulator's request may be refused again at
        // each heartbeat while it waits; the router's fake refuses once, or always).
        let refused = (routed[i].refusals > 0, simulated[i].refusals > 0);
        assert_eq!(refused, (i == 0 || i == 3, i == 0 || i == 3), "step {i}");
    }
}
