//! The model's forward on a GPU (`device = "cuda:N"`), through `kernels::cuda::llama`.
//!
//! The device KV pool uses the same block numbering as the host [`KvCache`], and the host
//! cache is the one KV crosses workers through (prefill-worker exports, KV transfers,
//! admissions): in a step with KV that leaves the worker (prefill-only requests), the new keys
//! and values come back to the host cache layer by layer (so layer-wise streaming works
//! unchanged); other steps keep theirs on the device (a step without a sink); and KV
//! written on the host — a remote prefill's — is uploaded to the device before its sequence
//! runs. With KV tiers, the host cache is page-locked and mapped into the device
//! ([`GpuPages`]): a cached page the pool evicts is copied off the device into it on its way
//! down to G2/G3, and a page loaded back from them is copied onto the device, each batch of
//! pages in one kernel launch. Without the `cuda` feature the types are uninhabited and none
//! of this can be reached.

use std::sync::{Arc, Mutex};

use kernels::cuda::llama::{GpuBatch, GpuLlama, LayerRefs, LlamaShape};
use kernels::cuda::Gpu;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::forward::{Forward, LayerSink, Mapped, PageDevice};
use crate::kv_cache::{BlockTable, KvCache};
use crate::model::{Model, SeqChunk, Weights};

/// `model` on `gpu`: its weights uploaded, with a device KV pool of `num_blocks` blocks of
/// `block_size` tokens.
pub fn gpu_llama(
    model: &Model,
    gpu: &Arc<Gpu>,
    block_size: usize,
    num_blocks: usize,
) -> Result<GpuLlama> {
    let w = model
        .weights()
        .ok_or_else(|| EngineError::Config("the mock engine has no weights".into()))?;
    llama(&model.config, w, gpu, block_size, num_blocks)
}

fn llama(
    c: &ModelConfig,
    w: &Weights,
    gpu: &Arc<Gpu>,
    block_size: usize,
    num_blocks: usize,
) -> Result<GpuLlama> {
    let layers: Vec<LayerRefs<'_>> = w
        .layers
        .iter()
        .map(|l| LayerRefs {
            attn_norm: &l.attn_norm,
            wq: &l.wq,
            wk: &l.wk,
            wv: &l.wv,
            wo: &l.wo,
            ffn_norm: &l.ffn_norm,
            w_gate: &l.w_gate,
            w_up: &l.w_up,
            w_down: &l.w_down,
        })
        .collect();
    let shape = LlamaShape {
        dim: c.dim,
        n_layers: c.n_layers,
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        hidden: c.ffn_dim,
        vocab: c.vocab_size,
        eps: c.rms_eps,
        rope_base: c.rope_base,
        rope_style: c.rope_style,
    };
    Ok(GpuLlama::new(
        gpu.clone(),
        shape,
        &w.embed,
        &layers,
        &w.norm,
        &w.output,
        block_size,
        num_blocks,
    )?)
}

/// The forward on a CUDA device: the weights (uploaded when the KV pool is set up) and the
/// device pool, created with the cache.
pub struct GpuForward {
    weights: Weights,
    gpu: Arc<Gpu>,
    pool: Arc<Mutex<Option<GpuLlama>>>,
}

impl Forward for GpuForward {
    fn batch_invariant(&self) -> bool {
        false
    }

    fn name(&self) -> String {
        format!("{:?}", self.gpu)
    }

    fn weights(&self) -> Option<&Weights> {
        Some(&self.weights)
    }

    fn prepare_kv(&self, c: &ModelConfig, block_size: usize, num_blocks: usize) -> Result<()> {
        let g = llama(c, &self.weights, &self.gpu, block_size, num_blocks)?;
        *self.pool.lock().expect("gpu lock") = Some(g);
        Ok(())
    }

    fn kv_on_host(&self) -> bool {
        false
    }

    fn kv_written(
        &self,
        c: &ModelConfig,
        kv: &KvCache,
        table: &BlockTable,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        self.upload(kv, c.n_layers, table, range)
    }

    /// Page-locks the host cache and maps it into the device: a page then moves either way
    /// in one kernel launch ([`GpuPages`]).
    fn page_device(&self, kv: &mut KvCache) -> Result<Option<Arc<dyn PageDevice>>> {
        let layers = kv.raw_regions().ok_or_else(|| {
            EngineError::Config("a GPU KV cache has one table of whole layers".into())
        })?;
        let owners = kv.owners();
        let mut g = self.pool.lock().expect("gpu lock");
        let g = g
            .as_mut()
            .ok_or_else(|| EngineError::Internal("the GPU pool is not set up".into()))?;
        // SAFETY: the regions are the host cache's pools, laid out as the device's (the same
        // geometry, `prepare_kv`), kept allocated and unmoved by their owners.
        unsafe { g.map_host_kv(&layers, owners) }?;
        Ok(Some(Arc::new(GpuPages(
            self.pool.clone(),
            self.gpu.clone(),
        ))))
    }

