//! Which worker of a pool takes a request: the routing policy (`[router] policy`).
//!
//! `kv` (the default) uses the KV index: a decode worker is chosen by how much of the prompt it
//! already caches, among the workers no busier than the least busy one plus a slack (so a hot
//! prefix — one system prompt shared by every request — cannot pile every request onto one
//! worker: the others get some, compute the prefix once, and share in turn); a prefill worker
//! by its estimated time to first token: the prompt tokens it would compute (those it does not
//! cache) plus the tokens queued ahead of them, over its measured rate. Ties break at random.
//! `least-loaded` and `round-robin` ignore the caches, for comparison.

use std::time::Duration;

pub use proto::config::Policy;

/// The policy and its one parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routing {
    /// How workers are picked.
    pub policy: Policy,
    /// `kv`: how much later than the best estimate a prefill worker's estimated time to first
    /// token may be and still be chosen for its cache.
    pub prefill_slack: Duration,
    /// `kv`: what a block in a worker's host-memory and disk tiers counts for against one in
    /// its pool, and one only the cluster store holds; `None` (or the store's): derived per
    /// worker from its measured load time ([`tier_weight`]).
    pub tier_weights: Option<([f64; 2], Option<f64>)>,
}

impl Default for Routing {
    fn default() -> Self {
        Routing {
            policy: Policy::Kv,
            prefill_slack: Duration::from_millis(100),
            tier_weights: None,
        }
    }
}

/// Requests beyond the least busy candidate's that a worker may carry and still be chosen
/// for its cache.
pub const BUSY_SLACK: usize = 2;

/// Prompt tokens per second assumed for a prefill worker that has not measured its rate yet.
pub const DEFAULT_RATE: f64 = 1000.0;

/// What a block held in a tier below the pool counts for before its worker has measured a load
/// from it (host memory, disk): a copy costs a small part of computing the block.
pub const UNMEASURED_TIER_WEIGHTS: [f64; 2] = [0.9, 0.7];

/// What a block only the cluster store holds counts for before the worker has measured a
/// fetch: a network read, dearer than a local tier's.
pub const UNMEASURED_STORE_WEIGHT: f64 = 0.5;

/// What a block fetched from a decode worker (peer fetch) counts for before the prefill worker
/// has measured a fetch: a network read, as the store's.
pub const UNMEASURED_PEER_WEIGHT: f64 = UNMEASURED_STORE_WEIGHT;

/// What a block loaded from a tier counts for against one in the pool (1) and one computed
/// (0): the share of the block's compute time (`block_tokens` at `rate` tokens/s) that loading
/// it (`load_s`) saves.
pub fn tier_weight(load_s: f64, block_tokens: usize, rate: f64) -> f64 {
    let compute_s = block_tokens as f64 / rate;
    (1.0 - load_s / compute_s).clamp(0.0, 1.0)
}

/// One worker that could take the request.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Requests in flight on it and queued there.
    pub load: usize,
    /// Prompt tokens it holds in its cache (leading whole blocks), a block in a tier below
    /// the pool counted at its tier's weight.
    pub cached: usize,
    /// Prefill: prompt tokens sent to it and not yet done.
    pub queued_tokens: u64,
    /// Prefill: measured prompt tokens per second (0: not measured yet).
    pub rate: f64,
}

