//! The forward on the CPU kernels ([`kernels::Backend`]): every token of the batch goes
//! through each matrix multiplication together; attention is per token over its own sequence's
//! cache. Every kernel computes a row the same way whatever else is in the batch, so a
//! sequence's logits are bitwise identical however it is batched or chunked.

use kernels::{Device, PagedKv, Query};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::forward::{Forward, LayerSink};
use crate::kv_cache::KvCache;
use crate::model::{LayerWeights, SeqChunk, Weights};

/// The CPU forward: the weights and the device whose kernels run them.
pub struct CpuForward {
    /// The model's weights.
    pub weights: Weights,
    /// The CPU device (its backend picks AVX2/AVX-512/portable kernels at run time).
    pub device: Device,
}

/// Where each token of a batch sits: its position, its cache slot in each layer group, and
/// its attention query for each (layer group, attention window) the model's layers use.
struct Rows<'a> {
    positions: Vec<usize>,
    slots: Vec<Vec<usize>>,
    queries: Vec<(QueryKey, Vec<Query<'a>>)>,
}

/// A layer's queries differ by its group (block table) and window.
type QueryKey = (usize, Option<usize>);

impl<'a> Rows<'a> {
    fn new(c: &ModelConfig, kv: &KvCache, batch: &[SeqChunk<'a>]) -> Rows<'a> {
        let positions = batch
            .iter()
            .flat_map(|s| s.start_pos..s.start_pos + s.tokens.len())
            .collect();
        let slots = (0..kv.groups())
            .map(|g| {
                let slot = |s: &SeqChunk<'a>, p| kv.slot(s.block_table.group(g), p);
                batch
                    .iter()
                    .flat_map(|s| (s.start_pos..s.start_pos + s.tokens.len()).map(move |p| (s, p)))
                    .map(|(s, p)| slot(s, p).expect("checked by Model::step"))
                    .collect()
            })
            .collect();
        let mut r = Rows {
            positions,
            slots,
            queries: Vec::new(),
        };
        for (l, la) in c.layers.iter().enumerate() {
            let key = (kv.group_of(l), la.window);
            if r.queries.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let qs = batch
                .iter()
                .flat_map(|s| {
                    (s.start_pos..s.start_pos + s.tokens.len()).map(|pos| Query {
                        pos,
                        first: Query::first_in_window(pos, la.window),
                        block_table: s.block_table.group(key.0),
                    })
                })
                .collect();
            r.queries.push((key, qs));
        }
        r
    }

    fn queries(&self, key: QueryKey) -> &[Query<'a>] {
        let (_, q) = self
            .queries
            .iter()
            .find(|(k, _)| *k == key)
            .expect("one list per group and window");
        q
    }
}

/// One step's activations, `t` tokens.
struct Scratch {
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    kn: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Scratch {
    fn new(c: &ModelConfig, t: usize) -> Scratch {
        let (qd, kvw) = (c.n_heads * c.head_dim, c.kv_width());
        Scratch {
            h: vec![0f32; t * c.dim],
            q: vec![0f32; t * qd],
            k: vec![0f32; t * kvw],
            kn: if c.qk_norm {
                vec![0f32; t * kvw]
            } else {
                Vec::new()
            },
            v: vec![0f32; t * kvw],
            att: vec![0f32; t * qd],
            o: vec![0f32; t * c.dim],
            gate: vec![0f32; t * c.ffn_dim],
            up: vec![0f32; t * c.ffn_dim],
        }
    }
}

/// `x += out`, through a post-norm first where the block has one (`tmp` is scratch of `x`'s
/// size).
fn residual(
    be: &dyn kernels::Backend,
    x: &mut [f32],
    out: &mut [f32],
    tmp: &mut [f32],
    post_norm: Option<&[f32]>,
    eps: f32,
) {
    match post_norm {
        Some(w) => {
            be.rms_norm(out, w, eps, tmp);
            kernels::ops::add_assign(x, tmp);
        }
        None => kernels::ops::add_assign(x, out),
    }
}

/// Adds `bias` to every row of `x`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_mut(bias.len()) {
        kernels::ops::add_assign(row, bias);
    }
}

impl CpuForward {
    /// One transformer block over the batch's residual stream `x`: its K/V stored in `kv`
    /// (then handed to `sink`) before its attention reads the cache.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        c: &ModelConfig,
        l: usize,
        w: &LayerWeights,
        x: &mut [f32],
        s: &mut Scratch,
        r: &Rows<'_>,
        kv: &mut KvCache,
        sink: &mut Option<LayerSink<'_>>,
    ) -> Result<()> {
        let be = self.device.backend();
        let (t, hd, kvw) = (r.positions.len(), c.head_dim, c.kv_width());
        let la = c.layers[l];
        be.rms_norm(x, &w.attn_norm, c.rms_eps, &mut s.h);
        be.matmul_many(
            &s.h,
            t,
            &mut [(&w.wq, &mut s.q), (&w.wk, &mut s.k), (&w.wv, &mut s.v)],
        )?;
        if let Some([bq, bk, bv]) = &w.extra.qkv_bias {
            add_rows(&mut s.q, bq);
            add_rows(&mut s.k, bk);
            add_rows(&mut s.v, bv);
        }
        if let (Some(qn), Some(kn)) = (&w.extra.q_norm, &w.extra.k_norm) {
            // Each head is a row of `head_dim` values to the norm.
            be.rms_norm(&s.q, qn, c.rms_eps, &mut s.att);
            std::mem::swap(&mut s.q, &mut s.att);
            be.rms_norm(&s.k, kn, c.rms_eps, &mut s.kn);
            std::mem::swap(&mut s.k, &mut s.kn);
        }
        let ff = c.rope_freq_factors.as_deref();
        be.rope(
            &mut s.q,
            &r.positions,
            c.n_heads,
            hd,
            la.rope_base,
            c.rope_style,
            ff,
        );
        be.rope(
            &mut s.k,
            &r.positions,
            c.n_kv_heads,
            hd,
            la.rope_base,
            c.rope_style,
            ff,
        );
        let slots = &r.slots[kv.group_of(l)];
        let layer = kv.layer_mut(l);
        be.store_kv(&mut layer.k, &mut layer.v, slots, &s.k, &s.v, kvw);
        if let Some(sink) = sink.as_deref_mut() {
            sink(l, kv);
        }
        let layer = kv.layer(l);
        let paged = PagedKv {
            k: &layer.k,
            v: &layer.v,
            block_size: kv.block_size(),
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
        };
        let queries = r.queries((kv.group_of(l), la.window));
        be.attention(&s.q, queries, paged, c.n_heads, c.attn_scale, &mut s.att);
        be.matmul(&w.wo, &s.att, t, &mut s.o)?;
        residual(
            be,
            x,
            &mut s.o,
            &mut s.h,
            w.extra.post_attn_norm.as_deref(),
            c.rms_eps,
        );
        be.rms_norm(x, &w.ffn_norm, c.rms_eps, &mut s.h);
        be.matmul_many(
            &s.h,
            t,
            &mut [(&w.w_gate, &mut s.gate), (&w.w_up, &mut s.up)],
        )?;
        be.glu(&mut s.gate, &s.up, c.activation);
        be.matmul(&w.w_down, &s.gate, t, &mut s.o)?;
        residual(
            be,
            x,
            &mut s.o,
            &mut s.h,
            w.extra.post_ffn_norm.as_deref(),
            c.rms_eps,
        );
        Ok(())
    }

