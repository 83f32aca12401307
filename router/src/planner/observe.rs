//! One planner tick: what the router observes of its pools (its signals and its table of
//! workers, read once) and the loop that decides, reports and acts each tick.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::core::Table;

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
    /// Prompt tokens per second arriving for the prefill pool, read each tick over spans of the
    /// pool's TTFT target (a burst shorter than that the queue absorbs within the target):
    /// their p90 and their trend over the window.
    pub prefill_demand: Option<Outlook>,
    /// Of the prompt tokens the prefill engines admitted over the window, the share they found
    /// cached (in their pools, tiers or the cluster store): what of the demand is not computed.
    pub prefill_hit_share: Option<f64>,
    /// p90 of the prefill TTFT window.
    pub prefill_ttft_p90: Option<Duration>,
    /// p90 of the inter-token latency window.
    pub itl_p90: Option<Duration>,
    /// p90 of the admission wait window, the waits so far of the requests waiting now
    /// counted in.
    pub admission_p90: Option<Duration>,
    /// Requests waiting right now for a decode worker with room.
    pub decode_waiting: u64,
    /// The live decode replicas' KV blocks in use, by their heartbeats.
    pub decode_blocks_used: u64,
    /// The most in use over the planner's window, once it has a whole one (its p90 cost
    /// requests: a pool sized to it turned more away for want of room within their wait).
    pub decode_blocks_peak: Option<u64>,
    /// How fast the blocks in use are rising (blocks a second, over the window).
    pub decode_blocks_slope: f64,
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
                // Replicas sized to the demand in the tokens they will compute (a replica's
                // rate is of tokens computed): what arrives, less the share the engines find
                // cached; and how fast that is moving, in replicas a second.
                let computed = 1.0 - self.prefill_hit_share.unwrap_or(0.0).clamp(0.0, 1.0);
                let demand = self.prefill_demand.filter(|_| per_replica > 0.0);
                let needed = demand.map(|d| d.high * computed / per_replica);
                let growth = demand.map_or(0.0, |d| d.slope * computed / per_replica);
                Inputs {
                    live,
                    starting,
                    p90: self.prefill_ttft_p90,
                    predicted,
                    queued: pending,
                    needed,
                    censored: false,
                    growth,
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
                censored: self.decode_waiting > 0,
                growth: self.decode_growth(live),
                room_needed: self.room_needed(live),
            },
        }
    }

    /// Decode replicas for the most KV held over the window (while requests wait for room, a
    /// floor of the demand: see [`Inputs::censored`]).
    fn decode_needed(&self, live: u32) -> Option<f64> {
        let peak = self.decode_blocks_peak? as f64;
        if self.decode_blocks_total == 0 || live == 0 {
            return None;
        }
        let per_replica = self.decode_blocks_total as f64 / live as f64;
        Some(peak / (per_replica * DECODE_UTILISATION))
    }

    /// How fast the KV held is rising, in replicas a second.
    fn decode_growth(&self, live: u32) -> f64 {
        if self.decode_blocks_total == 0 || live == 0 {
            return 0.0;
        }
        let per_replica = self.decode_blocks_total as f64 / live as f64;
        self.decode_blocks_slope / (per_replica * DECODE_UTILISATION)
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

/// What the planner keeps from tick to tick beside its plans: the prefill pool's demand (a
/// rate over spans of its target, read each tick into a trend) and the decode pool's peak KV
/// and its trend, over the window.
pub struct Watch {
    /// The prompt tokens arriving per second over a span of the TTFT target (a burst shorter than
    /// that the queue absorbs within the target), and over the window (whether it saw any).
    demand: Rate,
    recent: Rate,
    /// The demand's readings' p90, over the window.
    demand_trend: Trend,
    /// The slope, fitted to what each tick alone saw arrive (a rate over a window read each tick
    /// overlaps its neighbours: fitted to those, noise passed for a trend) since the window
    /// last saw none (a load starting from idle is a step, not a rise to extrapolate), over
    /// the window or as far back as the planner looks ahead, the longer.
    tick_trend: Trend,
    last_arrived: Option<(Instant, u64)>,
    peak: Peak,
    used_trend: Trend,
    window: Duration,
    /// The prefill engines' admitted and cached prompt tokens, as rates.
    admitted: Rate,
    hit: Rate,
    engines: EngineCounts,
}

/// The prefill engines' counters (admitted, cached prompt tokens) summed into totals that only
/// grow: each worker's growth since it was last read (a worker that joins or rejoins under a
/// new id counts from zero; one that leaves takes nothing back).
#[derive(Default)]
struct EngineCounts {
    last: std::collections::HashMap<types::WorkerId, (u64, u64)>,
    total: (u64, u64),
}

impl EngineCounts {
    fn read<'a>(&mut self, workers: impl Iterator<Item = &'a crate::core::Worker>) -> (u64, u64) {
        let mut seen = std::collections::HashMap::new();
        for w in workers {
            let now = (w.load.prompt_tokens, w.load.prefix_hit_tokens);
            let (p0, h0) = self.last.get(&w.id).copied().unwrap_or_default();
            self.total.0 += now.0.saturating_sub(p0);
            self.total.1 += now.1.saturating_sub(h0);
            seen.insert(w.id, now);
        }
        self.last = seen;
        self.total
    }
}

