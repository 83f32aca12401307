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
        step_overhead: sim::Overhead::default(),
    };
    SimConfig {
        model,
        prefill: (prefill > 0).then(|| pool(prefill)),
        decode: pool(decode),
        routing: router::routing::Routing::default(),
        router: router::core::Settings::default(),
        link: Link {
            bandwidth: 2e9,
            latency: Duration::from_micros(200),
            write_ns_per_byte: 0.0,
        },
        scaling: Vec::new(),
        start_up: Duration::from_secs(1),
        hop: Duration::ZERO,
        token_delay: Default::default(),
        liveness: sim::Liveness::default(),
        faults: Vec::new(),
        store: None,
        peer_fetch: false,
        kv_rebalance: None,
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
    let remote = router::core::PrefillDecision::Remote.label();
    assert_eq!(r.decisions.get(remote), Some(&2));
    // Hits are counted where a prompt is computed: the prefill worker found 96 of the 99
    // tokens of the second; the decode worker's 96 shortened the transfer (above).
    assert_eq!((r.prompt_tokens, r.prefix_hit_tokens), (2 * 99, 96));
    let second = r.outcomes[1].ttft.unwrap().as_secs_f64() * 1e6;
    assert!(second < 10_000.0, "a 3-token prefill: {second} µs");
}

/// A decode engine's time writing arrived KV delays its next step: the first token comes that
/// much later (99 tokens' KV at 2 ns a byte), the gaps after it do not.
#[test]
fn writing_arrived_kv_delays_the_decode_workers_next_step() {
    let prompt: Vec<u32> = (0..100).map(|i| 300 + i).collect();
    let ttft = |write_ns_per_byte: f64| {
        let mut c = cluster(1, 1);
        c.link.write_ns_per_byte = write_ns_per_byte;
        let r = Sim::new(c, vec![request(0, prompt.clone(), 4)])
            .unwrap()
            .run();
        let o = &r.outcomes[0];
        assert!(o
            .gaps
            .iter()
            .all(|g| (g.as_secs_f64() * 1e6 - 2500.0).abs() < 1.0));
        o.ttft.unwrap().as_secs_f64() * 1e6
    };
    let delay = ttft(2.0) - ttft(0.0);
    let want = (99 * KV_BYTES) as f64 * 2.0 / 1e3;
    assert!((delay - want).abs() < 1.0, "{delay} µs, by hand {want} µs");
}

/// Step overheads drawn from a measured histogram give the decode steps its spread: one
/// request's gaps are the timing model's 2.5 ms plus draws that fill the histogram's buckets
/// (half of the steps 0..1 ms over, a tenth 4..8 ms over), where the mean alone gives every
/// gap the same time. The same inputs draw the same steps.
#[test]
fn step_overheads_drawn_from_a_histogram_spread_the_gaps() {
    let prompt: Vec<u32> = (0..100).map(|i| 300 + i).collect();
    let measured =
        sim::Overhead::from_buckets(&[(0.001, 50.0), (0.004, 90.0), (0.008, 100.0)]).unwrap();
    let gaps = |o: &sim::Overhead| {
        let mut c = cluster(1, 1);
        c.decode.step_overhead = o.clone();
        let r = Sim::new(c, vec![request(0, prompt.clone(), 2001)])
            .unwrap()
            .run();
        let us = |g: &Duration| g.as_secs_f64() * 1e6 - 2500.0;
        r.outcomes[0].gaps.iter().map(us).collect::<Vec<f64>>()
    };
    let drawn = gaps(&measured);
    assert_eq!(drawn.len(), 2000);
    let share = |lo: f64, hi: f64| {
        drawn.iter().filter(|&&g| g >= lo && g < hi).count() as f64 / drawn.len() as f64
    };
    assert!(
        (share(-1.0, 1000.0) - 0.5).abs() < 0.04,
        "{}",
        share(-1.0, 1000.0)
    );
    assert!(
        (share(4000.0, 8001.0) - 0.1).abs() < 0.03,
        "{}",
        share(4000.0, 8001.0)
    );
    assert_eq!(
        drawn,
        gaps(&measured),
        "a simulation is a function of its inputs"
    );
    let mean = measured.mean_ns();
    let fixed = gaps(&sim::Overhead::fixed(Duration::from_nanos(mean as u64)));
    assert!(fixed.iter().all(|g| (g - mean / 1e3).abs() < 1.0));
}

