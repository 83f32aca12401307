//! The planner's decisions on a virtual clock.

use super::*;

fn plan(pool: Pool) -> PoolPlan {
    PoolPlan::new(Scaling {
        pool,
        wait_target: None,
        target: Duration::from_millis(500),
        min: 1,
        max: 4,
        initial: 1,
        tick: Duration::from_millis(100),
        cooldown: Duration::from_secs(2),
        window: Duration::from_secs(5),
    })
}

/// A decode pool of 10–512 from 50, ITL target 100 ms, tick 1 s, cooldown and window 10 s.
fn decode_plan() -> PoolPlan {
    PoolPlan::new(Scaling {
        pool: Pool::Decode,
        wait_target: None,
        target: Duration::from_millis(100),
        min: 10,
        max: 512,
        initial: 50,
        tick: Duration::from_secs(1),
        cooldown: Duration::from_secs(10),
        window: Duration::from_secs(10),
    })
}

fn inp(live: u32, p90_ms: Option<u64>, predicted_ms: Option<u64>, queued: u64) -> Inputs {
    Inputs {
        live,
        starting: 0,
        p90: p90_ms.map(Duration::from_millis),
        predicted: predicted_ms.map(Duration::from_millis),
        queued,
        needed: None,
        censored: false,
        growth: 0.0,
        room_needed: None,
    }
}

#[test]
fn the_queue_scales_up_before_the_window_shows_a_miss_and_down_only_after_calm() {
    let t0 = Instant::now();
    let mut p = plan(Pool::Prefill);
    // The window still looks fine, but the queue predicts 1.4 s: up to 3 now.
    let d = p.decide(t0, inp(1, Some(200), Some(1400), 9000));
    assert_eq!((d.desired, d.action), (3, Action::Up), "{}", d.why);
    assert!(d.why.contains("predicted 1400 ms"), "{}", d.why);
    // While the new replicas start, no further scale-up.
    let mut i = inp(1, Some(900), Some(900), 9000);
    i.starting = 2;
    assert_eq!(
        p.decide(t0 + Duration::from_millis(100), i).action,
        Action::Hold
    );
    // Within target: hold.
    let d = p.decide(
        t0 + Duration::from_secs(1),
        inp(3, Some(400), Some(300), 10),
    );
    assert_eq!((d.desired, d.action), (3, Action::Hold));
    // Calm (below half the target, nothing queued) must last the cooldown.
    let t1 = t0 + Duration::from_secs(3);
    assert_eq!(
        p.decide(t1, inp(3, Some(100), None, 0)).action,
        Action::Hold
    );
    assert_eq!(
        p.decide(t1 + Duration::from_millis(1900), inp(3, None, None, 0))
            .action,
        Action::Hold
    );
    let d = p.decide(t1 + Duration::from_secs(2), inp(3, None, None, 0));
    assert_eq!((d.desired, d.action), (2, Action::Down));
    // One at a time, a cooldown apart, never below the minimum.
    assert_eq!(
        p.decide(t1 + Duration::from_secs(3), inp(2, None, None, 0))
            .action,
        Action::Hold
    );
    assert_eq!(
        p.decide(t1 + Duration::from_secs(4), inp(2, None, None, 0))
            .desired,
        1
    );
    assert_eq!(
        p.decide(t1 + Duration::from_secs(9), inp(1, None, None, 0))
            .desired,
        1
    );
}

/// A pool far larger than its demand needs sheds the surplus in one decision once it is
/// cooled and within 80% of its target (queue or not: a busy large pool always has
/// prompts in flight); near what it needs, or closer to its target, it does not.
#[test]
fn a_pool_far_over_its_demand_goes_down_to_it_at_once() {
    let t0 = Instant::now();
    let mut p = PoolPlan::new(Scaling {
        max: 100,
        initial: 40,
        ..plan(Pool::Prefill).scaling
    });
    let sized = |live, p90_ms, needed| Inputs {
        needed: Some(needed as f64),
        ..inp(live, Some(p90_ms), Some(20), 5000)
    };
    // Over 80% of the target: no.
    assert_eq!(p.decide(t0, sized(40, 450, 6)).action, Action::Hold);
    let d = p.decide(t0 + Duration::from_secs(1), sized(40, 350, 6));
    assert_eq!((d.desired, d.action), (6, Action::Down), "{}", d.why);
    assert!(d.why.contains("the demand needs 6"), "{}", d.why);
    // Not again within the cooldown, and not for a replica's difference.
    assert_eq!(
        p.decide(t0 + Duration::from_secs(2), sized(6, 100, 1))
            .action,
        Action::Hold
    );
    let d = p.decide(t0 + Duration::from_secs(4), sized(6, 100, 5));
    assert_eq!((d.desired, d.action), (6, Action::Hold), "{}", d.why);
}

