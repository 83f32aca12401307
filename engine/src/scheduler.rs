//! Continuous batching over the paged KV cache.
//!
//! Each [`Engine::step`] runs one forward pass: every running sequence that is decoding
//! contributes its newest token, and the remaining token budget goes to prompt chunks of
//! sequences still prefilling (first come, first served). Sequences join between steps and leave
//! (freeing their blocks) as soon as they finish. A request is admitted only when the cache can
//! hold its prompt plus `max_tokens`, reserved up front, so a running sequence never runs out of
//! blocks and admissions simply wait.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::ledger::{Ledger, LedgerCounts};

use crate::error::{EngineError, Result};
use crate::grammar::{Grammars, Guide};
use crate::kv_cache::{BlockTable, KvCache};
use crate::model::{Logits, Model, SeqChunk};
use crate::sampler::{FinishReason, Sampler, SamplingParams, TokenLogprobs};

/// Sizes of the scheduler and its cache.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Most tokens in one forward step (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// How long blocks reserved for a prefill worker's KV wait for it (`None`: no limit);
    /// [`Engine::expired`] names the reservations past it.
    pub kv_lease: Option<Duration>,
    /// Keep computed full blocks as a prefix cache shared by later sequences (see
    /// [`crate::prefix`]).
    pub prefix_cache: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 1024,
            max_batch_tokens: 512,
            max_running: 64,
            kv_lease: None,
            prefix_cache: true,
        }
    }
}

/// Most prompt tokens a step computes of a request that wants its prompt's log-probabilities:
/// each row's logits are held until they are read (64 × a 262k vocabulary is 67 MB).
const PROMPT_LOGPROBS_CHUNK: usize = 64;

/// A token produced by a step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The request it belongs to.
    pub id: u64,
    /// The token.
    pub token: u32,
    /// Set on the request's last token.
    pub finish: Option<FinishReason>,
    /// The token's log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
    /// With a request's first token, when it asked for them: each prompt token's after the
    /// first, in order.
    pub prompt_logprobs: Option<Vec<TokenLogprobs>>,
}

struct Seq {
    id: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose KV is in the cache.
    computed: usize,
    max_tokens: usize,
    table: BlockTable,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    /// Compute the prompt's KV and stop: no logits, no tokens (a prefill worker's requests).
    prefill_only: bool,
    /// Blocks registered in the prefix cache so far, and the last one's hash.
    chain: (usize, u64),
    /// Prefill-only: the tokens before this one are not exported (the receiver holds them).
    send_from: usize,
    /// Prompt log-probabilities asked for (how many likeliest tokens each), and those computed.
    prompt_lp: Option<(usize, Vec<TokenLogprobs>)>,
    /// The grammar the output must match, when the request has one.
    guide: Option<Guide>,
}

/// A model, its KV cache and the sequences being served.
pub struct Engine {
    model: Arc<Model>,
    kv: KvCache,
    config: EngineConfig,
    eos_ids: Vec<u32>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Blocks reserved, waiting for their prompt's KV to arrive from a prefill worker.
    awaiting: Vec<Seq>,
    /// Prefill-only requests whose KV is complete, until exported.
    prefilled: Vec<Seq>,
    /// Tokens in the last step: (prompt tokens, decode tokens).
    last_step: (usize, usize),
    /// Who holds blocks for KV from a prefill worker: reserved, in flight, committed.
    ledger: Ledger,
    /// The prefix cache's hash seed (the model's identity), when the cache is on.
    prefix_seed: Option<u64>,
    /// Prompt tokens admitted, and those found in the prefix cache (not computed), since start.
    prompt_tokens: u64,
    prefix_hit_tokens: u64,
    /// Reservations refused for lack of room (free or evictable blocks), since start.
    refusals: u64,
    /// Forward steps run, since start.
    steps: u64,
    /// The vocabulary's grammar compiler (structured output), when the worker set one.
    grammars: Option<Arc<Grammars>>,
}

/// Why a request leaves the engine before it finished (logged; the blocks are freed the same
/// way whatever the reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The caller cancelled it or went away.
    Cancelled,
    /// Its KV transfer broke.
    TransferFailed,
    /// Its KV did not arrive within the lease.
    LeaseExpired,
    /// A step failed.
    StepFailed,
}

