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

use std::time::{Duration, Instant};

mod observe;
mod signals;
#[cfg(test)]
mod tests;

pub use observe::{observe, run, Observed, Watch};
pub use signals::{Outlook, Peak, PendingPrefill, Rate, Signals, Trend, Window};

/// The share of its KV blocks a decode replica is sized to (a request's blocks are reserved
/// whole, prompt and output, when it is admitted; the rest is room for the long ones, which
/// need much of one replica at once).
pub const DECODE_UTILISATION: f64 = 0.85;

/// A pool sized down to its demand only while its latency is under this share of its target.
pub const SIZED_DOWN_BELOW: f64 = 0.8;

/// The sizing margin's steps a tick: up while the window is over target, down while under
/// [`SIZED_DOWN_BELOW`] of it. Measured on the simulated day (`scripts/plan_trace.sh`,
/// BENCHMARKS): a step up of 1.1 met 90.2% of requests, 1.05 87.6%, 1.15 89.9%.
pub const MARGIN_STEP: (f64, f64) = (1.1, 0.998);

/// The largest sizing margin.
pub const MARGIN_MAX: f64 = 2.0;
pub use proto::Pool;

/// A pool's bounds, target and pace.
#[derive(Debug, Clone)]
pub struct Scaling {
    /// Which pool.
    pub pool: Pool,
    /// The p90 target (TTFT for prefill, ITL for decode).
    pub target: Duration,
    /// What the queue's prediction ([`Inputs::predicted`]) is held to, where not `target`:
    /// the decode pool's wait for room, a part of the TTFT and not of the ITL. With one, a
    /// line waiting under half of it does not keep the pool from calming down.
    pub wait_target: Option<Duration>,
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
    /// Replicas the measured demand needs, a fraction kept (prefill: the p90 over the window
    /// of the prompt tokens arriving per second, each reading over a span of the TTFT target,
    /// less the share the engines found cached — the tokens to compute — at the replicas'
    /// measured rate: the margin is the demand's own spread, not a chosen utilisation (read
    /// instead as the larger of the window's rate and a span's burst served within the span and
    /// the target, a simulated day met its targets for 52–65% of requests, not 83%); decode: the most KV blocks its requests held over a whole window, at
    /// [`DECODE_UTILISATION`] of a replica's — the current blocks of a pool filling up from
    /// idle looked ten times too few and cut a simulated pool to its minimum).
    pub needed: Option<f64>,
    /// Some of the demand waits (decode: requests waiting for room), so `needed` is what was
    /// served, a floor of the demand: the pool is sized down by it (only within target, as
    /// ever), never up or ahead. Read as no measure at all while any request waited, a pool
    /// started large on a flat trace shed only one replica a cooldown (BENCHMARKS, the
    /// planner's 2026-12-07 runs).
    pub censored: bool,
    /// How fast `needed` is moving, replicas a second (the least-squares slope of the demand
    /// read each tick over the window): the planner asks a replica's start-up ahead of it.
    pub growth: f64,
    /// Decode, while requests wait for room: replicas for the KV blocks held and those the
    /// waiting requests want (each at the mean a held request takes), at
    /// [`DECODE_UTILISATION`] — what a scale-up for room asks, not the latency's ratio to
    /// the ITL target (an admission wait over an ITL target tripled a pool for 7 requests).
    pub room_needed: Option<u32>,
}

/// Which way the planner moves a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// More replicas.
    Up,
    /// Fewer replicas.
    Down,
    /// As it is.
    Hold,
}

impl Action {
    /// The metrics label and log word.
    pub fn label(self) -> &'static str {
        match self {
            Action::Up => "up",
            Action::Down => "down",
            Action::Hold => "hold",
        }
    }
}

/// What the planner decided and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Replicas wanted.
    pub desired: u32,
    /// Which way.
    pub action: Action,
    /// The reason, with the numbers.
    pub why: String,
    /// Replicas the demand will need a start-up from now, on its trend (what the planner
    /// predicts; `Inputs::needed` is what it observes — a floor while `Inputs::censored`).
    pub needed_ahead: Option<u32>,
}