/// A counter's rate over the window, once readings span half of it.
#[test]
fn rates_are_taken_over_the_window() {
    let t0 = Instant::now();
    let mut r = Rate::new(Duration::from_secs(10));
    assert_eq!(r.observe(t0, 0), None);
    assert_eq!(r.observe(t0 + Duration::from_secs(4), 400), None);
    assert_eq!(r.observe(t0 + Duration::from_secs(5), 500), Some(100.0));
    // Older readings fall out: 20 s in, the rate of the last 10 s.
    for s in 6..=20 {
        r.observe(t0 + Duration::from_secs(s), 500 + (s - 5) * 10);
    }
    let last = r.observe(t0 + Duration::from_secs(21), 660).unwrap();
    assert!((last - 10.0).abs() < 1e-9, "{last}");
}

#[test]
fn a_stale_window_after_a_scale_up_does_not_scale_up_again() {
    let t0 = Instant::now();
    let mut p = plan(Pool::Prefill);
    assert_eq!(p.decide(t0, inp(1, Some(900), None, 0)).desired, 2);
    // The new replica joined; the window still shows 900 ms for a while: hold.
    let d = p.decide(t0 + Duration::from_secs(2), inp(2, Some(900), Some(200), 0));
    assert_eq!((d.desired, d.action), (2, Action::Hold), "{}", d.why);
    // Unless the queue itself predicts a miss.
    let d = p.decide(
        t0 + Duration::from_secs(3),
        inp(2, Some(900), Some(1200), 5000),
    );
    assert_eq!((d.desired, d.action), (4, Action::Up), "{}", d.why);
}

#[test]
fn pressure_is_capped_at_max_and_a_lost_replica_is_wanted_back() {
    let t0 = Instant::now();
    let mut p = plan(Pool::Decode);
    let d = p.decide(t0, inp(1, Some(5000), None, 3));
    assert_eq!(d.desired, 4);
    // A replica crashed: the desired count stays, so the actuator replaces it.
    let d = p.decide(t0 + Duration::from_secs(1), inp(3, Some(450), None, 0));
    assert_eq!((d.desired, d.action), (4, Action::Hold));
    // A queue with a fine window is not calm: no scale-down.
    let t = t0 + Duration::from_secs(10);
    assert_eq!(p.decide(t, inp(4, Some(10), None, 2)).action, Action::Hold);
    assert_eq!(
        p.decide(t + Duration::from_secs(5), inp(4, Some(10), None, 2))
            .action,
        Action::Hold
    );
}

#[test]
fn windows_forget_old_latencies() {
    let t0 = Instant::now();
    let mut w = Window::new(Duration::from_secs(1));
    for i in 0..100 {
        w.record(t0, Duration::from_millis(if i < 90 { 10 } else { 1000 }));
    }
    let (p90, n) = w.quantile(t0, 0.9);
    assert_eq!(n, 100);
    assert!(p90.unwrap() <= Duration::from_millis(11));
    let (p99, _) = w.quantile(t0, 0.99);
    assert!(p99.unwrap() >= Duration::from_millis(990));
    assert_eq!(w.quantile(t0 + Duration::from_secs(2), 0.9), (None, 0));
}

