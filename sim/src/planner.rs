//! The planner in the simulation: each tick, the router's own decision function
//! ([`router::planner::PoolPlan::decide`]) on the router's own inputs
//! ([`router::planner::Observed::inputs`]) from windows of the simulated latencies, on virtual
//! instants; its decisions act as the `command` actuator's do — a replica asked for joins after
//! the configured start-up time, one let go drains (no new requests, gone when its last one
//! ends).

use std::time::{Duration, Instant};

use router::planner::{Observed, Peak, Rate, Window};

use crate::{Event, Pool, Sim};

/// One tick of one pool, for the time series.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Virtual time, seconds from the start.
    pub t: f64,
    /// `prefill` or `decode`.
    pub pool: &'static str,
    /// Replicas serving (joined, not draining).
    pub live: u32,
    /// Replicas started, not joined yet.
    pub starting: u32,
    /// What the planner wants.
    pub desired: u32,
    /// The pool's queue (prompt tokens pending; requests waiting for room).
    pub queued: u64,
    /// The window's p90 (TTFT, ITL), milliseconds.
    pub p90_ms: Option<f64>,
    /// "up", "down" or "hold".
    pub action: &'static str,
}

/// The simulated router's latency windows, as the real router records them.
pub(crate) struct Signals {
    pub(crate) prefill_ttft: Window,
    pub(crate) itl: Window,
    pub(crate) admission: Window,
    /// Prompt tokens sent to the prefill pool, ever, and their rate over the window.
    pub(crate) prefill_sent: u64,
    demand: Rate,
    decode_peak: Peak,
}

impl Signals {
    pub(crate) fn new(window: Duration) -> Signals {
        Signals {
            prefill_ttft: Window::new(window),
            itl: Window::new(window),
            admission: Window::new(window),
            prefill_sent: 0,
            demand: Rate::new(window),
            decode_peak: Peak::new(window),
        }
    }
}

impl Sim {
    /// The virtual clock as an `Instant` (the planner's windows and decisions take instants).
    pub(crate) fn instant(&self) -> Instant {
        self.base + Duration::from_nanos(self.now)
    }

    /// What the router would observe now.
    fn observe(&mut self) -> Observed {
        let now = self.instant();
        let live = |w: &crate::Worker| w.pool == Pool::Prefill && w.serving();
        let prefill_capacity = self
            .workers
            .iter()
            .filter(|w| live(w))
            .map(|w| w.rate())
            .sum();
        let prefill_measured = self
            .workers
            .iter()
            .filter(|w| live(w) && w.rate() > 0.0)
            .count() as u32;
        let prefill_pending_tokens = self
            .workers
            .iter()
            .filter(|w| w.pool == Pool::Prefill)
            .map(|w| w.queued_tokens)
            .sum();
        // The decode pool's KV, as the replicas' last heartbeats said it.
        let (mut used, mut total, mut holding) = (0, 0, 0);
        for w in self
            .workers
            .iter()
            .filter(|w| w.pool == Pool::Decode && w.serving())
        {
            let l = &w.seen;
            used += l.kv_blocks_total.saturating_sub(l.kv_blocks_free) as u64;
            total += l.kv_blocks_total as u64;
            holding += (l.running + l.waiting + l.pending_transfers) as u64;
        }
        let s = &mut self.signals;
        Observed {
            prefill_demand: s.demand.observe(now, s.prefill_sent),
            prefill_pending_tokens,
            prefill_capacity,
            prefill_measured,
            prefill_ttft_p90: s.prefill_ttft.quantile(now, 0.9).0,
            itl_p90: s.itl.quantile(now, 0.9).0,
            admission_p90: s.admission.quantile(now, 0.9).0,
            decode_waiting: self.waiting,
            decode_blocks_used: used,
            decode_blocks_peak: s.decode_peak.observe(now, used),
            decode_blocks_total: total,
            decode_holding: holding,
        }
    }

    /// A planner tick: each pool's decision, acted on, recorded; the next tick while requests
    /// remain.
    pub(crate) fn tick(&mut self, tick: Duration) {
        let observed = self.observe();
        let now = self.instant();
        for i in 0..self.plans.len() {
            let pool = self.plans[i].scaling.pool;
            let live = self.pool(pool).len() as u32;
            let starting = self.starting(pool);
            let inputs = observed.inputs(pool, live, starting);
            let d = self.plans[i].decide(now, inputs);
            self.series.push(Sample {
                t: self.now as f64 / 1e9,
                pool: pool.name(),
                live,
                starting,
                desired: d.desired,
                queued: inputs.queued,
                p90_ms: inputs.p90.map(|p| p.as_secs_f64() * 1e3),
                action: d.action,
            });
            self.reconcile(pool, d.desired);
        }
        // While requests remain and something can still happen (a run whose last requests
        // can never be served ends, with them unfinished).
        if self.open > 0 && !self.queue.is_empty() {
            let at = self.now + tick.as_nanos() as u64;
            self.schedule(at, Event::Tick);
        }
    }

    fn starting(&self, pool: Pool) -> u32 {
        self.starting.iter().filter(|p| **p == pool).count() as u32
    }

    /// The actuator: starts replicas up to `desired` (they join after the start-up time), or
    /// drains the least busy ones down to it.
    fn reconcile(&mut self, pool: Pool, desired: u32) {
        let have = self.pool(pool).len() as u32 + self.starting(pool);
        for _ in have..desired {
            self.starting.push(pool);
            let at = self.now + self.cfg.start_up.as_nanos() as u64;
            self.schedule(at, Event::WorkerUp(pool));
        }
        let live = self.pool(pool);
        let surplus = (live.len() as u32).saturating_sub(desired) as usize;
        let mut by_load: Vec<usize> = live;
        by_load.sort_by_key(|&w| self.workers[w].in_flight);
        for w in by_load.into_iter().take(surplus) {
            self.workers[w].draining = true;
            self.retire(w);
        }
    }

    /// A replica the planner asked for has started and joins its pool.
    pub(crate) fn worker_up(&mut self, pool: Pool) {
        if let Some(i) = self.starting.iter().position(|p| *p == pool) {
            self.starting.remove(i);
        }
        let spec = match pool {
            Pool::Prefill => self.cfg.prefill.clone(),
            Pool::Decode => Some(self.cfg.decode.clone()),
        };
        if let Some(spec) = spec {
            self.add_worker(pool, &spec)
                .expect("a configuration that started once starts");
        }
        // Requests waiting for room may fit now.
        if pool == Pool::Decode {
            self.retry_admission(None);
        }
    }

    /// A draining worker with nothing left leaves (its time stops counting).
    pub(crate) fn retire(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        if wk.draining && wk.stopped.is_none() && wk.in_flight == 0 && !wk.busy {
            wk.stopped = Some(self.now);
            self.index.remove_worker(w as u64);
        }
    }
}