impl Engine {
    /// An engine over `model`; `eos_ids` end every request unless it sets `ignore_eos`.
    pub fn new(model: Arc<Model>, config: EngineConfig, eos_ids: Vec<u32>) -> Result<Engine> {
        if config.max_batch_tokens == 0 || config.max_running == 0 {
            return Err(EngineError::InvalidRequest(
                "max_batch_tokens and max_running must be positive".into(),
            ));
        }
        let kv = model.new_windowed_kv_cache(
            config.block_size,
            config.num_blocks,
            config.max_batch_tokens,
        )?;
        // Seeded by the model's KV identity: blocks of two models or layouts never match.
        let seed = crate::block_hash::identity_seed(&model.config, config.block_size);
        let prefix_seed = config.prefix_cache.then_some(seed);
        Ok(Engine {
            model,
            kv,
            config,
            eos_ids,
            waiting: VecDeque::new(),
            running: Vec::new(),
            awaiting: Vec::new(),
            prefilled: Vec::new(),
            last_step: (0, 0),
            ledger: Ledger::new(),
            prefix_seed,
            prompt_tokens: 0,
            prefix_hit_tokens: 0,
            refusals: 0,
            steps: 0,
            grammars: None,
        })
    }

    /// Serves requests with a [`crate::sampler::Constraint`] (structured output) through
    /// `grammars`; without it such requests are refused.
    pub fn set_grammars(&mut self, grammars: Arc<Grammars>) {
        self.grammars = Some(grammars);
    }

    /// The model being served.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Free KV blocks.
    pub fn free_blocks(&self) -> usize {
        self.kv.free_blocks()
    }