/// Requests waiting for room scale the decode pool to the KV held and wanted, not by the
/// admission wait's ratio to the ITL target: 50 replicas of 1,000 blocks at 95%, 500
/// requests holding them (95 blocks each), 7 waiting — (47,500 + 7 × 95) / 850 → 57, where
/// a 3-s wait over a 100-ms target would ask for the maximum. An ITL over its target is a
/// lack of speed, and still scales by its ratio.
#[test]
fn a_decode_pool_short_of_room_grows_by_the_room_its_requests_need() {
    let t0 = Instant::now();
    let mut seen = Observed {
        itl_p90: Some(Duration::from_millis(60)),
        admission_p90: Some(Duration::from_secs(3)),
        decode_waiting: 7,
        decode_blocks_used: 47_500,
        decode_blocks_total: 50_000,
        decode_holding: 500,
        ..Default::default()
    };
    let inputs = seen.inputs(Pool::Decode, 50, 0);
    assert_eq!(inputs.room_needed, Some(57));
    let d = decode_plan().decide(t0, inputs);
    assert_eq!((d.desired, d.action), (57, Action::Up), "{}", d.why);
    // Nothing waiting: no room is needed.
    seen.decode_waiting = 0;
    assert_eq!(seen.inputs(Pool::Decode, 50, 0).room_needed, None);
    // Slow tokens: by the ITL's ratio (150 / 100 → 75).
    seen.decode_waiting = 7;
    seen.itl_p90 = Some(Duration::from_millis(150));
    seen.admission_p90 = None;
    let d = decode_plan().decide(t0, seen.inputs(Pool::Decode, 50, 0));
    assert_eq!((d.desired, d.action), (75, Action::Up), "{}", d.why);
}

#[test]
fn peaks_are_taken_over_a_whole_window() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut p = Peak::new(s(10));
    assert_eq!(p.observe(t0, 100), None, "not a whole window yet");
    assert_eq!(p.observe(t0 + s(5), 50), None);
    assert_eq!(p.observe(t0 + s(10), 30), Some(100));
    assert_eq!(
        p.observe(t0 + s(11), 20),
        Some(50),
        "100 has left the window"
    );
    assert_eq!(p.observe(t0 + s(16), 10), Some(30));
    assert_eq!(p.observe(t0 + s(17), 40), Some(40));
}

/// A decode pool is sized down to the most KV its requests held over a whole window: 50
/// replicas of 1,000 blocks, a peak of 17,000 blocks in use, at 85% → 20 — while requests
/// wait for room too, but then never up by it. Not before a whole window.
#[test]
fn a_decode_pool_is_sized_down_to_the_most_kv_held_over_a_window() {
    let t0 = Instant::now();
    let mut p = decode_plan();
    let mut seen = Observed {
        itl_p90: Some(Duration::from_millis(7)),
        decode_blocks_used: 12_000,
        decode_blocks_peak: Some(17_000),
        decode_blocks_total: 50_000,
        decode_holding: 300,
        ..Default::default()
    };
    let inputs = seen.inputs(Pool::Decode, 50, 0);
    assert_eq!(inputs.needed.map(f64::ceil), Some(20.0));
    let d = p.decide(t0, inputs);
    assert_eq!((d.desired, d.action), (20, Action::Down), "{}", d.why);
    // While requests wait for room, what was held is a floor of the demand: it still sizes
    // the pool down (within target)…
    seen.decode_waiting = 1;
    let inputs = seen.inputs(Pool::Decode, 50, 0);
    assert!(inputs.censored);
    let d = decode_plan().decide(t0, inputs);
    assert_eq!((d.desired, d.action), (20, Action::Down), "{}", d.why);
    // … but never up by it: over target with replicas starting, a need of 60 (51,000 / 850;
    // 66 with the margin the window over target raised a tenth) asks for more only when none
    // waits.
    seen.decode_blocks_peak = Some(51_000);
    seen.itl_p90 = Some(Duration::from_millis(150));
    let d = decode_plan().decide(t0, seen.inputs(Pool::Decode, 50, 5));
    assert_eq!((d.desired, d.action), (50, Action::Hold), "{}", d.why);
    seen.decode_waiting = 0;
    let d = decode_plan().decide(t0, seen.inputs(Pool::Decode, 50, 5));
    assert_eq!((d.desired, d.action), (66, Action::Up), "{}", d.why);
    seen.decode_blocks_peak = None;
    assert_eq!(seen.inputs(Pool::Decode, 50, 0).needed, None);
}

