//! The CUDA kernels (feature `cuda`): `cuda/*.cu` compiled by NVRTC at start for the device's
//! architecture (cached per architecture on disk), launched through cudarc with dynamic loading
//! — so tandem builds without a CUDA toolkit, and a machine without a driver gets a clear error
//! instead of cudarc's panic. [`compile_all`] needs only libnvrtc, not a GPU: CI uses it to
//! compile every kernel for sm_80 and sm_90.
//!
//! What is here: every kernel of the forward pass and its typed launch wrapper, tested against
//! the CPU kernels on a GPU (`kernels/tests/cuda.rs`), and the Llama forward built from them
//! ([`llama`]), which the engine runs for `device = "cuda:N"` (`engine/src/gpu.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::KernelError;

pub mod emu;
pub mod llama;

const COMMON: &str = include_str!("../cuda/common.cuh");

/// Every kernel source file, by name.
pub const SOURCES: [(&str, &str); 5] = [
    ("elementwise", include_str!("../cuda/elementwise.cu")),
    ("dequant", include_str!("../cuda/dequant.cu")),
    ("attention", include_str!("../cuda/attention.cu")),
    ("kv", include_str!("../cuda/kv.cu")),
    ("sampling", include_str!("../cuda/sampling.cu")),
];

/// The kernels (`extern "C"` names) each source defines.
const FUNCTIONS: [(&str, &[&str]); 5] = [
    (
        "elementwise",
        &[
            "embedding_bf16",
            "rms_norm",
            "rope",
            "silu_mul",
            "add_into",
            "f32_to_bf16_rows",
            "gather_rows",
        ],
    ),
    (
        "dequant",
        &[
            "dequant_q4_0",
            "dequant_q4_1",
            "dequant_q8_0",
            "dequant_q4_k",
            "dequant_q6_k",
        ],
    ),
    ("attention", &["paged_attention"]),
    (
        "kv",
        &[
            "store_kv",
            "pack_kv",
            "unpack_kv",
            "copy_pages",
            "page_from_host",
        ],
    ),
    ("sampling", &["argmax_rows", "sample_top_k_top_p"]),
];

pub(crate) fn err(what: &str, e: impl std::fmt::Display) -> KernelError {
    KernelError::Unavailable(format!("CUDA: {what}: {e}"))
}

/// A source with the shared helpers put in place of its `#include "common.cuh"` (NVRTC gets no
/// include path).
pub fn source(name: &str) -> Option<String> {
    let src = SOURCES.iter().find(|(n, _)| *n == name)?.1;
    let common = COMMON.replace("#pragma once", "");
    Some(src.replace("#include \"common.cuh\"", &common))
}

fn nvrtc_present() -> Result<(), KernelError> {
    // SAFETY: only tries to open the library; cudarc would panic on first use without it.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(KernelError::Unavailable(
            "CUDA: libnvrtc not found (install the CUDA toolkit, or the `nvidia-cuda-nvrtc` \
             wheel and put its lib directory on LD_LIBRARY_PATH)"
                .into(),
        ))
    }
}

/// Compiles one source to PTX for `arch` (`"sm_80"`, `"sm_90"`, …). Needs libnvrtc, no GPU.
pub fn compile(name: &str, arch: &'static str) -> Result<String, KernelError> {
    nvrtc_present()?;
    let src = source(name).ok_or_else(|| err("no kernel source", name))?;
    let opts = CompileOptions {
        arch: Some(arch),
        use_fast_math: Some(false),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts)
        .map_err(|e| err(&format!("compiling {name}.cu for {arch}"), format!("{e:?}")))?;
    Ok(ptx.to_src())
}

/// Every source compiled for `arch`: (name, PTX).
pub fn compile_all(arch: &'static str) -> Result<Vec<(&'static str, String)>, KernelError> {
    SOURCES
        .iter()
        .map(|(n, _)| Ok((*n, compile(n, arch)?)))
        .collect()
}

fn arch_name(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (9, _) => "sm_90",
        (10, _) => "sm_100",
        (12, _) => "sm_120",
        _ => "sm_80",
    }
}

