//! Faults on the virtual clock — worker deaths and freezes, links slowed or cut — at given
//! times or at times drawn from a seed. What a fault does to the workers and the links is
//! modelled here; what the router does about it is the router's own request core, fed what a
//! real router would see:
//!
//! - A worker that **dies** breaks its streams and calls at once: its decode requests see
//!   their stream fail (the core migrates them: the prompt plus the tokens streamed, the rest
//!   of its tokens, a new admission deadline, up to the migration limit), its prefill calls
//!   fail (the core recomputes those prompts on their decode workers). The dead worker leaves
//!   the router's table and the KV index; it is started again after the start-up time (`tandem
//!   up`'s supervisor, a Deployment's controller), or, in a pool the planner scales, the
//!   planner sees the pool short and asks for one.
//! - A worker that **freezes** — its engine wedged — stops stepping but goes on heartbeating:
//!   the router's table finds it stalled once its steps have stood still for the stall timeout
//!   while it holds work (no new requests go to it; the core migrates its decode requests and
//!   recomputes its prefills on their decode workers). When it thaws, the step it was in ends
//!   and, its steps moving again, it serves again.
//! - A **link** to a rack (worker `i` is in rack `i % racks`) at a share of its bandwidth slows
//!   the transfers to that rack's decode workers that start while it lasts; a **cut** (share 0)
//!   fails them after the transfer timeout (the prefill call fails, and the core recomputes
//!   the prompt on the decode worker). A transfer's time is fixed when it starts (a change
//!   mid-transfer does not touch it).

use std::str::FromStr;
use std::time::Duration;

use proto::Cause;
use router::core::Input;

use crate::{ns, wid, Event, Pool, Sim};

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

    /// Worker `w` dies: its streams and calls break now.
    fn kill(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        wk.stopped = Some(self.now);
        wk.busy = false;
        let pool = wk.pool;
        self.table.remove(wid(w));
        self.result.deaths += 1;
        let died = |why: &str| format!("the worker died ({why})");
        self.lose(
            w,
            Input::DecodeFailed(Cause::Unreachable, died("stream broken")),
            Input::PrefillFailed(Cause::Unreachable, died("call broken")),
        );
        // Started again after its start-up time, unless the planner scales this pool (it
        // sees the pool short and asks for one itself).
        if !self.plans.iter().any(|p| p.scaling.pool == pool) {
            let at = self.now + ns(self.cfg.start_up);
            self.schedule(at, Event::WorkerUp(pool));
        }
    }

    /// Worker `w` stops stepping for `lasting` (its heartbeats go on).
    fn freeze(&mut self, w: usize, lasting: Duration) {
        self.workers[w].frozen = true;
        self.schedule(self.now + ns(lasting), Event::Thaw(w));
    }

    /// A frozen worker thaws: the step it was in ends now, and it steps again.
    pub(crate) fn thaw(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        if wk.stopped.is_some() {
            return;
        }
        wk.frozen = false;
        if std::mem::take(&mut wk.deferred) {
            self.step_done(w);
        } else {
            self.kick(w);
        }
        self.poke(None);
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
