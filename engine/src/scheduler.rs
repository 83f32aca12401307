//! Continuous batching over the paged KV cache.
//!
//! Each [`Engine::step`] runs one forward pass in three parts: *plan* (every running sequence
//! that is decoding contributes its newest token, and the remaining token budget goes to prompt
//! chunks of sequences still prefilling, first come first served), *run* (the forward over
//! those chunks) and *apply* (sequences move past their chunks, tokens are sampled, finished
//! sequences leave and free their blocks). Sequences join between steps. A request is admitted
//! only when the cache can hold its prompt plus `max_tokens`: full layer groups' blocks are
//! reserved up front, sliding-window groups' are promised and taken as the sequence reaches
//! them ([`KvCache::ensure`]). A promised page can be short when a block the sequence gave back
//! is still shared by another; such a sequence sits a step out until a page is free (the one
//! furthest behind never waits, so all move on). Admissions simply wait for room.
//!
//! The remote-KV part of the API (reservations for a prefill worker's KV, its admission, the
//! ledger) is in [`crate::remote`].

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use types::{KvEvent, RequestId};

use crate::error::{EngineError, Result};
use crate::grammar::Grammars;
use crate::kv_cache::{BlockTable, KvCache};
use crate::ledger::{Ledger, LedgerCounts};
use crate::model::{Model, SeqChunk};
use crate::preempt::{Admission, Preemptions};
use crate::sampler::{FinishReason, SamplingParams, TokenLogprobs};
use crate::speculate::{Acceptance, SpecStats, StepCosts};

mod chunk;
mod draft;
mod seq;
use chunk::{sample, Chunk};
use draft::verify;
pub(crate) use seq::Seq;

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
    /// Host memory and disk below the pool for the prefix cache's evicted blocks (see
    /// [`crate::tiers`]); needs the prefix cache.
    pub tiers: crate::tiers::TierConfig,
    /// What a request's admission reserves, and whether running sequences can be preempted
    /// (see [`crate::preempt`]).
    pub admission: Admission,
    /// Most drafts a decoding sequence's step verifies, for requests that do not say
    /// (prompt-lookup speculation, see [`crate::speculate`]; 0: off).
    pub speculation: usize,
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
            tiers: Default::default(),
            admission: Admission::default(),
            speculation: 0,
        }
    }
}

/// Most prompt tokens a step computes of a request that wants its prompt's log-probabilities:
/// each row's logits are held until they are read (64 × a 262k vocabulary is 67 MB).
const PROMPT_LOGPROBS_CHUNK: usize = 64;

/// Where a streaming step hands the KV of prefill-only requests completing in it:
/// `(request, layer, bytes)`, each layer as soon as it is computed.
pub type KvSink<'a> = &'a mut (dyn FnMut(RequestId, usize, Vec<u8>) + Send);

/// A token produced by a step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// The request it belongs to.
    pub id: RequestId,
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

/// A model, its KV cache and the sequences being served.
pub struct Engine {
    pub(crate) model: Arc<Model>,
    pub(crate) kv: KvCache,
    pub(crate) config: EngineConfig,
    pub(crate) eos_ids: Vec<u32>,
    pub(crate) waiting: VecDeque<Seq>,
    pub(crate) running: Vec<Seq>,
    /// Blocks reserved, waiting for their prompt's KV to arrive from a prefill worker.
    pub(crate) awaiting: Vec<Seq>,
    /// Prefill-only requests whose KV is complete, until exported.
    pub(crate) prefilled: Vec<Seq>,
    /// Decoding sequences paused for a live move: not stepped, their KV held until handed
    /// off ([`Engine::export_paused`]) and released.
    pub(crate) paused: Vec<Seq>,
    /// Tokens in the last step: (prompt tokens, decode tokens).
    pub(crate) last_step: (usize, usize),
    /// Who holds blocks for KV from a prefill worker: reserved, in flight, committed.
    pub(crate) ledger: Ledger,
    /// The prefix cache's hash seed (the model's identity), when the cache is on.
    pub(crate) prefix_seed: Option<u64>,
    /// Prompt tokens admitted, and those found in the prefix cache (not computed), since start.
    pub(crate) prompt_tokens: u64,
    pub(crate) prefix_hit_tokens: u64,
    /// Reservations refused for lack of room (free or evictable blocks), since start.
    pub(crate) refusals: u64,
    /// Forward steps run, since start.
    pub(crate) steps: u64,
    /// Sequences preempted, and what resuming them cost, since start.
    pub(crate) preemptions: Preemptions,
    /// Requests the last step preempted, until [`Engine::take_preempted`] takes them.
    pub(crate) preempted_now: Vec<RequestId>,
    /// Requests accepted so far: the next one's [`Seq::arrival`].
    arrivals: u64,
    /// Measured step times by tokens, for speculation's choices.
    pub(crate) costs: StepCosts,
    /// What speculation proposed and had accepted, since start.
    pub(crate) spec: SpecStats,
    /// Drafts' acceptance over every sequence: a new one's prior.
    pub(crate) accept: Acceptance,
    /// The vocabulary's grammar compiler (structured output), when the worker set one.
    pub(crate) grammars: Option<Arc<Grammars>>,
}

