//! A step's speculation (see [`crate::speculate`]): drafts chosen for the decoding chunks, and
//! a verify chunk's rows drawn in turn.

use super::chunk::{sample, Chunk};
use super::{Engine, Seq, TokenEvent};
use crate::speculate::{Acceptance, SpecStats};

impl Engine {
    /// Gives decoding chunks of `plan` their drafts, from `budget` (returned less what they
    /// took): sequence by sequence, the count with the most expected tokens per second of the
    /// step as measured ([`crate::speculate::StepCosts::choose`]).
    pub(super) fn speculate(&mut self, plan: &mut [Chunk], mut budget: usize) -> usize {
        let mut tokens = plan.len();
        let mut out = plan.len() as f64;
        for c in plan.iter_mut() {
            let s = &mut self.running[c.seq];
            let Some(d) = s.drafter.as_mut() else {
                continue;
            };
            // A verify step draws one token more than it has drafts; its drafts write only
            // pages the sequence holds (a windowed group's promised ones aside): they never take
            // a page another sequence could have, nor cause a preemption.
            let left = s.max_tokens - (s.tokens.len() - s.prompt_len);
            let room = self.kv.held_tokens(&s.table).saturating_sub(s.tokens.len());
            let cap = left.saturating_sub(1).min(budget).min(room);
            let Some((n, drafts)) = d.propose(&s.tokens, cap) else {
                continue;
            };
            let k = self.costs.choose(tokens, out, drafts.len(), |k| {
                d.expected(n, k, &self.accept)
            });
            let newest = *s.tokens.last().expect("a decoding sequence has tokens");
            d.set(newest, n, &drafts, k, s.tokens.len());
            if k == 0 {
                self.spec.declined += 1;
                continue;
            }
            (c.len, c.draft) = (1 + k, k);
            tokens += k;
            out += d.expected(n, k, &self.accept);
            budget -= k;
        }
        budget
    }
}

/// Draws verify chunk `c`'s rows `l` for `s` in turn: each draw equal to the draft after it
/// accepts that draft (its KV computed in this step) and goes on; the first that differs, the
/// row after the last draft, or a token that ends the request, stops. Returns the tokens drawn.
pub(super) fn verify(
    s: &mut Seq,
    c: &Chunk,
    mut l: Vec<f32>,
    vocab: usize,
    stats: &mut SpecStats,
    all: &mut Acceptance,
) -> Vec<TokenEvent> {
    let d = s
        .drafter
        .as_mut()
        .expect("a verify chunk's sequence drafts");
    let drafts = std::mem::take(&mut d.chunk);
    debug_assert_eq!(drafts.len(), c.draft + 1);
    // The newest token's KV is computed.
    s.computed += 1;
    let mut drawn = Vec::new();
    let mut accepted = 0;
    for (j, row) in l.chunks_exact_mut(vocab).enumerate() {
        let ev = sample(s, c, row, vocab).expect("a decoding row draws a token");
        let (tok, done) = (ev.token, ev.finish.is_some());
        drawn.push(ev);
        if drafts.get(j + 1) != Some(&tok) {
            break;
        }
        accepted += 1;
        if done {
            break;
        }
        // The draft's KV, computed in this step, is the drawn token's.
        s.computed += 1;
    }
    let d = s.drafter.as_mut().expect("checked above");
    d.chunk = drafts;
    d.verified(accepted, all);
    stats.verifies += 1;
    stats.proposed += c.draft as u64;
    stats.accepted += accepted as u64;
    drawn
}
