//! The simulator's clock against the timing model worked out by hand, and its path through the
//! cluster (where each request was prefilled, the KV bytes it moved, the prefix-cache hits).

use std::time::Duration;

use engine::{EngineConfig, MockTiming};
use sim::{Link, PoolSpec, Sim, SimConfig, SimRequest};

fn cluster(prefill: usize, decode: usize) -> SimConfig {
    let (model, _) = engine::inspect(&tandem_tests::model_path()).unwrap();
    let pool = |replicas| PoolSpec {
        replicas,
        engine: EngineConfig::default(),
        timing: MockTiming::CPU_SMOLLM2,
        step_overhead: Duration::ZERO,
    };
    SimConfig {
        model,
        prefill: (prefill > 0).then(|| pool(prefill)),
        decode: pool(decode),
        routing: router::routing::Routing::default(),
        local_prefill_max_tokens: 0,
        link: Link {
            bandwidth: 2e9,
            latency: Duration::from_micros(200),
        },
        scaling: Vec::new(),
        start_up: Duration::from_secs(1),
        hop: Duration::ZERO,
    }
}

fn request(at_ms: u64, prompt: Vec<u32>, output: usize) -> SimRequest {
    SimRequest {
        at: Duration::from_millis(at_ms),
        prompt,
        output,
    }
}

/// SmolLM2's KV per token: 30 layers × 3 KV heads × 64 values, keys and values, f16.
const KV_BYTES: u64 = 30 * 192 * 2 * 2;

/// One request alone through 1 prefill + 1 decode worker: its 99-token prefill step
/// (1,150 + 99 × 1,030 µs), the transfer of 99 tokens' KV (200 µs + bytes / 2 GB/s), the decode
/// worker's first step (1,150 + 1,350 µs) to the first token; then a token each 2.5 ms. The
/// same prompt again a second later: both workers hold its first 6 blocks (96 tokens), so 3
/// tokens are computed and moved.
#[test]
fn a_request_takes_the_time_the_timing_model_gives_and_the_second_reuses_the_prefix() {
    let prompt: Vec<u32> = (0..100).map(|i| 300 + i).collect();
    let reqs = vec![request(0, prompt.clone(), 4), request(1000, prompt, 4)];
    let r = Sim::new(cluster(1, 1), reqs).unwrap().run();
    let first = &r.outcomes[0];
    assert_eq!(first.error, None);
    let transfer_ns = 200_000.0 + (99 * KV_BYTES) as f64 / 2e9 * 1e9;
    let want = 1150.0 + 99.0 * 1030.0 + transfer_ns / 1e3 + 2500.0;
    let got = first.ttft.unwrap().as_secs_f64() * 1e6;
    assert!((got - want).abs() < 1.0, "TTFT {got} µs, by hand {want} µs");
    assert_eq!(first.tokens, 4);
    for g in &first.gaps {
        assert!((g.as_secs_f64() * 1e6 - 2500.0).abs() < 1.0, "gap {g:?}");
    }
    assert_eq!(r.kv_bytes, (99 + 3) * KV_BYTES, "the second moved 3 tokens");
    assert_eq!(r.decisions.get("remote"), Some(&2));
    // Hits are counted where a prompt is computed: the prefill worker found 96 of the 99
    // tokens of the second; the decode worker's 96 shortened the transfer (above).
    assert_eq!((r.prompt_tokens, r.prefix_hit_tokens), (2 * 99, 96));
    let second = r.outcomes[1].ttft.unwrap().as_secs_f64() * 1e6;
    assert!(second < 10_000.0, "a 3-token prefill: {second} µs");
}

/// Colocated (no prefill pool), the decode workers prefill their own requests: a burst of 8
/// all finishes, no KV moves, no prefill decision is made.
#[test]
fn colocated_requests_move_no_kv() {
    let reqs: Vec<SimRequest> = (0..8)
        .map(|i| request(0, (0..64).map(|t| 1000 * i + t + 300).collect(), 8))
        .collect();
    let r = Sim::new(cluster(0, 2), reqs).unwrap().run();
    assert!(r
        .outcomes
        .iter()
        .all(|o| o.error.is_none() && o.tokens == 8));
    assert_eq!(r.kv_bytes, 0);
    assert!(
        r.decisions.is_empty(),
        "no reservation, no prefill decision"
    );
    assert_eq!(r.worker_seconds.len(), 1);
}

/// The planner in the loop: a decode pool of 1 (up to 3) under a burst its one worker cannot
/// hold (4 sequences at a time) scales up — the series records the router's own decision with
/// its inputs, the new replicas join after the start-up time and take requests — and the
/// worker-seconds count each replica from its joining.
#[test]
fn the_planner_scales_the_decode_pool_up_under_a_queue() {
    let mut cfg = cluster(1, 1);
    cfg.decode.engine.max_running = 4;
    cfg.decode.engine.num_blocks = 64;
    cfg.scaling = vec![router::planner::Scaling {
        pool: proto::Pool::Decode,
        target: Duration::from_millis(20),
        min: 1,
        max: 3,
        initial: 1,
        tick: Duration::from_millis(100),
        cooldown: Duration::from_secs(60),
        window: Duration::from_secs(5),
    }];
    cfg.start_up = Duration::from_millis(300);
    let reqs: Vec<SimRequest> = (0..40)
        .map(|i| {
            request(
                10 * i,
                (0..40).map(|t| 2000 * i as u32 + t + 300).collect(),
                100,
            )
        })
        .collect();
    let r = Sim::new(cfg, reqs).unwrap().run();
    assert!(
        r.outcomes.iter().all(|o| o.error.is_none()),
        "{:?}",
        r.outcomes[0].error
    );
    let up = r
        .series
        .iter()
        .find(|s| s.action == "up")
        .expect("a scale-up");
    assert!(up.queued > 0, "decided on the admission queue: {up:?}");
    let joined = r
        .series
        .iter()
        .find(|s| s.live > 1)
        .expect("a replica joined");
    assert!(
        joined.t >= up.t + 0.3,
        "after the start-up time: {up:?} then {joined:?}"
    );
    let decode_s = r.worker_seconds["decode"];
    let run_s = r.duration.as_secs_f64();
    assert!(
        decode_s > run_s + 0.1 && decode_s < 3.0 * run_s,
        "{decode_s} over {run_s} s"
    );
}
