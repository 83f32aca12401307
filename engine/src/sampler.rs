//! Token sampling: greedy, temperature, top-k, top-p. The random draw for a token is a function
//! of the request's seed and the token's position in the sequence alone, so a seed reproduces
//! the same tokens whatever else is being served — and a request resumed elsewhere from its
//! prompt plus the tokens it already produced (a migration) continues exactly as it would
//! have.

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

    /// Reads the wire form (`None` while the request goes on, or for a value this build does
    /// not know).
    pub fn from_wire(finish: i32) -> Option<FinishReason> {
        match proto::grpc::Finish::try_from(finish).ok()? {
            proto::grpc::Finish::None => None,
            proto::grpc::Finish::Stop => Some(FinishReason::Stop),
            proto::grpc::Finish::Length => Some(FinishReason::Length),
        }
    }

    /// The wire form of a token's finish (`None`: not the last token).
    pub fn to_wire(finish: Option<FinishReason>) -> proto::grpc::Finish {
        match finish {
            None => proto::grpc::Finish::None,
            Some(FinishReason::Stop) => proto::grpc::Finish::Stop,
            Some(FinishReason::Length) => proto::grpc::Finish::Length,
        }
    }
}

/// The wire form (0 means unset there: no `max_tokens` limit, `top_p` 1).
impl From<&SamplingParams> for proto::grpc::SamplingParams {
    fn from(p: &SamplingParams) -> Self {
        proto::grpc::SamplingParams {
            max_tokens: p.max_tokens.map_or(0, |m| m as u32),
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k as u32,
            seed: p.seed,
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
        }
    }
}

impl From<proto::grpc::SamplingParams> for SamplingParams {
    fn from(p: proto::grpc::SamplingParams) -> Self {
        SamplingParams {
            max_tokens: (p.max_tokens > 0).then_some(p.max_tokens as usize),
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: if p.top_p > 0.0 { p.top_p } else { 1.0 },
            seed: p.seed,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
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
        Ok(())
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
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks tokens for one request.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
}

impl Sampler {
    /// A sampler following `params`.
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler { params }
    }

    /// Chooses the token at position `pos` of the sequence (prompt included) from `logits`.
    pub fn sample(&self, logits: &[f32], pos: usize) -> u32 {
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
    fn greedy_and_seeded_sampling() {
        let logits = [0.1f32, 2.0, 1.9, -1.0];
        assert_eq!(
            Sampler::new(SamplingParams::greedy(1)).sample(&logits, 0),
            1
        );
        let p = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let s = Sampler::new(p.clone());
            (0..50).map(|i| s.sample(&logits, i)).collect()
        };
        let b: Vec<u32> = {
            let s = Sampler::new(p.clone());
            (0..50).map(|i| s.sample(&logits, i)).collect()
        };
        assert_eq!(a, b);
        // Resuming at position 20 draws what position 20 drew.
        let s = Sampler::new(p.clone());
        let resumed: Vec<u32> = (20..50).map(|i| s.sample(&logits, i)).collect();
        assert_eq!(resumed, a[20..]);
        let other = Sampler::new(SamplingParams {
            seed: 43,
            ..p.clone()
        });
        let c: Vec<u32> = (0..50).map(|i| other.sample(&logits, i)).collect();
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
        assert!((0..200).all(|i| matches!(s.sample(&logits, i), 1 | 2)));
        let tp = SamplingParams { top_p: 0.4, ..p };
        let s = Sampler::new(tp);
        assert!((0..200).all(|i| s.sample(&logits, i) == 1));
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
    }
}
