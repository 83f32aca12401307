//! The Llama forward pass over a paged KV cache, for a batch of sequences at different positions.
//!
//! A batch is a list of sequence chunks: each brings some consecutive tokens of one sequence,
//! starting at the position where its cached KV ends. All tokens go through each matrix
//! multiplication together; attention is per token over its own sequence's cache. Every kernel
//! computes a row the same way whatever else is in the batch, so a sequence's logits are bitwise
//! identical however it is batched or chunked.

use std::path::Path;

use kernels::{Device, Matrix};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
pub use crate::forward::{Forward, LayerSink};
use crate::kv_cache::{BlockTable, KvCache};

/// Weights of one transformer block.
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection, `dim` rows.
    pub wq: Matrix,
    /// Key projection, `kv_width` rows.
    pub wk: Matrix,
    /// Value projection, `kv_width` rows.
    pub wv: Matrix,
    /// Attention output projection.
    pub wo: Matrix,
    /// RMSNorm before the feed-forward block.
    pub ffn_norm: Vec<f32>,
    /// SwiGLU gate projection.
    pub w_gate: Matrix,
    /// SwiGLU up projection.
    pub w_up: Matrix,
    /// Feed-forward down projection.
    pub w_down: Matrix,
    /// What an architecture adds to Llama's block (each present exactly when the config says).
    pub extra: LayerExtras,
}

/// The optional parts of a block: query/key head norms (`head_dim` values each), post-norms
/// (`dim`), projection biases (one per output row).
#[derive(Default)]
pub struct LayerExtras {
    /// RMSNorm weight over each query head.
    pub q_norm: Option<Vec<f32>>,
    /// RMSNorm weight over each key head.
    pub k_norm: Option<Vec<f32>>,
    /// RMSNorm on the attention output before the residual add.
    pub post_attn_norm: Option<Vec<f32>>,
    /// RMSNorm on the feed-forward output before the residual add.
    pub post_ffn_norm: Option<Vec<f32>>,
    /// Query, key and value projection biases.
    pub qkv_bias: Option<[Vec<f32>; 3]>,
}

/// All weights of a Llama model.
pub struct Weights {
    /// Token embedding table, `vocab` rows.
    pub embed: Matrix,
    /// Transformer blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm.
    pub norm: Vec<f32>,
    /// Output projection to logits (the embedding table when tied).
    pub output: Matrix,
}

/// Where weights come from: a name → tensor lookup over one model format.
pub(crate) trait TensorSource {
    fn path(&self) -> &Path;
    fn matrix(&self, name: &str) -> Result<Matrix>;
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>>;
    fn has(&self, name: &str) -> bool;
}

/// Tensor names of one format; `layer(i, part)` names layer `i`'s part (`attn_norm`, `q`, `k`,
/// `v`, `o`, `ffn_norm`, `gate`, `up`, `down`, `q_norm`, `k_norm`, `post_attn_norm`,
/// `post_ffn_norm`, `q_bias`, `k_bias`, `v_bias`).
pub(crate) struct Names {
    pub embed: &'static str,
    pub norm: &'static str,
    pub output: &'static str,
    pub layer: fn(usize, &str) -> String,
    /// Added to every RMSNorm weight as it is read (a format that stores `w` for `1 + w`).
    pub norm_offset: f32,
}

