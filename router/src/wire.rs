//! The engine's types as the router puts them on the wire and reads them off it — the one
//! place they are converted on the router's side (the workers have the other directions in
//! `worker::wire`): sampling parameters out; tokens' finish reasons and log-probabilities in.

use engine::sampler::{FinishReason, SamplingParams, TokenLogprobs};
use proto::grpc;

/// A request's sampling parameters on the wire (0 means unset there: no `max_tokens` limit,
/// `top_p` 1).
pub fn sampling_params(p: &SamplingParams) -> grpc::SamplingParams {
    grpc::SamplingParams {
        max_tokens: p.max_tokens.map_or(0, |m| m as u32),
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k as u32,
        seed: p.seed,
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: p.repetition_penalty,
        logit_bias: p.logit_bias.iter().copied().collect(),
        min_p: p.min_p,
        min_tokens: p.min_tokens as u32,
        generated: p.generated as u32,
        logprobs: p.logprobs.is_some(),
        top_logprobs: p.logprobs.unwrap_or(0) as u32,
        prompt_logprobs: p.prompt_logprobs.is_some(),
        prompt_top_logprobs: p.prompt_logprobs.unwrap_or(0) as u32,
        constraint: p.constraint.as_ref().map_or_else(String::new, |c| {
            serde_json::to_string(c).expect("serialisable")
        }),
        cache_salt: p.cache_salt.clone().unwrap_or_default(),
        speculation: p.speculation.map(|k| k as u32),
    }
}

/// A token's finish as the decode worker sent it (`None` while the request goes on, or for a
/// value this build does not know).
pub fn finish(finish: i32) -> Option<FinishReason> {
    match grpc::Finish::try_from(finish).ok()? {
        grpc::Finish::None => None,
        grpc::Finish::Stop => Some(FinishReason::Stop),
        grpc::Finish::Length => Some(FinishReason::Length),
    }
}

/// A token's log-probabilities as the decode worker sent them.
pub fn logprobs(l: grpc::TokenLogprobs) -> TokenLogprobs {
    TokenLogprobs {
        logprob: l.logprob,
        top: l.top_ids.into_iter().zip(l.top_logprobs).collect(),
    }
}