/// PTX for `arch`, from `~/.cache/tandem/ptx` when this exact source was compiled before.
fn cached_ptx(name: &str, arch: &'static str) -> Result<String, KernelError> {
    let src = source(name).unwrap_or_default();
    let key = format!("{:016x}", fxhash(src.as_bytes()));
    let dir = std::env::var_os("HOME")
        .map(|h| std::path::PathBuf::from(h).join(".cache/tandem/ptx"))
        .unwrap_or_else(|| std::env::temp_dir().join("tandem-ptx"));
    let path = dir.join(format!("{name}-{arch}-{key}.ptx"));
    if let Ok(p) = std::fs::read_to_string(&path) {
        return Ok(p);
    }
    let ptx = compile(name, arch)?;
    let _ = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, &ptx));
    Ok(ptx)
}

fn fxhash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// One GPU with every kernel loaded.
pub struct Gpu {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    arch: &'static str,
}

fn grid(n: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(block).max(1), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn launched(
    r: Result<
        Option<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
        cudarc::driver::DriverError,
    >,
) -> Result<(), KernelError> {
    r.map(|_| ()).map_err(|e| err("launch", e))
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{} ({})", self.ordinal, self.arch)
    }
}

impl Gpu {
    /// Opens device `ordinal` and loads every kernel, compiled for its architecture.
    pub fn new(ordinal: usize) -> Result<Gpu, KernelError> {
        // SAFETY: only tries to open the driver library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::Unavailable(
                "CUDA: no driver (libcuda) on this machine".into(),
            ));
        }
        nvrtc_present()?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| err(&format!("opening cuda:{ordinal}"), e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| err("compute capability", e))?;
        let arch = arch_name(major, minor);
        let mut functions = HashMap::new();
        for (name, fns) in FUNCTIONS {
            let ptx = cached_ptx(name, arch)?;
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(|e| err(&format!("loading {name}.cu"), e))?;
            for f in fns {
                let func = module
                    .load_function(f)
                    .map_err(|e| err(&format!("kernel {f}"), e))?;
                functions.insert(*f, func);
            }
        }
        // One stream does all of this GPU's work, so cudarc's cross-stream event tracking (two
        // events a buffer) buys nothing.
        // SAFETY: every buffer of this Gpu is used on its one stream only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        Ok(Gpu {
            ordinal,
            ctx,
            stream,
            functions,
            arch,
        })
    }

    /// The architecture the kernels were compiled for.
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn f(&self, name: &str) -> &CudaFunction {
        &self.functions[name]
    }

    /// Copies host data to a new device buffer.
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, KernelError> {
        self.stream.clone_htod(host).map_err(|e| err("upload", e))
    }

    /// Copies a device buffer back.
    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, KernelError> {
        self.stream.clone_dtoh(dev).map_err(|e| err("download", e))
    }

    /// A device buffer of `n` values left as the allocator gives it: for buffers the caller
    /// writes whole before reading (any bits are a valid `T`, so reading early gives garbage
    /// numbers, never undefined behaviour).
    pub fn uninit<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        // SAFETY: device memory is not Rust memory; `T` is a plain number type for which any
        // bits are a value (ValidAsZeroBits), and the callers write it before reading.
        unsafe { self.stream.alloc(n) }.map_err(|e| err("alloc", e))
    }

    /// A zeroed device buffer.
    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        self.stream.alloc_zeros(n).map_err(|e| err("alloc", e))
    }

    /// Rows `ids` of a bf16 `table` (`[vocab, dim]`) into `out` (`[ids, dim]` f32).
    pub fn embedding(
        &self,
        table: &CudaSlice<u16>,
        ids: &CudaSlice<u32>,
        n: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let dim = dim as i32;
        let cfg = per_row(n, 256);
        let mut b = self.stream.launch_builder(self.f("embedding_bf16"));
        b.arg(table).arg(ids).arg(out).arg(&dim);
        // SAFETY: buffers sized by the caller: table covers every id, out holds n × dim.
        launched(unsafe { b.launch(cfg) })
    }

    /// Row-wise RMSNorm of `rows` rows of `dim`.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let dim = dim as i32;
        let cfg = per_row(rows, 256);
        let mut b = self.stream.launch_builder(self.f("rms_norm"));
        b.arg(x).arg(weight).arg(out).arg(&dim).arg(&eps);
        // SAFETY: x and out hold rows × dim, weight dim.
        launched(unsafe { b.launch(cfg) })
    }

    /// Rows `rows` of `x` (`[_, dim]` f32) into `out` (`[rows, dim]`), in that order.
    pub fn gather_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: &CudaSlice<u32>,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let d = dim as i32;
        let mut b = self.stream.launch_builder(self.f("gather_rows"));
        b.arg(x).arg(rows).arg(out).arg(&d);
        // SAFETY: every row index lies in x; out holds rows.len() × dim.
        launched(unsafe { b.launch(per_row(rows.len(), 256)) })
    }

    /// In-place RoPE of `[tokens, n_heads, head_dim]` at `positions`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<u32>,
        tokens: usize,
        n_heads: usize,
        head_dim: usize,
        base: f32,
        style: crate::RopeStyle,
    ) -> Result<(), KernelError> {
        let (h, d) = (n_heads as i32, head_dim as i32);
        let neox = matches!(style, crate::RopeStyle::Halves) as i32;
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, n_heads as u32, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(self.f("rope"));
        b.arg(x)
            .arg(positions)
            .arg(&h)
            .arg(&d)
            .arg(&base)
            .arg(&neox);
        // SAFETY: x holds tokens × n_heads × head_dim, positions tokens.
        launched(unsafe { b.launch(cfg) })
    }

    /// Launches the elementwise kernel `name` over `n` values with one thread per value; `args`
    /// pushes its buffers, then `n` follows.
    fn elementwise<'a>(
        &'a self,
        name: &str,
        n: &'a u64,
        args: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) -> Result<(), KernelError> {
        let mut b = self.stream.launch_builder(self.f(name));
        args(&mut b);
        b.arg(n);
        // SAFETY: every buffer the callers push holds (at least) n values.
        launched(unsafe { b.launch(grid(*n as u32, 256)) })
    }

    /// `x += y` over `n` values.
    pub fn add_into(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        self.elementwise("add_into", &(n as u64), |b| {
            b.arg(x).arg(y);
        })
    }

    /// `n` f32 values to bf16.
    pub fn to_bf16(
        &self,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
        n: usize,
    ) -> Result<(), KernelError> {
        self.elementwise("f32_to_bf16_rows", &(n as u64), |b| {
            b.arg(x).arg(out);
        })
    }

    /// `gate = silu(gate) * up` over `n` values.
    pub fn silu_mul(
        &self,
        gate: &mut CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        self.elementwise("silu_mul", &(n as u64), |b| {
            b.arg(gate).arg(up);
        })
    }

    /// A GGUF tensor in Q4_0, Q4_1, Q8_0, Q4_K or Q6_K blocks, dequantised to bf16 on the
    /// device.
    pub fn dequantize(
        &self,
        dtype: crate::DType,
        blocks: &CudaSlice<u8>,
        n_blocks: usize,
    ) -> Result<CudaSlice<u16>, KernelError> {
        let f = match dtype {
            crate::DType::Q4_0 => "dequant_q4_0",
            crate::DType::Q4_1 => "dequant_q4_1",
            crate::DType::Q8_0 => "dequant_q8_0",
            crate::DType::Q4_K => "dequant_q4_k",
            crate::DType::Q6_K => "dequant_q6_k",
            other => {
                return Err(err(
                    "dequantize",
                    format!("{other:?} is not a block format"),
                ))
            }
        };
        let mut out = self.zeros::<u16>(n_blocks * dtype.block_len())?;
        let n = n_blocks as u64;
        let mut b = self.stream.launch_builder(self.f(f));
        b.arg(blocks).arg(&mut out).arg(&n);
        // SAFETY: `blocks` holds n_blocks blocks of the format; out their values (32 or 256
        // each).
        launched(unsafe { b.launch(grid(n_blocks as u32, 128)) })?;
        Ok(out)
    }

    /// Causal attention over the paged cache for `n_q` queries (see `cuda/attention.cu`).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        block_tables: &CudaSlice<u32>,
        q_seq: &CudaSlice<u32>,
        q_pos: &CudaSlice<u32>,
        n_q: usize,
        shape: AttentionShape,
    ) -> Result<(), KernelError> {
        let threads = shape.head_dim.next_power_of_two().clamp(64, 1024) as u32;
        let cfg = LaunchConfig {
            grid_dim: (n_q as u32, shape.n_heads as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: ((shape.head_dim + threads as usize) * 4) as u32,
        };
        let (h, kvh, d, bs, mb) = (
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
            shape.block_size as i32,
            shape.max_blocks as i32,
        );
        let mut b = self.stream.launch_builder(self.f("paged_attention"));
        b.arg(q)
            .arg(out)
            .arg(k_cache)
            .arg(v_cache)
            .arg(block_tables)
            .arg(q_seq)
            .arg(q_pos)
            .arg(&h)
            .arg(&kvh)
            .arg(&d)
            .arg(&bs)
            .arg(&mb)
            .arg(&shape.scale);
        // SAFETY: shapes as documented in attention.cu; every table entry names a cache block.
        launched(unsafe { b.launch(cfg) })
    }

    /// Greedy tokens: the argmax of each of `rows` rows of `vocab` logits.
    pub fn argmax(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<Vec<u32>, KernelError> {
        let mut out = self.zeros::<u32>(rows)?;
        let v = vocab as i32;
        let cfg = per_row(rows, 1024);
        let mut b = self.stream.launch_builder(self.f("argmax_rows"));
        b.arg(logits).arg(&mut out).arg(&v);
        // SAFETY: logits hold rows × vocab.
        launched(unsafe { b.launch(cfg) })?;
        self.download(&out)
    }

    /// Temperature / top-k (≤ 64) / top-p sampling, one uniform draw in [0, 1) per row.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        logits: &CudaSlice<f32>,
        uniform: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        top_k: usize,
        temperature: f32,
        top_p: f32,
    ) -> Result<Vec<u32>, KernelError> {
        let mut out = self.zeros::<u32>(rows)?;
        let (v, k) = (vocab as i32, top_k.clamp(1, 64) as i32);
        let cfg = per_row(rows, 1024);
        let mut b = self.stream.launch_builder(self.f("sample_top_k_top_p"));
        b.arg(logits)
            .arg(uniform)
            .arg(&mut out)
            .arg(&v)
            .arg(&k)
            .arg(&temperature)
            .arg(&top_p);
        // SAFETY: logits hold rows × vocab, uniform rows.
        launched(unsafe { b.launch(cfg) })?;
        self.download(&out)
    }

    /// One layer of a sequence's first `span.n` tokens from the paged pool into a staging
    /// buffer in the transfer's wire layout (`[2, n, width]` f16).
    pub fn pack_kv(
        &self,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        table: &CudaSlice<u32>,
        staging: &mut CudaSlice<u16>,
        span: KvSpan,
    ) -> Result<(), KernelError> {
        let (n, w, bs) = span.args();
        let mut b = self.stream.launch_builder(self.f("pack_kv"));
        b.arg(k_cache)
            .arg(v_cache)
            .arg(table)
            .arg(staging)
            .arg(&n)
            .arg(&w)
            .arg(&bs);
        // SAFETY: the table covers n tokens; staging holds 2 × n × width.
        launched(unsafe { b.launch(per_row(span.n, 256)) })
    }

    /// The reverse of [`Gpu::pack_kv`].
    pub fn unpack_kv(
        &self,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        table: &CudaSlice<u32>,
        staging: &CudaSlice<u16>,
        span: KvSpan,
    ) -> Result<(), KernelError> {
        let (n, w, bs) = span.args();
        let mut b = self.stream.launch_builder(self.f("unpack_kv"));
        b.arg(k_cache)
            .arg(v_cache)
            .arg(table)
            .arg(staging)
            .arg(&n)
            .arg(&w)
            .arg(&bs);
        // SAFETY: as for pack_kv.
        launched(unsafe { b.launch(per_row(span.n, 256)) })
    }

    /// Pages `pages` of every segment (a layer's keys or values) from the pools at the
    /// addresses `src` to those at `dst` (as many of each, `page_bytes` a page), in one launch:
    /// the device pool and a host copy of it mapped into the device (see
    /// [`llama::GpuLlama::map_host_kv`]).
    pub fn copy_pages(
        &self,
        dst: &CudaSlice<u64>,
        src: &CudaSlice<u64>,
        pages: &CudaSlice<u32>,
        page_bytes: usize,
    ) -> Result<(), KernelError> {
        if pages.is_empty() || src.is_empty() {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (pages.len() as u32, src.len() as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let bytes = page_bytes as u64;
        let mut b = self.stream.launch_builder(self.f("copy_pages"));
        b.arg(dst).arg(src).arg(pages).arg(&bytes);
        // SAFETY: `dst` and `src` hold as many addresses, each of a pool (device memory, or
        // host memory registered with the device) holding every page `pages` names.
        launched(unsafe { b.launch(cfg) })
    }

    /// Starts copying one page laid out contiguously at `src` (an address in host memory
    /// mapped into the device, [`Gpu::map_host`]: each segment's page in turn) into page
    /// `page` of every segment's pool at the addresses `dev` and `mirror`.
    pub fn page_from_host(
        &self,
        dev: &CudaSlice<u64>,
        mirror: &CudaSlice<u64>,
        src: u64,
        page: u32,
        page_bytes: usize,
    ) -> Result<(), KernelError> {
        let cfg = LaunchConfig {
            grid_dim: (dev.len() as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let bytes = page_bytes as u64;
        let mut b = self.stream.launch_builder(self.f("page_from_host"));
        b.arg(dev).arg(mirror).arg(&src).arg(&page).arg(&bytes);
        // SAFETY: `dev` and `mirror` hold as many pools' addresses, each holding page `page`;
        // `src` is mapped memory holding a page of every segment (the caller's contract).
        launched(unsafe { b.launch(cfg) })
    }

    /// Page-locks `len` bytes of host memory at `at` and maps them into the device until the
    /// returned mapping drops.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated and unmoved while the mapping lives.
    pub unsafe fn map_host(
        self: &Arc<Self>,
        at: usize,
        len: usize,
    ) -> Result<HostMapping, KernelError> {
        use cudarc::driver::sys;
        self.ctx
            .bind_to_thread()
            .map_err(|e| err("binding the context", e))?;
        let p = at as *mut std::ffi::c_void;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller vouches for the memory; registering only pins it.
        unsafe { sys::cuMemHostRegister_v2(p, len, flags) }
            .result()
            .map_err(|e| err("page-locking host memory", e))?;
        let mut mapping = HostMapping {
            gpu: self.clone(),
            at,
            device: 0,
        };
        // SAFETY: `p` was registered with DEVICEMAP just above.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut mapping.device, p, 0) }
            .result()
            .map_err(|e| err("mapping host memory", e))?;
        Ok(mapping)
    }

    /// Rows of keys and values (f32, `[slots, width]`) into their cache slots as f16.
    #[allow(clippy::too_many_arguments)]
    pub fn store_kv(
        &self,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        slots: &CudaSlice<u32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        n: usize,
        width: usize,
    ) -> Result<(), KernelError> {
        let w = width as i32;
        let cfg = per_row(n, 256);
        let mut b = self.stream.launch_builder(self.f("store_kv"));
        b.arg(k_cache).arg(v_cache).arg(slots).arg(k).arg(v).arg(&w);
        // SAFETY: every slot lies in the caches; k and v hold n × width.
        launched(unsafe { b.launch(cfg) })
    }
}

/// Host memory page-locked and mapped into a GPU ([`Gpu::map_host`]); unregistered when
/// dropped.
pub struct HostMapping {
    gpu: Arc<Gpu>,
    at: usize,
    device: u64,
}

impl HostMapping {
    /// Where the device sees the memory's first byte.
    pub fn device_addr(&self) -> u64 {
        self.device
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        let _ = self.gpu.ctx.bind_to_thread();
        // SAFETY: registered by `map_host`; the memory is still allocated (its owner lets it
        // go after this mapping) and no copy from it is in flight (each one is waited for).
        unsafe { cudarc::driver::sys::cuMemHostUnregister(self.at as *mut std::ffi::c_void) };
    }
}

/// A sequence's span of the paged pool for [`Gpu::pack_kv`] / [`Gpu::unpack_kv`].
#[derive(Debug, Clone, Copy)]
pub struct KvSpan {
    /// Tokens.
    pub n: usize,
    /// Values per token (KV heads × head dim).
    pub width: usize,
    /// Tokens per block.
    pub block_size: usize,
}

impl KvSpan {
    fn args(&self) -> (i32, i32, i32) {
        (self.n as i32, self.width as i32, self.block_size as i32)
    }
}

/// One thread block per row.
fn per_row(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The shape arguments of [`Gpu::paged_attention`].
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub n_heads: usize,
    /// KV heads (GQA: query head h reads KV head h / (n_heads / n_kv_heads)).
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Entries per row of the block table.
    pub max_blocks: usize,
    /// Score scale (1/sqrt(head_dim)).
    pub scale: f32,
}
