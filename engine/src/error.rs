//! The engine's error type: one variant per kind of failure, so that callers map each to the
//! right answer (a client's 400, a full cache, a broken transfer, a fault of the worker's).

use std::path::PathBuf;

use types::RequestId;

/// Everything the engine can refuse or fail at, each naming what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A model file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A model file is malformed, truncated, or describes something tandem cannot run.
    #[error("{path}: {msg}")]
    Model {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// The engine, its cache or a model name was configured wrong (zero sizes, an unknown
    /// model, a mock model asked for weights).
    #[error("configuration: {0}")]
    Config(String),
    /// The tokenizer or chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request the engine cannot serve as asked: the caller's fault (too long, bad sampling
    /// parameters, an impossible grammar, …).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// No request of this id is where the call needs it (finished, cancelled, never added).
    #[error("no request {id} is {expected}")]
    UnknownRequest {
        /// The request.
        id: RequestId,
        /// Where the call looked ("reserved", "waiting for KV").
        expected: &'static str,
    },
    /// KV that arrived does not fit the request it names (its layers, tokens or bytes).
    #[error("KV for request {id}: {msg}")]
    KvMismatch {
        /// The request.
        id: RequestId,
        /// What does not fit.
        msg: String,
    },
    /// KV written in place arrived corrupted: its bytes' checksum is not the sender's.
    #[error(
        "layer {layer} of request {id} was corrupted in transfer (CRC32 {got:08x}, the \
         sender's {want:08x})"
    )]
    CorruptKv {
        /// The request.
        id: RequestId,
        /// The layer.
        layer: usize,
        /// The checksum of what is in the cache.
        got: u32,
        /// The checksum the sender computed.
        want: u32,
    },
    /// In-place (RDMA) transfers cannot address this cache, and why.
    #[error("in-place KV transfers: {0}")]
    NotInPlace(String),
    /// A paused request's KV cannot be handed to another worker from here, and why.
    #[error("KV handoff: {0}")]
    Handoff(String),
    /// The KV cache has no room for the request now.
    #[error("KV cache full: {0}")]
    OutOfBlocks(String),
    /// The engine broke one of its own invariants (a block table short of a step's tokens): a
    /// fault of this worker's, not of the request.
    #[error("internal: {0}")]
    Internal(String),
    /// A kernel call failed.
    #[cfg(feature = "runtime")]
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
}

impl EngineError {
    /// A model file's error: `msg` about `path`.
    pub fn model(path: impl Into<PathBuf>, msg: impl Into<String>) -> EngineError {
        EngineError::Model {
            path: path.into(),
            msg: msg.into(),
        }
    }
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
