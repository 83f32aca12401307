//! A step's chunks and what the engine does with their logits: the token drawn (under a
//! grammar where the request has one), the prompt's log-probabilities collected.

use types::RequestId;

use super::{Seq, TokenEvent};
use crate::grammar::Guide;
use crate::model::{Logits, SeqChunk};
use crate::sampler::{FinishReason, Sampler, TokenLogprobs};

/// One sequence's part of a step: its tokens `start..start + len`; for a verify chunk
/// (`draft` > 0) its newest token and that many drafts after it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Chunk {
    /// The sequence's index in the running batch.
    pub(super) seq: usize,
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) draft: usize,
}

impl Chunk {
    /// Whether this is a decoding sequence's newest token (not a prompt chunk).
    pub(super) fn decodes(&self, running: &[Seq]) -> bool {
        self.len == 1 + self.draft && self.start >= running[self.seq].prompt_len
    }

    /// The forward's view of this chunk of `s`, and which rows' logits it needs.
    pub(super) fn forward<'a>(&self, s: &'a Seq) -> SeqChunk<'a> {
        let end = self.start + self.len;
        if self.draft > 0 {
            let d = s
                .drafter
                .as_ref()
                .expect("a verify chunk's sequence drafts");
            return SeqChunk {
                tokens: &d.chunk,
                start_pos: self.start,
                block_table: &s.table,
                logits: Logits::Verify,
            };
        }
        SeqChunk {
            tokens: &s.tokens[self.start..end],
            start_pos: self.start,
            block_table: &s.table,
            logits: if s.prefill_only {
                Logits::None
            } else if s.prompt_lp.is_some() && self.start < s.prompt_len {
                Logits::All
            } else if end == s.tokens.len() {
                Logits::Last
            } else {
                Logits::None
            },
        }
    }
}

/// The token `s` draws from chunk `c`'s logits `l` (its prompt's log-probabilities collected
/// first, when it asked for them), appended to it, with why it finished if it did; `None` while
/// a prompt-log-probability prompt is still being computed.
pub(super) fn sample(s: &mut Seq, c: &Chunk, l: &mut [f32], vocab: usize) -> Option<TokenEvent> {
    if let (Some((k, lps)), true) = (&mut s.prompt_lp, c.start < s.prompt_len) {
        prompt_logprobs(l, vocab, &s.tokens[..s.prompt_len], c.start, *k, lps);
        if c.start + c.len < s.prompt_len {
            return None;
        }
    }
    let last = l.len() - vocab;
    let l = &mut l[last..];
    let (tok, logprobs, complete) = match &mut s.guide {
        None => {
            let (tok, lp) = s.sampler.sample_with_logprobs(l, &s.tokens);
            (tok, lp, false)
        }
        Some(g) => guided(g, &s.sampler, l, &s.tokens, &s.stop_ids, s.id),
    };
    s.tokens.push(tok);
    let generated = s.tokens.len() - s.prompt_len;
    let finish = if complete || s.stop_ids.contains(&tok) {
        Some(FinishReason::Stop)
    } else if generated >= s.max_tokens {
        Some(FinishReason::Length)
    } else {
        None
    };
    Some(TokenEvent {
        id: s.id,
        token: tok,
        finish,
        logprobs,
        prompt_logprobs: s.prompt_lp.take().map(|(_, lps)| lps),
    })
}

/// The log-probabilities of the prompt tokens that the rows of `logits` (one per position from
/// `start`) predict, appended to `out`: row `j` gives token `start + j + 1`'s, while that is
/// still a prompt token.
fn prompt_logprobs(
    logits: &[f32],
    vocab: usize,
    prompt: &[u32],
    start: usize,
    k: usize,
    out: &mut Vec<TokenLogprobs>,
) {
    for (j, row) in logits.chunks_exact(vocab).enumerate() {
        if let Some(&next) = prompt.get(start + j + 1) {
            out.push(TokenLogprobs::of(row, next, k));
        }
    }
}

/// A draw under a grammar: the logits masked, the token drawn, the grammar moved past it;
/// also whether the grammar is complete. A grammar that fails (an internal error: its own
/// masks allow only what it accepts) ends the output there, logged.
fn guided(
    g: &mut Guide,
    sampler: &Sampler,
    logits: &mut [f32],
    tokens: &[u32],
    stops: &[u32],
    id: RequestId,
) -> (u32, Option<TokenLogprobs>, bool) {
    let masked = g.mask(logits);
    let (tok, lp) = sampler.sample_with_logprobs(logits, tokens);
    let done = masked.and_then(|()| match stops.contains(&tok) {
        true => Ok(true),
        false => g.commit(tok),
    });
    match done {
        Ok(done) => (tok, lp, done),
        Err(e) => {
            tracing::warn!(request = %id, "structured output ended: {e}");
            (tok, lp, true)
        }
    }
}
