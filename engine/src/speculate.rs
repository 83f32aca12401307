//! Speculative decoding by prompt lookup, on the engine that decodes.
//!
//! A decoding sequence's [`Drafter`] proposes the tokens that followed the most recent earlier
//! occurrence of its last n tokens (n from [`NGRAM_MAX`] down to 1) in its prompt and output —
//! an index kept as tokens arrive, never a rescan. The step verifies the proposal: its chunk is
//! the newest token followed by the k drafts, every row's logits are computed, and the
//! sequence's own sampler draws at each position in turn; a draw equal to the draft there
//! accepts it and goes on, the first draw that differs (or the row after the last draft) is
//! the model's own token and ends the chunk.
//!
//! **Contract: speculation never changes a token.** A draw is a function of the logits, the
//! tokens before it and the request's seed at its position ([`crate::sampler`]); the kernels
//! compute a row bitwise the same however the batch is made ([`crate::model`]). So every token
//! drawn in a verify chunk is the one decoding without speculation draws — greedy, seeded and
//! penalised alike. A rejected draft's KV is left past the sequence's computed tokens, in pages
//! it holds, and written over by the next step; the prefix cache registers only computed
//! (accepted) tokens, so no block name, cached block or KV event ever sees a rejected one.
//!
//! **Adaptive.** Each sequence keeps its drafts' acceptance per match length; the engine keeps
//! the measured time of its steps by their token count ([`StepCosts`]). A step's drafts are
//! chosen sequence by sequence for the most expected tokens per second: `k` drafts are worth
//! their expected accepted tokens and cost the step's measured time at `k` more tokens. Where
//! acceptance is low, or the batch is large enough that a token more costs its share of the
//! step, no draft pays and none is sent. A proposal not sent is still checked against the token
//! then drawn, so a sequence's acceptance keeps being measured while it does not speculate.

use std::collections::HashMap;

/// Longest suffix matched; shorter ones are tried when it is not found.
pub const NGRAM_MAX: usize = 8;

/// Most drafts a request may ask for in one step.
pub const MAX_DRAFT: usize = crate::sampler::MAX_SPECULATION;

/// Steps of at most this many tokens have their time kept (longer ones are prompt chunks no
/// draft decision needs).
const COSTED_TOKENS: usize = 256;

/// Weight of a new measurement in a step time's moving average.
const COST_EMA: f64 = 0.2;

/// A choice of drafts must promise this much more throughput than none (measured step times
/// are noisy).
const MARGIN: f64 = 1.02;

/// What speculation did, since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Drafts sent to a verify step.
    pub proposed: u64,
    /// Drafts the model's draw agreed with (each a step saved).
    pub accepted: u64,
    /// Verify chunks (a sequence's step carrying drafts).
    pub verifies: u64,
    /// Proposals found but not sent (the costs said they would not pay).
    pub declined: u64,
}

/// A sequence's proposer: its n-gram index and its drafts' measured acceptance.
#[derive(Debug)]
pub(crate) struct Drafter {
    /// Most drafts a step (the request's or the engine's cap).
    max: usize,
    /// The hash of n tokens (n mixed in) → the index of the last token of their latest
    /// occurrence whose next token is known. Bounded by the sequence: [`NGRAM_MAX`] entries
    /// (~150 bytes) a token, under 1% of the token's KV in the models served.
    index: HashMap<u64, u32>,
    /// Tokens whose n-grams ending there are indexed.
    indexed: usize,
    /// Per match length n (index n - 1): drafts accepted and tried, decayed.
    seen: [(f64, f64); NGRAM_MAX],
    /// A proposal not sent: its match length, its first draft and the position it was for.
    probe: Option<(usize, u32, usize)>,
    /// This step's verify chunk: the newest token, then the drafts.
    pub(crate) chunk: Vec<u32>,
    /// The match length of the drafts in `chunk`.
    n: usize,
}

