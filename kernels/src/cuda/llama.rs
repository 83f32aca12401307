//! The Llama forward pass on one GPU, from the kernels of `kernels/cuda/` and cuBLAS: weights
//! resident in bf16 (GGUF blocks dequantised on the device at load), bf16 GEMMs with f32
//! accumulation and f32 outputs, f32 activations, an f16 paged KV pool on the device with the
//! same block numbering as the engine's. The engine drives it for `device = "cuda:N"`
//! (`engine/src/gpu.rs`); checked against the CPU engine by the GPU suite
//! (`tests/tests/gpu_model.rs`).

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice};

use super::{err, AttentionShape, Gpu};
pub use crate::gpu_types::{GpuBatch, LayerRefs, LlamaShape};
use crate::{DType, KernelError, Matrix};

/// A weight matrix on the device: bf16, `[rows, cols]` row-major.
struct DevMatrix {
    w: CudaSlice<u16>,
    rows: usize,
    cols: usize,
}

struct DevLayer {
    attn_norm: CudaSlice<f32>,
    wq: DevMatrix,
    wk: DevMatrix,
    wv: DevMatrix,
    wo: DevMatrix,
    ffn_norm: CudaSlice<f32>,
    w_gate: DevMatrix,
    w_up: DevMatrix,
    w_down: DevMatrix,
}

/// A page-locked host buffer that grows to the largest copy seen. Each layer's new keys and
/// values leave the device through these (for the host mirror and the KV transfer), at full bus
/// speed where pageable memory would be staged a second time by the driver. Not write-combined:
/// the host reads them.
#[derive(Default)]
struct Pinned {
    host: Option<PinnedHostSlice<f32>>,
}

impl Pinned {
    /// Copies `dev` (all of it) into this buffer and returns the copy.
    fn download<'a>(
        &'a mut self,
        gpu: &Gpu,
        dev: &CudaSlice<f32>,
    ) -> Result<&'a [f32], KernelError> {
        let n = dev.len();
        if self.host.as_ref().is_none_or(|h| h.len() < n) {
            // SAFETY: the buffer is written by the copy below before any of it is read.
            let h = unsafe {
                gpu.context()
                    .alloc_pinned_with_flags::<f32>(n.next_power_of_two(), 0)
            }
            .map_err(|e| err("pinned host buffer", e))?;
            self.host = Some(h);
        }
        let host = (self.host.as_mut().expect("allocated above"))
            .as_mut_slice()
            .map_err(|e| err("pinned host buffer", e))?;
        // Exactly n values: a copy into the whole (larger) buffer would read past `dev`. The
        // copy into page-locked memory is asynchronous, hence the wait.
        let s = gpu.stream();
        s.memcpy_dtoh(dev, &mut host[..n])
            .and_then(|()| s.synchronize())
            .map_err(|e| err("download to pinned memory", e))?;
        Ok(&host[..n])
    }
}

/// A Llama model resident on one GPU, with its KV pool.
pub struct GpuLlama {
    gpu: Arc<Gpu>,
    blas: CudaBlas,
    shape: LlamaShape,
    embed: CudaSlice<u16>,
    layers: Vec<DevLayer>,
    norm: CudaSlice<f32>,
    output: DevMatrix,
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    block_size: usize,
    staging: (Pinned, Pinned),
    /// The engine's host copy of the pool, mapped (see [`GpuLlama::map_host_kv`]).
    host: Option<HostKv>,
}

/// The engine's host copy of the KV pool, page-locked and mapped into the device's address
/// space, so a batch of pages moves between it and the device pool in one kernel launch, at
/// bus speed (KV tiers: a page evicted from the pool is read off the device on its way down
/// to host memory and disk, one loaded from them is written back). Unregistered when dropped,
/// before the memory's owners are let go.
struct HostKv {
    /// Every segment's pool (each layer's keys, then its values) as the device addresses it:
    /// on the device, and the host copy.
    device: CudaSlice<u64>,
    mapped: CudaSlice<u64>,
    page_bytes: usize,
    /// Declared before the owners: unregistered first.
    _regions: Vec<super::HostMapping>,
    _owners: Vec<Arc<dyn Send + Sync>>,
}

fn to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

