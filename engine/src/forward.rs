//! One forward interface, three implementations chosen once when a model loads: the CPU
//! kernels ([`crate::cpu::CpuForward`]), CUDA ([`crate::gpu::GpuForward`]) and the mock timing
//! model ([`crate::mock::MockForward`]). The scheduler calls [`crate::Model::step`], which checks
//! the batch and calls the one implementation; none of them knows the others exist.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv_cache::{BlockTable, KvCache};
use crate::model::{SeqChunk, Weights};

/// Where a step's KV goes when it must leave the worker: called with each layer's index as
/// soon as that layer's keys and values of the whole batch are in the host cache.
pub type LayerSink<'a> = &'a mut (dyn FnMut(usize, &KvCache) + Send);

/// A KV pool kept on a device beside the engine's host cache, with the same page numbers: a
/// page moves between the two when the tiers below the pool store or load it.
pub trait PageDevice: Send + Sync {
    /// Copies `pages` from the device into the host cache (done when it returns).
    fn to_host(&self, pages: &[u32]) -> Result<()>;
    /// Copies `pages` of the host cache to the device (done when it returns).
    fn to_device(&self, pages: &[u32]) -> Result<()>;
    /// Maps `len` bytes of host memory at `at` into the device (page-locked), for
    /// [`PageDevice::page_from`] to copy from, until the returned mapping drops.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated and unmoved while the mapping lives.
    unsafe fn map(&self, at: *mut u8, len: usize) -> Result<Mapped>;
    /// Starts copying one page laid out contiguously at device address `src` (in mapped
    /// memory: every layer's keys, then its values, as a tier stores a page) into page `page`,
    /// on the device and in the host cache. Done when [`PageDevice::sync`] (or a copy above)
    /// returns.
    ///
    /// # Safety
    ///
    /// `src` must be mapped memory holding a whole page, left unchanged until then.
    unsafe fn page_from(&self, src: u64, page: u32) -> Result<()>;
    /// Waits for the copies started.
    fn sync(&self) -> Result<()>;
}

/// Host memory mapped into a device ([`PageDevice::map`]): where the device sees it, and what
/// keeps it mapped.
pub struct Mapped {
    /// The device address of the memory's first byte.
    pub addr: u64,
    /// Unmaps the memory when dropped.
    pub guard: Box<dyn Send + Sync>,
}

/// A model's forward pass on one kind of device.
pub trait Forward: Send + Sync {
    /// The backend and device, for logs.
    fn name(&self) -> String;

    /// The weights, where this forward has them (the mock engine has none).
    fn weights(&self) -> Option<&Weights> {
        None
    }

    /// Prepares what a KV cache of this geometry needs beside the host cache (a GPU's device
    /// pool).
    fn prepare_kv(&self, _c: &ModelConfig, _block_size: usize, _num_blocks: usize) -> Result<()> {
        Ok(())
    }

    /// Whether the KV cache needs memory for the values (the simulator's mock keeps only the
    /// block accounting).
    fn kv_backed(&self) -> bool {
        true
    }

    /// Whether the KV tiers below the pool keep the pages' bytes; without, they keep only the
    /// accounting and their time is priced (the mock's: a load or store of its tiers costs the
    /// timing model's time, as in the simulator, not this machine's copies of values no step
    /// reads).
    fn tier_values(&self) -> bool {
        self.kv_backed()
    }

    /// Whether a row's logits are bitwise the same however many rows a step has — what
    /// speculative decoding's contract needs (the CPU kernels and the mock: yes; cuBLAS picks
    /// its GEMM kernel by the row count: no, so a GPU worker does not speculate).
    fn batch_invariant(&self) -> bool {
        true
    }

    /// Whether the host cache holds every step's KV (a GPU keeps decode steps' on the device
    /// only): what a tier below the pool copies from and into.
    fn kv_on_host(&self) -> bool {
        true
    }

    /// Tokens `range` of `table` were written into `kv` on the host (KV from a prefill
    /// worker; `range` starts at a block's first token).
    fn kv_written(
        &self,
        _c: &ModelConfig,
        _kv: &KvCache,
        _table: &BlockTable,
        _range: std::ops::Range<usize>,
    ) -> Result<()> {
        Ok(())
    }

    /// For a cache whose pages live on a device as well ([`Forward::kv_on_host`] false): maps
    /// `kv`'s host memory into the device and returns the way pages move between them (what
    /// the tiers below the pool copy through). `None` where the host cache is the only copy.
    fn page_device(&self, _kv: &mut KvCache) -> Result<Option<Arc<dyn PageDevice>>> {
        Ok(None)
    }

    /// KV moved between the pool and its tiers since the last step: a timing model charges it
    /// to the next step (real kernels spent it already).
    fn tier_traffic(&self, _t: &crate::TierTraffic) {}

    /// The timing model's time of the last forward, left for [`Forward::take_modelled_time`]
    /// (the engine's step costs read it); `None` for real kernels.
    fn modelled_time(&self) -> Option<std::time::Duration> {
        None
    }

    /// The timing model's time of the last forward, taken (so `None` again until the next
    /// one): the mock engine's; `None` for real kernels.
    fn take_modelled_time(&self) -> Option<std::time::Duration> {
        None
    }

    /// One step over a checked batch (see [`crate::Model::step`]).
    fn forward(
        &self,
        c: &ModelConfig,
        kv: &mut KvCache,
        batch: &[SeqChunk<'_>],
        sink: Option<LayerSink<'_>>,
    ) -> Result<Vec<Option<Vec<f32>>>>;
}