/// What an engine reports of its load: its worker's heartbeats carry it to the router
/// (`worker` converts it to the wire's `WorkerLoad`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Sequences in the running batch.
    pub running: u32,
    /// Requests queued for the batch.
    pub waiting: u32,
    /// Requests holding blocks while their KV arrives from a prefill worker.
    pub pending_transfers: u32,
    /// Sequences paused for a live move, holding their KV.
    pub paused: u32,
    /// Blocks an allocation can take (free, or cached and evictable).
    pub kv_blocks_free: u32,
    /// Blocks in all.
    pub kv_blocks_total: u32,
    /// Blocks nobody holds that keep a computed prefix.
    pub kv_blocks_cached: u32,
    /// The ownership ledger's blocks per state.
    pub ledger: LedgerCounts,
    /// Prompt tokens admitted since start, and of those found in the prefix cache.
    pub prompt_tokens: u64,
    /// See `prompt_tokens`.
    pub prefix_hit_tokens: u64,
    /// Cached blocks evicted for new KV since start.
    pub kv_blocks_evicted: u64,
    /// Requests refused for lack of room since start.
    pub kv_refusals: u64,
    /// Forward steps run since start.
    pub engine_steps: u64,
    /// The tiers below the pool (zeros without them).
    pub tiers: crate::tiers::TiersStats,
    /// Sequences preempted since start (optimistic admission), swapped or recomputed.
    pub preemptions: Preemptions,
    /// Drafts proposed and accepted since start (speculative decoding).
    pub speculation: SpecStats,
}

/// The tiers of `config` under the cache `kv` of `model`, whose blocks are named under
/// `seed`.
fn open_tiers(
    model: &Model,
    config: &EngineConfig,
    kv: &KvCache,
    seed: u64,
) -> Result<crate::tiers::Tiers> {
    if !config.prefix_cache {
        let msg = "KV tiers keep the prefix cache's blocks: they need the prefix cache on";
        return Err(EngineError::Config(msg.into()));
    }
    let pool_values = kv.page_bytes() > 0;
    // A cache without values (the mock) counts what the model's pages would take.
    let bytes = model.kv_page_bytes(config.block_size);
    if pool_values && bytes != kv.page_bytes() {
        let msg = format!(
            "KV tiers: the model's page is {bytes} bytes, the cache's {}",
            kv.page_bytes()
        );
        return Err(EngineError::Internal(msg));
    }
    // Blocks on disk outlive the process: they are kept only for the same weights, not only
    // the same names (the block names' seed covers the model's name and shape).
    let identity = seed ^ model.weights_fingerprint().rotate_left(29);
    let values = pool_values && model.tier_values();
    crate::tiers::Tiers::open(&config.tiers, identity, bytes, values)
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
    /// Its KV was handed to another decode worker (a live move).
    Moved,
}