impl GpuLlama {
    /// Uploads the weights (GGUF blocks dequantised on the device, other formats converted to
    /// bf16 on the host) and allocates a KV pool of `num_blocks` blocks of `block_size` tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: Arc<Gpu>,
        shape: LlamaShape,
        embed: &Matrix,
        layers: &[LayerRefs<'_>],
        norm: &[f32],
        output: &Matrix,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<GpuLlama, KernelError> {
        let blas = CudaBlas::new(gpu.stream().clone()).map_err(|e| err("cuBLAS", e))?;
        let m = |w: &Matrix| upload_matrix(&gpu, w);
        let v = |x: &[f32]| gpu.upload(x);
        let mut dev = Vec::with_capacity(layers.len());
        for l in layers {
            dev.push(DevLayer {
                attn_norm: v(l.attn_norm)?,
                wq: m(l.wq)?,
                wk: m(l.wk)?,
                wv: m(l.wv)?,
                wo: m(l.wo)?,
                ffn_norm: v(l.ffn_norm)?,
                w_gate: m(l.w_gate)?,
                w_up: m(l.w_up)?,
                w_down: m(l.w_down)?,
            });
        }
        let width = shape.n_kv_heads * shape.head_dim;
        let pool = num_blocks * block_size * width;
        let mut k = Vec::with_capacity(shape.n_layers);
        let mut vv = Vec::with_capacity(shape.n_layers);
        for _ in 0..shape.n_layers {
            k.push(gpu.zeros::<u16>(pool)?);
            vv.push(gpu.zeros::<u16>(pool)?);
        }
        Ok(GpuLlama {
            embed: m(embed)?.w,
            norm: v(norm)?,
            output: m(output)?,
            layers: dev,
            k,
            v: vv,
            gpu,
            blas,
            shape,
            block_size,
            staging: Default::default(),
            host: None,
        })
    }

    /// `y[m, rows] = xb[m, cols] · W[rows, cols]^T`: `xb` is the input already in bf16 (one
    /// conversion serves every matrix that reads the same input), `y` f32.
    fn linear(
        &self,
        xb: &CudaSlice<u16>,
        m: usize,
        w: &DevMatrix,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let stream = self.gpu.stream();
        let (alpha, beta) = (1f32, 0f32);
        let (a, _ra) = w.w.device_ptr(stream);
        let (b, _rb) = xb.device_ptr(stream);
        let (c, _rc) = y.device_ptr_mut(stream);
        // Row-major y = x W^T is column-major y^T = W x^T: op(A) = W^T (A = W col-major
        // [cols, rows]), B = x^T (col-major [cols, m]).
        // SAFETY: W holds rows × cols, xb at least m × cols, y m × rows, all on this stream.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                w.rows as i32,
                m as i32,
                w.cols as i32,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                w.cols as i32,
                b as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                w.cols as i32,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                w.rows as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| err("cublasGemmEx", format!("{e:?}")))
    }

    /// Runs one step and returns the logits of the batch's `logit_rows` (`[rows, vocab]`).
    pub fn forward(&mut self, b: &GpuBatch<'_>) -> Result<Vec<f32>, KernelError> {
        self.forward_streaming(b, None)
    }

    /// Writes one layer of a sequence's first `n` tokens, in the transfer's wire layout (`[2,
    /// n, width]` f16 bits), into its blocks `table` of the device pool (KV that arrived from
    /// a prefill worker, or any KV written on the host). `table` may start at any block of a
    /// sequence: its first token is the block's first.
    pub fn upload_kv(
        &mut self,
        layer: usize,
        table: &[u32],
        wire: &[u16],
        n: usize,
    ) -> Result<(), KernelError> {
        let staging = self.gpu.upload(wire)?;
        let t = self.gpu.upload(table)?;
        let span = super::KvSpan {
            n,
            width: self.shape.n_kv_heads * self.shape.head_dim,
            block_size: self.block_size,
        };
        let (k, v) = (&mut self.k[layer], &mut self.v[layer]);
        self.gpu.unpack_kv(k, v, &t, &staging, span)
    }