/// The hash of an n-gram (FNV-1a over its length and ids; a collision is harmless, a match is
/// checked).
fn hash(tokens: &[u32]) -> u64 {
    use types::sum::{fnv1a, FNV_OFFSET};
    let seed = fnv1a(FNV_OFFSET, tokens.len() as u64);
    tokens.iter().fold(seed, |h, &t| fnv1a(h, t as u64))
}

impl Drafter {
    /// A proposer of at most `max` drafts a step (`None` when `max` is 0: no speculation).
    pub(crate) fn new(max: usize) -> Option<Drafter> {
        (max > 0).then(|| Drafter {
            max: max.min(MAX_DRAFT),
            index: HashMap::new(),
            indexed: 0,
            seen: [(0.0, 0.0); NGRAM_MAX],
            probe: None,
            chunk: Vec::new(),
            n: 0,
        })
    }

    /// Indexes the n-grams ending before the newest token (whose next token is known).
    fn catch_up(&mut self, tokens: &[u32]) {
        let end = tokens.len().saturating_sub(1);
        for i in self.indexed..end {
            for n in 1..=NGRAM_MAX.min(i + 1) {
                self.index.insert(hash(&tokens[i + 1 - n..=i]), i as u32);
            }
        }
        self.indexed = self.indexed.max(end);
    }

    /// The drafts that followed the latest earlier occurrence of the longest suffix of
    /// `tokens` found (at most `cap`), with that suffix's length. A proposal left unsent the
    /// step before is checked against the token drawn since.
    pub(crate) fn propose(&mut self, tokens: &[u32], cap: usize) -> Option<(usize, Vec<u32>)> {
        if let Some((n, t, at)) = self.probe.take() {
            if let Some(&drawn) = tokens.get(at) {
                self.observe(n, usize::from(drawn == t), 1);
            }
        }
        let cap = cap.min(self.max);
        if cap == 0 {
            return None;
        }
        self.catch_up(tokens);
        let len = tokens.len();
        (1..=NGRAM_MAX.min(len)).rev().find_map(|n| {
            let e = *self.index.get(&hash(&tokens[len - n..]))? as usize;
            // A hash can collide (with another length's too): the match is checked.
            (e + 1 >= n && tokens[e + 1 - n..=e] == tokens[len - n..]).then(|| {
                let end = (e + 1 + cap).min(len);
                (n, tokens[e + 1..end].to_vec())
            })
        })
    }

    /// Acceptance of drafts from a match of length `n`: the chance a draft is taken given the
    /// one before it was — this sequence's, starting from `prior` (the engine's) until measured.
    fn acceptance(&self, n: usize, prior: &Acceptance) -> f64 {
        let (ok, tried) = self.seen[n - 1];
        (ok + 2.0 * prior.rate(n)) / (tried + 2.0)
    }

    /// Tokens `k` drafts of a length-`n` match are expected to add to a step.
    pub(crate) fn expected(&self, n: usize, k: usize, prior: &Acceptance) -> f64 {
        let a = self.acceptance(n, prior);
        (1..=k).map(|i| a.powi(i as i32)).sum()
    }

    /// `ok` of `tried` drafts from a length-`n` match were accepted (older counts decay).
    fn observe(&mut self, n: usize, ok: usize, tried: usize) {
        let s = &mut self.seen[n - 1];
        *s = (0.9 * s.0 + ok as f64, 0.9 * s.1 + tried as f64);
    }

    /// Sends the first `k` of `drafts` (a length-`n` match) after `newest`, or, for `k` 0,
    /// keeps the first as a probe of the token drawn at `pos`.
    pub(crate) fn set(&mut self, newest: u32, n: usize, drafts: &[u32], k: usize, pos: usize) {
        self.chunk.clear();
        if k == 0 {
            self.probe = drafts.first().map(|&t| (n, t, pos));
            return;
        }
        self.chunk.push(newest);
        self.chunk.extend_from_slice(&drafts[..k]);
        self.n = n;
    }