    /// One step on the GPU. With `on_layer`, the host `kv` receives the step's keys and values
    /// layer by layer (each layer's copy waits for the device); without, they stay on the device.
    fn forward(
        &self,
        c: &ModelConfig,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        on_layer: Option<LayerSink<'_>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let max_blocks = batch
            .iter()
            .map(|s| s.block_table.blocks().len())
            .max()
            .unwrap_or(1)
            .max(1);
        let (mut tokens, mut positions, mut slots, mut seq) = (vec![], vec![], vec![], vec![]);
        let mut tables = vec![0u32; batch.len() * max_blocks];
        let mut last_rows = Vec::with_capacity(batch.len());
        for (i, s) in batch.iter().enumerate() {
            let end = s.start_pos + s.tokens.len();
            if end > c.context_len {
                return Err(EngineError::Internal(format!(
                    "sequence of {end} tokens exceeds the model's context of {}",
                    c.context_len
                )));
            }
            let blocks = s.block_table.blocks();
            tables[i * max_blocks..i * max_blocks + blocks.len()].copy_from_slice(blocks);
            for (j, &t) in s.tokens.iter().enumerate() {
                let p = s.start_pos + j;
                let slot = kv.slot(blocks, p).ok_or_else(|| {
                    EngineError::Internal(format!("block table does not cover position {p}"))
                })?;
                if t as usize >= c.vocab_size {
                    return Err(EngineError::Internal(format!(
                        "token id {t} is outside the vocabulary of {}",
                        c.vocab_size
                    )));
                }
                tokens.push(t);
                positions.push(p as u32);
                slots.push(slot as u32);
                seq.push(i as u32);
            }
            let r = s.logits.rows(s.tokens.len());
            let first = tokens.len() - s.tokens.len();
            last_rows.push((first + r.start)..(first + r.end));
        }
        let host_slots: Vec<usize> = slots.iter().map(|&s| s as usize).collect();
        let width = c.kv_width();
        let mirror = on_layer.map(|on_layer| {
            move |l: usize, k: &[f32], v: &[f32]| {
                let layer = kv.layer_mut(l);
                kernels::Backend::store_kv(
                    &kernels::CpuBackend,
                    &mut layer.k,
                    &mut layer.v,
                    &host_slots,
                    k,
                    v,
                    width,
                );
                on_layer(l, kv);
            }
        });
        let logit_rows: Vec<u32> = last_rows
            .iter()
            .flat_map(|r| r.clone().map(|i| i as u32))
            .collect();
        let b = GpuBatch {
            tokens: &tokens,
            positions: &positions,
            slots: &slots,
            seq: &seq,
            block_tables: &tables,
            max_blocks,
            logit_rows: &logit_rows,
        };
        let logits = {
            let mut g = self.pool.lock().expect("gpu lock");
            let g = g
                .as_mut()
                .ok_or_else(|| EngineError::Internal("the GPU pool is not set up".into()))?;
            match mirror {
                Some(mut m) => g.forward_streaming(&b, Some(&mut m))?,
                None => g.forward_streaming(&b, None)?,
            }
        };
        if logits.len() != logit_rows.len() * c.vocab_size {
            return Err(EngineError::Kernel(kernels::KernelError::Shape(format!(
                "the GPU returned {} logits for {} rows of {}",
                logits.len(),
                logit_rows.len(),
                c.vocab_size
            ))));
        }
        let mut at = 0;
        Ok(last_rows
            .into_iter()
            .map(|r| {
                let n = r.len() * c.vocab_size;
                at += n;
                (n > 0).then(|| logits[at - n..at].to_vec())
            })
            .collect())
    }
}

impl GpuForward {
    /// `weights` to run on `gpu`.
    pub fn new(weights: Weights, gpu: Arc<Gpu>) -> GpuForward {
        GpuForward {
            weights,
            gpu,
            pool: Arc::new(Mutex::new(None)),
        }
    }

    /// Copies the host cache's tokens `range` of `table` (from a block's first token) to the
    /// device (KV that was written on the host).
    fn upload(
        &self,
        kv: &KvCache,
        n_layers: usize,
        table: &BlockTable,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let mut g = self.pool.lock().expect("gpu lock");
        let Some(g) = g.as_mut() else { return Ok(()) };
        let bs = kv.block_size();
        if range.is_empty() {
            return Ok(());
        }
        if !range.start.is_multiple_of(bs) {
            return Err(EngineError::Internal(format!(
                "KV written from token {}, inside a block of {bs}",
                range.start
            )));
        }
        let blocks = &table.blocks()[range.start / bs..];
        let mut bytes = Vec::new();
        for l in 0..n_layers {
            bytes.clear();
            kv.read_range(table, l, range.clone(), &mut bytes);
            let wire: Vec<u16> = bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            g.upload_kv(l, blocks, &wire, range.len())?;
        }
        Ok(())
    }
}

/// The pages of a GPU's KV pool and the engine's host cache mapped into it (see
/// [`GpuForward::page_device`]).
struct GpuPages(Arc<Mutex<Option<GpuLlama>>>, Arc<Gpu>);

impl GpuPages {
    /// `f` on the device pool.
    fn with<R>(
        &self,
        f: impl FnOnce(&mut GpuLlama) -> std::result::Result<R, kernels::KernelError>,
    ) -> Result<R> {
        let mut g = self.0.lock().expect("gpu lock");
        let g = g
            .as_mut()
            .ok_or_else(|| EngineError::Internal("the GPU pool is not set up".into()))?;
        Ok(f(g)?)
    }
}

impl PageDevice for GpuPages {
    unsafe fn map(&self, at: *mut u8, len: usize) -> Result<Mapped> {
        // SAFETY: the caller keeps the memory allocated and unmoved while mapped.
        let m = unsafe { self.1.map_host(at as usize, len) }?;
        Ok(Mapped {
            addr: m.device_addr(),
            guard: Box::new(m),
        })
    }

    unsafe fn page_from(&self, src: u64, page: u32) -> Result<()> {
        // SAFETY: the caller's contract is the kernel's.
        self.with(|g| unsafe { g.page_from_host(src, page) })
    }

    fn sync(&self) -> Result<()> {
        self.with(|g| g.sync())
    }

    fn to_host(&self, pages: &[u32]) -> Result<()> {
        self.with(|g| g.pages_to_host(pages))
    }

    fn to_device(&self, pages: &[u32]) -> Result<()> {
        self.with(|g| g.pages_to_device(pages))
    }
}