impl Engine {
    /// An engine over `model`; `eos_ids` end every request unless it sets `ignore_eos`.
    pub fn new(model: Arc<Model>, config: EngineConfig, eos_ids: Vec<u32>) -> Result<Engine> {
        if config.max_batch_tokens == 0 || config.max_running == 0 {
            return Err(EngineError::Config(
                "max_batch_tokens and max_running must be positive".into(),
            ));
        }
        let mut kv = model.new_windowed_kv_cache(
            config.block_size,
            config.num_blocks,
            config.max_batch_tokens,
        )?;
        // Seeded by the model's KV identity: blocks of two models or layouts never match.
        let seed = crate::block_hash::identity_seed(&model.config, config.block_size);
        let prefix_seed = config.prefix_cache.then_some(seed);
        if config.tiers.enabled() {
            let mut tiers = open_tiers(&model, &config, &kv, seed)?;
            // A GPU's pool: its pages go down through the host cache and come back from G2
            // straight, both mapped into the device.
            let device = model.page_device(&mut kv)?;
            if let Some(d) = &device {
                tiers.map_host(d.as_ref())?;
            }
            kv.set_tiers(tiers, device);
        }
        Ok(Engine {
            model,
            kv,
            config,
            eos_ids,
            waiting: VecDeque::new(),
            running: Vec::new(),
            awaiting: Vec::new(),
            prefilled: Vec::new(),
            paused: Vec::new(),
            last_step: (0, 0),
            ledger: Ledger::new(),
            prefix_seed,
            prompt_tokens: 0,
            prefix_hit_tokens: 0,
            refusals: 0,
            steps: 0,
            preemptions: Preemptions::default(),
            preempted_now: Vec::new(),
            arrivals: 0,
            costs: StepCosts::default(),
            spec: SpecStats::default(),
            accept: Acceptance::default(),
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
    pub fn add(&mut self, id: RequestId, prompt: Vec<u32>, params: SamplingParams) -> Result<()> {
        let seq = self.new_seq(id, prompt, params, false)?;
        self.waiting.push_back(seq);
        Ok(())
    }

    /// Queues a prefill-only request: its KV is computed (chunked, batched with others) and then
    /// held until [`Engine::export_kv`] (or streamed); no token is sampled. The KV of the
    /// tokens before `send_from` is not exported: the receiver holds it (a delta transfer).
    pub fn add_prefill_only(
        &mut self,
        id: RequestId,
        tokens: Vec<u32>,
        send_from: usize,
        cache_salt: Option<String>,
    ) -> Result<()> {
        if send_from >= tokens.len() {
            return Err(EngineError::InvalidRequest(format!(
                "nothing to send: the receiver holds {send_from} of {} tokens",
                tokens.len()
            )));
        }
        let params = SamplingParams {
            max_tokens: Some(1),
            cache_salt,
            ..Default::default()
        };
        let mut seq = self.new_seq(id, tokens, params, true)?;
        seq.max_tokens = 0;
        seq.send_from = send_from;
        self.waiting.push_back(seq);
        Ok(())
    }

    /// The load figures a worker reports (its heartbeats carry them).
    pub fn load(&self) -> Load {
        Load {
            running: self.running.len() as u32,
            waiting: self.waiting.len() as u32,
            pending_transfers: self.awaiting.len() as u32,
            paused: self.paused.len() as u32,
            kv_blocks_free: self.free_blocks() as u32,
            kv_blocks_total: self.total_blocks() as u32,
            kv_blocks_cached: self.kv.block_counts().cached as u32,
            ledger: self.ledger.counts(),
            prompt_tokens: self.prompt_tokens,
            prefix_hit_tokens: self.prefix_hit_tokens,
            kv_blocks_evicted: self.kv.evicted_blocks(),
            kv_refusals: self.refusals,
            engine_steps: self.steps,
            tiers: self.kv.tier_stats().unwrap_or_default(),
            preemptions: self.preemptions,
            speculation: self.spec,
        }
    }

    /// Prefix-cache blocks registered and forgotten since the last call, in order.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.kv.take_events()
    }

    /// Whether the disk tier has writes queued, or finished and not yet taken as events.
    pub fn tier_writes_pending(&self) -> bool {
        self.kv.tiers().is_some_and(|t| t.writes_pending())
    }

    /// Waits at most `limit` for the disk tier's queued writes (tests; an orderly shutdown);
    /// whether they finished. A step never waits on them.
    pub fn flush_tiers(&mut self, limit: Duration) -> bool {
        self.kv.tiers_mut().is_none_or(|t| t.flush(limit))
    }

    /// Tokens the last step ran: (prompt tokens, decoding sequences).
    pub fn last_step(&self) -> (usize, usize) {
        self.last_step
    }

    /// Blocks held by request `id` (0 if it holds none or is unknown).
    pub fn blocks_of(&self, id: RequestId) -> usize {
        self.awaiting
            .iter()
            .chain(&self.running)
            .chain(&self.waiting)
            .chain(&self.prefilled)
            .chain(&self.paused)
            .find(|s| s.id == id)
            .map_or(0, |s| s.table.held())
    }

    /// Drops a request wherever it is, frees its blocks and its ledger entry — the one way a
    /// request leaves before it finishes. Returns whether it was found.
    pub fn release(&mut self, id: RequestId, why: Release) -> bool {
        let held = self.ledger.free(id).is_some();
        let found = self.remove(id);
        if found || held {
            tracing::debug!(request = %id, ?why, "released");
        }
        found || held
    }

    fn remove(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i).expect("index found");
            self.kv.release(s.table);
            return true;
        }
        for list in [
            &mut self.running,
            &mut self.awaiting,
            &mut self.prefilled,
            &mut self.paused,
        ] {
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
    pub fn step_streaming(&mut self, sink: KvSink<'_>) -> Result<Vec<TokenEvent>> {
        self.step_inner(Some(sink))
    }

    /// Moves the first waiting request to the running batch if its reservation fits: first
    /// the cached blocks of its tokens' longest cached prefix (all but the last token, which
    /// must be computed), then fresh blocks for the rest of prompt plus `max_tokens` (under
    /// optimistic admission: the rest of what it holds, and a watermark left free).
    fn admit_front(&mut self) -> bool {
        let Some(front) = self.waiting.front_mut() else {
            return false;
        };
        let fresh = front.table.blocks().is_empty() && front.computed == 0;
        // Prompt log-probabilities need every prompt position's logits: nothing is reused.
        let reuse = fresh && front.prompt_lp.is_none();
        if let (Some(seed), true) = (self.prefix_seed, reuse) {
            let known = &front.tokens[..front.tokens.len() - 1];
            let (shared, last) = self
                .kv
                .share_prefix((seed, front.root), &mut front.table, known);
            front.computed = shared;
            front.chain = (front.table.blocks().len(), last);
        }
        let front = self.waiting.front().expect("checked above");
        let need = self.admission_tokens(front.tokens.len(), front.prompt_len, front.max_tokens);
        let computing = fresh && self.prefix_seed.is_some() && self.prefix_in_progress();
        let spare = if self.running.is_empty() {
            0
        } else {
            self.watermark()
        };
        let front = self.waiting.front_mut().expect("checked above");
        let fits = !computing && self.kv.reserve(&mut front.table, need).is_ok();
        if !fits || (fresh && self.kv.free_blocks() < spare) {
            if fresh {
                // Wait without holding shared blocks; the lookup runs again next time.
                self.kv.release(std::mem::take(&mut front.table));
                front.computed = 0;
                front.chain = (0, front.root);
            }
            return false;
        }
        if fresh && front.resumed {
            self.preemptions.resumed_tokens += front.tokens.len() as u64 - 1;
            self.preemptions.resumed_hit_tokens += front.computed as u64;
        } else if fresh {
            self.prompt_tokens += front.prompt_len as u64;
            self.prefix_hit_tokens += front.computed as u64;
            if front.computed > 0 {
                self.kv.note_hits(&front.table);
            }
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
        self.running.iter().any(|r| {
            let same = r.root == front.root && r.tokens.get(..end) == Some(want);
            r.chain.0 <= k && r.computed < end && same
        })
    }

    fn step_inner(&mut self, sink: Option<KvSink<'_>>) -> Result<Vec<TokenEvent>> {
        // The batch's next pages first (preempting under optimistic admission), then waiting
        // requests, in order, while their reservation fits.
        self.preempted_now.clear();
        self.grow();
        while self.running.len() < self.config.max_running {
            if !self.admit_front() {
                break;
            }
        }
        let plan = self.plan();
        let decoding = plan.iter().filter(|c| c.decodes(&self.running)).count();
        let total: usize = plan.iter().map(|c| c.len).sum();
        let drafts: usize = plan.iter().map(|c| c.draft).sum();
        self.last_step = (total - decoding - drafts, decoding);
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        self.steps += 1;
        let streamed = sink.is_some();
        let t0 = std::time::Instant::now();
        let logits = self.run(&plan, sink)?;
        let took = self.model.modelled_time().unwrap_or_else(|| t0.elapsed());
        self.costs.observe(total, took.as_secs_f64());
        Ok(self.apply(&plan, logits, streamed))
    }

    /// The step's chunks: each decoding sequence's newest token first, then prompt chunks
    /// under the remaining token budget, first come first served. A windowed group's next
    /// blocks are taken here; a sequence whose reservation came up short (a trimmed block
    /// another still shares) sits this step out until a page is free.
    fn plan(&mut self) -> Vec<Chunk> {
        let mut budget = self.config.max_batch_tokens;
        let mut plan = Vec::new();
        for (seq, s) in self.running.iter().enumerate() {
            if s.decoding() && budget > 0 {
                plan.push(Chunk {
                    seq,
                    start: s.computed,
                    len: 1,
                    draft: 0,
                });
                budget -= 1;
            }
        }
        budget = self.speculate(&mut plan, budget);
        // Prompts, and resumed sequences catching up with the tokens they had.
        for (seq, s) in self.running.iter().enumerate() {
            if !s.decoding() && s.computed < s.tokens.len() && budget > 0 {
                // Every row's logits of a prompt-log-probability chunk are held at once.
                let cap = match s.prompt_lp {
                    Some(_) => PROMPT_LOGPROBS_CHUNK,
                    None => usize::MAX,
                };
                let len = (s.tokens.len() - s.computed).min(budget).min(cap);
                plan.push(Chunk {
                    seq,
                    start: s.computed,
                    len,
                    draft: 0,
                });
                budget -= len;
            }
        }
        plan.retain_mut(|c| {
            let s = &mut self.running[c.seq];
            // Drafts past the pages to be had (a windowed group's promise short) are dropped,
            // not the sequence's step.
            if c.draft > 0
                && self
                    .kv
                    .ensure(&mut s.table, c.start, c.start + c.len)
                    .is_err()
            {
                (c.len, c.draft) = (1, 0);
                s.drafter.as_mut().expect("it drafted").chunk.clear();
            }
            match self.kv.ensure(&mut s.table, c.start, c.start + c.len) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(request = %s.id, "waits for a KV page: {e}");
                    false
                }
            }
        });
        plan
    }

    /// Runs the forward over `plan`; prefill-only requests whose prompt completes in this step
    /// hand each layer's KV to `sink` as soon as it is computed. Only their KV leaves this
    /// worker: without them a GPU keeps the step's KV on the device.
    fn run(
        &mut self,
        plan: &[Chunk],
        mut sink: Option<KvSink<'_>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|c| c.forward(&self.running[c.seq]))
            .collect();
        let completing: Vec<(RequestId, &BlockTable, Range<usize>)> = match sink {
            Some(_) => plan
                .iter()
                .map(|c| (c, &self.running[c.seq]))
                .filter(|(c, s)| s.prefill_only && c.start + c.len == s.prompt_len)
                .map(|(_, s)| (s.id, &s.table, s.send_from..s.prompt_len))
                .collect(),
            None => Vec::new(),
        };
        let mut stream_layers = |l: usize, kv: &KvCache| {
            if let Some(sink) = sink.as_deref_mut() {
                for (id, table, range) in &completing {
                    let mut buf = Vec::new();
                    kv.read_range(table, l, range.clone(), &mut buf);
                    sink(*id, l, buf);
                }
            }
        };
        let exports = plan.iter().any(|c| self.running[c.seq].prefill_only);
        let layer_sink: Option<crate::LayerSink<'_>> = exports.then_some(&mut stream_layers);
        let bs = self.kv.block_size();
        if let Some(traffic) = self.kv.tiers_mut().map(|t| t.take_traffic(bs)) {
            if !traffic.is_empty() {
                self.model.tier_traffic(&traffic);
            }
        }
        self.model.step(&mut self.kv, &chunks, layer_sink)
    }

    /// Moves each planned sequence past its chunk (its new full blocks registered in the
    /// prefix cache, blocks out of every window given back), samples where the chunk ends a
    /// prompt or is a decode token, and retires what finished.
    fn apply(
        &mut self,
        plan: &[Chunk],
        logits: Vec<Option<Vec<f32>>>,
        streamed: bool,
    ) -> Vec<TokenEvent> {
        let mut events = Vec::new();
        let mut finished = Vec::new();
        for (c, l) in plan.iter().zip(logits) {
            let s = &mut self.running[c.seq];
            let vocab = self.model.config.vocab_size;
            let drawn = if c.draft > 0 {
                let l = l.expect("a verify chunk has every row's logits");
                verify(s, c, l, vocab, &mut self.spec, &mut self.accept)
            } else {
                s.computed += c.len;
                l.and_then(|mut l| sample(s, c, &mut l, vocab))
                    .into_iter()
                    .collect()
            };
            if let Some(seed) = self.prefix_seed {
                self.kv
                    .register(seed, &s.table, &s.tokens, s.computed, &mut s.chain);
            }
            self.kv.trim(&mut s.table, s.computed);
            if s.prefill_only && s.computed == s.prompt_len {
                finished.push(s.id);
            }
            for ev in drawn {
                if ev.finish.is_some() {
                    finished.push(ev.id);
                }
                events.push(ev);
            }
        }
        for id in finished {
            self.retire(id, streamed);
        }
        events
    }

    /// A finished sequence leaves the batch: its ledger entry goes, its blocks too — unless it
    /// is a prefill-only request whose KV waits to be exported ([`Engine::export_kv`]).
    fn retire(&mut self, id: RequestId, streamed: bool) {
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

    /// Runs steps until every request has finished; returns each request's tokens by id.
    pub fn run_to_completion(&mut self) -> Result<std::collections::BTreeMap<RequestId, Vec<u32>>> {
        let mut out = std::collections::BTreeMap::<RequestId, Vec<u32>>::new();
        while self.has_work() {
            for e in self.step()? {
                out.entry(e.id).or_default().push(e.token);
            }
        }
        Ok(out)
    }
}