    /// Maps the engine's host copy of the pool into the device: `layers` (each layer's keys
    /// and values, as (address, bytes)) page-locked and addressed by the device, kept
    /// allocated by `owners` while mapped. Afterwards [`GpuLlama::pages_to_host`] and
    /// [`GpuLlama::pages_to_device`] move pages between them.
    ///
    /// # Safety
    ///
    /// Each region must be memory of that many bytes that `owners` keep allocated and unmoved,
    /// laid out as the device pool is (the same blocks of `block_size` tokens, f16).
    pub unsafe fn map_host_kv(
        &mut self,
        layers: &[[(usize, usize); 2]],
        owners: Vec<Arc<dyn Send + Sync>>,
    ) -> Result<(), KernelError> {
        let pool = self.k.first().map_or(0, |k| k.len() * 2);
        if layers.len() != self.k.len() || layers.iter().flatten().any(|&(_, n)| n != pool) {
            return Err(err(
                "mapping the host KV cache",
                format!("{} layers of {pool} bytes expected", self.k.len()),
            ));
        }
        let mut regions = Vec::new();
        for &(at, n) in layers.iter().flatten() {
            // SAFETY: the caller vouches for the region.
            regions.push(unsafe { self.gpu.map_host(at, n) }?);
        }
        let mapped: Vec<u64> = regions.iter().map(|r| r.device_addr()).collect();
        let stream = self.gpu.stream();
        let device: Vec<u64> = (self.k.iter().zip(&self.v))
            .flat_map(|(k, v)| [k.device_ptr(stream).0, v.device_ptr(stream).0])
            .collect();
        self.host = Some(HostKv {
            device: self.gpu.upload(&device)?,
            mapped: self.gpu.upload(&mapped)?,
            page_bytes: self.block_size * self.shape.n_kv_heads * self.shape.head_dim * 2,
            _regions: regions,
            _owners: owners,
        });
        Ok(())
    }

    /// Starts copying one page laid out contiguously at device address `src` (mapped host
    /// memory, [`super::Gpu::map_host`]: each layer's keys, then its values) into page `page`
    /// of the device pool and of the mapped host copy; done by the next
    /// [`GpuLlama::sync`] (or page copy).
    ///
    /// # Safety
    ///
    /// `src` must be mapped memory holding a whole page of every layer, left unchanged until
    /// then.
    pub unsafe fn page_from_host(&mut self, src: u64, page: u32) -> Result<(), KernelError> {
        let h = self
            .host
            .as_ref()
            .ok_or_else(|| err("copying a KV page", "the host KV cache is not mapped"))?;
        self.gpu
            .page_from_host(&h.device, &h.mapped, src, page, h.page_bytes)
    }

    /// Waits for everything queued on the device.
    pub fn sync(&self) -> Result<(), KernelError> {
        self.gpu
            .stream()
            .synchronize()
            .map_err(|e| err("waiting for the device", e))
    }

    /// Copies `pages` of every layer from the device pool into the mapped host copy, and
    /// waits for them.
    pub fn pages_to_host(&mut self, pages: &[u32]) -> Result<(), KernelError> {
        self.copy_pages(pages, true)
    }

    /// Copies `pages` of every layer from the mapped host copy into the device pool, and
    /// waits for them.
    pub fn pages_to_device(&mut self, pages: &[u32]) -> Result<(), KernelError> {
        self.copy_pages(pages, false)
    }

    fn copy_pages(&mut self, pages: &[u32], to_host: bool) -> Result<(), KernelError> {
        let h = self
            .host
            .as_ref()
            .ok_or_else(|| err("copying KV pages", "the host KV cache is not mapped"))?;
        if pages.is_empty() {
            return Ok(());
        }
        let p = self.gpu.upload(pages)?;
        let (dst, src) = match to_host {
            true => (&h.mapped, &h.device),
            false => (&h.device, &h.mapped),
        };
        self.gpu.copy_pages(dst, src, &p, h.page_bytes)?;
        self.gpu
            .stream()
            .synchronize()
            .map_err(|e| err("copying KV pages", e))
    }

