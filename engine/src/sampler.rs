//! Token sampling: logit bias, penalties on tokens already in the sequence, greedy or
//! temperature with top-k, top-p and min-p. The random draw for a token is a function of the
//! request's seed and the token's position in the sequence alone, and the penalties a function
//! of the sequence, so a seed reproduces the same tokens whatever else is being served — and a
//! request resumed elsewhere from its prompt plus the tokens it already produced (a migration,
//! which says how many of them there are: [`SamplingParams::generated`]) continues exactly as
//! it would have.
//!
//! The order, for the token at position `pos` of sequence `tokens`: `logit_bias` is added; the
//! stop tokens are masked while fewer than `min_tokens` were generated; each token seen in the
//! sequence is divided by `repetition_penalty` (multiplied where its logit is negative, as in
//! the CTRL paper and vLLM), and each seen in the output lowered by `frequency_penalty` × its
//! count + `presence_penalty` (OpenAI's definition); then greedy, or temperature, top-k,
//! top-p and min-p.

use crate::error::{EngineError, Result};

/// How to pick tokens and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Most tokens to generate (`None`: until the context is full).
    pub max_tokens: Option<usize>,
    /// 0 is greedy; otherwise logits are divided by this before softmax.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches this (1: all).
    pub top_p: f32,
    /// Seed of the request's random generator.
    pub seed: u64,
    /// Extra token ids that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Lowers the logit of every token the output holds (-2..=2; 0: off).
    pub presence_penalty: f32,
    /// Lowers the logit of every token the output holds by this times its count (-2..=2).
    pub frequency_penalty: f32,
    /// Divides positive logits (multiplies negative ones) of tokens in the prompt or output
    /// (> 0; 1: off).
    pub repetition_penalty: f32,
    /// Added to these tokens' logits (-100..=100 each).
    pub logit_bias: Vec<(u32, f32)>,
    /// Drops tokens less likely than this times the likeliest (0..=1; 0: off).
    pub min_p: f32,
    /// Stop and end-of-sequence tokens are masked until this many tokens were generated.
    pub min_tokens: usize,
    /// How many of the prompt's last tokens this request generated before (a migration): they
    /// count as output for the penalties and `min_tokens`.
    pub generated: usize,
    /// Report each token's log-probability and those of this many likeliest tokens (0..=20).
    pub logprobs: Option<usize>,
    /// Report the log-probability of each prompt token after the first (given the tokens before
    /// it) and those of this many likeliest tokens (0..=20), with the first generated token. The
    /// whole prompt is computed (no prefix-cache reuse); the raw model distribution (no bias or
    /// penalties).
    pub prompt_logprobs: Option<usize>,
    /// What the output must match (structured output); compiled by the decode worker.
    pub constraint: Option<Constraint>,
    /// The tenant's prefix-cache salt (vLLM's `cache_salt`): its prompt's blocks are named
    /// under a root of their own ([`crate::block_hash::root`]), shared only with requests of
    /// the same salt.
    pub cache_salt: Option<String>,
    /// Most drafts a step verifies for this request (prompt-lookup speculative decoding; `None`:
    /// the worker's default; `Some(0)`: off; at most [`MAX_SPECULATION`]). Never changes a
    /// token: it only lets a step check several.
    pub speculation: Option<usize>,
}

/// Most drafts a request may ask a step to verify.
pub const MAX_SPECULATION: usize = 16;

/// A grammar the output must match (see `engine::grammar`): the sequence ends, with
/// [`FinishReason::Stop`], when the grammar is complete.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// JSON valid against this schema (`{"type": "object"}`: any object), written compactly.
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression.
    Regex(String),
    /// Exactly one of these texts.
    Choice(Vec<String>),
    /// A constraint that arrived in a form this engine cannot read (the reason): refused.
    Unreadable(String),
    /// A constraint compiled ahead, off the engine thread, within a time budget (a decode
    /// worker's): the engine takes its guide as it is. Never on the wire.
    #[cfg(feature = "runtime")]
    #[serde(skip)]
    Compiled(crate::grammar::Compiled),
}

