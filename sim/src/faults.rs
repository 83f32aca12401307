//! Faults on the virtual clock — worker deaths and freezes, links slowed or cut — at given
//! times or at times drawn from a seed, and the simulated router's reactions as the real
//! router has them (`router::request`):
//!
//! - A decode worker that **dies** breaks its streams at once: each of its requests migrates
//!   (`Migrating`: the prompt plus the tokens streamed, the rest of its tokens, a new admission
//!   deadline) up to the migration limit, else fails; a prefill worker that dies fails its
//!   prefill calls, and the decode worker holding each reservation computes the prompt itself
//!   (`Recomputing`). The dead worker leaves routing and the KV index; it is started again
//!   after the start-up time (`tandem up`'s supervisor, a Deployment's controller), or, in a
//!   pool the planner scales, the planner sees the pool short and asks for one.
//! - A worker that **freezes** (SIGSTOP) stops stepping and is still routed to until the
//!   router's stall timeout passes with it holding work: then it is marked stalled (no new
//!   requests), its decode requests migrate and its prefills are recomputed on their decode
//!   workers. When it thaws, the step it was in ends and it serves again.
//! - A **link** to a rack (worker `i` is in rack `i % racks`) at a share of its bandwidth slows
//!   the transfers to that rack's decode workers that start while it lasts; a **cut** (share 0)
//!   fails them after the transfer timeout, and the decode worker recomputes the prompt. A
//!   transfer's time is fixed when it starts (a change mid-transfer does not touch it).

use std::str::FromStr;
use std::time::Duration;

use engine::Release;

use crate::{ns, Event, Pool, Sim};

/// How many workers a fault takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Count {
    /// This share (0..1] of the pool's serving workers, at least one.
    Share(f64),
    /// This many.
    Workers(usize),
}

/// What goes wrong.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultKind {
    /// Workers of a pool die.
    Kill {
        /// Which pool.
        pool: Pool,
        /// How many.
        count: Count,
    },
    /// Workers of a pool freeze for a while.
    Freeze {
        /// Which pool.
        pool: Pool,
        /// How many.
        count: Count,
        /// For how long.
        lasting: Duration,
    },
    /// The links to a rack run at a share of their bandwidth (0: cut).
    Link {
        /// Which rack.
        rack: usize,
        /// The share of the bandwidth left.
        share: f64,
        /// For how long (`None`: to the end).
        lasting: Option<Duration>,
    },
}

/// A fault and when it strikes.
#[derive(Debug, Clone, PartialEq)]
pub struct Fault {
    /// From the start of the run.
    pub at: Duration,
    /// What.
    pub kind: FaultKind,
}

/// When a fault strikes as written: a time, or `random` (drawn from the seed within the run's
/// arrivals).
#[derive(Debug, Clone, PartialEq)]
pub struct FaultSpec {
    /// `None`: at random.
    pub at: Option<Duration>,
    /// What.
    pub kind: FaultKind,
    /// How many times (`kill:decode:1@random*5`: five faults, each at its own random time).
    pub times: usize,
}

/// A duration as `1500ms`, `30s`, `20m` or `1h`.
pub fn duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map_or((s, ""), |i| s.split_at(i));
    let n: f64 = n.parse().map_err(|_| format!("{s:?}: not a duration"))?;
    let secs = match unit {
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: a duration needs a unit: ms, s, m or h")),
    };
    Ok(Duration::from_secs_f64(secs))
}

fn count(s: &str) -> Result<Count, String> {
    match s.strip_suffix('%') {
        Some(p) => {
            let p: f64 = p.parse().map_err(|_| format!("{s:?}: not a share"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(format!("{s:?}: a share is over 0% and at most 100%"));
            }
            Ok(Count::Share(p / 100.0))
        }
        None => match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Count::Workers(n)),
            _ => Err(format!(
                "{s:?}: a worker count (1, 2, ...) or a share (10%)"
            )),
        },
    }
}