/// A decode worker's engine thread takes a reservation between steps: a request that arrives
/// while the worker steps for another is reserved when that step ends. The first request's
/// KV lands at 104,460.48 µs (its prefill, 200 µs and 99 tokens' KV at 2 GB/s) and the decode
/// worker steps every 2.5 ms from there; the second arrives at 110 ms, in the third step, and
/// waits 1,960.48 µs for its end — its admission phase, as the router would measure it.
#[test]
fn a_reservation_waits_for_the_decode_workers_step_in_progress() {
    let prompt = |base: u32| (0..100).map(|i| base + i).collect::<Vec<u32>>();
    let reqs = vec![request(0, prompt(300), 50), request(110, prompt(5000), 4)];
    let r = Sim::new(cluster(1, 1), reqs).unwrap().run();
    assert!(r.outcomes.iter().all(|o| o.error.is_none()));
    let (n, secs) = r.ttft_phases["admission"];
    assert_eq!(n, 2, "both first tries");
    assert!(
        (secs * 1e6 - 1960.48).abs() < 1.0,
        "admission {} µs in all, by hand 0 + 1,960.48 µs",
        secs * 1e6
    );
    assert_eq!(r.ttft_phases["prefill"].0, 2);
    assert_eq!(r.ttft_phases["first_token"].0, 2);
}

/// The router counts a prompt on its prefill worker until the prefill call returns — after
/// the KV has landed and the decode worker answered — not only until the compute ends: its
/// 99 tokens stay queued from the compute's end (103,120 µs) until the transfer's (5 ms
/// latency: 109,460 µs), as the planner's ticks (every millisecond) see.
#[test]
fn a_prompt_stays_queued_on_its_prefill_worker_until_the_call_returns() {
    let mut cfg = cluster(1, 1);
    cfg.link.latency = Duration::from_millis(5);
    cfg.scaling = vec![router::planner::Scaling {
        pool: proto::Pool::Prefill,
        wait_target: None,
        target: Duration::from_secs(10),
        min: 1,
        max: 1,
        initial: 1,
        tick: Duration::from_millis(1),
        cooldown: Duration::from_secs(60),
        window: Duration::from_secs(5),
    }];
    let prompt: Vec<u32> = (0..100).map(|i| 300 + i).collect();
    let r = Sim::new(cfg, vec![request(0, prompt, 4)]).unwrap().run();
    assert_eq!(r.outcomes[0].error, None);
    let queued = |from: f64, to: f64| -> Vec<u64> {
        let s = r.series.iter().filter(|s| s.t > from && s.t < to);
        s.map(|s| s.queued).collect()
    };
    let held = queued(0.1035, 0.1090);
    assert_eq!(held.len(), 5, "ticks at 104..108 ms");
    assert!(
        held.iter().all(|&q| q == 99),
        "held after compute: {held:?}"
    );
    let after = queued(0.1100, 0.2);
    assert!(
        !after.is_empty() && after.iter().all(|&q| q == 0),
        "{after:?}"
    );
}

/// Distinct prompts of `n` tokens, one per `base`.
fn distinct(base: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| base + i).collect()
}

/// `reqs` through 1 prefill and `decode` decode workers of 40 blocks each, all finishing.
fn run_on_40_blocks(decode: usize, reqs: Vec<SimRequest>) -> sim::SimResult {
    let mut cfg = cluster(1, decode);
    cfg.decode.engine.num_blocks = 40;
    let r = Sim::new(cfg, reqs).unwrap().run();
    assert!(r.outcomes.iter().all(|o| o.error.is_none()));
    r
}

