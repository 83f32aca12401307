//! The planner in the simulation: each tick, the router's own decision function
//! ([`router::planner::PoolPlan::decide`]) on what the router's own planner observes
//! ([`router::planner::observe`]: the simulated router's signals and table, on virtual
//! instants); its decisions act as the `command` actuator's do — a replica asked for joins after
//! the configured start-up time, one let go drains (no new requests, gone when its last one
//! ends).

use std::time::Duration;

use router::planner::{observe, Action};

use crate::{wid, Event, Pool, Sim};

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
    /// Replicas the demand needs, observed now.
    pub needed: Option<f64>,
    /// And predicted a start-up ahead, on its trend.
    pub needed_ahead: Option<u32>,
    /// Which way it moved the pool.
    pub action: Action,
}

impl Sim {
    /// A planner tick: each pool's decision, acted on, recorded; the next tick while requests
    /// remain.
    pub(crate) fn tick(&mut self, tick: Duration) {
        let now = self.instant();
        self.watch.look_ahead(&self.plans);
        let observed = observe(&self.signals, &mut self.watch, &self.table, now);
        for i in 0..self.plans.len() {
            let pool = self.plans[i].scaling.pool;
            let live = self.live(pool);
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
                needed: inputs.needed,
                needed_ahead: d.needed_ahead,
                action: d.action,
            });
            self.reconcile(pool, d.desired);
        }
        // While requests remain and something can still happen.
        if self.open > 0 && !self.queue.is_empty() {
            let at = self.now + tick.as_nanos() as u64;
            self.schedule(at, Event::Tick);
        }
    }

    /// Replicas of `pool` in the router's table, not draining (as the router's planner counts).
    fn live(&self, pool: Pool) -> u32 {
        let t = &self.table;
        t.pool(pool).filter(|w| !w.draining).count() as u32
    }

    fn starting(&self, pool: Pool) -> u32 {
        self.starting.iter().filter(|p| **p == pool).count() as u32
    }

    /// The actuator: starts replicas up to `desired` (they join after the start-up time), or
    /// drains the least busy ones down to it.
    fn reconcile(&mut self, pool: Pool, desired: u32) {
        let live = self.pool(pool);
        let have = live.len() as u32 + self.starting(pool);
        for _ in have..desired {
            self.starting.push(pool);
            let at = self.now + self.cfg.start_up.as_nanos() as u64;
            self.schedule(at, Event::WorkerUp(pool));
        }
        let surplus = (live.len() as u32).saturating_sub(desired) as usize;
        let in_flight = |w: usize| self.table.get(wid(w)).map_or(0, |x| x.in_flight());
        let mut by_load = live;
        by_load.sort_by_key(|&w| in_flight(w));
        for w in by_load.into_iter().take(surplus) {
            self.workers[w].draining = true;
            self.table.set_draining(wid(w));
            self.draining.push(w);
            self.leaving(w);
            self.retire(w);
        }
    }

    /// A replica the planner asked for (or a dead one's replacement) has started and joins its
    /// pool.
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
            self.poke(None);
        }
    }
}
