//! The Llama forward pass over a paged KV cache, for a batch of sequences at different positions.
//!
//! A batch is a list of sequence chunks: each brings some consecutive tokens of one sequence,
//! starting at the position where its cached KV ends. All tokens go through each matrix
//! multiplication together; attention is per token over its own sequence's cache. Every kernel
//! computes a row the same way whatever else is in the batch, so a sequence's logits are bitwise
//! identical however it is batched or chunked.

use std::path::Path;

use kernels::{Device, Matrix, PagedKv, Query};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_cache::KvCache;

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

/// Tensor names of one format.
pub(crate) struct Names {
    pub embed: &'static str,
    pub norm: &'static str,
    pub output: &'static str,
    pub layer: fn(usize, &str) -> String,
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
                Ok(LayerWeights {
                    attn_norm: src.vector(&n("attn_norm"), d)?,
                    wq: shape(&n("q"), qd, d)?,
                    wk: shape(&n("k"), kvw, d)?,
                    wv: shape(&n("v"), kvw, d)?,
                    wo: shape(&n("o"), d, qd)?,
                    ffn_norm: src.vector(&n("ffn_norm"), d)?,
                    w_gate: shape(&n("gate"), ff, d)?,
                    w_up: shape(&n("up"), ff, d)?,
                    w_down: shape(&n("down"), d, ff)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights {
            embed,
            layers,
            norm: src.vector(names.norm, d)?,
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
    /// The sequence's blocks; must cover every position of this chunk.
    pub block_table: &'a [u32],
    /// Whether to return the logits of the chunk's last token.
    pub logits: bool,
}

/// A loaded model ready to run.
pub struct Model {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Weights.
    pub weights: Weights,
    device: Device,
    mock: Option<crate::mock::MockTiming>,
    gpu: crate::gpu::GpuModel,
}

impl Model {
    /// Builds a model from loaded weights.
    pub fn new(config: ModelConfig, weights: Weights, device: Device) -> Model {
        Model {
            config,
            weights,
            device,
            mock: None,
            gpu: Default::default(),
        }
    }

    /// This model as the mock engine: no kernels run, each step takes `timing`'s time and
    /// yields deterministic tokens (see [`crate::mock`]).
    pub fn into_mock(mut self, timing: crate::mock::MockTiming) -> Model {
        self.mock = Some(timing);
        self
    }

    /// The backend's name.
    pub fn device_name(&self) -> String {
        match (&self.mock, self.device.gpu()) {
            (Some(_), _) => "mock".into(),
            (None, Some(g)) => format!("{g:?}"),
            (None, None) => self.device.backend().name(),
        }
    }

    /// A KV cache shaped for this model (on a GPU device, with its device mirror: one cache
    /// per model).
    pub fn new_kv_cache(&self, block_size: usize, num_blocks: usize) -> Result<KvCache> {
        let kv = KvCache::new(
            self.config.n_layers,
            self.config.kv_width(),
            block_size,
            num_blocks,
        )?;
        if let (Some(g), None) = (self.device.gpu(), &self.mock) {
            self.gpu.init(self, g, block_size, num_blocks)?;
        }
        Ok(kv)
    }

    /// Tells the model that tokens `0..n` of `table` were written into `kv` on the host (KV
    /// from a prefill worker), so a GPU copy of the pool follows.
    pub fn kv_written(&self, kv: &KvCache, table: &[u32], n: usize) -> Result<()> {
        self.gpu.upload(kv, self.config.n_layers, table, n)
    }

    /// Runs one forward step over `batch`, writing each chunk's K/V into `kv`, and returns the
    /// logits of each chunk that asked for them (in batch order; `None` for the others).
    pub fn forward(
        &self,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<Option<Vec<f32>>>> {
        self.forward_layers(kv, batch, &mut |_, _| {})
    }

    /// [`Model::forward`] for a batch whose KV never leaves this worker (nothing is exported or
    /// streamed from it): on a GPU the step's keys and values stay in the device pool and the
    /// host cache is not updated (no copy back and no wait for it, layer by layer); on the CPU
    /// the same as [`Model::forward`].
    pub fn forward_local(
        &self,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<Option<Vec<f32>>>> {
        if self.mock.is_none() && self.gpu.active() {
            return self.gpu.forward(self, kv, batch, None);
        }
        self.forward(kv, batch)
    }

    /// [`Model::forward`], calling `on_layer(l, kv)` as soon as layer `l`'s keys and values of
    /// the whole batch are in the cache (before the layer's attention runs), so that a caller
    /// can ship them while the remaining layers compute.
    pub fn forward_layers(
        &self,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut (dyn FnMut(usize, &KvCache) + Send),
    ) -> Result<Vec<Option<Vec<f32>>>> {
        if let Some(timing) = self.mock {
            return self.forward_mock(timing, kv, batch, on_layer);
        }
        if self.gpu.active() {
            return self.gpu.forward(self, kv, batch, Some(on_layer));
        }
        let mut result = None;
        self.device
            .backend()
            .run(&mut || result = Some(self.forward_inner(kv, batch, on_layer)));
        result.expect("the backend ran the step")
    }

    /// The mock engine's step: the same checks as a real one, the timing model's time spread
    /// over the layers (so layer-wise streaming behaves as with real compute), one-hot logits.
    fn forward_mock(
        &self,
        timing: crate::mock::MockTiming,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut (dyn FnMut(usize, &KvCache) + Send),
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let c = &self.config;
        let (mut prefill, mut decode, mut attended) = (0, 0, 0);
        for s in batch {
            let end = s.start_pos + s.tokens.len();
            if end > c.context_len {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence of {end} tokens exceeds the model's context of {}",
                    c.context_len
                )));
            }
            if end > 0 && kv.slot(s.block_table, end - 1).is_none() {
                return Err(EngineError::InvalidRequest(format!(
                    "block table of {} blocks does not cover position {}",
                    s.block_table.len(),
                    end - 1
                )));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {t} is outside the vocabulary of {}",
                    c.vocab_size
                )));
            }
            match s.tokens.len() {
                1 if s.start_pos > 0 => decode += 1,
                n => prefill += n,
            }
            attended += end;
        }
        let total = timing.step_time(prefill, decode, attended);
        let t0 = std::time::Instant::now();
        // The step's time is spread over four groups of layers (layer-wise streaming still sees
        // layers arrive over the step) rather than one sleep a layer, whose wake-ups would add
        // the machine's scheduling latency thirty times.
        let group = c.n_layers.div_ceil(4).max(1);
        for l in 0..c.n_layers {
            if (l + 1) % group == 0 || l + 1 == c.n_layers {
                crate::mock::wait_layer(t0, total, l, c.n_layers);
            }
            on_layer(l, kv);
        }
        Ok(batch
            .iter()
            .map(|s| {
                s.logits.then(|| {
                    let end = s.start_pos + s.tokens.len();
                    let last = s.tokens.last().copied().unwrap_or(0);
                    let mut l = vec![0f32; c.vocab_size];
                    l[crate::mock::next_token(last, end, c.vocab_size) as usize] = 1.0;
                    l
                })
            })
            .collect())
    }

    fn forward_inner(
        &self,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: &mut (dyn FnMut(usize, &KvCache) + Send),
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let c = &self.config;
        let be = self.device.backend();
        let (d, kvw, hd) = (c.dim, c.kv_width(), c.head_dim);
        let qd = c.n_heads * hd;
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut queries = Vec::new();
        for s in batch {
            if s.start_pos + s.tokens.len() > c.context_len {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence of {} tokens exceeds the model's context of {}",
                    s.start_pos + s.tokens.len(),
                    c.context_len
                )));
            }
            for p in s.start_pos..s.start_pos + s.tokens.len() {
                let slot = kv.slot(s.block_table, p).ok_or_else(|| {
                    EngineError::InvalidRequest(format!(
                        "block table of {} blocks does not cover position {p}",
                        s.block_table.len()
                    ))
                })?;
                positions.push(p);
                slots.push(slot);
                queries.push(Query {
                    pos: p,
                    block_table: s.block_table,
                });
            }
        }
        let t = positions.len();
        let mut x = vec![0f32; t * d];
        for (row, &tok) in x.chunks_mut(d).zip(batch.iter().flat_map(|s| s.tokens)) {
            if tok as usize >= c.vocab_size {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {tok} is outside the vocabulary of {}",
                    c.vocab_size
                )));
            }
            self.weights.embed.dequantize_row(tok as usize, row);
        }
        let mut h = vec![0f32; t * d];
        let mut q = vec![0f32; t * qd];
        let mut k = vec![0f32; t * kvw];
        let mut v = vec![0f32; t * kvw];
        let mut att = vec![0f32; t * qd];
        let mut o = vec![0f32; t * d];
        let mut gate = vec![0f32; t * c.ffn_dim];
        let mut up = vec![0f32; t * c.ffn_dim];
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, w) in self.weights.layers.iter().enumerate() {
            be.rms_norm(&x, &w.attn_norm, c.rms_eps, &mut h);
            be.matmul_many(
                &h,
                t,
                &mut [(&w.wq, &mut q), (&w.wk, &mut k), (&w.wv, &mut v)],
            )?;
            be.rope(&mut q, &positions, c.n_heads, hd, c.rope_base, c.rope_style);
            be.rope(
                &mut k,
                &positions,
                c.n_kv_heads,
                hd,
                c.rope_base,
                c.rope_style,
            );
            let layer = kv.layer_mut(l);
            be.store_kv(&mut layer.k, &mut layer.v, &slots, &k, &v, kvw);
            on_layer(l, kv);
            let layer = kv.layer(l);
            let paged = PagedKv {
                k: &layer.k,
                v: &layer.v,
                block_size: kv.block_size(),
                n_kv_heads: c.n_kv_heads,
                head_dim: hd,
            };
            be.attention(&q, &queries, paged, c.n_heads, scale, &mut att);
            be.matmul(&w.wo, &att, t, &mut o)?;
            kernels::ops::add_assign(&mut x, &o);
            be.rms_norm(&x, &w.ffn_norm, c.rms_eps, &mut h);
            be.matmul_many(&h, t, &mut [(&w.w_gate, &mut gate), (&w.w_up, &mut up)])?;
            be.silu_mul(&mut gate, &up);
            be.matmul(&w.w_down, &gate, t, &mut o)?;
            kernels::ops::add_assign(&mut x, &o);
        }
        // Logits only for the last token of the chunks that want them.
        let mut rows = Vec::new();
        let mut end = 0;
        for s in batch {
            end += s.tokens.len();
            if s.logits && !s.tokens.is_empty() {
                rows.extend_from_slice(&x[(end - 1) * d..end * d]);
            }
        }
        let n = rows.len() / d;
        let mut normed = vec![0f32; rows.len()];
        be.rms_norm(&rows, &self.weights.norm, c.rms_eps, &mut normed);
        let mut logits = vec![0f32; n * c.vocab_size];
        be.matmul(&self.weights.output, &normed, n, &mut logits)?;
        let mut it = logits.chunks(c.vocab_size);
        Ok(batch
            .iter()
            .map(|s| {
                (s.logits && !s.tokens.is_empty())
                    .then(|| it.next().expect("one row per chunk").to_vec())
            })
            .collect())
    }
}