fn pool(s: &str) -> Result<Pool, String> {
    match s {
        "prefill" => Ok(Pool::Prefill),
        "decode" => Ok(Pool::Decode),
        _ => Err(format!("{s:?}: the pool is prefill or decode")),
    }
}

fn rack(s: &str) -> Result<usize, String> {
    s.strip_prefix("rack")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("{s:?}: a rack is rack0, rack1, ..."))
}

impl FromStr for FaultSpec {
    type Err = String;

    /// `kill:POOL:N|P%@WHEN`, `freeze:POOL:N|P%@WHEN+FOR`, `link:rackK:P%@WHEN[+FOR]`,
    /// `cut:rackK@WHEN[+FOR]`; `WHEN` is a duration or `random`, `*N` repeats a random one.
    fn from_str(s: &str) -> Result<FaultSpec, String> {
        let bad = |why: String| format!("--fault {s:?}: {why}");
        let (what, when) = s
            .split_once('@')
            .ok_or_else(|| bad("expected WHAT@WHEN (e.g. kill:decode:10%@20m)".into()))?;
        let (when, times) = match when.split_once('*') {
            Some((w, n)) => (
                w,
                n.parse().map_err(|_| bad(format!("{n:?}: not a count")))?,
            ),
            None => (when, 1),
        };
        let (when, lasting) = match when.split_once('+') {
            Some((w, l)) => (w, Some(duration(l).map_err(bad)?)),
            None => (when, None),
        };
        let at = match when {
            "random" => None,
            w => Some(duration(w).map_err(bad)?),
        };
        if times != 1 && at.is_some() {
            return Err(bad("*N repeats only a random time".into()));
        }
        let parts: Vec<&str> = what.split(':').collect();
        let kind = match parts.as_slice() {
            ["kill", p, n] if lasting.is_none() => FaultKind::Kill {
                pool: pool(p).map_err(bad)?,
                count: count(n).map_err(bad)?,
            },
            ["freeze", p, n] => FaultKind::Freeze {
                pool: pool(p).map_err(bad)?,
                count: count(n).map_err(bad)?,
                lasting: lasting.ok_or_else(|| bad("a freeze needs +FOR".into()))?,
            },
            ["link", r, share] => {
                let Count::Share(share) = count(share).map_err(bad)? else {
                    return Err(bad("a link's bandwidth is a share (10%)".into()));
                };
                FaultKind::Link { rack: rack(r).map_err(bad)?, share, lasting }
            }
            ["cut", r] => FaultKind::Link { rack: rack(r).map_err(bad)?, share: 0.0, lasting },
            _ => {
                return Err(bad(
                    "expected kill:POOL:N@WHEN, freeze:POOL:N@WHEN+FOR, link:rackK:P%@WHEN[+FOR] or cut:rackK@WHEN[+FOR]"
                        .into(),
                ))
            }
        };
        Ok(FaultSpec { at, kind, times })
    }
}

/// splitmix64, for the faults' random times and victims.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The faults of `specs` with their times: random ones drawn from `seed` within `horizon`.
pub fn schedule(specs: &[FaultSpec], seed: u64, horizon: Duration) -> Vec<Fault> {
    let mut out = Vec::new();
    let mut n = 0u64;
    for s in specs {
        for _ in 0..s.times {
            n += 1;
            let at = s.at.unwrap_or_else(|| {
                let u =
                    (mix(seed ^ n.wrapping_mul(0x5851_f42d)) >> 11) as f64 / (1u64 << 53) as f64;
                horizon.mul_f64(u)
            });
            out.push(Fault {
                at,
                kind: s.kind.clone(),
            });
        }
    }
    out.sort_by_key(|f| f.at);
    out
}

impl Sim {
    /// The rack of worker `w`.
    pub(crate) fn rack(&self, w: usize) -> usize {
        w % self.cfg.liveness.racks.max(1)
    }

