//! Which worker of a pool takes a request: the routing policy (`[router] policy`).
//!
//! `kv` (the default) uses the KV index: a decode worker is chosen by how much of the prompt it
//! already caches, among the workers no busier than the least busy one plus a slack (so a hot
//! prefix — one system prompt shared by every request — cannot pile every request onto one
//! worker: the others get some, compute the prefix once, and share in turn); a prefill worker
//! by its estimated time to first token: the prompt tokens it would compute (those it does not
//! cache) plus the tokens queued ahead of them, over its measured rate. Ties break at random.
//! `least-loaded` and `round-robin` ignore the caches, for comparison.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// How the router picks workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Cache-aware (see the module doc).
    Kv,
    /// The worker with the fewest requests in flight and queued.
    LeastLoaded,
    /// Each worker in turn.
    RoundRobin,
}

impl Policy {
    /// Parses `kv`, `least-loaded` or `round-robin`.
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "kv" => Some(Policy::Kv),
            "least-loaded" => Some(Policy::LeastLoaded),
            "round-robin" => Some(Policy::RoundRobin),
            _ => None,
        }
    }
}

/// Requests beyond the least busy candidate's that a worker may carry and still be chosen
/// for its cache.
pub const BUSY_SLACK: usize = 2;

/// Prompt tokens per second assumed for a prefill worker that has not measured its rate yet.
const DEFAULT_RATE: f64 = 1000.0;

/// One worker that could take the request.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Requests in flight on it and queued there.
    pub load: usize,
    /// Prompt tokens it holds in its cache (leading whole blocks).
    pub cached: usize,
    /// Prefill: prompt tokens sent to it and not yet done.
    pub queued_tokens: u64,
    /// Prefill: measured prompt tokens per second (0: not measured yet).
    pub rate: f64,
}

/// A random tie-break key.
fn coin() -> u64 {
    RandomState::new().build_hasher().finish()
}

/// The index in `c` of the worker to take a decode request, `rr` the pool's round-robin count.
pub fn decode(policy: Policy, c: &[Candidate], rr: usize) -> Option<usize> {
    let min = c.iter().map(|x| x.load).min()?;
    match policy {
        Policy::RoundRobin => Some(rr % c.len()),
        Policy::LeastLoaded => (0..c.len()).min_by_key(|&i| (c[i].load, coin())),
        Policy::Kv => (0..c.len())
            .filter(|&i| c[i].load <= min + BUSY_SLACK)
            .max_by_key(|&i| (c[i].cached, std::cmp::Reverse(c[i].load), coin())),
    }
}

/// The index in `c` of the worker to prefill a prompt of `prompt` tokens.
pub fn prefill(policy: Policy, c: &[Candidate], prompt: usize, rr: usize) -> Option<usize> {
    if c.is_empty() {
        return None;
    }
    let ttft = |x: &Candidate| {
        let work = prompt.saturating_sub(x.cached) as f64 + x.queued_tokens as f64;
        work / if x.rate > 0.0 { x.rate } else { DEFAULT_RATE }
    };
    match policy {
        Policy::Kv => (0..c.len()).min_by(|&a, &b| {
            ttft(&c[a])
                .total_cmp(&ttft(&c[b]))
                .then_with(|| coin().cmp(&coin()))
        }),
        other => decode(other, c, rr),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(load: usize, cached: usize) -> Candidate {
        Candidate {
            load,
            cached,
            queued_tokens: 0,
            rate: 1000.0,
        }
    }

    #[test]
    fn the_cache_wins_until_its_worker_is_busier_than_the_slack() {
        let c = [cand(1, 0), cand(2, 512), cand(1, 64)];
        assert_eq!(decode(Policy::Kv, &c, 0), Some(1));
        let busy = [cand(0, 0), cand(3, 512), cand(1, 64)];
        assert_eq!(
            decode(Policy::Kv, &busy, 0),
            Some(2),
            "worker 1 is past the slack"
        );
        assert_eq!(decode(Policy::LeastLoaded, &busy, 0), Some(0));
        assert_eq!(decode(Policy::RoundRobin, &busy, 4), Some(1));
        // Ties break at random: both idle, empty workers get picked.
        let even = [cand(0, 0), cand(0, 0)];
        let picks: std::collections::HashSet<_> = (0..64)
            .filter_map(|_| decode(Policy::Kv, &even, 0))
            .collect();
        assert_eq!(picks.len(), 2);
    }

    #[test]
    fn a_prefill_worker_is_chosen_by_its_estimated_ttft() {
        let mut a = cand(0, 1024);
        a.queued_tokens = 4000; // holds most of the prompt, but a long queue
        let mut b = cand(0, 0);
        b.rate = 2000.0;
        assert_eq!(prefill(Policy::Kv, &[a, b], 1100, 0), Some(1));
        a.queued_tokens = 0;
        assert_eq!(prefill(Policy::Kv, &[a, b], 1100, 0), Some(0));
        assert_eq!(prefill(Policy::Kv, &[], 10, 0), None);
    }
}