impl Weights {
    pub(crate) fn load(
        src: &dyn TensorSource,
        names: &Names,
        cfg: &ModelConfig,
    ) -> Result<Weights> {
        let shape = |name: &str, rows: usize, cols: usize| -> Result<Matrix> {
            let m = src.matrix(name)?;
            if m.rows() != rows || m.cols() != cols {
                return Err(EngineError::model(
                    src.path(),
                    format!(
                        "tensor {name} is {}x{}, expected {rows}x{cols}",
                        m.rows(),
                        m.cols()
                    ),
                ));
            }
            Ok(m)
        };
        let (d, kvw, ff) = (cfg.dim, cfg.kv_width(), cfg.ffn_dim);
        let qd = cfg.n_heads * cfg.head_dim;
        let embed = shape(names.embed, cfg.vocab_size, d)?;
        let output = if src.has(names.output) {
            shape(names.output, cfg.vocab_size, d)?
        } else {
            embed.clone()
        };
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let n = |s: &str| (names.layer)(i, s);
                let v = |s: &str, len: usize| {
                    let mut w = src.vector(&n(s), len)?;
                    if s.ends_with("norm") {
                        w.iter_mut().for_each(|x| *x += names.norm_offset);
                    }
                    Ok::<_, EngineError>(w)
                };
                let hd = cfg.head_dim;
                let extra = LayerExtras {
                    q_norm: cfg.qk_norm.then(|| v("q_norm", hd)).transpose()?,
                    k_norm: cfg.qk_norm.then(|| v("k_norm", hd)).transpose()?,
                    post_attn_norm: cfg.post_norms.then(|| v("post_attn_norm", d)).transpose()?,
                    post_ffn_norm: cfg.post_norms.then(|| v("post_ffn_norm", d)).transpose()?,
                    qkv_bias: cfg
                        .qkv_bias
                        .then(|| {
                            Ok::<_, EngineError>([
                                v("q_bias", qd)?,
                                v("k_bias", kvw)?,
                                v("v_bias", kvw)?,
                            ])
                        })
                        .transpose()?,
                };
                Ok(LayerWeights {
                    extra,
                    attn_norm: v("attn_norm", d)?,
                    wq: shape(&n("q"), qd, d)?,
                    wk: shape(&n("k"), kvw, d)?,
                    wv: shape(&n("v"), kvw, d)?,
                    wo: shape(&n("o"), d, qd)?,
                    ffn_norm: v("ffn_norm", d)?,
                    w_gate: shape(&n("gate"), ff, d)?,
                    w_up: shape(&n("up"), ff, d)?,
                    w_down: shape(&n("down"), d, ff)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights {
            embed,
            layers,
            norm: {
                let mut w = src.vector(names.norm, d)?;
                w.iter_mut().for_each(|x| *x += names.norm_offset);
                w
            },
            output,
        })
    }

    /// Bytes of weights read per decoded token (all matrices and norms; one embedding row).
    pub fn bytes_per_token(&self) -> usize {
        let m = |w: &Matrix| w.rows() * w.row_bytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                m(&l.wq)
                    + m(&l.wk)
                    + m(&l.wv)
                    + m(&l.wo)
                    + m(&l.w_gate)
                    + m(&l.w_up)
                    + m(&l.w_down)
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len())
            })
            .sum();
        layers + m(&self.output) + 4 * self.norm.len() + self.embed.row_bytes()
    }
}

/// A chunk of one sequence in a forward batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Position of the first token (= number of tokens already in the cache).
    pub start_pos: usize,
    /// The sequence's blocks; must cover every position of this chunk in every layer group.
    pub block_table: &'a BlockTable,
    /// Which of the chunk's logits to return.
    pub logits: Logits,
}

/// The logits a chunk asks for: `None`, its last token's (a sequence about to sample), or every
/// token's, in order (prompt log-probabilities).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// No logits.
    None,
    /// The last token's.
    Last,
    /// One row a token.
    All,
    /// One row a token of a decoding sequence's verify chunk (its newest token and the drafts
    /// after it, see [`crate::speculate`]): as [`Logits::All`], and a timing model prices the
    /// tokens as decode tokens.
    Verify,
}

impl Logits {
    /// The chunk's tokens (counted from its first) whose logits are wanted, of `n`.
    pub fn rows(self, n: usize) -> std::ops::Range<usize> {
        match self {
            Logits::None => n..n,
            Logits::Last => n.saturating_sub(1)..n,
            Logits::All | Logits::Verify => 0..n,
        }
    }
}

/// A loaded model ready to run: its shape and the one forward implementation chosen at load
/// (CPU kernels, CUDA or the mock timing model; see [`Forward`]).
pub struct Model {
    /// Hyper-parameters.
    pub config: ModelConfig,
    forward: Box<dyn Forward>,
}

impl Model {
    /// A model with these weights, run by the kernels of `device`. The CUDA forward runs
    /// Llama's block only: another architecture on a GPU is refused here.
    pub fn new(config: ModelConfig, weights: Weights, device: Device) -> Result<Model> {
        let forward: Box<dyn Forward> = match device.gpu() {
            Some(_) if !config.is_plain_llama() => {
                return Err(EngineError::Kernel(kernels::KernelError::Unavailable(format!(
                    "the {} architecture runs on the CPU only (the CUDA forward runs Llama's block)",
                    config.arch
                ))))
            }
            Some(gpu) => Box::new(crate::gpu::GpuForward::new(weights, gpu.clone())),
            None => Box::new(crate::cpu::CpuForward { weights, device }),
        };
        Ok(Model { config, forward })
    }

    /// A model of this shape run by the mock engine: no weights, no kernels; each step takes
    /// `timing`'s time and yields deterministic tokens (see [`crate::mock`]).
    pub fn mock(config: ModelConfig, timing: crate::mock::MockTiming) -> Model {
        let forward = Box::new(crate::mock::MockForward {
            timing,
            clock: None,
            modelled: Default::default(),
            tier_ns: Default::default(),
        });
        Model { config, forward }
    }