    /// Fault `i` strikes.
    pub(crate) fn strike(&mut self, i: usize) {
        let f = self.faults[i].clone();
        match f.kind {
            FaultKind::Kill { pool, count } => {
                for w in self.victims(pool, count, i) {
                    self.kill(w);
                }
            }
            FaultKind::Freeze {
                pool,
                count,
                lasting,
            } => {
                for w in self.victims(pool, count, i) {
                    self.freeze(w, lasting);
                }
            }
            FaultKind::Link {
                rack,
                share,
                lasting,
            } => {
                if let Some(slot) = self.link_share.get_mut(rack) {
                    *slot = share;
                }
                if let Some(l) = lasting {
                    self.schedule(self.now + ns(l), Event::LinkRestored(rack));
                }
            }
        }
        self.result
            .faults
            .push((self.now as f64 / 1e9, format!("{:?}", f.kind)));
    }

    /// The serving workers of `pool` fault `i` takes (by the seed).
    fn victims(&self, pool: Pool, count: Count, i: usize) -> Vec<usize> {
        let mut live = self.pool(pool);
        let n = match count {
            Count::Share(s) => ((live.len() as f64 * s).round() as usize).max(1),
            Count::Workers(n) => n,
        }
        .min(live.len());
        let seed = self.cfg.liveness.fault_seed ^ (i as u64) << 32;
        live.sort_by_key(|&w| mix(seed ^ w as u64));
        live.truncate(n);
        live
    }

    /// Worker `w` dies: its streams break now.
    fn kill(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        wk.stopped = Some(self.now);
        wk.busy = false;
        let pool = wk.pool;
        self.index.remove_worker(w as u64);
        self.lose(w, "died");
        self.result.deaths += 1;
        // Started again after its start-up time, unless the planner scales this pool (it
        // sees the pool short and asks for one itself).
        if !self.plans.iter().any(|p| p.scaling.pool == pool) {
            let at = self.now + ns(self.cfg.start_up);
            self.schedule(at, Event::WorkerUp(pool));
        }
    }

    /// The router gives up on worker `w`'s requests: decode requests migrate, prefills are
    /// computed on their decode workers.
    fn lose(&mut self, w: usize, why: &str) {
        for r in 0..self.reqs.len() {
            let q = &self.reqs[r];
            if q.done || q.error.is_some() {
                continue;
            }
            if q.decode == Some(w) {
                self.migrate(r, format!("decode worker {w} {why}"));
            } else if q.prefill_on == Some(w) {
                self.recompute(r, "recomputed: prefill worker lost");
            }
        }
    }

    /// Worker `w` stops stepping for `lasting`.
    fn freeze(&mut self, w: usize, lasting: Duration) {
        let wk = &mut self.workers[w];
        wk.frozen = true;
        wk.freezes += 1;
        let serial = wk.freezes;
        self.schedule(self.now + ns(lasting), Event::Thaw(w));
        let stall = ns(self.cfg.liveness.stall);
        self.schedule(self.now + stall, Event::StallCheck { worker: w, serial });
    }

    /// The stall timeout after a freeze: still frozen with work held, the router marks it
    /// stalled and takes its requests elsewhere.
    pub(crate) fn stall_check(&mut self, w: usize, serial: u64) {
        let wk = &self.workers[w];
        let holds = wk.in_flight > 0 || wk.engine.has_work();
        if wk.frozen && wk.freezes == serial && wk.stopped.is_none() && holds {
            self.workers[w].stalled = true;
            self.result.stalls += 1;
            self.lose(w, "stalled");
        }
    }

    /// A frozen worker thaws: the step it was in ends now, and it serves again.
    pub(crate) fn thaw(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        if wk.stopped.is_some() {
            return;
        }
        wk.frozen = false;
        wk.stalled = false;
        if std::mem::take(&mut wk.deferred) {
            self.step_done(w);
        } else {
            self.kick(w);
        }
        self.retry_admission(None);
    }

