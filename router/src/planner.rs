//! The planner: each pool scales on its own latency target, from sliding windows of what the
//! router measures, and from its queues, so it acts before an SLO is lost.
//!
//! - The **prefill pool** reads TTFT from a request's decode reservation to its first token
//!   (prefill queueing, compute and KV wait: the part the prefill pool owns), and predicts it
//!   from the prompt tokens waiting for a prefill and the pool's measured per-replica rate.
//! - The **decode pool** reads inter-token latency, and requests waiting for a decode worker
//!   to have room (admission queueing, which TTFT would otherwise hide).
//!
//! Neither pool reads the other's signals. [`PoolPlan::decide`] is a pure function of its
//! inputs and the time, unit-tested on a virtual clock; the loop in [`run`] feeds it each tick,
//! logs every decision with its inputs, exports them as metrics, and hands the desired count to
//! the pool's [`crate::actuator::Actuator`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Latencies over the last `window`, in slices so old ones fall out.
pub struct Window {
    window: Duration,
    slice: Duration,
    slices: VecDeque<(Instant, Histogram<u64>)>,
}

impl Window {
    /// A window of `window`, kept in slices of a tenth of it.
    pub fn new(window: Duration) -> Window {
        Window {
            window,
            slice: (window / 10).max(Duration::from_millis(10)),
            slices: VecDeque::new(),
        }
    }

    /// How far back it looks.
    pub fn span(&self) -> Duration {
        self.window
    }

    /// Records a latency at `now`.
    pub fn record(&mut self, now: Instant, value: Duration) {
        let fresh = self
            .slices
            .back()
            .is_none_or(|(start, _)| now.duration_since(*start) >= self.slice);
        if fresh {
            let h = Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("valid bounds");
            self.slices.push_back((now, h));
        }
        let us = (value.as_micros() as u64).clamp(1, 3_600_000_000);
        let h = &mut self.slices.back_mut().expect("pushed").1;
        let _ = h.record(us);
        self.expire(now);
    }

    fn expire(&mut self, now: Instant) {
        while self
            .slices
            .front()
            .is_some_and(|(start, _)| now.duration_since(*start) > self.window)
        {
            self.slices.pop_front();
        }
    }

    /// The `q` quantile (0..1) of the window at `now` and how many samples it has.
    pub fn quantile(&mut self, now: Instant, q: f64) -> (Option<Duration>, u64) {
        let ([v], n) = self.quantiles(now, [q]);
        (v, n)
    }

    /// Several quantiles of the window at `now` from one merge of its slices, and how many
    /// samples it has.
    pub fn quantiles<const N: usize>(
        &mut self,
        now: Instant,
        qs: [f64; N],
    ) -> ([Option<Duration>; N], u64) {
        self.expire(now);
        let mut all = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 2).expect("valid bounds");
        for (_, h) in &self.slices {
            let _ = all.add(h);
        }
        let n = all.len();
        let at = |q: f64| (n > 0).then(|| Duration::from_micros(all.value_at_quantile(q)));
        (qs.map(at), n)
    }
}

/// What the router measures for the planner (recorded on the request path, read each tick).
pub struct Signals {
    /// Every request: arrival at the router to its first token (what clients see).
    pub ttft: Mutex<Window>,
    /// Prefill pool: decode reservation to first token, remote prefills only.
    pub prefill_ttft: Mutex<Window>,
    /// Decode pool: gaps between tokens.
    pub itl: Mutex<Window>,
    /// Decode pool: time requests waited for a decode worker with room.
    pub admission: Mutex<Window>,
    /// Prompt tokens sent to the prefill pool and not yet done.
    pub prefill_pending_tokens: AtomicU64,
    /// Requests waiting right now for a decode worker with room.
    pub decode_waiting: AtomicUsize,
}