    /// The verify chunk's outcome: `accepted` of its drafts taken (counted in the engine's
    /// `all` too).
    pub(crate) fn verified(&mut self, accepted: usize, all: &mut Acceptance) {
        let k = self.chunk.len() - 1;
        let tried = (accepted + 1).min(k);
        self.observe(self.n, accepted, tried);
        all.observe(self.n, accepted, tried);
        self.chunk.clear();
    }
}

/// Drafts accepted and tried per match length over every sequence (decayed slowly): what a
/// new sequence's acceptance starts from.
#[derive(Debug, Clone)]
pub(crate) struct Acceptance([(f64, f64); NGRAM_MAX]);

impl Default for Acceptance {
    fn default() -> Self {
        Acceptance([(0.0, 0.0); NGRAM_MAX])
    }
}

impl Acceptance {
    /// The rate for matches of length `n` (one in two until measured).
    fn rate(&self, n: usize) -> f64 {
        let (ok, tried) = self.0[n - 1];
        (ok + 1.0) / (tried + 2.0)
    }

    fn observe(&mut self, n: usize, ok: usize, tried: usize) {
        let s = &mut self.0[n - 1];
        *s = (0.99 * s.0 + ok as f64, 0.99 * s.1 + tried as f64);
    }
}

/// The measured time of a step by its tokens: a moving average per token count.
#[derive(Debug)]
pub(crate) struct StepCosts {
    secs: Vec<Option<f64>>,
    /// The token counts measured, ascending (an estimate is two binary searches, not a scan:
    /// it runs for every draft count of every speculating sequence, every step).
    known: Vec<usize>,
}

impl Default for StepCosts {
    fn default() -> Self {
        StepCosts {
            secs: vec![None; COSTED_TOKENS + 1],
            known: Vec::new(),
        }
    }
}

impl StepCosts {
    /// A step of `tokens` tokens took `secs`.
    pub(crate) fn observe(&mut self, tokens: usize, secs: f64) {
        let Some(slot) = self.secs.get_mut(tokens) else {
            return;
        };
        if slot.is_none() {
            let at = self.known.partition_point(|&t| t < tokens);
            self.known.insert(at, tokens);
        }
        *slot = Some(slot.map_or(secs, |s| s + COST_EMA * (secs - s)));
    }

    /// A step of `tokens` tokens' time: measured, or on the line through the nearest measured
    /// counts on either side; past the largest measured, on the line through the two largest
    /// (with one measured, that one's: an untried size is tried, and then known). `None` with
    /// nothing measured at or below it.
    fn estimate(&self, tokens: usize) -> Option<f64> {
        let tokens = tokens.min(COSTED_TOKENS);
        let point = |i: usize| {
            let t = self.known[i];
            (t, self.secs[t].expect("a known count is measured"))
        };
        let at = self.known.partition_point(|&t| t <= tokens);
        let below = point(at.checked_sub(1)?);
        if below.0 == tokens {
            return Some(below.1);
        }
        let line = |(t0, s0): (usize, f64), (t1, s1): (usize, f64)| {
            s0 + (tokens as f64 - t0 as f64) * (s1 - s0) / (t1 - t0) as f64
        };
        Some(if at < self.known.len() {
            line(below, point(at))
        } else if at >= 2 {
            line(point(at - 2), below).max(below.1)
        } else {
            below.1
        })
    }