/// A decode worker without room refuses, and the router asks another at once, as the real
/// router does: two decode workers of 40 blocks, one nearly filled by a 600-token prompt (38
/// blocks), the other holding a 100-token one (7); two 150-token requests (10 blocks each)
/// come next — whichever is sent to the full worker is refused and reserved on the other with
/// no wait (without asking again, it would wait for the long request's end, 600+ ms).
#[test]
fn a_refused_request_is_asked_of_another_decode_worker_at_once() {
    let reqs = vec![
        request(0, distinct(1000, 600), 4),
        request(0, distinct(3000, 100), 4),
        request(10, distinct(5000, 150), 4),
        request(10, distinct(7000, 150), 4),
    ];
    let r = run_on_40_blocks(2, reqs);
    let (n, secs) = r.ttft_phases["admission"];
    assert_eq!(n, 4);
    assert!(secs < 1e-6, "no request waited for room: {secs} s");
}

/// With no decode worker left to ask, a refused request waits for a heartbeat of one that
/// refused it (the router knows of freed room no sooner): one decode worker of 40 blocks, a
/// 600-token prompt (38 blocks) and a 100-token one (7) at once — the second is reserved at
/// the worker's first heartbeat after the first request's end, within a period of it, not at
/// the end itself.
#[test]
fn a_request_refused_everywhere_is_reserved_at_the_next_heartbeat() {
    let reqs = vec![
        request(0, distinct(1000, 600), 4),
        request(0, distinct(3000, 100), 4),
    ];
    let r = run_on_40_blocks(1, reqs);
    let first_end = r.outcomes[0].e2e.as_secs_f64();
    let (n, waited) = r.ttft_phases["admission"];
    assert_eq!(n, 2);
    let period = proto::membership::HEARTBEAT_PERIOD.as_secs_f64();
    assert!(
        waited > first_end + 1e-3 && waited <= first_end + period,
        "reserved at {waited} s; the first request ended at {first_end} s"
    );
}

/// A request larger than a decode worker's whole cache fails at once with why, rather than
/// waiting for room it could never have (it would hold a worker after `HOLD_AFTER` and fail at
/// the admission deadline): 40 blocks of 16 tokens, a 700-token prompt with 4 out.
#[test]
fn a_request_larger_than_a_whole_cache_fails_at_once() {
    let mut cfg = cluster(1, 1);
    cfg.decode.engine.num_blocks = 40;
    let reqs = vec![
        request(0, distinct(1000, 700), 4),
        request(0, distinct(3000, 100), 4),
    ];
    let r = Sim::new(cfg, reqs).unwrap().run();
    let e = r.outcomes[0].error.as_deref().unwrap_or_default();
    assert!(e.contains("40 in all"), "{e}");
    assert_eq!(r.outcomes[0].e2e, Duration::ZERO);
    assert_eq!(r.outcomes[1].error, None);
    assert_eq!(r.admission_holds, 0);
}

/// A long request does not starve behind a stream of short ones: two decode workers of 64
/// blocks kept busy by 100-token requests (every 60 ms for 20 s, 13 blocks each, never both
/// idle), and one 900-token request (57 blocks) at 1 s, which fits only on an emptied worker.
/// Asking on each heartbeat it never finds one; after waiting `HOLD_AFTER` it holds the
/// emptiest worker, which takes no other request until it has room — reserved within about a
/// second of the hold, not at the stream's end.
#[test]
fn a_long_request_holds_a_worker_after_a_while_rather_than_starve() {
    let mut cfg = cluster(2, 2);
    cfg.prefill.as_mut().unwrap().timing = MockTiming::H200_LLAMA8B;
    cfg.decode.timing = MockTiming::H200_LLAMA8B;
    cfg.decode.engine.num_blocks = 64;
    let mut reqs: Vec<SimRequest> = (0..333)
        .map(|i| request(60 * i, distinct(10_000 + 200 * i as u32, 100), 100))
        .collect();
    reqs.push(request(1000, distinct(500_000, 900), 4));
    let r = Sim::new(cfg, reqs).unwrap().run();
    assert!(r.outcomes.iter().all(|o| o.error.is_none()));
    assert_eq!(r.admission_holds, 1);
    let ttft = r.outcomes[333].ttft.unwrap().as_secs_f64();
    let hold = router::core::HOLD_AFTER.as_secs_f64();
    assert!(
        ttft > hold && ttft < hold + 1.5,
        "the long request's first token after {ttft} s"
    );
}