    /// Total KV blocks.
    pub fn total_blocks(&self) -> usize {
        self.kv.total_blocks()
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a request. Refused at once if it could never fit: empty prompt, prompt plus
    /// `max_tokens` beyond the context, or more blocks than the whole cache holds.
    pub fn add(&mut self, id: u64, prompt: Vec<u32>, params: SamplingParams) -> Result<()> {
        let seq = self.new_seq(id, prompt, params, false)?;
        self.waiting.push_back(seq);
        Ok(())
    }

    /// Queues a prefill-only request: its KV is computed (chunked, batched with others) and then
    /// held until [`Engine::export_kv`] (or streamed); no token is sampled. The KV of the
    /// tokens before `send_from` is not exported: the receiver holds it (a delta transfer).
    pub fn add_prefill_only(&mut self, id: u64, tokens: Vec<u32>, send_from: usize) -> Result<()> {
        if send_from >= tokens.len() {
            return Err(EngineError::InvalidRequest(format!(
                "nothing to send: the receiver holds {send_from} of {} tokens",
                tokens.len()
            )));
        }
        let params = SamplingParams {
            max_tokens: Some(1),
            ..Default::default()
        };
        let mut seq = self.new_seq(id, tokens, params, true)?;
        seq.max_tokens = 0;
        seq.send_from = send_from;
        self.waiting.push_back(seq);
        Ok(())
    }

    /// Reserves blocks for a request whose prompt KV (all but the last prompt token) will come
    /// from a prefill worker; returns how many of those tokens this cache already holds (whole
    /// cached blocks, shared, at most all but one token): the prefill sends only the rest.
    /// Fails at once with `OutOfBlocks` when the cache has no room now.
    pub fn reserve_remote(
        &mut self,
        id: u64,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<usize> {
        if prompt.len() < 2 {
            return Err(EngineError::InvalidRequest(
                "a remote prefill needs a prompt of at least 2 tokens".into(),
            ));
        }
        if params.prompt_logprobs.is_some() {
            return Err(EngineError::InvalidRequest(
                "prompt log-probabilities need the whole prompt computed here, not a remote prefill"
                    .into(),
            ));
        }
        let mut seq = self.new_seq(id, prompt, params, false)?;
        if let Some(seed) = self.prefix_seed {
            let known = &seq.tokens[..seq.prompt_len - 2];
            let (shared, last) = self.kv.share_prefix(seed, &mut seq.table, known);
            (seq.computed, seq.chain) = (shared, (seq.table.blocks().len(), last));
        }
        if let Err(e) = self
            .kv
            .reserve(&mut seq.table, seq.prompt_len + seq.max_tokens)
        {
            self.kv.release(seq.table);
            self.refusals += 1;
            return Err(e);
        }
        let lease = self.config.kv_lease.map(|d| Instant::now() + d);
        self.ledger.reserve(id, seq.table.reserved() as u32, lease);
        let cached = seq.computed;
        self.awaiting.push(seq);
        Ok(cached)
    }

    /// A reserved request whose remaining prompt is computed here instead of arriving from a
    /// prefill worker (conditional disaggregation: a short uncached suffix).
    pub fn prefill_here(&mut self, id: u64) -> Result<()> {
        let i = self
            .awaiting
            .iter()
            .position(|s| s.id == id)
            .ok_or_else(|| EngineError::InvalidRequest(format!("no request {id} is reserved")))?;
        let seq = self.awaiting.remove(i);
        self.ledger.commit(id);
        self.prompt_tokens += seq.prompt_len as u64;
        self.prefix_hit_tokens += seq.computed as u64;
        self.waiting.push_front(seq);
        Ok(())
    }

    /// The position in `awaiting` of reserved request `id` and the tokens its remote KV covers
    /// (after the ones this cache held), once `layers` (what arrived: one entry per layer)
    /// matches the model.
    fn awaiting_kv(&self, id: u64, layers: usize, what: &str) -> Result<(usize, Range<usize>)> {
        let i = self
            .awaiting
            .iter()
            .position(|s| s.id == id)
            .ok_or_else(|| {
                EngineError::InvalidRequest(format!("no request {id} is waiting for KV"))
            })?;
        if layers != self.model.config.n_layers {
            return Err(EngineError::InvalidRequest(format!(
                "{what} for {layers} layers; the model has {}",
                self.model.config.n_layers
            )));
        }
        let s = &self.awaiting[i];
        Ok((i, s.computed..s.prompt_len - 1))
    }

    /// Queues awaiting request `i`, whose first `n` tokens are in the cache, to generate from
    /// its last prompt token.
    fn admit(&mut self, i: usize, n: usize) -> Result<()> {
        // A GPU model's device pool follows the host cache the KV was written into.
        self.model
            .kv_written(&self.kv, &self.awaiting[i].table, n)?;
        let mut seq = self.awaiting.remove(i);
        seq.computed = n;
        if let Some(seed) = self.prefix_seed {
            self.kv
                .register(seed, &seq.table, &seq.tokens, n, &mut seq.chain);
        }
        self.ledger.commit(seq.id);
        self.waiting.push_front(seq);
        Ok(())
    }

    /// Writes the KV that arrived for a reserved request (one buffer per layer, see
    /// [`KvCache::read_range`]: the tokens after those this cache held) and queues it to
    /// generate from its last prompt token.
    pub fn admit_remote(&mut self, id: u64, layers: &[Vec<u8>]) -> Result<()> {
        let (i, range) = self.awaiting_kv(id, layers.len(), "KV")?;
        let table = &mut self.awaiting[i].table;
        self.kv.write_arrived(table, range.clone(), layers)?;
        self.admit(i, range.end)
    }

    /// Whether in-place (RDMA) transfers can address this cache, or why not.
    fn in_place(&self) -> std::result::Result<(), String> {
        match self.kv.one_table() {
            true => Ok(()),
            false => Err(format!(
                "in-place KV transfers address one block table of whole layers; this model's \
                 cache has {} layer groups (sliding-window layers keep their own blocks)",
                self.kv.groups()
            )),
        }
    }

    /// In-place (RDMA) transfers: the blocks a reserved request's remote KV of `n_tokens`
    /// tokens (after the whole blocks this cache held) is written into, in token order.
    pub fn grant(&self, id: u64, n_tokens: usize) -> Result<Vec<u32>> {
        let seq = self.awaiting.iter().find(|s| s.id == id).ok_or_else(|| {
            EngineError::InvalidRequest(format!("no request {id} is waiting for KV"))
        })?;
        self.in_place().map_err(EngineError::InvalidRequest)?;
        let from = seq.computed;
        if from + n_tokens + 1 != seq.prompt_len {
            return Err(EngineError::InvalidRequest(format!(
                "KV of {n_tokens} tokens offered for a prompt of {} with {from} held here",
                seq.prompt_len
            )));
        }
        let blocks = self.kv.blocks_for(from)..self.kv.blocks_for(from + n_tokens);
        Ok(seq.table.blocks()[blocks].to_vec())
    }

    /// In-place transfers: admits a reserved request whose KV was written straight into its
    /// blocks, once every layer's bytes match the CRC32 the sender computed.
    pub fn admit_in_place(&mut self, id: u64, crcs: &[u32]) -> Result<()> {
        let (i, range) = self.awaiting_kv(id, crcs.len(), "checksums")?;
        let mut buf = Vec::new();
        for (l, &want) in crcs.iter().enumerate() {
            buf.clear();
            let table = &self.awaiting[i].table;
            self.kv.read_range(table, l, range.clone(), &mut buf);
            let got = crc32fast::hash(&buf);
            if got != want {
                return Err(EngineError::InvalidRequest(format!(
                    "layer {l} of request {id} was corrupted in transfer \
                     (CRC32 {got:08x}, the sender's {want:08x})"
                )));
            }
        }
        self.admit(i, range.end)
    }

    /// The KV pool as raw memory for RDMA registration (see [`KvCache::raw_regions`]), with
    /// what keeps it allocated; or why in-place writes cannot address it.
    pub fn kv_regions(&mut self) -> std::result::Result<proto::KvRegions, String> {
        self.in_place()?;
        let layers = self
            .kv
            .raw_regions()
            .ok_or("the KV pool has no raw regions")?;
        Ok(proto::KvRegions {
            layers,
            block_bytes: self.kv.block_bytes(),
            owners: self.kv.owners(),
        })
    }

    /// Ids of prefill-only requests whose KV is complete and not yet exported.
    pub fn take_prefilled(&self) -> Vec<u64> {
        self.prefilled.iter().map(|s| s.id).collect()
    }

    /// Copies out a completed prefill-only request's KV (one buffer per layer) and frees its
    /// blocks.
    pub fn export_kv(&mut self, id: u64) -> Option<Vec<Vec<u8>>> {
        let i = self.prefilled.iter().position(|s| s.id == id)?;
        let seq = self.prefilled.remove(i);
        let layers = (0..self.model.config.n_layers)
            .map(|l| {
                let mut buf = Vec::new();
                let range = seq.send_from..seq.prompt_len;
                self.kv.read_range(&seq.table, l, range, &mut buf);
                buf
            })
            .collect();
        self.kv.release(seq.table);
        Some(layers)
    }

    /// The simulator's transfer: frees a completed prefill-only request's blocks without
    /// copying its KV out (the virtual mock's cache holds no values); returns the tokens it
    /// would have sent.
    pub fn discard_prefilled(&mut self, id: u64) -> Option<usize> {
        let i = self.prefilled.iter().position(|s| s.id == id)?;
        let seq = self.prefilled.remove(i);
        let sent = seq.prompt_len - seq.send_from;
        self.kv.release(seq.table);
        Some(sent)
    }

    /// The simulator's arrival: admits reserved request `id` as if its remote KV had been
    /// written (see [`Engine::discard_prefilled`]).
    pub fn admit_simulated(&mut self, id: u64) -> Result<()> {
        let (i, range) = self.awaiting_kv(id, self.model.config.n_layers, "simulated KV")?;
        self.admit(i, range.end)
    }

    /// Prefix-cache blocks registered (`true`) and forgotten (`false`) since the last call, by
    /// name ([`crate::block_hash`]).
    pub fn take_kv_events(&mut self) -> Vec<(bool, u64)> {
        self.kv.take_events()
    }

    /// The KV of reserved request `id` started to arrive (its lease still runs).
    pub fn kv_arriving(&mut self, id: u64) -> bool {
        self.ledger.in_flight(id)
    }

    /// The sender of reserved request `id`'s KV renewed it: its lease runs from now again.
    pub fn renew_lease(&mut self, id: u64) -> bool {
        match self.config.kv_lease {
            Some(d) => self.ledger.renew(id, Instant::now() + d),
            None => false,
        }
    }

    /// Reservations whose lease has passed by `now` without their KV (release them).
    pub fn expired(&self, now: Instant) -> Vec<u64> {
        self.ledger.expired(now)
    }

    /// The earliest lease still running.
    pub fn next_lease(&self) -> Option<Instant> {
        self.ledger.next_expiry()
    }

    /// The ledger's blocks per state.
    pub fn ledger(&self) -> LedgerCounts {
        self.ledger.counts()
    }

    /// The load figures a worker reports.
    pub fn load(&self) -> proto::grpc::WorkerLoad {
        let c = self.ledger.counts();
        proto::grpc::WorkerLoad {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            pending_transfers: self.awaiting.len() as u32,
            kv_blocks_free: self.free_blocks() as u32,
            kv_blocks_total: self.total_blocks() as u32,
            kv_blocks_reserved: c.reserved as u32,
            kv_blocks_in_flight: c.in_flight as u32,
            kv_blocks_committed: c.committed as u32,
            kv_requests_freed: c.freed,
            kv_blocks_cached: self.kv.block_counts().cached as u32,
            prompt_tokens: self.prompt_tokens,
            prefix_hit_tokens: self.prefix_hit_tokens,
            kv_blocks_evicted: self.kv.evicted_blocks(),
            kv_refusals: self.refusals,
            engine_steps: self.steps,
            ..Default::default()
        }
    }

    /// Tokens the last step ran: (prompt tokens, decoding sequences).
    pub fn last_step(&self) -> (usize, usize) {
        self.last_step
    }

    /// Blocks held by request `id` (0 if it holds none or is unknown).
    pub fn blocks_of(&self, id: u64) -> usize {
        self.awaiting
            .iter()
            .chain(&self.running)
            .chain(&self.waiting)
            .chain(&self.prefilled)
            .find(|s| s.id == id)
            .map_or(0, |s| s.table.held())
    }

    fn new_seq(
        &self,
        id: u64,
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
            chain: (0, crate::prefix::ROOT),
            send_from: 0,
            prompt_lp,
            guide,
        })
    }

