//! The engine's error type.

use std::path::PathBuf;

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
    /// The tokenizer or chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request the engine cannot serve (too long, bad sampling parameters, …).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The KV cache has no room for the request.
    #[error("KV cache full: {0}")]
    OutOfBlocks(String),
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
