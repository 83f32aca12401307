//! One forward interface, three implementations chosen once when a model loads: the CPU
//! kernels ([`crate::cpu::CpuForward`]), CUDA ([`crate::gpu::GpuForward`]) and the mock timing
//! model ([`crate::mock::MockForward`]). The scheduler calls [`crate::Model::step`], which checks
//! the batch and calls the one implementation; none of them knows the others exist.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv_cache::{BlockTable, KvCache};
use crate::model::{SeqChunk, Weights};

/// Where a step's KV goes when it must leave the worker: called with each layer's index as
/// soon as that layer's keys and values of the whole batch are in the host cache.
pub type LayerSink<'a> = &'a mut (dyn FnMut(usize, &KvCache) + Send);

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

    /// Whether the host cache holds every step's KV (a GPU keeps decode steps' on the device
    /// only): what a tier below the pool copies from and into.
    fn kv_on_host(&self) -> bool {
        true
    }

    /// Tokens `0..n` of `table` were written into `kv` on the host (KV from a prefill worker).
    fn kv_written(
        &self,
        _c: &ModelConfig,
        _kv: &KvCache,
        _table: &BlockTable,
        _n: usize,
    ) -> Result<()> {
        Ok(())
    }

    /// KV moved between the pool and its tiers since the last step: a timing model charges it
    /// to the next step (real kernels spent it already).
    fn tier_traffic(&self, _t: &crate::TierTraffic) {}

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
