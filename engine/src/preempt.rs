//! Optimistic admission and preemption.
//!
//! Under [`Admission::Reserve`] (the default) a request is admitted only when the cache can
//! hold its prompt plus `max_tokens`, and nothing is ever preempted. Under
//! [`Admission::Optimistic`] a request is admitted when its prompt fits (with a small
//! watermark of pages left free), and a decoding sequence takes its next page as it reaches
//! it. When a page is not there, the running sequence that came last is preempted — the one
//! asking itself, when it is the latest; a resumed sequence keeps its place, so it is not the
//! next one out — and goes back to the front of the queue:
//!
//! - **swapped**: with a host tier (G2) below the pool, its registered blocks are copied there
//!   now, whatever the tiers' write policy, and its pages given back; when it resumes, its
//!   prefix lookup (over all its tokens, generated ones included) loads them back like any
//!   prefix hit, checksums checked. Only its last, partial block is computed again.
//! - **recomputed**: without one, its pages are given back (their blocks stay in the pool's
//!   prefix cache until evicted) and whatever is gone is computed again when it resumes.
//!
//! Either way its tokens stay as they were: the forward computes a row the same whatever the
//! batch or chunk (see [`crate::model`]), so a resumed sequence's KV, and every token after,
//! is bitwise what it would have been.

use crate::scheduler::Engine;
use crate::RequestId;

/// When a request is admitted, and whether running sequences can be preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Admission {
    /// Its prompt plus `max_tokens` reserved at admission; never preempted.
    #[default]
    Reserve,
    /// Its prompt reserved at admission; pages taken as it decodes; the latest sequence
    /// preempted (swapped to G2, or recomputed) when the pool runs out.
    Optimistic,
}

/// Preemptions and what resuming them cost, since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Preemptions {
    /// Sequences preempted with their KV copied to G2.
    pub swapped: u64,
    /// Sequences preempted with their KV given up (no host tier).
    pub recomputed: u64,
    /// Tokens whose KV resumed sequences needed back.
    pub resumed_tokens: u64,
    /// Of those, tokens found in the pool or its tiers (not computed again).
    pub resumed_hit_tokens: u64,
}

impl Engine {
    /// The tokens a waiting sequence's admission reserves: all it can grow to under
    /// [`Admission::Reserve`]; under [`Admission::Optimistic`] what it holds now and its next
    /// token's.
    pub(crate) fn admission_tokens(&self, tokens: usize, prompt: usize, max: usize) -> usize {
        match self.config.admission {
            Admission::Reserve => prompt + max,
            Admission::Optimistic => (tokens + 1).min(prompt + max),
        }
    }

    /// Pages an optimistic admission leaves free while others run (1% of the pool, at least
    /// one), so the batch can take its next pages without preempting what was just admitted.
    pub(crate) fn watermark(&self) -> usize {
        match self.config.admission {
            Admission::Reserve => 0,
            Admission::Optimistic => (self.kv.total_blocks() / 100).max(1),
        }
    }

    /// Gives every decoding sequence the page its next token writes, preempting the latest
    /// running sequence (not a prefill-only one) while the pool has none.
    pub(crate) fn grow(&mut self) {
        if self.config.admission == Admission::Reserve {
            return;
        }
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            let decoding = !s.prefill_only && s.computed >= s.prompt_len;
            if !decoding || self.kv.reserve(&mut s.table, s.computed + 1).is_ok() {
                i += 1;
                continue;
            }
            let victim = self
                .running
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.prefill_only)
                .max_by_key(|(_, s)| s.arrival)
                .map(|(v, _)| v)
                .expect("sequence i is one");
            // The one at i, when it is the latest: the next one has moved to i.
            self.preempt(victim);
            if victim < i {
                i -= 1;
            }
        }
    }

    /// The requests the last step preempted, in order (none once taken): a worker tells each
    /// one's caller that it waits for room, not for a wedged engine.
    pub fn take_preempted(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.preempted_now)
    }

    /// Takes running sequence `i` out of the batch to the front of the queue: its KV swapped
    /// to G2 where there is one, its pages given back.
    fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        self.ledger.free(s.id);
        let swapped = match self.prefix_seed {
            Some(seed) => self
                .kv
                .swap_out((seed, s.root), &s.table, &s.tokens, s.chain.0),
            None => false,
        };
        self.kv.release(std::mem::take(&mut s.table));
        tracing::debug!(request = %s.id, tokens = s.computed, swapped, "preempted");
        s.computed = 0;
        s.chain = (0, s.root);
        s.resumed = true;
        // Log-probabilities of a prompt not computed yet are computed again from the start.
        if let Some((_, lps)) = &mut s.prompt_lp {
            lps.clear();
        }
        match swapped {
            true => self.preemptions.swapped += 1,
            false => self.preemptions.recomputed += 1,
        }
        self.preempted_now.push(s.id);
        self.waiting.push_front(s);
    }
}