    /// How many of `offered` drafts to send, for a step that so far runs `tokens` tokens and
    /// is expected to produce `out`: the count with the most expected tokens per second
    /// (`gain(k)`: the tokens k drafts add), none unless that beats none by [`MARGIN`]. With
    /// nothing measured all are sent (and then measured).
    pub(crate) fn choose(
        &self,
        tokens: usize,
        out: f64,
        offered: usize,
        gain: impl Fn(usize) -> f64,
    ) -> usize {
        let Some(base) = self.estimate(tokens) else {
            return offered;
        };
        let rate = |k: usize| (out + gain(k)) / self.estimate(tokens + k).unwrap_or(base);
        let none = out / base;
        let (best, r) =
            (1..=offered)
                .map(|k| (k, rate(k)))
                .fold((0, none), |a, b| if b.1 > a.1 { b } else { a });
        if r > none * MARGIN {
            best
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_longest_match() {
        let mut d = Drafter::new(4).unwrap();
        // "1 2 3 4 5 ... 9 1 2 3" → after "1 2 3" came "4 5"…
        let t = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3];
        assert_eq!(d.propose(&t, 8), Some((3, vec![4, 5, 6, 9])));
        // Capped by the request's max and what exists.
        let mut d = Drafter::new(2).unwrap();
        assert_eq!(d.propose(&t, 8), Some((3, vec![4, 5])));
        // No earlier occurrence of the newest token: nothing.
        let mut d = Drafter::new(4).unwrap();
        assert_eq!(d.propose(&[1, 2, 3, 7], 4), None);
        // The latest occurrence wins; the index is kept as tokens come.
        let mut d = Drafter::new(2).unwrap();
        assert_eq!(d.propose(&[5, 1, 5], 4), Some((1, vec![1, 5])));
        assert_eq!(d.propose(&[5, 1, 5, 2, 5], 4), Some((1, vec![2, 5])));
        assert_eq!(Drafter::new(0).map(|_| ()), None);
    }

    #[test]
    fn acceptance_is_learned_and_probes_count() {
        let mut all = Acceptance::default();
        let mut d = Drafter::new(4).unwrap();
        assert_eq!(d.acceptance(2, &all), 0.5);
        d.set(7, 2, &[1, 2, 3], 3, 10);
        d.verified(3, &mut all);
        assert!(d.acceptance(2, &all) > 0.7);
        // A new sequence starts from what every sequence saw.
        let fresh = Drafter::new(4).unwrap();
        assert!(
            fresh.acceptance(2, &all) > 0.7,
            "{}",
            fresh.acceptance(2, &all)
        );
        // A proposal not sent, then a different token drawn at its position: counted a miss.
        let before = d.acceptance(1, &all);
        d.set(7, 1, &[4], 0, 3);
        assert!(d.chunk.is_empty());
        let _ = d.propose(&[9, 9, 9, 5], 4);
        assert!(d.acceptance(1, &all) < before);
    }

    #[test]
    fn costs_decide_from_measurements() {
        let mut c = StepCosts::default();
        // Nothing measured: try them all.
        assert_eq!(c.choose(1, 1.0, 4, |k| k as f64 * 0.9), 4);
        // Bandwidth-bound: five tokens cost what one does — drafts pay.
        c.observe(1, 0.010);
        c.observe(5, 0.011);
        assert_eq!(c.choose(1, 1.0, 4, |k| k as f64 * 0.9), 4);
        // Nobody accepts: none pay.
        assert_eq!(c.choose(1, 1.0, 4, |_| 0.0), 0);
        // Compute-bound (time grows with tokens): drafts accepted nine times in ten lose.
        let mut c = StepCosts::default();
        c.observe(16, 0.016);
        c.observe(20, 0.020);
        assert_eq!(c.choose(16, 16.0, 4, |k| k as f64 * 0.9), 0);
        assert!((c.estimate(18).unwrap() - 0.018).abs() < 1e-12);
        // Past the largest measured: on the line through the two largest.
        assert_eq!(c.choose(20, 20.0, 4, |k| k as f64 * 0.9), 0);
        assert!((c.estimate(24).unwrap() - 0.024).abs() < 1e-12);
        // Measured out of order: between two, on their line; below all, nothing; one alone, its
        // own time above it.
        let mut c = StepCosts::default();
        c.observe(30, 0.030);
        c.observe(10, 0.010);
        c.observe(30, 0.030);
        assert_eq!(c.known, [10, 30]);
        assert!((c.estimate(20).unwrap() - 0.020).abs() < 1e-12);
        assert_eq!(c.estimate(9), None);
        assert!(
            (c.estimate(1000).unwrap() - 0.256).abs() < 1e-12,
            "capped at 256 tokens"
        );
        let mut c = StepCosts::default();
        c.observe(4, 0.004);
        assert_eq!(c.estimate(8), Some(0.004));
    }
}