    /// Logits of the tokens the chunks ask for (see [`crate::Logits`]).
    fn logits(
        &self,
        c: &ModelConfig,
        x: &[f32],
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let (be, d, vocab) = (self.device.backend(), c.dim, c.vocab_size);
        let mut rows = Vec::new();
        let mut start = 0;
        for s in batch {
            let r = s.logits.rows(s.tokens.len());
            rows.extend_from_slice(&x[(start + r.start) * d..(start + r.end) * d]);
            start += s.tokens.len();
        }
        let n = rows.len() / d;
        let mut normed = vec![0f32; rows.len()];
        be.rms_norm(&rows, &self.weights.norm, c.rms_eps, &mut normed);
        let mut logits = vec![0f32; n * vocab];
        be.matmul(&self.weights.output, &normed, n, &mut logits)?;
        let takes = |s: &SeqChunk<'_>| !s.logits.rows(s.tokens.len()).is_empty();
        if batch.iter().filter(|s| takes(s)).count() == 1 {
            // One sequence's rows (a batch-1 or verify step): its logits are all of them.
            return Ok(batch
                .iter()
                .map(|s| takes(s).then(|| std::mem::take(&mut logits)))
                .collect());
        }
        let mut at = 0;
        Ok(batch
            .iter()
            .map(|s| {
                let k = s.logits.rows(s.tokens.len()).len();
                at += k * vocab;
                (k > 0).then(|| logits[at - k * vocab..at].to_vec())
            })
            .collect())
    }

    fn run(
        &self,
        c: &ModelConfig,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        mut sink: Option<LayerSink<'_>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let r = Rows::new(c, kv, batch);
        let t = r.positions.len();
        let mut x = vec![0f32; t * c.dim];
        for (row, &tok) in x.chunks_mut(c.dim).zip(batch.iter().flat_map(|s| s.tokens)) {
            self.weights.embed.dequantize_row(tok as usize, row);
            if c.embed_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= c.embed_scale);
            }
        }
        let mut s = Scratch::new(c, t);
        for (l, w) in self.weights.layers.iter().enumerate() {
            self.layer(c, l, w, &mut x, &mut s, &r, kv, &mut sink)?;
        }
        self.logits(c, &x, batch)
    }
}

impl Forward for CpuForward {
    fn name(&self) -> String {
        self.device.backend().name()
    }

    fn weights(&self) -> Option<&Weights> {
        Some(&self.weights)
    }

    fn forward(
        &self,
        c: &ModelConfig,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        mut sink: Option<LayerSink<'_>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let mut result = None;
        self.device
            .backend()
            .run(&mut || result = Some(self.run(c, kv, batch, sink.take())));
        result.expect("the backend ran the step")
    }
}