/// The prefill pool is sized to the tokens it will compute: 100,000 prompt tokens a second
/// sent (the p90 of the readings) to replicas computing 10,000 a second each → 10 replicas;
/// with a quarter of what the engines admit found cached → 7.5 (75,000 / 10,000).
#[test]
fn a_prefill_pool_is_sized_to_the_tokens_it_will_compute() {
    let mut seen = Observed {
        prefill_capacity: 200_000.0,
        prefill_measured: 20,
        prefill_demand: Some(Outlook {
            high: 100_000.0,
            slope: 0.0,
        }),
        ..Default::default()
    };
    assert_eq!(seen.inputs(Pool::Prefill, 20, 0).needed, Some(10.0));
    seen.prefill_hit_share = Some(0.25);
    assert_eq!(seen.inputs(Pool::Prefill, 20, 0).needed, Some(7.5));
}

/// A trend's p90 and slope: a steady rise of 100 a second reads as 100 (less its noise: none);
/// flat readings that jitter read as no trend at all.
#[test]
fn a_trend_reads_a_rise_and_not_jitter() {
    let t0 = Instant::now();
    let mut rising = Trend::new(Duration::from_secs(10));
    let mut flat = Trend::new(Duration::from_secs(10));
    let (mut r, mut f) = (None, None);
    for i in 0..=10u64 {
        let at = t0 + Duration::from_secs(i);
        r = rising.observe(at, 1000.0 + 100.0 * i as f64);
        f = flat.observe(at, if i % 2 == 0 { 900.0 } else { 1100.0 });
    }
    let (r, f) = (r.unwrap(), f.unwrap());
    assert!((r.slope - 100.0).abs() < 1e-6, "{r:?}");
    assert_eq!(r.high, 1900.0);
    assert_eq!((f.slope, f.high), (0.0, 1100.0));
}

/// Demand rising within target: the pool is asked, now, for what the trend will need once a
/// replica has started, as measured: none before one has been; after a start-up of 5 s, 4
/// needed, rising 0.5 a second → 4 + 2.5 = 7 (up); and each start-up measured moves the lead.
#[test]
fn rising_demand_is_met_a_start_up_ahead() {
    let t0 = Instant::now();
    let mut p = PoolPlan::new(Scaling {
        max: 10,
        initial: 4,
        ..plan(Pool::Prefill).scaling
    });
    // No start-up measured: no look ahead. Then one, on pressure, taking 5 s.
    let s = Duration::from_secs;
    let rising = |live, starting, growth| Inputs {
        needed: Some(4.0),
        growth,
        starting,
        ..inp(live, Some(300), None, 0)
    };
    let d = p.decide(t0, rising(4, 0, 0.5));
    assert_eq!((d.action, d.needed_ahead), (Action::Hold, Some(4)));
    let d = p.decide(t0, inp(4, Some(100), Some(600), 9000));
    assert_eq!((d.desired, d.action), (5, Action::Up), "{}", d.why);
    p.decide(t0 + s(2), rising(4, 1, 0.0));
    let t0 = t0 + s(5);
    assert_eq!(p.decide(t0, rising(5, 0, 0.0)).action, Action::Hold);
    assert_eq!(p.lead(), Some(s(5)));
    // A slight rise in a demand short of what serves asks nothing (3.9 + 0.05 is still 4).
    let slight = Inputs {
        needed: Some(3.9),
        ..rising(5, 0, 0.01)
    };
    assert_eq!(p.decide(t0, slight).action, Action::Hold);
    // A floor of the demand (some of it waiting: censored) is no reason to look ahead.
    let floor = Inputs {
        censored: true,
        ..rising(5, 0, 0.5)
    };
    assert_eq!(p.decide(t0, floor).action, Action::Hold);
    let d = p.decide(t0, rising(5, 0, 0.5));
    assert_eq!((d.desired, d.action), (7, Action::Up), "{}", d.why);
    assert!(d.why.contains("rising"), "{}", d.why);
    // Asked for already: no more while they start.
    assert_eq!(p.decide(t0 + s(1), rising(5, 2, 0.5)).action, Action::Hold);
    p.decide(t0 + s(3), rising(7, 0, 0.0));
    // 5 s measured, then 3 s: (5 + 3·3)/4 = 3.5 s.
    assert_eq!(p.lead(), Some(Duration::from_millis(3500)));
}