    /// The mock engine on a virtual clock (the simulator's workers): a step takes no time but
    /// leaves the time it would take in the returned cell (nanoseconds), and the KV cache keeps
    /// its block accounting and prefix cache without memory for the values (feature `sim`).
    #[cfg(feature = "sim")]
    pub fn mock_virtual(
        config: ModelConfig,
        timing: crate::mock::MockTiming,
    ) -> (Model, std::sync::Arc<std::sync::atomic::AtomicU64>) {
        let clock = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let forward = Box::new(crate::mock::MockForward {
            timing,
            clock: Some(clock.clone()),
            modelled: Default::default(),
            tier_ns: Default::default(),
        });
        (Model { config, forward }, clock)
    }

    /// The weights, where the forward has them (the mock engine has none).
    pub fn weights(&self) -> Option<&Weights> {
        self.forward.weights()
    }

    /// Whether the KV tiers keep pages' bytes ([`crate::forward::Forward::tier_values`]).
    pub fn tier_values(&self) -> bool {
        self.forward.tier_values()
    }

    /// The timing model's time of the last step, taken: the mock engine's (a worker's step
    /// beyond it is the machine's overhead, which the simulator draws from); `None` for real
    /// kernels or when no step ran since the last call.
    pub fn take_modelled_time(&self) -> Option<std::time::Duration> {
        self.forward.take_modelled_time()
    }

    /// Whether a row's logits are the same bits however the step is batched (see
    /// [`Forward::batch_invariant`]).
    pub fn batch_invariant(&self) -> bool {
        self.forward.batch_invariant()
    }

    /// The timing model's time of the last step, left to be taken (`None` for real kernels).
    pub fn modelled_time(&self) -> Option<std::time::Duration> {
        self.forward.modelled_time()
    }

    /// KV moved between the pool and its tiers since the last step, for a timing model to
    /// charge (see [`Forward::tier_traffic`]).
    pub fn tier_traffic(&self, t: &crate::TierTraffic) {
        self.forward.tier_traffic(t)
    }

    /// Whether the host KV cache holds every step's KV (not on a GPU: see
    /// [`Forward::kv_on_host`]).
    pub fn kv_on_host(&self) -> bool {
        self.forward.kv_on_host()
    }

    /// The forward's name (backend and device).
    pub fn device_name(&self) -> String {
        self.forward.name()
    }

    /// A KV cache shaped for this model in which every layer keeps every token (on a GPU
    /// device, with its device mirror: one cache per model).
    pub fn new_kv_cache(&self, block_size: usize, num_blocks: usize) -> Result<KvCache> {
        self.kv_cache(block_size, num_blocks, None)
    }

    /// A KV cache whose sliding-window layers keep only their window (see [`KvCache`]), for
    /// steps of at most `max_chunk` tokens a sequence: what an [`crate::Engine`] serves from.
    pub fn new_windowed_kv_cache(
        &self,
        block_size: usize,
        num_blocks: usize,
        max_chunk: usize,
    ) -> Result<KvCache> {
        self.kv_cache(block_size, num_blocks, Some(max_chunk))
    }

    /// Pages of an engine's cache of `num_blocks` blocks (see [`Model::new_windowed_kv_cache`]).
    pub fn kv_pages(&self, num_blocks: usize) -> usize {
        num_blocks * crate::kv_cache::group_count(&self.windows(true))
    }

    /// Bytes of one page of this model's KV cache with blocks of `block_size` tokens: one
    /// block of one layer group's layers, keys and values in f16 — what a KV tier stores of it
    /// (the mock's cache keeps no values; this is what they would take).
    pub fn kv_page_bytes(&self, block_size: usize) -> usize {
        let c = &self.config;
        let groups = crate::kv_cache::group_count(&self.windows(true)).max(1);
        (c.n_layers / groups) * 2 * block_size * c.kv_width() * 2
    }

    /// Blocks the KV tiers of `c` hold at most for this model (what a worker tells the router
    /// its index may keep beside its pool's blocks).
    pub fn kv_tier_blocks(&self, c: &crate::EngineConfig) -> u64 {
        c.tiers.capacity(self.kv_page_bytes(c.block_size))
    }