impl Watch {
    /// For `plans`: over the longest of their windows, the prefill demand over spans of its
    /// pool's target.
    pub fn for_plans(plans: &[PoolPlan]) -> Watch {
        let window = plans.iter().map(|p| p.scaling.window).max();
        let span = plans
            .iter()
            .find(|p| p.scaling.pool == Pool::Prefill)
            .map(|p| p.scaling.target);
        let window = window.unwrap_or(Duration::from_secs(10));
        Watch::new(window, span.unwrap_or(window).min(window))
    }

    /// Over `window`, the prefill demand read over spans of `span`.
    pub fn new(window: Duration, span: Duration) -> Watch {
        Watch {
            demand: Rate::new(span),
            recent: Rate::new(window),
            demand_trend: Trend::new(window),
            tick_trend: Trend::new(window),
            last_arrived: None,
            peak: Peak::new(window),
            used_trend: Trend::new(window),
            window,
            admitted: Rate::new(window),
            hit: Rate::new(window),
            engines: EngineCounts::default(),
        }
    }

    /// Notes the prompt tokens `arrived` in all at `now`; the demand's outlook over the window.
    pub fn demand(&mut self, now: Instant, arrived: u64) -> Option<Outlook> {
        let tick = self
            .last_arrived
            .replace((now, arrived))
            .and_then(|(t, n)| {
                let dt = now.duration_since(t).as_secs_f64();
                (dt > 0.0).then(|| arrived.saturating_sub(n) as f64 / dt)
            });
        if self.recent.observe(now, arrived) == Some(0.0) {
            self.tick_trend = Trend::new(self.tick_trend.window());
        }
        let slope = tick
            .and_then(|r| self.tick_trend.observe(now, r))
            .map_or(0.0, |o| o.slope);
        let reading = self.demand.observe(now, arrived)?;
        let high = self.demand_trend.observe(now, reading)?.high;
        Some(Outlook { high, slope })
    }

    /// Fits the demand's trend over as long as `plans`' prefill pool looks ahead (its measured
    /// start-up), when that is longer than the window: a line is extrapolated no further than
    /// it was fitted.
    pub fn look_ahead(&mut self, plans: &[PoolPlan]) {
        let lead = plans
            .iter()
            .find(|p| p.scaling.pool == Pool::Prefill)
            .and_then(|p| p.lead());
        let span = lead.map_or(self.window, |l| l.max(self.window));
        self.tick_trend.set_window(span);
    }

    /// Starts the peak afresh (a router leading again reads a whole window before sizing down
    /// by it).
    pub fn restart_peak(&mut self) {
        self.peak = Peak::new(self.window);
    }
}

