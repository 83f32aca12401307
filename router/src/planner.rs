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

/// A counter's rate over the last `window`, from its totals read at ticks.
#[derive(Debug)]
pub struct Rate {
    window: Duration,
    points: VecDeque<(Instant, u64)>,
}

impl Rate {
    /// A rate over `window`.
    pub fn new(window: Duration) -> Rate {
        Rate {
            window,
            points: VecDeque::new(),
        }
    }

    /// Notes the counter's `total` at `now`; its rate per second over the window, once the
    /// readings span at least half of it.
    pub fn observe(&mut self, now: Instant, total: u64) -> Option<f64> {
        self.points.push_back((now, total));
        while self
            .points
            .get(1)
            .is_some_and(|(t, _)| now.duration_since(*t) >= self.window)
        {
            self.points.pop_front();
        }
        let &(t0, n0) = self.points.front()?;
        let span = now.duration_since(t0);
        (span >= self.window / 2).then(|| total.saturating_sub(n0) as f64 / span.as_secs_f64())
    }
}

/// A reading's highest value over the last `window`, from readings at ticks.
#[derive(Debug)]
pub struct Peak {
    window: Duration,
    since: Option<Instant>,
    points: VecDeque<(Instant, u64)>,
}

impl Peak {
    /// A peak over `window`.
    pub fn new(window: Duration) -> Peak {
        Peak {
            window,
            since: None,
            points: VecDeque::new(),
        }
    }

    /// Notes `value` at `now`; the highest over the window, once readings cover a whole one.
    pub fn observe(&mut self, now: Instant, value: u64) -> Option<u64> {
        let since = *self.since.get_or_insert(now);
        while self
            .points
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > self.window)
        {
            self.points.pop_front();
        }
        // Kept falling: a value under a later one never is the peak.
        while self.points.back().is_some_and(|&(_, v)| v <= value) {
            self.points.pop_back();
        }
        self.points.push_back((now, value));
        let full = now.duration_since(since) >= self.window;
        full.then(|| self.points.front().map_or(value, |p| p.1))
    }
}

/// The share of its measured rate a prefill replica is sized to: room for the queueing that
/// arrivals in bursts bring.
pub const PREFILL_UTILISATION: f64 = 0.7;

/// The share of its KV blocks a decode replica is sized to (a request's blocks are reserved
/// whole, prompt and output, when it is admitted; the rest is room for the long ones, which
/// need much of one replica at once).
pub const DECODE_UTILISATION: f64 = 0.85;