/// The prefill demand is read over spans of the TTFT target, its p90 over the window: 1,000
/// tokens a second steadily reads 1,000; then 6,000 in a second reads 3,500 over the 2-s span
/// — counted once a second such reading has come (the p90 of the window's eleven readings is
/// their second highest).
#[test]
fn the_prefill_demand_is_the_p90_of_its_rate_over_spans_of_the_target() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut w = Watch::new(s(10), s(2));
    let mut sent = 0;
    let mut last = None;
    for i in 0..=20u64 {
        last = w.demand(t0 + s(i), sent);
        sent += 1000;
    }
    assert_eq!(
        last,
        Some(Outlook {
            high: 1000.0,
            slope: 0.0
        })
    );
    sent += 5000;
    assert_eq!(w.demand(t0 + s(21), sent).unwrap().high, 1000.0);
    sent += 1000;
    assert_eq!(w.demand(t0 + s(22), sent).unwrap().high, 3500.0);
}

/// The demand's trend is fitted to what each tick alone saw sent: a steady rise of 100 tokens
/// a second each second reads as 100; a flat load read over an overlapping window, however it
/// happened to fall, as none.
#[test]
fn the_prefill_trend_is_fitted_to_each_ticks_own_tokens() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut rising = Watch::new(s(10), s(2));
    let (mut sent, mut rate) = (0, 1000);
    let mut last = None;
    for i in 0..=10u64 {
        last = rising.demand(t0 + s(i), sent);
        sent += rate;
        rate += 100;
    }
    assert!((last.unwrap().slope - 100.0).abs() < 1e-6, "{last:?}");
    // Flat at 1,000 a second, in uneven ticks: 400, 1,600, 1,000, ... .
    let mut flat = Watch::new(s(10), s(2));
    let mut sent = 0;
    for i in 0..=20u64 {
        last = flat.demand(t0 + s(i), sent);
        sent += [400, 1600, 1000][i as usize % 3];
    }
    assert_eq!(last.unwrap().slope, 0.0, "{last:?}");
    // From idle to 1,000 a second: a step, no trend.
    let mut step = Watch::new(s(10), s(2));
    let mut sent = 0;
    for i in 0..=30u64 {
        last = step.demand(t0 + s(i), sent);
        sent += if i < 15 { 0 } else { 1000 };
        assert_eq!(last.map_or(0.0, |o| o.slope), 0.0, "at {i} s: {last:?}");
    }
}

/// Over target while replicas start: the window's pressure asks nothing more (it does not
/// show them yet), but a demand beyond the replicas asked for does.
#[test]
fn over_target_while_replicas_start_only_the_demand_asks_for_more() {
    let t0 = Instant::now();
    let mut p = PoolPlan::new(Scaling {
        max: 20,
        initial: 4,
        ..plan(Pool::Prefill).scaling
    });
    let over = |needed: f64| Inputs {
        starting: 2,
        needed: Some(needed),
        ..inp(4, Some(900), Some(900), 5000)
    };
    // Asked for 6 (4 serving, 2 starting): a demand of 4.9 asks nothing more (5.9 with the
    // margin, raised a tenth by each tick over target).
    let d = p.decide(t0, inp(4, Some(700), Some(700), 5000));
    assert_eq!((d.desired, d.action), (6, Action::Up), "{}", d.why);
    let d = p.decide(t0 + Duration::from_secs(1), over(4.9));
    assert_eq!(d.action, Action::Hold, "{}", d.why);
    // The demand grows to 7.5 replicas (9.98 with the margin): up to 10 now, before the two
    // have joined.
    let d = p.decide(t0 + Duration::from_secs(2), over(7.5));
    assert_eq!((d.desired, d.action), (10, Action::Up), "{}", d.why);
    assert!(d.why.contains("the demand needs 10"), "{}", d.why);
}