/// What the router's signals and its table of workers (their heartbeats, the line of requests
/// waiting for room) say at `now` — the router's planner and the simulator's read the same.
pub fn observe(signals: &Signals, watch: &mut Watch, table: &Table, now: Instant) -> Observed {
    let p90 = |w: &Mutex<Window>| w.lock().expect("window lock").quantile(now, 0.9).0;
    let arrived = signals.prefill_arrived_tokens.load(Ordering::SeqCst);
    let live = |pool: Pool| table.pool(pool).filter(|w| !w.draining);
    let decode = |f: fn(&proto::grpc::WorkerLoad) -> u32| -> u64 {
        live(Pool::Decode).map(|w| f(&w.load) as u64).sum()
    };
    // The KV draining workers still hold is demand too: it moves to the live ones (or is
    // served where it is until it ends).
    let used = table
        .pool(Pool::Decode)
        .map(|w| w.load.kv_blocks_total.saturating_sub(w.load.kv_blocks_free) as u64)
        .sum::<u64>();
    let (admitted, hit) = watch.engines.read(table.pool(Pool::Prefill));
    let hit_share = match (
        watch.admitted.observe(now, admitted),
        watch.hit.observe(now, hit),
    ) {
        (Some(a), Some(h)) if a > 0.0 => Some(h / a),
        _ => None,
    };
    let used_trend = watch.used_trend.observe(now, used as f64);
    Observed {
        prefill_demand: watch.demand(now, arrived),
        prefill_hit_share: hit_share,
        prefill_pending_tokens: signals.prefill_pending_tokens.load(Ordering::SeqCst),
        prefill_capacity: live(Pool::Prefill)
            .map(|w| w.load.prompt_tokens_per_s as f64)
            .sum(),
        prefill_measured: live(Pool::Prefill)
            .filter(|w| w.load.prompt_tokens_per_s > 0.0)
            .count() as u32,
        prefill_ttft_p90: p90(&signals.prefill_ttft),
        itl_p90: p90(&signals.itl),
        // The waits that ended over the window and those of the requests waiting now, so far.
        admission_p90: {
            let mut w = signals.admission.lock().expect("window lock");
            w.quantiles_with(now, [0.9], table.line.ages(now)).0[0]
        },
        decode_waiting: table.line.len() as u64,
        decode_blocks_used: used,
        decode_blocks_peak: watch.peak.observe(now, used),
        decode_blocks_slope: used_trend.map_or(0.0, |t| t.slope),
        decode_blocks_total: decode(|l| l.kv_blocks_total),
        decode_holding: decode(|l| l.running + l.waiting + l.pending_transfers),
    }
}

/// Exports a tick's decision for `pool` and its inputs, and says it when it is not a hold.
fn report(pool: Pool, inputs: &Inputs, d: &Decision, tick: Duration, margin: f64) {
    let name = pool.name();
    metrics::gauge!("tandem_planner_margin", "pool" => name).set(margin);
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
    // The demand in replicas: observed now, and predicted a start-up ahead on its trend.
    metrics::gauge!("tandem_planner_needed_replicas", "pool" => name, "horizon" => "now")
        .set(inputs.needed.unwrap_or(0.0));
    metrics::gauge!("tandem_planner_needed_replicas", "pool" => name, "horizon" => "lead")
        .set(d.needed_ahead.map_or(0.0, f64::from));
    metrics::counter!("tandem_planner_decisions_total", "pool" => name, "action" => d.action.label())
        .increment(1);
    if d.action == Action::Hold {
        tracing::debug!(pool = name, desired = d.desired, "planner: hold: {}", d.why);
        return;
    }
    tracing::info!(
        pool = name,
        desired = d.desired,
        action = d.action.label(),
        "planner: {}",
        d.why
    );
    eprintln!(
        "tandem router: planner {name} {} to {}: {}",
        d.action.label(),
        d.desired,
        d.why
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
    let mut watch = Watch::for_plans(&plans);
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
                watch.restart_peak();
                continue;
            }
        }
        let now = Instant::now();
        watch.look_ahead(&plans);
        let (mut observed, live) = registry.with(|t| {
            let live = |pool| t.pool(pool).filter(|w| !w.draining).count() as u32;
            let o = observe(&state.signals, &mut watch, t, now);
            (o, [live(Pool::Prefill), live(Pool::Decode)])
        });
        if leader.is_some() {
            // Several routers may share the pools (etcd): this one sees only its own prompts,
            // a fraction of the demand — too little to size a pool down by — and only its own
            // requests waiting for room.
            observed.prefill_demand = None;
            observed.decode_blocks_peak = None;
        }
        for plan in &mut plans {
            let pool = plan.scaling.pool;
            let live = live[(pool == Pool::Decode) as usize];
            let on_way = starting.get(&pool).copied().unwrap_or(0);
            let inputs = observed.inputs(pool, live, on_way);
            let d = plan.decide(now, inputs);
            report(pool, &inputs, &d, tick, plan.margin());
            metrics::gauge!("tandem_planner_start_up_seconds", "pool" => pool.name())
                .set(plan.lead().map_or(0.0, |l| l.as_secs_f64()));
            state.board.decided(now, pool, &inputs, &d);
            starting.insert(pool, actuator.reconcile(pool, d.desired, &registry).await);
        }
    }
}