/// Each token's way out takes a delay drawn from a measured histogram (half under 0.5 ms,
/// half 0.5..2 ms): the gaps spread around the step time both ways, their sum still the
/// decode time (tokens arrive in order), and the first token comes later by its own draw.
#[test]
fn drawn_token_delays_spread_the_gaps_and_keep_the_tokens_in_order() {
    let prompt: Vec<u32> = (0..100).map(|i| 300 + i).collect();
    let delays = sim::Overhead::from_buckets(&[(0.0005, 50.0), (0.002, 100.0)]).unwrap();
    let run = |d: &sim::Overhead| {
        let mut c = cluster(1, 1);
        c.token_delay = d.clone();
        let r = Sim::new(c, vec![request(0, prompt.clone(), 1001)])
            .unwrap()
            .run();
        r.outcomes[0].clone()
    };
    let (plain, drawn) = (run(&sim::Overhead::default()), run(&delays));
    assert!(plain
        .gaps
        .iter()
        .all(|g| (g.as_secs_f64() * 1e6 - 2500.0).abs() < 1.0));
    let us: Vec<f64> = drawn.gaps.iter().map(|g| g.as_secs_f64() * 1e6).collect();
    let share = |f: &dyn Fn(f64) -> bool| us.iter().filter(|&&g| f(g)).count() as f64 / 1000.0;
    assert!(
        share(&|g| g < 2200.0) > 0.2,
        "some tokens gain on the one before"
    );
    assert!(share(&|g| g > 2800.0) > 0.2, "some lose");
    let first = (drawn.ttft.unwrap() - plain.ttft.unwrap()).as_secs_f64() * 1e6;
    assert!(
        (0.0..=2000.0).contains(&first),
        "first token {first} µs later"
    );
    let span = |o: &sim::Outcome| o.e2e - o.ttft.unwrap();
    let moved = span(&drawn).as_secs_f64() * 1e6 - span(&plain).as_secs_f64() * 1e6;
    assert!(
        moved.abs() <= 2000.0,
        "the span moves by two draws at most: {moved} µs"
    );
    assert_eq!(us.len(), 1000);
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
        wait_target: None,
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
        .find(|s| s.action == router::planner::Action::Up)
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

fn fault(spec: &str, horizon: Duration) -> Vec<sim::Fault> {
    sim::schedule_faults(&[spec.parse().unwrap()], 1, horizon)
}

/// Distinct 40-token prompts, one every `every_ms`, each `output` tokens long.
fn burst(n: u32, every_ms: u64, output: usize) -> Vec<SimRequest> {
    (0..n)
        .map(|i| {
            let prompt = (0..40).map(|t| 2000 * i + t + 300).collect();
            request(every_ms * i as u64, prompt, output)
        })
        .collect()
}

/// A decode worker dies mid-decode: its requests migrate to the other one (prompt plus the
/// tokens streamed) and finish there, each with all its tokens and one long gap; the dead one
/// comes back after the start-up time. Without a migration allowed, they fail instead.
#[test]
fn a_dead_decode_workers_requests_migrate_and_finish_elsewhere() {
    let mut cfg = cluster(1, 2);
    cfg.faults = fault("kill:decode:1@50ms", Duration::ZERO);
    let r = Sim::new(cfg.clone(), burst(8, 1, 100)).unwrap().run();
    assert_eq!(r.deaths, 1);
    assert!(r.migrations > 0 && r.migrations < 8, "{}", r.migrations);
    for o in &r.outcomes {
        assert_eq!((o.error.as_deref(), o.tokens), (None, 100), "{o:?}");
    }
    let worst = r.outcomes.iter().flat_map(|o| &o.gaps).max().unwrap();
    assert!(
        *worst > Duration::from_millis(5),
        "a migration's gap: {worst:?}"
    );
    cfg.router.migration_limit = 0;
    let r = Sim::new(cfg, burst(8, 1, 100)).unwrap().run();
    let failed: Vec<&str> = r
        .outcomes
        .iter()
        .filter_map(|o| o.error.as_deref())
        .collect();
    assert!(
        !failed.is_empty() && failed.iter().all(|e| e.contains("migration_limit = 0")),
        "{failed:?}"
    );
}

/// A freeze shorter than the stall timeout only delays (no migration: one gap of the freeze);
/// a longer one is found stalled at the timeout and its requests move.
#[test]
fn a_frozen_worker_is_waited_for_up_to_the_stall_timeout_then_left() {
    let mut cfg = cluster(1, 2);
    cfg.liveness.stall = Duration::from_millis(500);
    // The 8 prompts are prefilled in one ~330 ms step; decoding runs from then to about 1 s.
    cfg.faults = fault("freeze:decode:1@500ms+200ms", Duration::ZERO);
    let r = Sim::new(cfg.clone(), burst(8, 1, 100)).unwrap().run();
    assert_eq!((r.migrations, r.stalls), (0, 0));
    assert!(r
        .outcomes
        .iter()
        .all(|o| o.error.is_none() && o.tokens == 100));
    let worst = r.outcomes.iter().flat_map(|o| &o.gaps).max().unwrap();
    assert!(
        *worst >= Duration::from_millis(190),
        "the freeze shows in a gap: {worst:?}"
    );
    cfg.faults = fault("freeze:decode:1@500ms+5s", Duration::ZERO);
    let r = Sim::new(cfg, burst(8, 1, 100)).unwrap().run();
    assert_eq!(r.stalls, 1);
    assert!(r.migrations > 0);
    assert!(r
        .outcomes
        .iter()
        .all(|o| o.error.is_none() && o.tokens == 100));
    // They moved at the stall timeout, not after the thaw.
    let worst = r.outcomes.iter().flat_map(|o| &o.gaps).max().unwrap();
    assert!(*worst < Duration::from_secs(1), "{worst:?}");
}

/// A cut link fails the transfers to its rack at the transfer timeout: those prompts are
/// recomputed on their decode workers; a slowed link only makes them slower; a dead prefill
/// worker's prompts are recomputed too.
#[test]
fn cut_links_and_dead_prefill_workers_mean_recomputation_on_the_decode_worker() {
    let mut cfg = cluster(1, 2);
    cfg.liveness.racks = 2;
    cfg.liveness.transfer_timeout = Duration::from_millis(300);
    cfg.faults = fault("cut:rack1@0ms", Duration::ZERO);
    let r = Sim::new(cfg.clone(), burst(8, 60, 4)).unwrap().run();
    let recomputed = r
        .decisions
        .get("recomputed: transfer failed")
        .copied()
        .unwrap_or(0);
    // Worker 2 (the second decode worker) is in rack 0; worker 1, the first, in rack 1.
    assert!(recomputed > 0 && recomputed < 8, "{:?}", r.decisions);
    assert!(r
        .outcomes
        .iter()
        .all(|o| o.error.is_none() && o.tokens == 4));
    let slow = r
        .outcomes
        .iter()
        .filter_map(|o| o.ttft)
        .filter(|t| *t > Duration::from_millis(300))
        .count();
    assert_eq!(slow as u64, recomputed, "each waited out the timeout");

    cfg.faults = fault("kill:prefill:1@30ms", Duration::ZERO);
    let r = Sim::new(cfg, burst(8, 10, 4)).unwrap().run();
    assert!(
        r.decisions.contains_key("recomputed: prefill worker lost"),
        "{:?}",
        r.decisions
    );
    assert!(r
        .outcomes
        .iter()
        .all(|o| o.error.is_none() && o.tokens == 4));
}

/// The cluster store: a prompt computed on one colocated worker is put in the store; the same
/// prompt sent to the other (round-robin) is fetched from it — its 6 whole blocks staged in
/// the host tier and loaded from there, only its last 4 tokens computed — and the fetch is
/// priced on that worker's step by the timing model's store link, beside the host tier's write
/// and load: 1,150 + 4 × 1,030 µs, plus 2 × (2 + bytes / 8 GB/s) (into the host tier and out)
/// and 900 + bytes / 2 GB/s (the store) for 96 tokens' KV.
#[test]
fn a_prefix_another_worker_computed_comes_from_the_store_at_its_price() {
    let mut c = cluster(0, 2);
    c.routing.policy = router::routing::Policy::RoundRobin;
    let page = 16 * KV_BYTES;
    c.decode.engine.tiers.host_bytes = 64 * page;
    c.store = Some(sim::StoreSpec {
        capacity_bytes: 1 << 30,
    });
    let prompt: Vec<u32> = (0..100).map(|i| 300 + i).collect();
    let reqs = vec![request(0, prompt.clone(), 1), request(1000, prompt, 1)];
    let r = Sim::new(c, reqs).unwrap().run();
    assert!(r.outcomes.iter().all(|o| o.error.is_none()));
    assert_eq!(
        r.store_hits, 6,
        "the second fetched the prompt's 6 whole blocks"
    );
    assert_eq!(r.tier_hits, [6, 0], "and loaded them from the host tier");
    assert_eq!((r.prompt_tokens, r.prefix_hit_tokens), (200, 96));
    let bytes = (96 * KV_BYTES) as f64;
    let host = 2.0 + bytes / 8e9 * 1e6;
    let want = 1150.0 + 4.0 * 1030.0 + 2.0 * host + (900.0 + bytes / 2e9 * 1e6);
    let got = r.outcomes[1].ttft.unwrap().as_secs_f64() * 1e6;
    assert!((got - want).abs() < 1.0, "TTFT {got} µs, by hand {want} µs");
}

/// Peer fetch: a prompt prefilled on its decode worker (a short uncached rest), then a longer
/// one starting with it prefilled remotely — the prefill worker holds none of it; with peer
/// fetch it takes the 6 whole blocks the decode worker holds from that worker (staged in its
/// host tier, loaded from there) and computes only the rest; without it, all of it. A second
/// conversation alike, seconds later, once heartbeats carry what the first fetch cost: over a
/// link where a block takes longer to fetch than to compute (1 MB/s), the router has the
/// prefill worker compute it instead (`compute`), where the link is fast it fetches again.
#[test]
fn with_peer_fetch_a_prefill_worker_takes_what_the_decode_worker_holds_when_it_is_cheaper() {
    let conversation = |at: u64, base: u32| {
        let first: Vec<u32> = (0..100).map(|i| base + i).collect();
        let second: Vec<u32> = (0..400).map(|i| base + i).collect();
        [request(at, first, 1), request(at + 1000, second, 1)]
    };
    let run = |peer: bool, link_bytes_per_s: f64| {
        let mut c = cluster(1, 1);
        let prefill = c.prefill.as_mut().unwrap();
        prefill.engine.tiers.host_bytes = 64 * 16 * KV_BYTES;
        prefill.timing.store_link.read_bytes_per_s = link_bytes_per_s;
        c.router.local_prefill_max_tokens = 120;
        c.peer_fetch = peer;
        let mut reqs = conversation(0, 300).to_vec();
        reqs.extend(conversation(10_000, 3000));
        Sim::new(c, reqs).unwrap().run()
    };
    let fast = MockTiming::CPU_SMOLLM2.store_link.read_bytes_per_s;
    let (on, off, slow) = (run(true, fast), run(false, fast), run(true, 1e6));
    for r in [&on, &off, &slow] {
        assert!(r.outcomes.iter().all(|o| o.error.is_none()));
    }
    assert_eq!((on.peer_hits, off.peer_hits, slow.peer_hits), (12, 0, 6));
    let decisions = |r: &sim::SimResult| r.peer_fetch.clone().into_iter().collect::<Vec<_>>();
    assert_eq!(decisions(&on), [("fetch", 2)]);
    assert_eq!(decisions(&off), []);
    assert_eq!(decisions(&slow), [("compute", 1), ("fetch", 1)]);
    assert_eq!(
        on.tier_hits,
        [12, 0],
        "loaded from the prefill worker's host tier"
    );
    // Prefix hits: the decode worker's 96 tokens on each second prompt's reservation in every
    // run, and the prefill worker's 96 as well for each it fetched.
    assert_eq!(on.prefix_hit_tokens - off.prefix_hit_tokens, 2 * 96);
    assert_eq!(slow.prefix_hit_tokens - off.prefix_hit_tokens, 96);
}

/// Peer fetch from another decode worker than the request's: a conversation's first turn is
/// computed on one decode worker, three long requests sharing its prefix follow it there; its
/// second turn goes to the other decode worker (the first carries more than the busy slack
/// over it), which holds none of it — the router names the first as the source, and the
/// prefill worker fetches its 6 blocks from there.
#[test]
fn a_prefill_worker_fetches_from_a_decode_worker_holding_the_prefix_not_the_requests() {
    let first: Vec<u32> = (0..100).map(|i| 300 + i).collect();
    let second: Vec<u32> = (0..400).map(|i| 300 + i).collect();
    let long = |k: u32| -> Vec<u32> {
        first
            .iter()
            .copied()
            .chain((0..50).map(|i| 5000 + 100 * k + i))
            .collect()
    };
    let mut c = cluster(1, 2);
    c.prefill.as_mut().unwrap().engine.tiers.host_bytes = 64 * 16 * KV_BYTES;
    c.router.local_prefill_max_tokens = 120;
    c.peer_fetch = true;
    let mut reqs = vec![request(0, first.clone(), 1)];
    reqs.extend((0..3).map(|k| request(3000 + k as u64, long(k), 2000)));
    reqs.push(request(3500, second.clone(), 1));
    let r = Sim::new(c, reqs).unwrap().run();
    assert!(r.outcomes.iter().all(|o| o.error.is_none()));
    assert_eq!(
        r.peer_hits, 6,
        "the first turn's 6 blocks, from the other decode worker"
    );
    let decisions: Vec<_> = r.peer_fetch.clone().into_iter().collect();
    assert_eq!(decisions, [("fetch", 1)]);
    assert_eq!(
        r.tier_hits,
        [6, 0],
        "loaded from the prefill worker's host tier"
    );
}

/// Decode memory pressure on the mock H200 preset (issue 34, acceptance 5, where a recompute
/// costs what it costs a GPU): streams queued at once whose KV outgrows a pool a quarter of
/// what they grow to, the engine stepped on the virtual clock. Preempted streams swapped to G2
/// (priced at the preset's PCIe link) against the same engine recomputing them, the same pool
/// reserving each stream's length up front, and room for all (the limit); every arm's tokens
/// the same, the path asserted from the counters, and swap ahead of recompute. The goodputs
/// are printed (`BENCHMARKS.md`):
/// `cargo test --release -p sim --test sim -- swap_ --nocapture`
#[test]
fn swap_beats_recompute_under_decode_pressure_on_the_h200_preset() {
    let (model, _) = engine::inspect(&tandem_tests::model_path()).unwrap();
    let shapes: [(usize, (usize, usize)); 4] = [
        (32, (128, 512)),
        (24, (512, 512)),
        (16, (1024, 512)),
        (64, (512, 1024)),
    ];
    for (streams, (prompt, output)) in shapes {
        let bs = EngineConfig::default().block_size;
        let need = streams * (prompt + output).div_ceil(bs);
        let run = |blocks, admission, host: bool| {
            let (m, _) = engine::Model::mock_virtual(model.clone(), MockTiming::H200_LLAMA8B);
            let block_bytes = (m.kv_page_bytes(bs) * m.kv_pages(1)) as u64;
            let mut config = EngineConfig {
                num_blocks: blocks,
                admission,
                ..Default::default()
            };
            config.tiers.host_bytes = if host { need as u64 * block_bytes } else { 0 };
            let mut e = engine::Engine::new(std::sync::Arc::new(m), config, Vec::new()).unwrap();
            for k in 0..streams as u64 {
                let tokens = distinct(300 + 700 * k as u32, prompt as u32);
                let params = engine::SamplingParams {
                    max_tokens: Some(output),
                    ignore_eos: true,
                    ..Default::default()
                };
                e.add(engine::RequestId(k), tokens, params).unwrap();
            }
            let (mut out, mut ns) = (std::collections::BTreeMap::new(), 0u128);
            while e.has_work() {
                for t in e.step().unwrap() {
                    out.entry(t.id).or_insert_with(Vec::new).push(t.token);
                }
                ns += e
                    .model()
                    .take_modelled_time()
                    .unwrap_or_default()
                    .as_nanos();
            }
            assert_eq!(e.free_blocks(), e.total_blocks(), "every page back");
            let goodput = (streams * output) as f64 / (ns as f64 / 1e9);
            (out, e.load(), goodput)
        };
        use engine::Admission::{Optimistic, Reserve};
        let tight = need / 4;
        let (want, _, limit) = run(need, Reserve, false);
        let (swapped, s, swap) = run(tight, Optimistic, true);
        let (recomputed, r, recompute) = run(tight, Optimistic, false);
        let (reserved, _, reserve) = run(tight, Reserve, false);
        assert!(want.values().all(|t| t.len() == output));
        assert!(swapped == want && recomputed == want && reserved == want);
        let (ps, pr) = (s.preemptions, r.preemptions);
        assert!(
            ps.swapped > 0 && ps.recomputed == 0 && s.tiers.host.hits > 0,
            "{ps:?}"
        );
        assert!(pr.recomputed > 0 && pr.swapped == 0, "{pr:?}");
        println!(
            "{streams} x ({prompt} + {output}), pool {tight} of {need} pages: tokens/s room for \
             all {limit:.0}, swap {swap:.0} ({} preempted), recompute {recompute:.0} ({} \
             preempted), reserve {reserve:.0}; swap/recompute {:.2}x",
            ps.swapped,
            pr.recomputed,
            swap / recompute
        );
        assert!(
            swap > recompute,
            "swap {swap:.0} tokens/s, recompute {recompute:.0}"
        );
    }
}

/// The planner lets decode workers go while they decode long answers: their sequences move
/// live to the worker it keeps (the router core's own moves: paused, reserved there, the KV
/// over the link), none recomputed, migrated or failed, and each answer whole.
#[test]
fn the_planner_scaling_down_moves_live_sequences_off_the_workers_it_lets_go() {
    let mut cfg = cluster(1, 3);
    cfg.scaling = vec![router::planner::Scaling {
        pool: proto::Pool::Decode,
        wait_target: None,
        target: Duration::from_millis(200),
        min: 1,
        max: 3,
        initial: 3,
        tick: Duration::from_millis(100),
        cooldown: Duration::from_millis(500),
        window: Duration::from_secs(1),
    }];
    let reqs: Vec<SimRequest> = (0..3)
        .map(|i| {
            request(
                10 * i,
                (0..40).map(|t| 2000 * i as u32 + t + 300).collect(),
                3000,
            )
        })
        .collect();
    let r = Sim::new(cfg, reqs).unwrap().run();
    for o in &r.outcomes {
        assert_eq!(o.error, None);
        assert_eq!(o.tokens, 3000);
    }
    assert!(r.moves >= 1, "moved: {}", r.moves);
    assert_eq!(r.moves_stayed, 0);
    assert_eq!(r.migrations, 0);
    assert!(
        !r.decisions.keys().any(|k| k.starts_with("recomputed")),
        "{:?}",
        r.decisions
    );
    let downs = r
        .series
        .iter()
        .filter(|s| s.action == router::planner::Action::Down);
    assert!(downs.count() >= 1);
}