impl Signals {
    /// Signals over `window`.
    pub fn new(window: Duration) -> Signals {
        Signals {
            ttft: Mutex::new(Window::new(window)),
            prefill_ttft: Mutex::new(Window::new(window)),
            itl: Mutex::new(Window::new(window)),
            admission: Mutex::new(Window::new(window)),
            prefill_pending_tokens: AtomicU64::new(0),
            decode_waiting: AtomicUsize::new(0),
        }
    }

    /// A prompt of `tokens` went to the prefill pool; the guard marks it done when dropped.
    pub fn prefill_started(self: &Arc<Self>, tokens: u64) -> PendingPrefill {
        self.prefill_pending_tokens
            .fetch_add(tokens, Ordering::SeqCst);
        PendingPrefill(self.clone(), tokens)
    }
}

/// A prompt in the prefill pool, counted as pending until dropped (finished or given up).
pub struct PendingPrefill(Arc<Signals>, u64);

impl Drop for PendingPrefill {
    fn drop(&mut self) {
        self.0
            .prefill_pending_tokens
            .fetch_sub(self.1, Ordering::SeqCst);
    }
}

pub use proto::Pool;

/// A pool's bounds, target and pace.
#[derive(Debug, Clone)]
pub struct Scaling {
    /// Which pool.
    pub pool: Pool,
    /// The p90 target (TTFT for prefill, ITL for decode).
    pub target: Duration,
    /// Fewest replicas.
    pub min: u32,
    /// Most replicas.
    pub max: u32,
    /// Replicas to start with.
    pub initial: u32,
    /// Decision period.
    pub tick: Duration,
    /// Least time between scale-downs, and after a scale-up before one.
    pub cooldown: Duration,
    /// Percentile window.
    pub window: Duration,
}

/// One tick's view of a pool.
#[derive(Debug, Clone, Copy, Default)]
pub struct Inputs {
    /// Replicas serving (joined, not draining).
    pub live: u32,
    /// Replicas started and not yet joined.
    pub starting: u32,
    /// p90 of the pool's latency over the window, if it has samples.
    pub p90: Option<Duration>,
    /// Latency the queue predicts for work arriving now, if known.
    pub predicted: Option<Duration>,
    /// Work queued in front of the pool (prompt tokens pending; requests waiting for room).
    pub queued: u64,
}

/// What the planner decided and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Replicas wanted.
    pub desired: u32,
    /// "up", "down" or "hold".
    pub action: &'static str,
    /// The reason, with the numbers.
    pub why: String,
}

/// A pool's planner state.
#[derive(Debug)]
pub struct PoolPlan {
    /// Its configuration.
    pub scaling: Scaling,
    desired: u32,
    last_change: Option<Instant>,
    last_up: Option<Instant>,
    calm_since: Option<Instant>,
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3))
}

impl PoolPlan {
    /// A plan starting at `scaling.initial` (clamped to the bounds).
    pub fn new(scaling: Scaling) -> PoolPlan {
        let desired = scaling.initial.clamp(scaling.min, scaling.max);
        PoolPlan {
            scaling,
            desired,
            last_change: None,
            last_up: None,
            calm_since: None,
        }
    }

    /// Replicas currently wanted.
    pub fn desired(&self) -> u32 {
        self.desired
    }