    /// Request `r` leaves its decode worker and starts over elsewhere from its prompt plus the
    /// tokens streamed — or fails, past the migration limit.
    pub(crate) fn migrate(&mut self, r: usize, why: String) {
        self.leave(r);
        let limit = self.cfg.liveness.migration_limit;
        let q = &mut self.reqs[r];
        if q.migrations >= limit {
            return self.fail(
                r,
                format!("{why}; not migrated again (migration_limit = {limit})"),
            );
        }
        q.migrations += 1;
        q.attempt += 1;
        q.blocks = None;
        q.reserved = None;
        q.admit_from = self.now;
        q.refused_by.clear();
        let (len, streamed) = (q.prompt_len, q.tokens);
        // The streamed tokens join the prompt (what they were matters to no cache here).
        let prompt = &mut self.requests[r].prompt;
        prompt.truncate(len);
        prompt.extend(
            (0..streamed as u64).map(|i| (mix(r as u64 ^ i << 20) % crate::VOCAB as u64) as u32),
        );
        self.result.migrations += 1;
        let at = self.now + ns(self.cfg.hop);
        self.schedule(at, Event::Arrive(r));
    }

    /// Request `r` is released wherever it is held.
    pub(crate) fn leave(&mut self, r: usize) {
        self.prefill_returned(r);
        let q = &mut self.reqs[r];
        if let Some(p) = q.prefill_on.take() {
            self.workers[p].engine.release(r as u64, Release::Cancelled);
        }
        if let Some(d) = self.reqs[r].decode.take() {
            let wk = &mut self.workers[d];
            wk.engine.release(r as u64, Release::Cancelled);
            wk.in_flight = wk.in_flight.saturating_sub(1);
            self.retire(d);
        }
    }

    /// Request `r`'s prefill or transfer failed: its decode worker computes the prompt.
    pub(crate) fn recompute(&mut self, r: usize, why: &'static str) {
        self.prefill_returned(r);
        let q = &mut self.reqs[r];
        q.attempt += 1;
        if let Some(p) = q.prefill_on.take() {
            self.workers[p].engine.release(r as u64, Release::Cancelled);
        }
        let Some(d) = self.reqs[r].decode else { return };
        *self.result.decisions.entry(why).or_default() += 1;
        match self.workers[d].engine.prefill_here(r as u64) {
            Ok(()) => self.kick(d),
            Err(e) => self.fail(r, format!("{why}: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_read_as_written_and_bad_ones_say_why() {
        let f: FaultSpec = "kill:decode:10%@20m".parse().unwrap();
        assert_eq!(f.at, Some(Duration::from_secs(1200)));
        assert_eq!(
            f.kind,
            FaultKind::Kill {
                pool: Pool::Decode,
                count: Count::Share(0.1)
            }
        );
        let f: FaultSpec = "freeze:prefill:2@90s+15s".parse().unwrap();
        let lasting = Duration::from_secs(15);
        assert_eq!(
            f.kind,
            FaultKind::Freeze {
                pool: Pool::Prefill,
                count: Count::Workers(2),
                lasting
            }
        );
        let f: FaultSpec = "link:rack1:10%@30m".parse().unwrap();
        assert_eq!(
            f.kind,
            FaultKind::Link {
                rack: 1,
                share: 0.1,
                lasting: None
            }
        );
        let f: FaultSpec = "cut:rack0@random*3".parse().unwrap();
        assert_eq!((f.at, f.times), (None, 3));
        for (bad, says) in [
            ("kill:decode:10%", "WHAT@WHEN"),
            ("kill:router:1@1m", "prefill or decode"),
            ("freeze:decode:1@1m", "needs +FOR"),
            ("kill:decode:0@1m", "worker count"),
            ("link:rack0:1@1m", "share"),
            ("kill:decode:1@5", "unit"),
            ("kill:decode:1@1m*2", "random"),
        ] {
            let e = bad.parse::<FaultSpec>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn random_times_come_from_the_seed_within_the_horizon() {
        let specs: Vec<FaultSpec> = vec!["kill:decode:1@random*4".parse().unwrap()];
        let h = Duration::from_secs(600);
        let a = schedule(&specs, 7, h);
        assert_eq!(a, schedule(&specs, 7, h));
        assert_ne!(a, schedule(&specs, 8, h));
        assert_eq!(a.len(), 4);
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at) && a.iter().all(|f| f.at < h));
    }
}