    /// A fingerprint of the weights, for KV kept across restarts (the disk tier): each matrix's
    /// type, shape and bytes sampled every 64 KiB, every norm, the RoPE base. KV computed with
    /// other weights under the same name and shape — a fine-tune, a requantisation — does not
    /// match. The mock engine, without weights, has none (0).
    #[cfg(feature = "runtime")]
    pub fn weights_fingerprint(&self) -> u64 {
        const STRIDE: usize = 64 << 10;
        let Some(w) = self.weights() else {
            return 0;
        };
        let mut s = crate::tiers::Summer::default();
        let mut matrix = |m: &kernels::Matrix| {
            s.sum(
                &[m.rows() as u64, m.cols() as u64]
                    .map(u64::to_le_bytes)
                    .concat(),
            );
            s.sum(format!("{:?}", m.dtype()).as_bytes());
            let b = m.bytes();
            for at in (0..b.len()).step_by(STRIDE) {
                s.sum(&b[at..(at + 64).min(b.len())]);
            }
        };
        matrix(&w.embed);
        matrix(&w.output);
        for l in &w.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                matrix(m);
            }
        }
        let norms = w.layers.iter().flat_map(|l| [&l.attn_norm, &l.ffn_norm]);
        for n in norms.chain([&w.norm]) {
            s.sum(bytemuck::cast_slice(n));
        }
        s.sum(&self.config.rope_base.to_le_bytes());
        s.finish()
    }

    /// Each layer's window as the cache keeps it (`windowed`), or every token.
    fn windows(&self, windowed: bool) -> Vec<Option<usize>> {
        let c = &self.config;
        match (self.forward.kv_backed(), windowed) {
            (false, _) => Vec::new(),
            (true, true) => c.layers.iter().map(|l| l.window).collect(),
            (true, false) => vec![None; c.n_layers],
        }
    }

    fn kv_cache(&self, bs: usize, num_blocks: usize, chunk: Option<usize>) -> Result<KvCache> {
        let c = &self.config;
        let windows = self.windows(chunk.is_some());
        let kv = KvCache::with_windows(&windows, c.kv_width(), bs, num_blocks, chunk.unwrap_or(1))?;
        self.forward.prepare_kv(c, bs, kv.total_blocks())?;
        Ok(kv)
    }

    /// Tells the model that tokens `range` of `table` were written into `kv` on the host (KV
    /// from a prefill worker, after the cached blocks), so a GPU copy of the pool follows.
    pub fn kv_written(
        &self,
        kv: &KvCache,
        table: &BlockTable,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        self.forward.kv_written(&self.config, kv, table, range)
    }

    /// The device `kv`'s pages also live on, with `kv`'s host memory mapped into it (see
    /// [`crate::forward::Forward::page_device`]); `None` when the host cache is the only copy.
    pub fn page_device(
        &self,
        kv: &mut KvCache,
    ) -> Result<Option<std::sync::Arc<dyn crate::forward::PageDevice>>> {
        self.forward.page_device(kv)
    }

    /// Runs one forward step over `batch`, writing each chunk's K/V into `kv`, and returns the
    /// logits of each chunk that asked for them (in batch order; `None` for the others). With a
    /// `sink`, the step's KV must leave this worker: `sink(l, kv)` is called as soon as layer
    /// `l`'s keys and values of the whole batch are in the host cache (before the layer's
    /// attention runs), so that a caller can ship them while the remaining layers compute.
    /// Without one, a GPU keeps the step's KV on the device.
    pub fn step(
        &self,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        sink: Option<LayerSink<'_>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        check(&self.config, kv, batch)?;
        self.forward.forward(&self.config, kv, batch, sink)
    }

    /// [`Model::step`] without a sink.
    pub fn forward(
        &self,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<Option<Vec<f32>>>> {
        self.step(kv, batch, None)
    }
}

/// Checks a batch against the model and the cache before any forward runs: positions within
/// the context, block tables covering them, token ids within the vocabulary.
fn check(c: &ModelConfig, kv: &KvCache, batch: &[SeqChunk<'_>]) -> Result<()> {
    for s in batch {
        let end = s.start_pos + s.tokens.len();
        if end > c.context_len {
            return Err(EngineError::Internal(format!(
                "sequence of {end} tokens exceeds the model's context of {}",
                c.context_len
            )));
        }
        let groups = (0..kv.groups()).map(|g| s.block_table.group(g));
        if let Some(g) = groups
            .map(|blocks| (s.start_pos..end).find(|&p| kv.slot(blocks, p).is_none()))
            .position(|p| p.is_some())
        {
            return Err(EngineError::Internal(format!(
                "the block table of layer group {g} ({} blocks) does not cover positions {}..{end}",
                s.block_table.group(g).len(),
                s.start_pos
            )));
        }
        if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(EngineError::Internal(format!(
                "token id {t} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
    }
    Ok(())
}
