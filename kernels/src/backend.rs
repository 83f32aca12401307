//! The backend seam: the model's forward pass calls kernels only through [`Backend`].
//!
//! [`Device`] dispatches by enum, so the choice of backend is made once, at model load. Today the
//! CPU backend is the only one; a CUDA backend slots in as another variant.

use half::f16;

use crate::{attention, matmul, ops, Activation, KernelError, Matrix, PagedKv, Query, RopeStyle};

/// The kernels a Llama forward pass needs. Activations are row-major f32 host slices.
pub trait Backend: Send + Sync {
    /// Short name for logs ("cpu-avx2", …).
    fn name(&self) -> String;
    /// `out[m, n] = x[m, :] . w[n, :]`.
    fn matmul(&self, w: &Matrix, x: &[f32], m: usize, out: &mut [f32]) -> Result<(), KernelError>;
    /// Several matmuls of the same activations, `outs[i].1 = x . outs[i].0^T`.
    fn matmul_many(
        &self,
        x: &[f32],
        m: usize,
        outs: &mut [(&Matrix, &mut [f32])],
    ) -> Result<(), KernelError>;
    /// Runs `f` where this backend's parallel kernels are cheapest to call (the CPU pool).
    fn run(&self, f: &mut (dyn FnMut() + Send));
    /// Row-wise RMSNorm scaled by `weight`.
    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]);
    /// In-place rotary embedding of rows at `positions` (pair `i`'s angle divided by
    /// `factors[i]` where given).
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[usize],
        n_heads: usize,
        head_dim: usize,
        base: f32,
        style: RopeStyle,
        factors: Option<&[f32]>,
    );
    /// `gate = act(gate) * up`.
    fn glu(&self, gate: &mut [f32], up: &[f32], act: Activation);
    /// Causal attention of `q` over a paged cache.
    fn attention(
        &self,
        q: &[f32],
        queries: &[Query<'_>],
        kv: PagedKv<'_>,
        n_heads: usize,
        scale: f32,
        out: &mut [f32],
    );
    /// Writes rows of keys and values (f32) into their cache slots as f16.
    fn store_kv(
        &self,
        k_cache: &mut [f16],
        v_cache: &mut [f16],
        slots: &[usize],
        k: &[f32],
        v: &[f32],
        width: usize,
    );
}

/// CPU backend: the kernels of this crate, on its thread pool.
#[derive(Debug, Clone, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        let vnni = match (crate::vnni(), crate::avx512()) {
            (true, true) => "+avx512vnni",
            (true, false) => "+vnni",
            _ => "",
        };
        format!("cpu-{:?}{vnni}", crate::isa()).to_lowercase()
    }
    fn matmul(&self, w: &Matrix, x: &[f32], m: usize, out: &mut [f32]) -> Result<(), KernelError> {
        matmul::matmul(w, x, m, out)
    }
    fn matmul_many(
        &self,
        x: &[f32],
        m: usize,
        outs: &mut [(&Matrix, &mut [f32])],
    ) -> Result<(), KernelError> {
        matmul::matmul_many(x, m, outs)
    }
    fn run(&self, f: &mut (dyn FnMut() + Send)) {
        f()
    }
    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        ops::rms_norm(x, weight, eps, out)
    }
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[usize],
        n_heads: usize,
        head_dim: usize,
        base: f32,
        style: RopeStyle,
        factors: Option<&[f32]>,
    ) {
        ops::rope(x, positions, n_heads, head_dim, base, style, factors)
    }
    fn glu(&self, gate: &mut [f32], up: &[f32], act: Activation) {
        ops::glu(gate, up, act)
    }
    fn attention(
        &self,
        q: &[f32],
        queries: &[Query<'_>],
        kv: PagedKv<'_>,
        n_heads: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        attention::attention(q, queries, kv, n_heads, scale, out)
    }
    fn store_kv(
        &self,
        k_cache: &mut [f16],
        v_cache: &mut [f16],
        slots: &[usize],
        k: &[f32],
        v: &[f32],
        width: usize,
    ) {
        for (t, &slot) in slots.iter().enumerate() {
            let dst = slot * width;
            half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                &mut k_cache[dst..dst + width],
                &k[t * width..(t + 1) * width],
            );
            half::slice::HalfFloatSliceExt::convert_from_f32_slice(
                &mut v_cache[dst..dst + width],
                &v[t * width..(t + 1) * width],
            );
        }
    }
}

/// The backend a model runs on, chosen at load time.
#[derive(Debug, Clone)]
pub enum Device {
    /// The CPU kernels.
    Cpu(CpuBackend),
    /// A GPU: the model's forward runs there (`kernels::cuda::llama`); host-side work (norms
    /// of loaded vectors and the like) still uses the CPU kernels.
    Cuda(std::sync::Arc<crate::cuda::Gpu>),
}

impl Device {
    /// Parses a device name: `cpu` (the default) or `cuda:N`. A CUDA device is opened (driver,
    /// NVRTC, kernels) here, so a missing GPU or driver is a clear error at start, never a
    /// silent CPU fallback.
    pub fn parse(name: &str) -> Result<Device, KernelError> {
        if name == "cpu" {
            return Ok(Device::Cpu(CpuBackend));
        }
        if let Some(n) = name.strip_prefix("cuda").map(|r| r.trim_start_matches(':')) {
            let ordinal: usize = if n.is_empty() {
                0
            } else {
                n.parse().map_err(|_| {
                    KernelError::Unavailable(format!("device {name:?}: expected cuda:N"))
                })?
            };
            return Ok(Device::Cuda(std::sync::Arc::new(crate::cuda::Gpu::new(
                ordinal,
            )?)));
        }
        Err(KernelError::Unavailable(format!(
            "unknown device {name:?} (expected \"cpu\" or \"cuda:N\")"
        )))
    }

    /// The backend behind this device.
    pub fn backend(&self) -> &dyn Backend {
        static CPU: CpuBackend = CpuBackend;
        match self {
            Device::Cpu(b) => b,
            Device::Cuda(_) => &CPU,
        }
    }

    /// The GPU, for a CUDA device.
    pub fn gpu(&self) -> Option<&std::sync::Arc<crate::cuda::Gpu>> {
        match self {
            Device::Cpu(_) => None,
            Device::Cuda(g) => Some(g),
        }
    }
}
