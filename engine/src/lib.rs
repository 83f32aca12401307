//! tandem's engine: everything that turns token ids into next tokens on one machine.
//!
//! - [`gguf`] and [`loader`]: GGUF v2/v3 files and Hugging Face directories, memory-mapped.
//! - [`tokenizer`] and [`text`]: byte-level BPE, the model's own chat template (minijinja),
//!   streaming detokenisation and stop strings.
//! - [`model`]: a model's shape and weights, and [`forward`]: one forward interface with three
//!   implementations chosen at load — the CPU kernels ([`cpu`]), CUDA ([`gpu`]) and the mock
//!   timing model ([`mock`]) — over a paged KV cache ([`kv_cache`]) for a batch of sequences at
//!   different positions.
//! - [`sampler`] and [`scheduler`]: sampling and continuous batching; [`remote`]: the
//!   remote-KV API (reservations for a prefill worker's KV, its admission) with the ownership
//!   [`ledger`].
//! - [`fetch`]: the default model's cache.
//! - [`mock`]: the mock engine (the model's shape, no weights, a timing model instead of
//!   kernels) for scaling tests.

pub mod block_hash;
pub mod config;
#[cfg(feature = "runtime")]
pub mod cpu;
pub mod error;
pub mod fetch;
#[cfg(feature = "runtime")]
pub mod forward;
pub mod gguf;
/// The model's forward on a GPU (`device = "cuda:N"`).
#[cfg(feature = "runtime")]
pub mod gpu;
#[cfg(feature = "runtime")]
pub mod grammar;
#[cfg(feature = "runtime")]
pub mod kv_cache;
pub mod ledger;
#[cfg(feature = "runtime")]
pub mod loader;
pub mod mock;
#[cfg(feature = "runtime")]
pub mod model;
#[cfg(feature = "runtime")]
pub mod preempt;
#[cfg(feature = "runtime")]
pub mod prefix;
pub mod rate;
#[cfg(feature = "runtime")]
pub mod remote;
pub mod sampler;
#[cfg(feature = "runtime")]
pub mod scheduler;
#[cfg(feature = "runtime")]
pub mod speculate;
mod spm;
#[cfg(feature = "runtime")]
pub mod store;
pub mod text;
#[cfg(feature = "runtime")]
pub mod tiers;
pub mod tokenizer;

pub use config::ModelConfig;
pub use error::{EngineError, Result};
#[cfg(feature = "runtime")]
pub use kv_cache::{BlockTable, KvCache, Staged, StoreBlock};
#[cfg(feature = "runtime")]
pub use loader::{load, load_mock};
pub use mock::{MockTiming, TierLink, TierTraffic};
#[cfg(feature = "runtime")]
pub use model::{Forward, LayerSink, Logits, Model, SeqChunk};
#[cfg(feature = "runtime")]
pub use preempt::{Admission, Preemptions};
pub use rate::PromptRate;
#[cfg(feature = "runtime")]
pub use remote::Reservation;
pub use sampler::{FinishReason, Sampler, SamplingParams};
#[cfg(feature = "runtime")]
pub use scheduler::{Engine, EngineConfig, KvSink, Load, Release, TokenEvent};
#[cfg(feature = "runtime")]
pub use speculate::SpecStats;
pub use tokenizer::{ChatMessage, Tokenizer};
pub use types::{KvEvent, ModelIdentity, RequestId};

/// The identity a worker announces: model name, KV dtype and KV geometry.
#[cfg(feature = "runtime")]
pub fn identity(model: &Model, block_size: usize) -> ModelIdentity {
    identity_of(&model.config, block_size)
}

/// The identity of a model with this configuration and KV block size.
pub fn identity_of(c: &ModelConfig, block_size: usize) -> ModelIdentity {
    ModelIdentity {
        model: c.name.clone(),
        kv_dtype: "f16".into(),
        block_size: block_size as u32,
        n_layers: c.n_layers as u32,
        n_kv_heads: c.n_kv_heads as u32,
        head_dim: c.head_dim as u32,
        windows: match c.layers.iter().any(|l| l.window.is_some()) {
            true => c
                .layers
                .iter()
                .map(|l| l.window.unwrap_or(0) as u32)
                .collect(),
            false => Vec::new(),
        },
    }
}

/// Reads a model's configuration and tokenizer without loading its weights (what the router
/// needs: it owns text, and checks workers' identities against the model's shape).
pub fn inspect(path: &std::path::Path) -> Result<(ModelConfig, Tokenizer)> {
    if config::is_dir(path)? {
        Ok((
            config::read_hf_config(path)?.0,
            Tokenizer::from_hf_dir(path)?,
        ))
    } else {
        let g = gguf::Gguf::open(path)?;
        Ok((ModelConfig::from_gguf(&g)?, Tokenizer::from_gguf(&g)?))
    }
}
