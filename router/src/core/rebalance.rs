//! Rebalancing the decode pool's KV by live moves: when the fullest decode worker holds at
//! least `trigger` times the pool's mean of KV blocks in use, it sheds enough sequences to come
//! down to the mean (each sequence counted at the worker's mean per sequence); the requests
//! that take the shedding up move live ([`super::MoveWhy::Rebalance`]) to the workers the
//! routing policy picks. One decision, then a pause of `settle` while the moves land and the
//! heartbeats report them. The router runs it on a timer, the simulator on its planner's
//! ticks, over the same table.

use std::time::{Duration, Instant};

use proto::Pool;
use types::WorkerId;

use super::table::Table;

/// How long after a decision the next may come: moves done and reported by heartbeats.
pub const SETTLE: Duration = Duration::from_secs(3);

/// The decode pool's rebalancer.
#[derive(Debug, Clone)]
pub struct Rebalancer {
    /// The fullest worker's KV over the mean that sets it off (above 1).
    pub trigger: f64,
    last: Option<Instant>,
}

/// One decision: the worker to shed sequences, and how many.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shed {
    /// The fullest worker.
    pub worker: WorkerId,
    /// Sequences to move off it.
    pub sequences: u32,
    /// Its KV blocks in use over the pool's mean, when decided.
    pub ratio: f64,
}

impl Rebalancer {
    /// A rebalancer set off at `trigger` times the mean.
    pub fn new(trigger: f64) -> Rebalancer {
        Rebalancer {
            trigger,
            last: None,
        }
    }

    /// What to shed at `now`, if anything, asked of the table's fullest decode worker
    /// ([`Table::shed`]).
    pub fn decide(&mut self, table: &mut Table, now: Instant) -> Option<Shed> {
        if self.last.is_some_and(|t| now < t + SETTLE) {
            return None;
        }
        let used: Vec<(WorkerId, f64, u32)> = table
            .pool(Pool::Decode)
            .filter(|w| w.usable())
            .map(|w| {
                let l = &w.load;
                let blocks = l.kv_blocks_total.saturating_sub(l.kv_blocks_free);
                (w.id, blocks as f64, l.running)
            })
            .collect();
        if used.len() < 2 {
            return None;
        }
        let mean = used.iter().map(|u| u.1).sum::<f64>() / used.len() as f64;
        let &(worker, most, running) = used.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
        let ratio = most / mean;
        if mean <= 0.0 || ratio < self.trigger || running < 2 {
            return None;
        }
        let each = most / running as f64;
        let sequences = (((most - mean) / each).round() as u32).clamp(1, running - 1);
        self.last = Some(now);
        table.shed(worker, sequences);
        tracing::info!(worker = %worker, sequences, ratio, "rebalancing the decode pool's KV");
        Some(Shed {
            worker,
            sequences,
            ratio,
        })
    }
}