/// Candidate `i`'s tie-break key for the pool's `turn`-th pick: ties fall on a different
/// worker each turn (no worker is always the first among equals), and a pick is a function of
/// its inputs (the simulator replays the same run twice alike).
fn coin(turn: usize, i: usize) -> u64 {
    let mut z = ((turn as u64) << 32 ^ i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The index in `c` of the worker to take a decode request, `rr` the pool's round-robin count.
pub fn decode(policy: Policy, c: &[Candidate], rr: usize) -> Option<usize> {
    let min = c.iter().map(|x| x.load).min()?;
    match policy {
        Policy::RoundRobin => Some(rr % c.len()),
        Policy::LeastLoaded => (0..c.len()).min_by_key(|&i| (c[i].load, coin(rr, i))),
        Policy::Kv => (0..c.len())
            .filter(|&i| c[i].load <= min + BUSY_SLACK)
            .max_by_key(|&i| (c[i].cached, std::cmp::Reverse(c[i].load), coin(rr, i))),
    }
}

impl Candidate {
    /// Prefill: its measured rate, or [`DEFAULT_RATE`] before it has one.
    pub fn rate_or_default(&self) -> f64 {
        if self.rate > 0.0 {
            self.rate
        } else {
            DEFAULT_RATE
        }
    }

    /// Prefill: seconds until the tokens queued on it are done.
    pub fn wait_s(&self) -> f64 {
        self.queued_tokens as f64 / self.rate_or_default()
    }

    /// Prefill: estimated seconds to compute a prompt of `prompt` tokens here, queue included.
    pub fn ttft_s(&self, prompt: usize) -> f64 {
        self.wait_s() + prompt.saturating_sub(self.cached) as f64 / self.rate_or_default()
    }
}

/// Prefill candidates that have not measured a rate yet (joined, or scaled up, a moment ago)
/// take their measured peers' mean: the same model on the same kind of machine. Estimated at
/// [`DEFAULT_RATE`] instead, a new worker looks many times slower than its warm peers and is
/// not chosen while they have any queue — so it never measures a rate.
pub fn fill_rates(c: &mut [Candidate]) {
    let measured: Vec<f64> = c.iter().map(|x| x.rate).filter(|&r| r > 0.0).collect();
    if measured.is_empty() {
        return;
    }
    let peers = measured.iter().sum::<f64>() / measured.len() as f64;
    for x in c.iter_mut().filter(|x| x.rate <= 0.0) {
        x.rate = peers;
    }
}

/// The index in `c` of the worker to prefill a prompt of `prompt` tokens.
pub fn prefill(r: &Routing, c: &[Candidate], prompt: usize, rr: usize) -> Option<usize> {
    if r.policy != Policy::Kv {
        return decode(r.policy, c, rr);
    }
    let mut c = c.to_vec();
    fill_rates(&mut c);
    let ttft: Vec<f64> = c.iter().map(|x| x.ttft_s(prompt)).collect();
    let best = ttft.iter().copied().min_by(f64::total_cmp)?;
    let within = best + r.prefill_slack.as_secs_f64();
    (0..c.len())
        .filter(|&i| ttft[i] <= within)
        .min_by(|&a, &b| {
            (c[b].cached.cmp(&c[a].cached))
                .then(ttft[a].total_cmp(&ttft[b]))
                .then_with(|| coin(rr, a).cmp(&coin(rr, b)))
        })
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
        // Ties break by the turn: both idle, empty workers get picked over the turns, and the
        // same turn picks the same one.
        let even = [cand(0, 0), cand(0, 0)];
        let picks: std::collections::HashSet<_> = (0..64)
            .filter_map(|turn| decode(Policy::Kv, &even, turn))
            .collect();
        assert_eq!(picks.len(), 2);
        assert_eq!(decode(Policy::Kv, &even, 7), decode(Policy::Kv, &even, 7));
    }

    #[test]
    fn a_prefill_worker_is_chosen_by_its_estimated_ttft() {
        let kv = Routing::default();
        let mut a = cand(0, 1024);
        a.queued_tokens = 4000; // holds most of the prompt, but a long queue
        let mut b = cand(0, 0);
        b.rate = 2000.0;
        assert_eq!(prefill(&kv, &[a, b], 1100, 0), Some(1));
        a.queued_tokens = 0;
        assert_eq!(prefill(&kv, &[a, b], 1100, 0), Some(0));
        assert_eq!(prefill(&kv, &[], 10, 0), None);
    }

    /// A worker that has computed nothing yet is estimated at its peers' rate: idle, it takes
    /// the next prompt from warm workers with a queue (at the default 1,000 tokens/s it would
    /// look 20 times slower and wait for a queue of that depth).
    #[test]
    fn a_new_prefill_worker_is_estimated_at_its_peers_rate() {
        let kv = Routing::default();
        let mut warm = cand(0, 0);
        (warm.rate, warm.queued_tokens) = (20_000.0, 8_000);
        let new = Candidate {
            rate: 0.0,
            ..cand(0, 0)
        };
        assert_eq!(prefill(&kv, &[warm, warm, new], 12_000, 0), Some(2));
        let mut c = [warm, new];
        fill_rates(&mut c);
        assert_eq!(c[1].rate, 20_000.0);
        // Nobody measured: the default for all.
        let mut cold = [new, new];
        fill_rates(&mut cold);
        assert_eq!(cold[0].rate_or_default(), DEFAULT_RATE);
    }

    #[test]
    fn a_prefill_worker_caching_the_prompt_wins_within_the_slack() {
        let kv = Routing {
            policy: Policy::Kv,
            prefill_slack: Duration::from_millis(50),
            tier_weights: None,
        };
        let mut cached = cand(0, 1024);
        let idle = cand(0, 0);
        // Idle: 1.1 s; cached: 76 ms of its own after 60 ms queued.
        cached.queued_tokens = 60;
        assert!(cached.ttft_s(1100) < idle.ttft_s(1100));
        assert_eq!(prefill(&kv, &[idle, cached], 1100, 0), Some(1));
        // A short prompt: the idle worker's estimate is 20 ms, the cached one's 84 ms (80 ms
        // queued), beyond the slack: the idle one takes it.
        let mut busy = cand(0, 16);
        busy.queued_tokens = 80;
        assert_eq!(prefill(&kv, &[busy, cand(0, 0)], 20, 0), Some(1));
        // Within the slack, the one holding more of the prompt wins even if a bit later.
        busy.queued_tokens = 20;
        assert_eq!(prefill(&kv, &[busy, cand(0, 0)], 20, 0), Some(0));
        let none = Routing {
            prefill_slack: Duration::ZERO,
            ..kv
        };
        assert_eq!(prefill(&none, &[busy, cand(0, 0)], 20, 0), Some(1));
    }

    #[test]
    fn a_tier_counts_for_what_loading_saves_against_computing() {
        // 16 tokens at 1,600 tokens/s: 10 ms to compute.
        assert_eq!(tier_weight(0.001, 16, 1600.0), 0.9);
        assert_eq!(tier_weight(0.0, 16, 1600.0), 1.0);
        assert_eq!(
            tier_weight(0.02, 16, 1600.0),
            0.0,
            "slower than computing: a miss"
        );
    }
}