    /// Decides at `now` from `inp`: up at once when the window or the queue says the target is
    /// (or will be) missed, by the ratio of the pressure; down one replica at a time after the
    /// pool has been calm (below half the target, nothing queued) for the cooldown.
    pub fn decide(&mut self, now: Instant, inp: Inputs) -> Decision {
        let s = &self.scaling;
        let target = s.target.as_secs_f64();
        let p90 = inp.p90.map_or(0.0, |d| d.as_secs_f64());
        let predicted = inp.predicted.map_or(0.0, |d| d.as_secs_f64());
        // For a window after a scale-up its percentiles still hold the latencies that caused it:
        // only the queue's prediction (which sees the new replicas at once) may add more.
        let stale = self
            .last_up
            .is_some_and(|t| now.duration_since(t) < s.window);
        let pressure = if stale { predicted } else { p90.max(predicted) } / target;
        let seen = format!(
            "p90 {} predicted {} target {} queued {} live {} starting {}",
            ms(inp.p90),
            ms(inp.predicted),
            ms(Some(s.target)),
            inp.queued,
            inp.live,
            inp.starting
        );
        let cooled = self
            .last_change
            .is_none_or(|t| now.duration_since(t) >= s.cooldown);
        let hold = |desired, why: String| Decision {
            desired,
            action: "hold",
            why,
        };
        if pressure > 1.0 {
            self.calm_since = None;
            if inp.starting > 0 {
                return hold(
                    self.desired,
                    format!("over target, replicas still starting: {seen}"),
                );
            }
            let have = inp.live.max(1);
            let want = ((have as f64 * pressure).ceil() as u32)
                .max(have + 1)
                .clamp(s.min, s.max);
            if want > self.desired.max(inp.live) {
                self.desired = want;
                self.last_change = Some(now);
                self.last_up = Some(now);
                let why = format!("pressure {pressure:.2}: {seen}");
                return Decision {
                    desired: want,
                    action: "up",
                    why,
                };
            }
            return hold(self.desired, format!("over target at the maximum: {seen}"));
        }
        if p90.max(predicted) / target < 0.5 && inp.queued == 0 {
            let calm = *self.calm_since.get_or_insert(now);
            if self.desired > s.min && cooled && now.duration_since(calm) >= s.cooldown {
                self.desired -= 1;
                self.last_change = Some(now);
                self.calm_since = Some(now);
                return Decision {
                    desired: self.desired,
                    action: "down",
                    why: format!("calm for {:?}: {seen}", s.cooldown),
                };
            }
            return hold(self.desired, format!("calm: {seen}"));
        }
        self.calm_since = None;
        hold(self.desired, format!("within target: {seen}"))
    }
}

/// What one tick observes of the cluster, the I/O done: the router's signals and the workers'
/// heartbeats, read once ([`observe`]) — or a simulation's (the `sim` crate).
#[derive(Debug, Clone, Copy, Default)]
pub struct Observed {
    /// Prompt tokens sent to the prefill pool and not yet done.
    pub prefill_pending_tokens: u64,
    /// Prompt tokens per second of engine time the live prefill replicas measure, summed.
    pub prefill_capacity: f64,
    /// p90 of the prefill TTFT window.
    pub prefill_ttft_p90: Option<Duration>,
    /// p90 of the inter-token latency window.
    pub itl_p90: Option<Duration>,
    /// p90 of the admission wait window.
    pub admission_p90: Option<Duration>,
    /// Requests waiting right now for a decode worker with room.
    pub decode_waiting: u64,
}

impl Observed {
    /// One tick's inputs of `pool` with `live` replicas (`starting` more on their way) — each
    /// pool from its own signals only.
    pub fn inputs(&self, pool: Pool, live: u32, starting: u32) -> Inputs {
        match pool {
            Pool::Prefill => {
                // The queue's prediction: prompt tokens not yet prefilled over what the live
                // replicas measure they compute per second of engine time.
                let (pending, capacity) = (self.prefill_pending_tokens, self.prefill_capacity);
                let predicted = (capacity > 0.0 && pending > 0)
                    .then(|| Duration::from_secs_f64(pending as f64 / capacity));
                Inputs {
                    live,
                    starting,
                    p90: self.prefill_ttft_p90,
                    predicted,
                    queued: pending,
                }
            }
            Pool::Decode => Inputs {
                live,
                starting,
                p90: self.itl_p90,
                // Requests queued for room now will have waited at least this long.
                predicted: self.admission_p90.filter(|_| self.decode_waiting > 0),
                queued: self.decode_waiting,
            },
        }
    }
}