/// A sampled token's log-probability and the likeliest tokens', under the distribution the
/// sampler drew from before temperature: the softmax of the logits after bias and penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The sampled token's.
    pub logprob: f32,
    /// The likeliest tokens and theirs, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// The log-softmax of `logits` at `tok`, and at the `k` largest logits.
    pub fn of(logits: &[f32], tok: u32, k: usize) -> TokenLogprobs {
        let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
        let lse = max + sum.ln();
        let lp = |t: u32| (logits[t as usize] as f64 - lse) as f32;
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let k = k.min(idx.len());
        if k > 0 && k < idx.len() {
            idx.select_nth_unstable_by(k - 1, by_logit);
        }
        idx.truncate(k);
        idx.sort_unstable_by(by_logit);
        TokenLogprobs {
            logprob: lp(tok),
            top: idx.into_iter().map(|t| (t, lp(t))).collect(),
        }
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token (or a stop string, found by the router).
    Stop,
    /// `max_tokens` reached or the context is full.
    Length,
}

impl FinishReason {
    /// The OpenAI API's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: None,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_p: 0.0,
            min_tokens: 0,
            generated: 0,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            cache_salt: None,
            speculation: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> SamplingParams {
        SamplingParams {
            max_tokens: Some(max_tokens),
            ..Default::default()
        }
    }

    /// Rejects parameters outside their ranges.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature must be a non-negative number, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.max_tokens == Some(0) {
            return bad("max_tokens must be at least 1".into());
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be between -2 and 2, got {v}"));
            }
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return bad(format!(
                "repetition_penalty must be a positive number, got {r}"
            ));
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return bad(format!(
                "logit_bias for token {t} must be between -100 and 100, got {b}"
            ));
        }
        if let Some(k) = self.logprobs.filter(|&k| k > 20) {
            return bad(format!("top_logprobs must be at most 20, got {k}"));
        }
        if let Some(k) = self.prompt_logprobs.filter(|&k| k > 20) {
            return bad(format!("prompt_logprobs must be at most 20, got {k}"));
        }
        if let Some(k) = self.speculation.filter(|&k| k > MAX_SPECULATION) {
            return bad(format!(
                "speculation must be at most {MAX_SPECULATION}, got {k}"
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be between 0 and 1, got {}", self.min_p));
        }
        if let Some(m) = self.max_tokens.filter(|&m| self.min_tokens > m) {
            return bad(format!(
                "min_tokens ({}) is more than max_tokens ({m})",
                self.min_tokens
            ));
        }
        Ok(())
    }

    /// Whether any logit is changed before sampling (bias, penalties, `min_tokens`).
    fn adjusts(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || self.min_tokens > 0
    }
}

/// splitmix64's finaliser: a well-mixed 64-bit function of `z`.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The uniform draw in [0, 1) for the token at `pos` of a request seeded with `seed`
/// (counter-based: no state to carry, the same on every worker and platform).
pub fn uniform(seed: u64, pos: usize) -> f64 {
    let z = mix(seed.wrapping_add(0x9e37_79b9_7f4a_7c15))
        ^ (pos as u64).wrapping_mul(0xd6e8_feb8_6659_fd93);
    (mix(z.wrapping_add(0x9e37_79b9_7f4a_7c15)) >> 11) as f64 / (1u64 << 53) as f64
}

/// Index of the largest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    // The largest value in 16 lanes (vectorised: a verify step draws several rows of 49,152
    // logits), then its first index. NaNs are never the largest, as in a scan keeping the first
    // strictly greater value; a NaN first value wins there, and here too.
    if logits.first().is_none_or(|v| v.is_nan()) {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = logits.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// Picks tokens for one request.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    /// Where the output starts in the sequence.
    output_start: usize,
    /// The tokens that end the output (masked before `min_tokens`).
    stop_ids: Vec<u32>,
}