/// A decode pool's wait for room is held to its wait target, not to the ITL target: a line
/// whose p90 wait is 200 ms, under half a 750-ms target, lets a pool calm down a replica a
/// cooldown (held to the 100-ms ITL target it would scale up); at 1.5 s it grows by the
/// room its requests need.
#[test]
fn a_decode_pools_line_is_held_to_its_wait_target() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let with_wait = || {
        let mut p = decode_plan();
        p.scaling.wait_target = Some(Duration::from_millis(750));
        PoolPlan::new(p.scaling)
    };
    let mut seen = Observed {
        itl_p90: Some(Duration::from_millis(7)),
        admission_p90: Some(Duration::from_millis(200)),
        decode_waiting: 5,
        decode_blocks_used: 47_500,
        decode_blocks_total: 50_000,
        decode_holding: 500,
        ..Default::default()
    };
    let mut p = with_wait();
    let d = p.decide(t0, seen.inputs(Pool::Decode, 50, 0));
    assert_eq!(d.action, Action::Hold, "{}", d.why);
    let d = p.decide(t0 + s(10), seen.inputs(Pool::Decode, 50, 0));
    assert_eq!((d.desired, d.action), (49, Action::Down), "{}", d.why);
    let d = decode_plan().decide(t0, seen.inputs(Pool::Decode, 50, 0));
    assert_eq!(d.action, Action::Up, "held to the ITL target: {}", d.why);
    seen.admission_p90 = Some(Duration::from_millis(1500));
    let d = with_wait().decide(t0, seen.inputs(Pool::Decode, 50, 0));
    // (47,500 + 5 x 95) / 850 → 57.
    assert_eq!((d.desired, d.action), (57, Action::Up), "{}", d.why);
}

/// The admission wait's p90 counts the requests still waiting at what they have waited so
/// far: a window of 9 waits of 10 ms and a line of two waiting 2 s reads 2 s, not 10 ms.
#[test]
fn the_waits_of_a_line_still_waiting_count() {
    let t0 = Instant::now();
    let mut w = Window::new(Duration::from_secs(10));
    for i in 0..9 {
        w.record(t0 + Duration::from_millis(i), Duration::from_millis(10));
    }
    let now = t0 + Duration::from_secs(1);
    let (ended, n) = w.quantile(now, 0.9);
    assert_eq!(n, 9);
    assert!(ended.unwrap() < Duration::from_millis(11), "{ended:?}");
    let line = [Duration::from_secs(2); 2];
    let ([all], n) = w.quantiles_with(now, [0.9], line.into_iter());
    assert_eq!(n, 11);
    assert!(all.unwrap() >= Duration::from_millis(1990), "{all:?}");
}

/// The sizing margin is learned from the pool's own latency: each tick whose window is over
/// target raises it a tenth (to at most 2), each calm tick lowers it by half a percent (to 1);
/// a tick within target but not calm leaves it.
#[test]
fn the_margin_rises_while_over_target_and_falls_back_while_calm() {
    let t0 = Instant::now();
    let mut p = plan(Pool::Prefill);
    let at = |i: u64| t0 + Duration::from_secs(i);
    let needed = |n: f64, p90: u64| Inputs {
        needed: Some(n),
        ..inp(10, Some(p90), None, 0)
    };
    assert_eq!(p.margin(), 1.0);
    p.decide(at(0), needed(10.0, 900));
    assert!((p.margin() - 1.1).abs() < 1e-9, "{}", p.margin());
    assert_eq!(p.needed_ahead(&needed(10.0, 0)), Some(11));
    for i in 1..20 {
        p.decide(at(i), needed(10.0, 900));
    }
    assert_eq!(p.margin(), MARGIN_MAX);
    let m = p.margin();
    p.decide(at(20), needed(10.0, 400));
    assert_eq!(p.margin(), m, "within target, not calm: kept");
    p.decide(at(21), needed(10.0, 100));
    assert!((p.margin() - m * MARGIN_STEP.1).abs() < 1e-9);
    for i in 22..400 {
        p.decide(at(i), needed(10.0, 100));
    }
    assert_eq!(p.margin(), 1.0, "back to none");
}