/// What the router's signals and the workers' heartbeats say at `now`.
fn observe(signals: &Signals, workers: &[crate::registry::Worker], now: Instant) -> Observed {
    let p90 = |w: &Mutex<Window>| w.lock().expect("window lock").quantile(now, 0.9).0;
    Observed {
        prefill_pending_tokens: signals.prefill_pending_tokens.load(Ordering::SeqCst),
        prefill_capacity: workers
            .iter()
            .filter(|w| w.pool == Pool::Prefill && !w.draining)
            .map(|w| w.load.prompt_tokens_per_s as f64)
            .sum(),
        prefill_ttft_p90: p90(&signals.prefill_ttft),
        itl_p90: p90(&signals.itl),
        admission_p90: p90(&signals.admission),
        decode_waiting: signals.decode_waiting.load(Ordering::SeqCst) as u64,
    }
}

/// Exports a tick's decision for `pool` and its inputs, and says it when it is not a hold.
fn report(pool: Pool, inputs: &Inputs, d: &Decision, tick: Duration) {
    let name = pool.name();
    let n = inputs.live;
    metrics::gauge!("tandem_planner_desired_replicas", "pool" => name).set(d.desired as f64);
    metrics::gauge!("tandem_planner_live_replicas", "pool" => name).set(n as f64);
    // Worker-seconds spent, for cost comparisons (live replicas integrated over ticks).
    metrics::gauge!("tandem_planner_replica_seconds", "pool" => name)
        .increment(n as f64 * tick.as_secs_f64());
    metrics::gauge!("tandem_planner_p90_seconds", "pool" => name)
        .set(inputs.p90.map_or(0.0, |d| d.as_secs_f64()));
    metrics::gauge!("tandem_planner_predicted_seconds", "pool" => name)
        .set(inputs.predicted.map_or(0.0, |d| d.as_secs_f64()));
    metrics::gauge!("tandem_planner_queued", "pool" => name).set(inputs.queued as f64);
    metrics::counter!("tandem_planner_decisions_total", "pool" => name, "action" => d.action)
        .increment(1);
    if d.action == "hold" {
        tracing::debug!(pool = name, desired = d.desired, "planner: hold: {}", d.why);
        return;
    }
    tracing::info!(
        pool = name,
        desired = d.desired,
        action = d.action,
        "planner: {}",
        d.why
    );
    eprintln!(
        "tandem router: planner {name} {} to {}: {}",
        d.action, d.desired, d.why
    );
}

