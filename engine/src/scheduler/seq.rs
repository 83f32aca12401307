//! A sequence the engine serves, and how a request becomes one (checked against the model
//! and the cache; its sampler, grammar and proposer made).

use types::RequestId;

use super::Engine;
use crate::error::{EngineError, Result};
use crate::grammar::Guide;
use crate::kv_cache::BlockTable;
use crate::sampler::{Constraint, Sampler, SamplingParams, TokenLogprobs};
use crate::speculate::Drafter;

pub(crate) struct Seq {
    pub(crate) id: RequestId,
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Tokens whose KV is in the cache.
    pub(crate) computed: usize,
    pub(crate) max_tokens: usize,
    pub(crate) table: BlockTable,
    pub(crate) sampler: Sampler,
    pub(crate) stop_ids: Vec<u32>,
    /// Compute the prompt's KV and stop: no logits, no tokens (a prefill worker's requests).
    pub(crate) prefill_only: bool,
    /// Blocks registered in the prefix cache so far, and the last one's hash.
    pub(crate) chain: (usize, u64),
    /// Where its chain of block names starts ([`crate::block_hash::root`] of its cache salt).
    pub(crate) root: u64,
    /// Prefill-only: the tokens before this one are not exported (the receiver holds them).
    pub(crate) send_from: usize,
    /// Prompt log-probabilities asked for (how many likeliest tokens each), and those computed.
    pub(crate) prompt_lp: Option<(usize, Vec<TokenLogprobs>)>,
    /// The grammar the output must match, when the request has one.
    pub(crate) guide: Option<Guide>,
    /// Preempted once at least: its admission looks up all its tokens, and counts as a resume.
    pub(crate) resumed: bool,
    /// Its place in the order requests came to this engine: the latest is preempted first.
    pub(crate) arrival: u64,
    /// Its prompt-lookup proposer, when it speculates.
    pub(crate) drafter: Option<Drafter>,
}

impl Seq {
    /// Whether its next chunk is its newest token: its prompt and every token before the
    /// newest are computed.
    pub(crate) fn decoding(&self) -> bool {
        self.computed >= self.prompt_len && self.computed + 1 == self.tokens.len()
    }
}

impl Engine {
    pub(crate) fn new_seq(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        prefill_only: bool,
    ) -> Result<Seq> {
        params.validate()?;
        let ctx = self.model.config.context_len;
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        if prompt.len() >= ctx {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {} tokens; the model's context is {ctx} tokens",
                prompt.len()
            )));
        }
        if let Some(&bad) = prompt
            .iter()
            .find(|&&t| t as usize >= self.model.config.vocab_size)
        {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        let max_tokens = params.max_tokens.unwrap_or(ctx - prompt.len());
        if prompt.len() + max_tokens > ctx {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {ctx} tokens",
                prompt.len()
            )));
        }
        // More than the whole cache: it would never fit, so no waiting for room.
        let need = self.kv.pages_for(prompt.len() + max_tokens);
        if need > self.kv.total_blocks() {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({} tokens) plus max_tokens ({max_tokens}) needs {need} KV pages; a worker's cache has {} in all",
                prompt.len(),
                self.kv.total_blocks()
            )));
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&(bad, _)) = params.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "logit_bias names token {bad}, outside the vocabulary of {vocab}"
            )));
        }
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend_from_slice(&self.eos_ids);
        }
        let prompt_len = prompt.len();
        let prompt_lp = params.prompt_logprobs.map(|k| (k, Vec::new()));
        let guide = self.guide(&params, &prompt)?;
        let root = crate::block_hash::root(params.cache_salt.as_deref());
        // A grammar's state cannot step back past a rejected draft: guided output does not
        // speculate; nor does a forward whose rows depend on the batch (it could change a
        // token).
        let drafts = params.speculation.unwrap_or(self.config.speculation);
        let drafter = (!prefill_only && guide.is_none() && self.model.batch_invariant())
            .then(|| Drafter::new(drafts))
            .flatten();
        self.arrivals += 1;
        Ok(Seq {
            id,
            prompt_len,
            tokens: prompt,
            computed: 0,
            max_tokens,
            table: BlockTable::default(),
            sampler: Sampler::for_prompt(params, prompt_len, stop_ids.clone()),
            stop_ids,
            prefill_only,
            chain: (0, root),
            root,
            send_from: 0,
            prompt_lp,
            guide,
            resumed: false,
            arrival: self.arrivals,
            drafter,
        })
    }

    /// The guide of a request with a constraint, past the output it already has (a migration's).
    fn guide(&self, params: &SamplingParams, prompt: &[u32]) -> Result<Option<Guide>> {
        let mut g = match &params.constraint {
            None => return Ok(None),
            Some(Constraint::Compiled(c)) => c.take()?,
            Some(c) => {
                let grammars = self.grammars.as_ref().ok_or_else(|| {
                    let msg = "this worker does not serve structured output";
                    EngineError::InvalidRequest(msg.into())
                })?;
                grammars.guide(c)?
            }
        };
        g.replay(&prompt[prompt.len().saturating_sub(params.generated)..])?;
        Ok(Some(g))
    }
}