impl Sampler {
    /// A sampler following `params` for a sequence whose output starts at position 0 and has
    /// no stop tokens.
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler::for_prompt(params, 0, Vec::new())
    }

    /// A sampler for a request of `prompt_len` prompt tokens (the last
    /// [`SamplingParams::generated`] of them its own earlier output) that `stop_ids` end.
    pub fn for_prompt(params: SamplingParams, prompt_len: usize, stop_ids: Vec<u32>) -> Sampler {
        Sampler {
            output_start: prompt_len.saturating_sub(params.generated),
            params,
            stop_ids,
        }
    }

    /// `logits` after the bias, the `min_tokens` mask and the penalties, for the next token
    /// of `tokens` (see the module doc); `None` where nothing changes.
    pub fn adjusted(&self, logits: &[f32], tokens: &[u32]) -> Option<Vec<f32>> {
        let p = &self.params;
        if !p.adjusts() {
            return None;
        }
        let mut l = logits.to_vec();
        for &(t, b) in &p.logit_bias {
            if let Some(v) = l.get_mut(t as usize) {
                *v += b;
            }
        }
        let output = &tokens[self.output_start.min(tokens.len())..];
        if output.len() < p.min_tokens {
            for &t in &self.stop_ids {
                if let Some(v) = l.get_mut(t as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen: Vec<u32> = tokens.to_vec();
            seen.sort_unstable();
            seen.dedup();
            let r = p.repetition_penalty;
            for t in seen {
                if let Some(v) = l.get_mut(t as usize) {
                    *v = if *v > 0.0 { *v / r } else { *v * r };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: Vec<u32> = output.to_vec();
            counts.sort_unstable();
            for run in counts.chunk_by(|a, b| a == b) {
                if let Some(v) = l.get_mut(run[0] as usize) {
                    *v -= p.frequency_penalty * run.len() as f32 + p.presence_penalty;
                }
            }
        }
        Some(l)
    }

    /// Chooses the next token of `tokens` (the sequence so far, prompt included; the token's
    /// position is `tokens.len()`) from `logits`.
    pub fn sample(&self, logits: &[f32], tokens: &[u32]) -> u32 {
        self.sample_with_logprobs(logits, tokens).0
    }

    /// [`Sampler::sample`], with the token's [`TokenLogprobs`] when the request asks for them.
    pub fn sample_with_logprobs(
        &self,
        logits: &[f32],
        tokens: &[u32],
    ) -> (u32, Option<TokenLogprobs>) {
        let adjusted = self.adjusted(logits, tokens);
        let l = adjusted.as_deref().unwrap_or(logits);
        let tok = self.pick(l, tokens.len());
        let lp = self.params.logprobs.map(|k| TokenLogprobs::of(l, tok, k));
        (tok, lp)
    }

    /// Greedy, or the seeded draw at `pos` from the temperature, top-k, top-p and min-p
    /// distribution of `logits`.
    fn pick(&self, logits: &[f32], pos: usize) -> u32 {
        let p = &self.params;
        if p.temperature == 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        // Candidates by descending logit (ties: lower id first), cut to top-k.
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if p.top_k > 0 && p.top_k < idx.len() {
            idx.select_nth_unstable_by(p.top_k - 1, by_logit);
            idx.truncate(p.top_k);
        }
        idx.sort_unstable_by(by_logit);
        let max = logits[idx[0] as usize] as f64;
        let t = p.temperature as f64;
        let mut probs: Vec<f64> = idx
            .iter()
            .map(|&i| ((logits[i as usize] as f64 - max) / t).exp())
            .collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|v| *v /= z);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let keep = probs.iter().position(|v| {
                cum += v;
                cum >= p.top_p as f64
            });
            let keep = keep.map_or(probs.len(), |k| k + 1);
            probs.truncate(keep);
            let z: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|v| *v /= z);
        }
        if p.min_p > 0.0 {
            // Sorted by descending probability: keep the head at least min_p x the first.
            let floor = p.min_p as f64 * probs[0];
            let keep = probs.iter().take_while(|&&v| v >= floor).count().max(1);
            probs.truncate(keep);
            let z: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|v| *v /= z);
        }
        let mut u = uniform(p.seed, pos);
        for (i, v) in probs.iter().enumerate() {
            if u < *v {
                return idx[i];
            }
            u -= v;
        }
        idx[probs.len() - 1]
    }

    /// The parameters this sampler follows.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_is_the_first_strictly_greater_value_of_a_scan() {
        let scan = |l: &[f32]| {
            let mut best = 0;
            for (i, &v) in l.iter().enumerate() {
                if v > l[best] {
                    best = i;
                }
            }
            best as u32
        };
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for case in 0..400 {
            let n = 1 + case % 70;
            let mut l: Vec<f32> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Few distinct values, so ties are common.
                    (x % 5) as f32 - 2.0
                })
                .collect();
            match case % 5 {
                1 => l[(case * 7) % n] = f32::NAN,
                2 => l[0] = f32::NAN,
                3 => l.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                4 => l[(case * 3) % n] = -0.0,
                _ => {}
            }
            assert_eq!(argmax(&l), scan(&l), "{l:?}");
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[0.0, -0.0, 0.0]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
    }

    /// A direct reading of the module doc's definition, value by value: each vocabulary
    /// entry's counts found by scanning the sequence.
    fn reference(
        p: &SamplingParams,
        logits: &[f32],
        tokens: &[u32],
        out0: usize,
        stops: &[u32],
    ) -> Vec<f32> {
        let output = &tokens[out0..];
        (0..logits.len() as u32)
            .map(|t| {
                let mut v = logits[t as usize];
                for &(bt, b) in &p.logit_bias {
                    if bt == t {
                        v += b;
                    }
                }
                if output.len() < p.min_tokens && stops.contains(&t) {
                    v = f32::NEG_INFINITY;
                }
                if tokens.contains(&t) {
                    v = if v > 0.0 {
                        v / p.repetition_penalty
                    } else {
                        v * p.repetition_penalty
                    };
                }
                let count = output.iter().filter(|&&o| o == t).count();
                if count > 0 {
                    v -= p.frequency_penalty * count as f32 + p.presence_penalty;
                }
                v
            })
            .collect()
    }

    #[test]
    fn penalties_and_bias_are_the_direct_computation() {
        let mut s = 0x1234_5678u64;
        let mut next = || {
            s = mix(s);
            s
        };
        for case in 0..50 {
            let vocab = 40;
            let logits: Vec<f32> = (0..vocab)
                .map(|_| (next() % 2000) as f32 / 100.0 - 10.0)
                .collect();
            let len = 1 + (next() % 30) as usize;
            let tokens: Vec<u32> = (0..len).map(|_| (next() % vocab as u64) as u32).collect();
            let p = SamplingParams {
                presence_penalty: (next() % 400) as f32 / 100.0 - 2.0,
                frequency_penalty: (next() % 400) as f32 / 100.0 - 2.0,
                repetition_penalty: 0.5 + (next() % 150) as f32 / 100.0,
                logit_bias: vec![((next() % vocab as u64) as u32, 5.5), (39, -100.0)],
                min_tokens: (next() % 10) as usize,
                generated: (next() % 5) as usize,
                ..Default::default()
            };
            let prompt_len = (next() % len as u64) as usize;
            let stops = vec![3, 7];
            let sampler = Sampler::for_prompt(p.clone(), prompt_len, stops.clone());
            let out0 = prompt_len.saturating_sub(p.generated);
            let want = reference(&p, &logits, &tokens, out0, &stops);
            let got = sampler
                .adjusted(&logits, &tokens)
                .expect("something to adjust");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "case {case}");
            let greedy = Sampler::for_prompt(
                SamplingParams {
                    temperature: 0.0,
                    ..p
                },
                prompt_len,
                stops,
            );
            assert_eq!(
                greedy.sample(&logits, &tokens),
                argmax(&want),
                "case {case}"
            );
        }
        assert!(Sampler::new(SamplingParams::default())
            .adjusted(&[1.0], &[0])
            .is_none());
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_logits_sampled_from() {
        let logits = [0.1f32, 2.0, 1.9, -1.0, 2.0];
        let z: f64 = logits.iter().map(|&v| (v as f64).exp()).sum();
        let want = |t: usize| ((logits[t] as f64).exp() / z).ln() as f32;
        let lp = TokenLogprobs::of(&logits, 2, 3);
        assert!((lp.logprob - want(2)).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 4, 2], "most likely first, ties by id");
        assert!(lp
            .top
            .iter()
            .all(|&(t, l)| (l - want(t as usize)).abs() < 1e-6));
        assert!(TokenLogprobs::of(&logits, 0, 0).top.is_empty());
        // With a bias, the values are those of the biased logits the token was drawn from.
        let p = SamplingParams {
            logit_bias: vec![(3, 10.0)],
            logprobs: Some(1),
            ..SamplingParams::greedy(1)
        };
        let (tok, lp) = Sampler::new(p).sample_with_logprobs(&logits, &[]);
        let biased = [0.1f32, 2.0, 1.9, 9.0, 2.0];
        assert_eq!((tok, lp), (3, Some(TokenLogprobs::of(&biased, 3, 1))));
    }

    #[test]
    fn logit_bias_forces_a_token_min_tokens_holds_off_the_stop_and_min_p_cuts() {
        let logits = [0.1f32, 2.0, 1.9, -1.0, 0.5];
        let forced = SamplingParams {
            temperature: 1.0,
            seed: 5,
            logit_bias: vec![(3, 100.0)],
            ..Default::default()
        };
        let s = Sampler::new(forced);
        assert!((0..100).all(|i| s.sample(&logits, &vec![0; i]) == 3));
        // Token 1 (the likeliest) is a stop token: masked for the first 2 output tokens.
        let p = SamplingParams {
            min_tokens: 2,
            ..SamplingParams::greedy(4)
        };
        let s = Sampler::for_prompt(p, 3, vec![1]);
        assert_eq!(s.sample(&logits, &[9, 9, 9]), 2);
        assert_eq!(s.sample(&logits, &[9, 9, 9, 2]), 2);
        assert_eq!(s.sample(&logits, &[9, 9, 9, 2, 2]), 1);
        // min_p 0.5: only tokens 1 and 2 are at least half as likely as token 1.
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: 1,
            ..Default::default()
        };
        let s = Sampler::new(p);
        let drawn: Vec<u32> = (0..300).map(|i| s.sample(&logits, &vec![0; i])).collect();
        assert!(
            drawn.iter().all(|t| matches!(t, 1 | 2)) && drawn.contains(&2),
            "{drawn:?}"
        );
    }

    #[test]
    fn greedy_and_seeded_sampling() {
        let logits = [0.1f32, 2.0, 1.9, -1.0];
        assert_eq!(
            Sampler::new(SamplingParams::greedy(1)).sample(&logits, &[]),
            1
        );
        let p = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let s = Sampler::new(p.clone());
            (0..50).map(|i| s.sample(&logits, &vec![0; i])).collect()
        };
        let b: Vec<u32> = {
            let s = Sampler::new(p.clone());
            (0..50).map(|i| s.sample(&logits, &vec![0; i])).collect()
        };
        assert_eq!(a, b);
        // Resuming at position 20 draws what position 20 drew.
        let s = Sampler::new(p.clone());
        let resumed: Vec<u32> = (20..50).map(|i| s.sample(&logits, &vec![0; i])).collect();
        assert_eq!(resumed, a[20..]);
        let other = Sampler::new(SamplingParams {
            seed: 43,
            ..p.clone()
        });
        let c: Vec<u32> = (0..50)
            .map(|i| other.sample(&logits, &vec![0; i]))
            .collect();
        assert_ne!(a, c, "another seed, other draws");
        assert!(
            a.contains(&1) && a.contains(&2),
            "both likely tokens appear: {a:?}"
        );
        let k2 = SamplingParams {
            top_k: 2,
            ..p.clone()
        };
        let s = Sampler::new(k2);
        assert!((0..200).all(|i| matches!(s.sample(&logits, &vec![0; i]), 1 | 2)));
        let tp = SamplingParams { top_p: 0.4, ..p };
        let s = Sampler::new(tp);
        assert!((0..200).all(|i| s.sample(&logits, &vec![0; i]) == 1));
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            max_tokens: Some(0),
            ..Default::default()
        }
        .validate()
        .is_err());
        for bad in [
            SamplingParams {
                presence_penalty: 2.5,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: -3.0,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(1, 101.0)],
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                min_tokens: 5,
                ..SamplingParams::greedy(4)
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