/// Runs the planner: every tick, each pool's decision from its own inputs, exported and handed
/// to the actuator — while `leader` reads `true` (etcd's election among several routers; `None`:
/// the only router, always leading).
pub async fn run(
    state: Arc<crate::State>,
    mut plans: Vec<PoolPlan>,
    mut actuator: Box<dyn crate::actuator::Actuator>,
    leader: Option<tokio::sync::watch::Receiver<bool>>,
) {
    let tick = plans
        .iter()
        .map(|p| p.scaling.tick)
        .min()
        .unwrap_or(Duration::from_secs(1));
    let registry = state.registry.clone();
    let mut starting: std::collections::HashMap<Pool, u32> = Default::default();
    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if let Some(l) = &leader {
            // A follower decides nothing: the leader's planner scales the pools.
            let leads = *l.borrow();
            metrics::gauge!("tandem_planner_leader").set(if leads { 1.0 } else { 0.0 });
            if !leads {
                starting.clear();
                continue;
            }
        }
        let now = Instant::now();
        let workers = registry.workers();
        let observed = observe(&state.signals, &workers, now);
        for plan in &mut plans {
            let pool = plan.scaling.pool;
            let live = workers
                .iter()
                .filter(|w| w.pool == pool && !w.draining)
                .count() as u32;
            let on_way = starting.get(&pool).copied().unwrap_or(0);
            let inputs = observed.inputs(pool, live, on_way);
            let d = plan.decide(now, inputs);
            report(pool, &inputs, &d, tick);
            state.board.decided(now, pool, &inputs, &d);
            starting.insert(pool, actuator.reconcile(pool, d.desired, &registry).await);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(pool: Pool) -> PoolPlan {
        PoolPlan::new(Scaling {
            pool,
            target: Duration::from_millis(500),
            min: 1,
            max: 4,
            initial: 1,
            tick: Duration::from_millis(100),
            cooldown: Duration::from_secs(2),
            window: Duration::from_secs(5),
        })
    }

    fn inp(live: u32, p90_ms: Option<u64>, predicted_ms: Option<u64>, queued: u64) -> Inputs {
        Inputs {
            live,
            starting: 0,
            p90: p90_ms.map(Duration::from_millis),
            predicted: predicted_ms.map(Duration::from_millis),
            queued,
        }
    }

    #[test]
    fn the_queue_scales_up_before_the_window_shows_a_miss_and_down_only_after_calm() {
        let t0 = Instant::now();
        let mut p = plan(Pool::Prefill);
        // The window still looks fine, but the queue predicts 1.4 s: up to 3 now.
        let d = p.decide(t0, inp(1, Some(200), Some(1400), 9000));
        assert_eq!((d.desired, d.action), (3, "up"), "{}", d.why);
        assert!(d.why.contains("predicted 1400 ms"), "{}", d.why);
        // While the new replicas start, no further scale-up.
        let mut i = inp(1, Some(900), Some(900), 9000);
        i.starting = 2;
        assert_eq!(p.decide(t0 + Duration::from_millis(100), i).action, "hold");
        // Within target: hold.
        let d = p.decide(
            t0 + Duration::from_secs(1),
            inp(3, Some(400), Some(300), 10),
        );
        assert_eq!((d.desired, d.action), (3, "hold"));
        // Calm (below half the target, nothing queued) must last the cooldown.
        let t1 = t0 + Duration::from_secs(3);
        assert_eq!(p.decide(t1, inp(3, Some(100), None, 0)).action, "hold");
        assert_eq!(
            p.decide(t1 + Duration::from_millis(1900), inp(3, None, None, 0))
                .action,
            "hold"
        );
        let d = p.decide(t1 + Duration::from_secs(2), inp(3, None, None, 0));
        assert_eq!((d.desired, d.action), (2, "down"));
        // One at a time, a cooldown apart, never below the minimum.
        assert_eq!(
            p.decide(t1 + Duration::from_secs(3), inp(2, None, None, 0))
                .action,
            "hold"
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

    #[test]
    fn a_stale_window_after_a_scale_up_does_not_scale_up_again() {
        let t0 = Instant::now();
        let mut p = plan(Pool::Prefill);
        assert_eq!(p.decide(t0, inp(1, Some(900), None, 0)).desired, 2);
        // The new replica joined; the window still shows 900 ms for a while: hold.
        let d = p.decide(t0 + Duration::from_secs(2), inp(2, Some(900), Some(200), 0));
        assert_eq!((d.desired, d.action), (2, "hold"), "{}", d.why);
        // Unless the queue itself predicts a miss.
        let d = p.decide(
            t0 + Duration::from_secs(3),
            inp(2, Some(900), Some(1200), 5000),
        );
        assert_eq!((d.desired, d.action), (4, "up"), "{}", d.why);
    }

    #[test]
    fn pressure_is_capped_at_max_and_a_lost_replica_is_wanted_back() {
        let t0 = Instant::now();
        let mut p = plan(Pool::Decode);
        let d = p.decide(t0, inp(1, Some(5000), None, 3));
        assert_eq!(d.desired, 4);
        // A replica crashed: the desired count stays, so the actuator replaces it.
        let d = p.decide(t0 + Duration::from_secs(1), inp(3, Some(450), None, 0));
        assert_eq!((d.desired, d.action), (4, "hold"));
        // A queue with a fine window is not calm: no scale-down.
        let t = t0 + Duration::from_secs(10);
        assert_eq!(p.decide(t, inp(4, Some(10), None, 2)).action, "hold");
        assert_eq!(
            p.decide(t + Duration::from_secs(5), inp(4, Some(10), None, 2))
                .action,
            "hold"
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
}