    /// The guide of a request with a constraint, past the output it already has (a migration's).
    fn guide(&self, params: &SamplingParams, prompt: &[u32]) -> Result<Option<Guide>> {
        let Some(c) = &params.constraint else {
            return Ok(None);
        };
        let grammars = self.grammars.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest("this worker does not serve structured output".into())
        })?;
        let mut g = grammars.guide(c)?;
        g.replay(&prompt[prompt.len().saturating_sub(params.generated)..])?;
        Ok(Some(g))
    }

    /// Drops a request wherever it is, frees its blocks and its ledger entry — the one way a
    /// request leaves before it finishes. Returns whether it was found.
    pub fn release(&mut self, id: u64, why: Release) -> bool {
        let held = self.ledger.free(id).is_some();
        let found = self.remove(id);
        if found || held {
            tracing::debug!(request = id, ?why, "released");
        }
        found || held
    }

    fn remove(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i).expect("index found");
            self.kv.release(s.table);
            return true;
        }
        for list in [&mut self.running, &mut self.awaiting, &mut self.prefilled] {
            if let Some(i) = list.iter().position(|s| s.id == id) {
                let s = list.remove(i);
                self.kv.release(s.table);
                return true;
            }
        }
        false
    }

    /// Runs one forward step and returns the tokens it produced.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>> {
        self.step_inner(None)
    }

    /// [`Engine::step`], streaming the KV of prefill-only requests that complete in this step:
    /// `sink(id, layer, bytes)` gets each of their layers (the layout of
    /// [`KvCache::read_tokens`]) as soon as the layer is computed, and their blocks are freed
    /// at the end of the step (they are not held for [`Engine::export_kv`]).
    pub fn step_streaming(
        &mut self,
        sink: &mut (dyn FnMut(u64, usize, Vec<u8>) + Send),
    ) -> Result<Vec<TokenEvent>> {
        self.step_inner(Some(sink))
    }

    /// Moves the first waiting request to the running batch if its reservation fits: first
    /// the cached blocks of its prompt's longest cached prefix (all but the last prompt token,
    /// which must be computed), then fresh blocks for the rest of prompt plus `max_tokens`.
    fn admit_front(&mut self) -> bool {
        let Some(front) = self.waiting.front_mut() else {
            return false;
        };
        let fresh = front.table.blocks().is_empty() && front.computed == 0;
        // Prompt log-probabilities need every prompt position's logits: nothing is reused.
        let reuse = fresh && front.prompt_lp.is_none();
        if let (Some(seed), true) = (self.prefix_seed, reuse) {
            let prompt = &front.tokens[..front.prompt_len - 1];
            let (shared, last) = self.kv.share_prefix(seed, &mut front.table, prompt);
            front.computed = shared;
            front.chain = (front.table.blocks().len(), last);
        }
        let need = front.prompt_len + front.max_tokens;
        let computing = fresh && self.prefix_seed.is_some() && self.prefix_in_progress();
        let front = self.waiting.front_mut().expect("checked above");
        if computing || self.kv.reserve(&mut front.table, need).is_err() {
            if fresh {
                // Wait without holding shared blocks; the lookup runs again next time.
                self.kv.release(std::mem::take(&mut front.table));
                front.computed = 0;
                front.chain = (0, crate::prefix::ROOT);
            }
            return false;
        }
        if fresh {
            self.prompt_tokens += front.prompt_len as u64;
            self.prefix_hit_tokens += front.computed as u64;
        }
        self.running
            .push(self.waiting.pop_front().expect("front exists"));
        true
    }

    /// Whether a running sequence is computing the block that follows the first waiting
    /// request's cached prefix (the same tokens from the start, not registered yet): the
    /// request waits for it rather than compute the same blocks twice (a hot prefix under
    /// chunked prefill).
    fn prefix_in_progress(&self) -> bool {
        let Some(front) = self.waiting.front() else {
            return false;
        };
        let bs = self.kv.block_size();
        let k = front.table.blocks().len();
        let end = (k + 1) * bs;
        if end >= front.prompt_len {
            return false;
        }
        let want = &front.tokens[..end];
        self.running
            .iter()
            .any(|r| r.chain.0 <= k && r.computed < end && r.tokens.get(..end) == Some(want))
    }

    fn step_inner(
        &mut self,
        mut sink: Option<&mut (dyn FnMut(u64, usize, Vec<u8>) + Send)>,
    ) -> Result<Vec<TokenEvent>> {
        // Admit waiting requests, in order, while their full reservation fits.
        while self.running.len() < self.config.max_running {
            if !self.admit_front() {
                break;
            }
        }
        // Decode tokens first (one each), then prompt chunks under the remaining budget.
        let mut budget = self.config.max_batch_tokens;
        let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (seq index, start, len)
        for (i, s) in self.running.iter().enumerate() {
            if s.computed >= s.prompt_len && budget > 0 {
                plan.push((i, s.computed, 1));
                budget -= 1;
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.computed < s.prompt_len && budget > 0 {
                // Every row's logits of a prompt-log-probability chunk are held at once.
                let cap = match s.prompt_lp {
                    Some(_) => PROMPT_LOGPROBS_CHUNK,
                    None => usize::MAX,
                };
                let n = (s.prompt_len - s.computed).min(budget).min(cap);
                plan.push((i, s.computed, n));
                budget -= n;
            }
        }
        // A windowed group's next blocks; a sequence whose reservation came up short (a trimmed
        // block another still shares) sits this step out until a page is free.
        plan.retain(|&(i, start, n)| {
            let s = &mut self.running[i];
            match self.kv.ensure(&mut s.table, start, start + n) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(request = s.id, "waits for a KV page: {e}");
                    false
                }
            }
        });
        let decoding = plan
            .iter()
            .filter(|&&(i, _, _)| self.running[i].computed >= self.running[i].prompt_len)
            .count();
        let total: usize = plan.iter().map(|p| p.2).sum();
        self.last_step = (total - decoding, decoding);
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        self.steps += 1;
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|&(i, start, n)| {
                let s = &self.running[i];
                SeqChunk {
                    tokens: &s.tokens[start..start + n],
                    start_pos: start,
                    block_table: &s.table,
                    logits: if s.prefill_only {
                        Logits::None
                    } else if s.prompt_lp.is_some() && start < s.prompt_len {
                        Logits::All
                    } else if start + n == s.tokens.len() {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                }
            })
            .collect();
        // Prefill-only requests whose prompt completes in this step stream their layers.
        let streamed = sink.is_some();
        let completing: Vec<(u64, &BlockTable, Range<usize>)> = match sink {
            Some(_) => plan
                .iter()
                .filter(|&&(i, start, n)| {
                    self.running[i].prefill_only && start + n == self.running[i].prompt_len
                })
                .map(|&(i, _, _)| {
                    let s = &self.running[i];
                    (s.id, &s.table, s.send_from..s.prompt_len)
                })
                .collect(),
            None => Vec::new(),
        };
        // Only prefill-only requests' KV leaves this worker (exported or streamed): a step with
        // them hands each layer to the sink; without them a GPU keeps the step's KV on the
        // device.
        let mut stream_layers = |l: usize, kv: &KvCache| {
            if let Some(sink) = sink.as_deref_mut() {
                for (id, table, range) in &completing {
                    let mut buf = Vec::new();
                    kv.read_range(table, l, range.clone(), &mut buf);
                    sink(*id, l, buf);
                }
            }
        };
        let exports = plan.iter().any(|&(i, _, _)| self.running[i].prefill_only);
        let layer_sink: Option<crate::LayerSink<'_>> = exports.then_some(&mut stream_layers);
        let logits = self.model.step(&mut self.kv, &chunks, layer_sink)?;
        let mut events = Vec::new();
        let mut finished = Vec::new();
        let vocab = self.model.config.vocab_size;
        for (&(i, start, n), l) in plan.iter().zip(logits) {
            let s = &mut self.running[i];
            s.computed += n;
            if let Some(seed) = self.prefix_seed {
                self.kv
                    .register(seed, &s.table, &s.tokens, s.computed, &mut s.chain);
            }
            self.kv.trim(&mut s.table, s.computed);
            if s.prefill_only && s.computed == s.prompt_len {
                finished.push(s.id);
            }
            let Some(mut l) = l else { continue };
            if let (Some((k, lps)), true) = (&mut s.prompt_lp, start < s.prompt_len) {
                prompt_logprobs(&l, vocab, &s.tokens[..s.prompt_len], start, *k, lps);
                if start + n < s.prompt_len {
                    continue;
                }
                l.drain(..l.len() - vocab);
            }
            let (tok, logprobs, complete) = match &mut s.guide {
                None => {
                    let (tok, lp) = s.sampler.sample_with_logprobs(&l, &s.tokens);
                    (tok, lp, false)
                }
                Some(g) => guided(g, &s.sampler, &mut l, &s.tokens, &s.stop_ids, s.id),
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
            if finish.is_some() {
                finished.push(s.id);
            }
            events.push(TokenEvent {
                id: s.id,
                token: tok,
                finish,
                logprobs,
                prompt_logprobs: s.prompt_lp.take().map(|(_, lps)| lps),
            });
        }
        for id in finished {
            let i = self
                .running
                .iter()
                .position(|s| s.id == id)
                .expect("planned seqs are running");
            let s = self.running.remove(i);
            self.ledger.free(s.id);
            if s.prefill_only && !streamed {
                self.prefilled.push(s);
            } else {
                self.kv.release(s.table);
            }
        }
        Ok(events)
    }

    /// Runs steps until every request has finished; returns each request's tokens by id.
    pub fn run_to_completion(&mut self) -> Result<std::collections::BTreeMap<u64, Vec<u32>>> {
        let mut out = std::collections::BTreeMap::<u64, Vec<u32>>::new();
        while self.has_work() {
            for e in self.step()? {
                out.entry(e.id).or_default().push(e.token);
            }
        }
        Ok(out)
    }
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
    id: u64,
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
            tracing::warn!(request = id, "structured output ended: {e}");
            (tok, lp, true)
        }
    }
}
