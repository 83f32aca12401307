//! The engine's types as a worker puts them on the wire and reads them off it — the one place
//! they are converted on the worker side (the router has the other directions in
//! `router::wire`): sampling parameters in, tokens with their log-probabilities and finish
//! reason out, the engine's load in heartbeats.

use engine::sampler::{Constraint, FinishReason, SamplingParams, TokenLogprobs};
use proto::grpc;

/// A request's sampling parameters as the router sent them (0 means unset on the wire: no
/// `max_tokens` limit, `top_p` and `repetition_penalty` 1).
pub fn sampling_params(p: grpc::SamplingParams) -> SamplingParams {
    let mut logit_bias: Vec<(u32, f32)> = p.logit_bias.into_iter().collect();
    logit_bias.sort_unstable_by_key(|&(t, _)| t);
    SamplingParams {
        max_tokens: (p.max_tokens > 0).then_some(p.max_tokens as usize),
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: if p.top_p > 0.0 { p.top_p } else { 1.0 },
        seed: p.seed,
        stop_token_ids: p.stop_token_ids,
        ignore_eos: p.ignore_eos,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: match p.repetition_penalty {
            r if r > 0.0 => r,
            _ => 1.0,
        },
        logit_bias,
        min_p: p.min_p,
        min_tokens: p.min_tokens as usize,
        generated: p.generated as usize,
        logprobs: p.logprobs.then_some(p.top_logprobs as usize),
        prompt_logprobs: p.prompt_logprobs.then_some(p.prompt_top_logprobs as usize),
        // An unreadable constraint is kept as such: the engine refuses it, never generates
        // unconstrained.
        constraint: (!p.constraint.is_empty()).then(|| {
            serde_json::from_str(&p.constraint)
                .unwrap_or_else(|e| Constraint::Unreadable(e.to_string()))
        }),
        cache_salt: (!p.cache_salt.is_empty()).then(|| p.cache_salt.clone()),
        speculation: p.speculation.map(|k| k as usize),
    }
}

/// A token's log-probabilities on the wire.
pub fn logprobs(l: &TokenLogprobs) -> grpc::TokenLogprobs {
    grpc::TokenLogprobs {
        logprob: l.logprob,
        top_ids: l.top.iter().map(|t| t.0).collect(),
        top_logprobs: l.top.iter().map(|t| t.1).collect(),
    }
}

/// A token's finish on the wire (`None`: not the last token).
pub fn finish(finish: Option<FinishReason>) -> grpc::Finish {
    match finish {
        None => grpc::Finish::None,
        Some(FinishReason::Stop) => grpc::Finish::Stop,
        Some(FinishReason::Length) => grpc::Finish::Length,
    }
}

/// The engine's load as a heartbeat carries it (a prefill worker adds its measured rate).
pub fn load(l: &engine::Load) -> grpc::WorkerLoad {
    grpc::WorkerLoad {
        running: l.running,
        waiting: l.waiting,
        pending_transfers: l.pending_transfers,
        paused: l.paused,
        kv_blocks_free: l.kv_blocks_free,
        kv_blocks_total: l.kv_blocks_total,
        kv_blocks_reserved: l.ledger.reserved as u32,
        kv_blocks_in_flight: l.ledger.in_flight as u32,
        kv_blocks_committed: l.ledger.committed as u32,
        kv_requests_freed: l.ledger.freed,
        kv_blocks_cached: l.kv_blocks_cached,
        prompt_tokens: l.prompt_tokens,
        prefix_hit_tokens: l.prefix_hit_tokens,
        kv_blocks_evicted: l.kv_blocks_evicted,
        kv_refusals: l.kv_refusals,
        engine_steps: l.engine_steps,
        kv_host_blocks: l.tiers.host.blocks,
        kv_host_hits: l.tiers.host.hits,
        kv_host_bytes_loaded: l.tiers.host.bytes_loaded,
        kv_host_bytes_stored: l.tiers.host.bytes_stored,
        kv_host_load_seconds: l.tiers.host.load_seconds,
        kv_disk_blocks: l.tiers.disk.blocks,
        kv_disk_hits: l.tiers.disk.hits,
        kv_disk_bytes_loaded: l.tiers.disk.bytes_loaded,
        kv_disk_bytes_stored: l.tiers.disk.bytes_stored,
        kv_disk_load_seconds: l.tiers.disk.load_seconds,
        kv_disk_writes_skipped: l.tiers.disk.writes_skipped,
        kv_tier_corrupt: l.tiers.host.corrupt + l.tiers.disk.corrupt,
        kv_peer_served_host: l.tiers.host.exported,
        preempted_swapped: l.preemptions.swapped,
        preempted_recomputed: l.preemptions.recomputed,
        resumed_tokens: l.preemptions.resumed_tokens,
        resumed_hit_tokens: l.preemptions.resumed_hit_tokens,
        spec_proposed: l.speculation.proposed,
        spec_accepted: l.speculation.accepted,
        spec_verifies: l.speculation.verifies,
        spec_declined: l.speculation.declined,
        ..Default::default()
    }
}