    /// [`GpuLlama::forward`], handing each layer's new keys and values (f32, `[tokens, width]`)
    /// to `on_layer` as soon as that layer has run, so a host mirror of the pool can follow
    /// and stream them.
    pub fn forward_streaming(
        &mut self,
        b: &GpuBatch<'_>,
        mut on_layer: Option<&mut dyn FnMut(usize, &[f32], &[f32])>,
    ) -> Result<Vec<f32>, KernelError> {
        let s = self.shape;
        let g = self.gpu.clone();
        let t = b.tokens.len();
        let (qd, kvw) = (s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim);
        let ids = g.upload(b.tokens)?;
        let pos = g.upload(b.positions)?;
        let slots = g.upload(b.slots)?;
        let seq = g.upload(b.seq)?;
        let tables = g.upload(b.block_tables)?;
        // Every buffer below is written whole before it is read (the CUDA emulator's NaN-filled
        // allocations check that), so none is zeroed first.
        let mut x = g.uninit::<f32>(t * s.dim)?;
        g.embedding(&self.embed, &ids, t, s.dim, &mut x)?;
        let mut h = g.uninit::<f32>(t * s.dim)?;
        let (mut q, mut k, mut v) = (
            g.uninit::<f32>(t * qd)?,
            g.uninit::<f32>(t * kvw)?,
            g.uninit::<f32>(t * kvw)?,
        );
        let mut att = g.uninit::<f32>(t * qd)?;
        let mut o = g.uninit::<f32>(t * s.dim)?;
        let (mut gate, mut up) = (
            g.uninit::<f32>(t * s.hidden)?,
            g.uninit::<f32>(t * s.hidden)?,
        );
        let mut xb = g.uninit::<u16>(t * s.dim.max(qd).max(s.hidden))?;
        let shape = AttentionShape {
            n_heads: s.n_heads,
            n_kv_heads: s.n_kv_heads,
            head_dim: s.head_dim,
            block_size: self.block_size,
            max_blocks: b.max_blocks,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
        };
        for l in 0..s.n_layers {
            let w = &self.layers[l];
            g.rms_norm(&x, &w.attn_norm, t, s.dim, s.eps, &mut h)?;
            g.to_bf16(&h, &mut xb, t * s.dim)?;
            self.linear(&xb, t, &w.wq, &mut q)?;
            self.linear(&xb, t, &w.wk, &mut k)?;
            self.linear(&xb, t, &w.wv, &mut v)?;
            g.rope(
                &mut q,
                &pos,
                t,
                s.n_heads,
                s.head_dim,
                s.rope_base,
                s.rope_style,
            )?;
            g.rope(
                &mut k,
                &pos,
                t,
                s.n_kv_heads,
                s.head_dim,
                s.rope_base,
                s.rope_style,
            )?;
            let (kc, vc) = (&mut self.k[l], &mut self.v[l]);
            g.store_kv(kc, vc, &slots, &k, &v, t, kvw)?;
            if let Some(f) = on_layer.as_deref_mut() {
                let (sk, sv) = &mut self.staging;
                f(l, sk.download(&g, &k)?, sv.download(&g, &v)?);
            }
            g.paged_attention(
                &q, &mut att, &self.k[l], &self.v[l], &tables, &seq, &pos, t, shape,
            )?;
            g.to_bf16(&att, &mut xb, t * qd)?;
            self.linear(&xb, t, &w.wo, &mut o)?;
            g.add_into(&mut x, &o, t * s.dim)?;
            g.rms_norm(&x, &w.ffn_norm, t, s.dim, s.eps, &mut h)?;
            g.to_bf16(&h, &mut xb, t * s.dim)?;
            self.linear(&xb, t, &w.w_gate, &mut gate)?;
            self.linear(&xb, t, &w.w_up, &mut up)?;
            g.silu_mul(&mut gate, &up, t * s.hidden)?;
            g.to_bf16(&gate, &mut xb, t * s.hidden)?;
            self.linear(&xb, t, &w.w_down, &mut o)?;
            g.add_into(&mut x, &o, t * s.dim)?;
        }
        // The LM head on the rows that sample alone (a prompt's last token, not all of it).
        let r = b.logit_rows.len();
        if r == 0 {
            return Ok(Vec::new());
        }
        let rows = g.upload(b.logit_rows)?;
        let mut last = g.uninit::<f32>(r * s.dim)?;
        g.gather_rows(&x, &rows, s.dim, &mut last)?;
        g.rms_norm(&last, &self.norm, r, s.dim, s.eps, &mut h)?;
        g.to_bf16(&h, &mut xb, r * s.dim)?;
        let mut logits = g.uninit::<f32>(r * s.vocab)?;
        self.linear(&xb, r, &self.output, &mut logits)?;
        g.download(&logits)
    }
}

fn upload_matrix(gpu: &Gpu, w: &Matrix) -> Result<DevMatrix, KernelError> {
    let (rows, cols) = (w.rows(), w.cols());
    let data = match w.dtype() {
        DType::Q4_0 | DType::Q4_1 | DType::Q8_0 | DType::Q4_K | DType::Q6_K => {
            let bytes = gpu.upload(w.bytes())?;
            gpu.dequantize(w.dtype(), &bytes, rows * cols / w.dtype().block_len())?
        }
        _ => {
            let mut row = vec![0f32; cols];
            let mut host = Vec::with_capacity(rows * cols);
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                host.extend(row.iter().map(|&x| to_bf16(x)));
            }
            gpu.upload(&host)?
        }
    };
    Ok(DevMatrix {
        w: data,
        rows,
        cols,
    })
}