/// One tick's reading of a pool against its target.
struct Reading {
    /// The larger of the window's p90 and the queue's prediction over the target — only the
    /// prediction for a window after a scale-up (its percentiles still hold the latencies that
    /// caused it).
    pressure: f64,
    /// The larger of the p90 and the prediction over the target, whatever the window.
    load: f64,
    /// The window's p90 is within the target.
    p90_within: bool,
    /// The last change is a cooldown ago.
    cooled: bool,
    /// What was seen, for the decision's reason.
    seen: String,
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
    /// The replicas last asked for and when, until they have all joined.
    asked: Option<(Instant, u32)>,
    /// How long replicas take from being asked for to serving, as measured (none until it has
    /// been: the planner looks no further ahead than it has seen a start-up take — with a
    /// guess, a load starting from idle, extrapolated, asked for replicas it never needed).
    lead: Option<Duration>,
    /// What the demand is multiplied by when the pool is sized to it, learned from the pool's
    /// own latency ([`PoolPlan::learn_margin`]).
    margin: f64,
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
            asked: None,
            lead: None,
            margin: 1.0,
        }
    }

    /// How far ahead the planner looks: the replicas' start-up, once measured.
    pub fn lead(&self) -> Option<Duration> {
        self.lead
    }

    /// Replicas the demand will need a start-up from now, on its trend (never fewer than it
    /// needs now), with the margin learned, rounded up.
    pub fn needed_ahead(&self, inp: &Inputs) -> Option<u32> {
        let lead = self.lead.unwrap_or_default().as_secs_f64();
        let ahead = inp.growth.max(0.0) * lead;
        let m = self.margin;
        inp.needed.map(|n| (m * (n + ahead)).ceil().max(0.0) as u32)
    }

    /// [`PoolPlan::needed_ahead`], where it may size the pool up (not while censored).
    fn needed_up(&self, inp: &Inputs) -> Option<u32> {
        self.needed_ahead(inp).filter(|_| !inp.censored)
    }

    /// Notes replicas joining: once all those asked for serve, how long they took (averaged
    /// with what was measured before).
    fn note_joins(&mut self, now: Instant, inp: &Inputs) {
        let Some((at, want)) = self.asked else { return };
        if inp.starting > 0 || inp.live < want {
            return;
        }
        let took = now.duration_since(at);
        self.lead = Some(self.lead.map_or(took, |l| (l + took * 3) / 4));
        self.asked = None;
    }

    /// The margin the demand is sized with now (1: none).
    pub fn margin(&self) -> f64 {
        self.margin
    }

    /// A window over target raises the margin by [`MARGIN_STEP`].0 (to at most
    /// [`MARGIN_MAX`]): the demand as measured — its p90 over the window, its trend a start-up
    /// ahead — was not enough for this pool's target. A window over target while replicas
    /// start raises it too, so such a window asks for more through the margin (learning only
    /// from windows begun after the last scale-up met 87.6–87.7% of the simulated day, not 90.2%).
    /// A tick under [`SIZED_DOWN_BELOW`] of the target lowers it by [`MARGIN_STEP`].1, back
    /// to 1 (so a pool whose long prompts keep it over half its target still sheds it). On
    /// the flat trace no window went over target and the margin stayed 1; on the day's ramp
    /// it rose (BENCHMARKS, the planner's learned margin).
    fn learn_margin(&mut self, r: &Reading) {
        if !r.p90_within {
            self.margin = (self.margin * MARGIN_STEP.0).min(MARGIN_MAX);
        } else if r.load < SIZED_DOWN_BELOW {
            self.margin = (self.margin * MARGIN_STEP.1).max(1.0);
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
        let mut d = self.choose(now, inp);
        d.needed_ahead = self.needed_ahead(&inp);
        d
    }

    fn choose(&mut self, now: Instant, inp: Inputs) -> Decision {
        self.note_joins(now, &inp);
        let r = self.read(now, &inp);
        self.learn_margin(&r);
        if r.pressure > 1.0 {
            self.calm_since = None;
            return self.up(now, &inp, &r);
        }
        if let Some(d) = self.ahead(now, &inp, &r) {
            return d;
        }
        if let Some(d) = self.sized_down(now, &inp, &r) {
            return d;
        }
        self.calm_down(now, &inp, r)
    }

    /// The pool's reading at `now` from `inp`.
    fn read(&self, now: Instant, inp: &Inputs) -> Reading {
        let s = &self.scaling;
        let target = s.target.as_secs_f64();
        let p90 = inp.p90.map_or(0.0, |d| d.as_secs_f64()) / target;
        let wait = s.wait_target.unwrap_or(s.target).as_secs_f64();
        let predicted = inp.predicted.map_or(0.0, |d| d.as_secs_f64()) / wait;
        let stale = self
            .last_up
            .is_some_and(|t| now.duration_since(t) < s.window);
        let seen = format!(
            "p90 {} predicted {} target {}{} queued {} live {} starting {} margin {:.2}",
            ms(inp.p90),
            ms(inp.predicted),
            ms(Some(s.target)),
            s.wait_target
                .map_or(String::new(), |w| format!(" wait target {}", ms(Some(w)))),
            inp.queued,
            inp.live,
            inp.starting,
            self.margin
        );
        Reading {
            pressure: if stale { predicted } else { p90.max(predicted) },
            load: p90.max(predicted),
            p90_within: p90 <= 1.0,
            cooled: self
                .last_change
                .is_none_or(|t| now.duration_since(t) >= s.cooldown),
            seen,
        }
    }

    fn hold(&self, why: String) -> Decision {
        Decision {
            desired: self.desired,
            action: Action::Hold,
            why,
            needed_ahead: None,
        }
    }

    /// Over target: up by the pressure (or, short of room rather than of speed, to as many as
    /// the KV needs), unless the pool is at its maximum. While replicas start, the window does
    /// not show them yet, so its pressure asks nothing more — only a demand beyond those
    /// asked for does (a day's ramp outran a pool that waited for each start-up in turn).
    fn up(&mut self, now: Instant, inp: &Inputs, r: &Reading) -> Decision {
        let s = &self.scaling;
        if inp.starting > 0 {
            let want = self.needed_up(inp).map(|n| n.clamp(s.min, s.max));
            return match want {
                Some(want) if want > self.desired => {
                    self.asked_for(now, want);
                    Decision {
                        desired: want,
                        action: Action::Up,
                        why: format!("over target, the demand needs {want}: {}", r.seen),
                        needed_ahead: None,
                    }
                }
                _ => self.hold(format!("over target, replicas still starting: {}", r.seen)),
            };
        }
        let have = inp.live.max(1);
        let by_pressure = (have as f64 * r.pressure).ceil() as u32;
        let want = match inp.room_needed {
            Some(n) if r.p90_within => n,
            _ => by_pressure,
        };
        let want = want.max(have + 1).clamp(s.min, s.max);
        if want <= self.desired.max(inp.live) {
            return self.hold(format!("over target at the maximum: {}", r.seen));
        }
        self.asked_for(now, want);
        Decision {
            desired: want,
            action: Action::Up,
            why: format!("pressure {:.2}: {}", r.pressure, r.seen),
            needed_ahead: None,
        }
    }

    fn asked_for(&mut self, now: Instant, want: u32) {
        self.desired = want;
        self.last_change = Some(now);
        self.last_up = Some(now);
        self.asked = Some((now, want));
    }

    /// Within target, but the demand's trend will need more replicas than are serving or
    /// starting by the time a new one would serve (a start-up measured): up to that, now.
    fn ahead(&mut self, now: Instant, inp: &Inputs, r: &Reading) -> Option<Decision> {
        let s = &self.scaling;
        let want = self.needed_up(inp)?.clamp(s.min, s.max);
        let rising = inp.growth > 0.0 && self.lead.is_some();
        if !rising || want <= self.desired.max(inp.live + inp.starting) {
            return None;
        }
        self.asked_for(now, want);
        Some(Decision {
            desired: want,
            action: Action::Up,
            why: format!(
                "the demand rising {:.2} replicas/s needs {want} in {:.0} s: {}",
                inp.growth,
                self.lead.unwrap_or_default().as_secs_f64(),
                r.seen
            ),
            needed_ahead: None,
        })
    }

    /// Far more replicas than the demand needs, and within target with a margin: down to what
    /// it needs at once (one a cooldown would take a fleet started large minutes to shed). Not
    /// "calm" as in [`PoolPlan::calm_down`]: where prompts are long, their compute alone can
    /// keep a pool's TTFT over half its target at any size. Only on a window with latencies in
    /// it: an idle pool's demand is no measure.
    fn sized_down(&mut self, now: Instant, inp: &Inputs, r: &Reading) -> Option<Decision> {
        let s = &self.scaling;
        let n = self
            .needed_ahead(inp)
            .filter(|_| inp.p90.is_some())?
            .clamp(s.min, s.max);
        // Not while replicas asked for still start: they were asked for a demand a start-up
        // ahead, and a trend that has since gone flat would cancel them as they arrive.
        if n + 1 >= self.desired || r.load >= SIZED_DOWN_BELOW || !r.cooled || inp.starting > 0 {
            return None;
        }
        self.desired = n;
        self.last_change = Some(now);
        self.calm_since = Some(now);
        Some(Decision {
            desired: n,
            action: Action::Down,
            why: format!("the demand needs {n}: {}", r.seen),
            needed_ahead: None,
        })
    }

    /// Calm (under half the target, nothing queued — or, with a wait target, waiting under
    /// half of it) for the cooldown: down one replica.
    fn calm_down(&mut self, now: Instant, inp: &Inputs, r: Reading) -> Decision {
        let s = &self.scaling;
        if r.load >= 0.5 || (inp.queued > 0 && s.wait_target.is_none()) {
            self.calm_since = None;
            return self.hold(format!("within target: {}", r.seen));
        }
        let calm = *self.calm_since.get_or_insert(now);
        if self.desired <= s.min || !r.cooled || now.duration_since(calm) < s.cooldown {
            return self.hold(format!("calm: {}", r.seen));
        }
        self.desired -= 1;
        self.last_change = Some(now);
        self.calm_since = Some(now);
        Decision {
            desired: self.desired,
            action: Action::Down,
            why: format!("calm for {:?}: {}", s.cooldown, r.seen),
            needed_ahead: None,
        }
    }
}