/// A pool sized down to its demand only while its latency is under this share of its target.
pub const SIZED_DOWN_BELOW: f64 = 0.8;

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
    /// Prompt tokens sent to the prefill pool, ever (its demand, as a rate: cached ones
    /// included, which errs on the side of more replicas — the index's view of the caches
    /// said a mock pool needed one replica where it needed two).
    pub prefill_sent_tokens: AtomicU64,
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
            prefill_sent_tokens: AtomicU64::new(0),
            decode_waiting: AtomicUsize::new(0),
        }
    }

    /// A prompt of `tokens` went to the prefill pool; the guard marks it done when dropped.
    pub fn prefill_started(self: &Arc<Self>, tokens: u64) -> PendingPrefill {
        self.prefill_pending_tokens
            .fetch_add(tokens, Ordering::SeqCst);
        self.prefill_sent_tokens.fetch_add(tokens, Ordering::SeqCst);
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
    /// Replicas the measured demand needs (prefill: prompt tokens arriving per second over the
    /// window, at [`PREFILL_UTILISATION`] of the replicas' measured rate; decode: the most KV
    /// blocks its requests held over a whole window, at [`DECODE_UTILISATION`] of a replica's,
    /// while none waits for room — the current blocks of a pool filling up from idle looked
    /// ten times too few and cut a simulated pool to its minimum).
    pub needed: Option<u32>,
    /// Decode, while requests wait for room: replicas for the KV blocks held and those the
    /// waiting requests want (each at the mean a held request takes), at
    /// [`DECODE_UTILISATION`] — what a scale-up for room asks, not the latency's ratio to
    /// the ITL target (an admission wait over an ITL target tripled a pool for 7 requests).
    pub room_needed: Option<u32>,
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
            let by_pressure = (have as f64 * pressure).ceil() as u32;
            // Short of room rather than of speed: as many as the KV needs.
            let want = match inp.room_needed {
                Some(n) if p90 <= target => n,
                _ => by_pressure,
            };
            let want = want.max(have + 1).clamp(s.min, s.max);
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
        // Far more replicas than the demand needs, and within target with a margin: down to
        // what it needs at once (one a cooldown would take a fleet started large minutes to
        // shed). Not "calm" as below: where prompts are long, their compute alone can keep a
        // pool's TTFT over half its target at any size. Only on a window with latencies in it:
        // an idle pool's demand is no measure.
        if let Some(n) = inp.needed.filter(|_| inp.p90.is_some()) {
            let n = n.clamp(s.min, s.max);
            if n + 1 < self.desired && p90.max(predicted) / target < SIZED_DOWN_BELOW && cooled {
                self.desired = n;
                self.last_change = Some(now);
                self.calm_since = Some(now);
                return Decision {
                    desired: n,
                    action: "down",
                    why: format!("the demand needs {n}: {seen}"),
                };
            }
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
    /// How many of the live prefill replicas have measured a rate.
    pub prefill_measured: u32,
    /// Prompt tokens per second sent to the prefill pool over the window.
    pub prefill_demand: Option<f64>,
    /// p90 of the prefill TTFT window.
    pub prefill_ttft_p90: Option<Duration>,
    /// p90 of the inter-token latency window.
    pub itl_p90: Option<Duration>,
    /// p90 of the admission wait window.
    pub admission_p90: Option<Duration>,
    /// Requests waiting right now for a decode worker with room.
    pub decode_waiting: u64,
    /// The live decode replicas' KV blocks in use, by their heartbeats.
    pub decode_blocks_used: u64,
    /// The most in use over the planner's window, once it has a whole one.
    pub decode_blocks_peak: Option<u64>,
    /// Their KV blocks in all.
    pub decode_blocks_total: u64,
    /// The requests holding their blocks (running, queued, awaiting their KV).
    pub decode_holding: u64,
}

impl Observed {
    /// One tick's inputs of `pool` with `live` replicas (`starting` more on their way) — each
    /// pool from its own signals only.
    pub fn inputs(&self, pool: Pool, live: u32, starting: u32) -> Inputs {
        match pool {
            Pool::Prefill => {
                // A replica's rate: the mean its measured peers compute per second of engine
                // time (a replica that has computed nothing yet is counted at it, as routing
                // does: `routing::fill_rates`).
                let per_replica = match self.prefill_measured {
                    0 => 0.0,
                    n => self.prefill_capacity / n as f64,
                };
                let (pending, capacity) = (self.prefill_pending_tokens, per_replica * live as f64);
                // The queue's prediction: prompt tokens not yet prefilled over the pool's rate.
                let predicted = (capacity > 0.0 && pending > 0)
                    .then(|| Duration::from_secs_f64(pending as f64 / capacity));
                // Replicas sized to the demand.
                let needed = self
                    .prefill_demand
                    .filter(|_| per_replica > 0.0)
                    .map(|d| (d / (per_replica * PREFILL_UTILISATION)).ceil() as u32);
                Inputs {
                    live,
                    starting,
                    p90: self.prefill_ttft_p90,
                    predicted,
                    queued: pending,
                    needed,
                    room_needed: None,
                }
            }
            Pool::Decode => Inputs {
                live,
                starting,
                p90: self.itl_p90,
                // Requests queued for room now will have waited at least this long.
                predicted: self.admission_p90.filter(|_| self.decode_waiting > 0),
                queued: self.decode_waiting,
                needed: self.decode_needed(live),
                room_needed: self.room_needed(live),
            },
        }
    }

    /// Decode replicas for the most KV held over the window, while none waits for room.
    fn decode_needed(&self, live: u32) -> Option<u32> {
        let peak = self.decode_blocks_peak? as f64;
        if self.decode_waiting > 0 || self.decode_blocks_total == 0 || live == 0 {
            return None;
        }
        let per_replica = self.decode_blocks_total as f64 / live as f64;
        Some((peak / (per_replica * DECODE_UTILISATION)).ceil().max(1.0) as u32)
    }

    /// Decode replicas for the blocks held and wanted, while requests wait for room.
    fn room_needed(&self, live: u32) -> Option<u32> {
        let (used, total, holding) = (
            self.decode_blocks_used as f64,
            self.decode_blocks_total as f64,
            self.decode_holding as f64,
        );
        if self.decode_waiting == 0 || holding == 0.0 || total == 0.0 || live == 0 {
            return None;
        }
        let wanted = used + self.decode_waiting as f64 * used / holding;
        let per_replica = total / live as f64;
        Some((wanted / (per_replica * DECODE_UTILISATION)).ceil() as u32)
    }
}

/// What the router's signals and the workers' heartbeats say at `now`.
fn observe(
    signals: &Signals,
    demand: &mut Rate,
    peak: &mut Peak,
    workers: &[crate::registry::Worker],
    now: Instant,
) -> Observed {
    let p90 = |w: &Mutex<Window>| w.lock().expect("window lock").quantile(now, 0.9).0;
    let sent = signals.prefill_sent_tokens.load(Ordering::SeqCst);
    let live = |pool: Pool| {
        workers
            .iter()
            .filter(move |w| w.pool == pool && !w.draining)
    };
    let decode = |f: fn(&proto::grpc::WorkerLoad) -> u32| -> u64 {
        live(Pool::Decode).map(|w| f(&w.load) as u64).sum()
    };
    let used = decode(|l| l.kv_blocks_total.saturating_sub(l.kv_blocks_free));
    Observed {
        prefill_demand: demand.observe(now, sent),
        prefill_pending_tokens: signals.prefill_pending_tokens.load(Ordering::SeqCst),
        prefill_capacity: live(Pool::Prefill)
            .map(|w| w.load.prompt_tokens_per_s as f64)
            .sum(),
        prefill_measured: live(Pool::Prefill)
            .filter(|w| w.load.prompt_tokens_per_s > 0.0)
            .count() as u32,
        prefill_ttft_p90: p90(&signals.prefill_ttft),
        itl_p90: p90(&signals.itl),
        admission_p90: p90(&signals.admission),
        decode_waiting: signals.decode_waiting.load(Ordering::SeqCst) as u64,
        decode_blocks_used: used,
        decode_blocks_peak: peak.observe(now, used),
        decode_blocks_total: decode(|l| l.kv_blocks_total),
        decode_holding: decode(|l| l.running + l.waiting + l.pending_transfers),
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
    let window = plans.iter().map(|p| p.scaling.window).max();
    let window = window.unwrap_or(Duration::from_secs(10));
    let (mut demand, mut peak) = (Rate::new(window), Peak::new(window));
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
                // Leading again, it reads a whole window before sizing down by it.
                peak = Peak::new(window);
                continue;
            }
        }
        let now = Instant::now();
        let workers = registry.workers();
        let mut observed = observe(&state.signals, &mut demand, &mut peak, &workers, now);
        if leader.is_some() {
            // Several routers may share the pools (etcd): this one sees only its own prompts,
            // a fraction of the demand — too little to size a pool down by — and only its own
            // requests waiting for room.
            observed.prefill_demand = None;
            observed.decode_blocks_peak = None;
        }
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

    /// A decode pool of 10–512 from 50, ITL target 100 ms, tick 1 s, cooldown and window 10 s.
    fn decode_plan() -> PoolPlan {
        PoolPlan::new(Scaling {
            pool: Pool::Decode,
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
            room_needed: None,
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
            needed: Some(needed),
            ..inp(live, Some(p90_ms), Some(20), 5000)
        };
        // Over 80% of the target: no.
        assert_eq!(p.decide(t0, sized(40, 450, 6)).action, "hold");
        let d = p.decide(t0 + Duration::from_secs(1), sized(40, 350, 6));
        assert_eq!((d.desired, d.action), (6, "down"), "{}", d.why);
        assert!(d.why.contains("the demand needs 6"), "{}", d.why);
        // Not again within the cooldown, and not for a replica's difference.
        assert_eq!(
            p.decide(t0 + Duration::from_secs(2), sized(6, 100, 1))
                .action,
            "hold"
        );
        let d = p.decide(t0 + Duration::from_secs(4), sized(6, 100, 5));
        assert_eq!((d.desired, d.action), (6, "hold"), "{}", d.why);
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
        assert_eq!((d.desired, d.action), (57, "up"), "{}", d.why);
        // Nothing waiting: no room is needed.
        seen.decode_waiting = 0;
        assert_eq!(seen.inputs(Pool::Decode, 50, 0).room_needed, None);
        // Slow tokens: by the ITL's ratio (150 / 100 → 75).
        seen.decode_waiting = 7;
        seen.itl_p90 = Some(Duration::from_millis(150));
        seen.admission_p90 = None;
        let d = decode_plan().decide(t0, seen.inputs(Pool::Decode, 50, 0));
        assert_eq!((d.desired, d.action), (75, "up"), "{}", d.why);
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

    /// With none waiting for room, a decode pool is sized down to the most KV its requests
    /// held over a whole window: 50 replicas of 1,000 blocks, a peak of 17,000 blocks in use,
    /// at 85% → 20. Not while requests wait for room, nor before a whole window.
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
        assert_eq!(inputs.needed, Some(20));
        let d = p.decide(t0, inputs);
        assert_eq!((d.desired, d.action), (20, "down"), "{}", d.why);
        seen.decode_waiting = 1;
        assert_eq!(seen.inputs(Pool::Decode, 50, 0).needed, None);
        seen.decode_waiting = 0;
        seen.decode_blocks_peak = None;
        assert_eq!(seen.inputs(Pool::Decode, 50, 0).needed, None);
    }
}
