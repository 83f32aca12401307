//! tandem's declarative protocol crate: the facts every process must agree on.
//!
//! - [`PROTOCOL_VERSION`] and [`ModelIdentity`]: what workers announce when they join, so that
//!   the router refuses a prefill/decode pair that cannot exchange KV.
//! - [`config`]: the `cluster.toml` schema and its validation.
//! - [`grpc`]: the control plane between router and workers (`proto/tandem.proto`), and
//!   [`membership`], the worker side of joining.

pub mod config;
pub mod membership;
pub mod metrics;

/// Generated gRPC messages, clients and servers of `proto/tandem.proto`.
#[allow(missing_docs, clippy::all)]
pub mod grpc {
    tonic::include_proto!("tandem.v1");
}

/// Version of tandem's control and KV-transfer protocols; peers with another version are refused.
pub const PROTOCOL_VERSION: u32 = 1;

/// What a worker computes with: two workers can exchange KV only if these agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    /// Model name and a digest of its weights file.
    pub model: String,
    /// Element type of the KV cache ("f16").
    pub kv_dtype: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Transformer layers.
    pub n_layers: u32,
    /// KV heads per layer.
    pub n_kv_heads: u32,
    /// Values per head.
    pub head_dim: u32,
}

impl From<grpc::ModelIdentity> for ModelIdentity {
    fn from(g: grpc::ModelIdentity) -> Self {
        ModelIdentity {
            model: g.model,
            kv_dtype: g.kv_dtype,
            block_size: g.block_size,
            n_layers: g.n_layers,
            n_kv_heads: g.n_kv_heads,
            head_dim: g.head_dim,
        }
    }
}

impl From<ModelIdentity> for grpc::ModelIdentity {
    fn from(m: ModelIdentity) -> Self {
        grpc::ModelIdentity {
            model: m.model,
            kv_dtype: m.kv_dtype,
            block_size: m.block_size,
            n_layers: m.n_layers,
            n_kv_heads: m.n_kv_heads,
            head_dim: m.head_dim,
        }
    }
}

impl ModelIdentity {
    /// Explains why KV computed under `self` cannot be used under `other`, if it cannot.
    pub fn incompatibility(&self, other: &ModelIdentity) -> Option<String> {
        let fields = [
            ("model", self.model.clone(), other.model.clone()),
            ("kv_dtype", self.kv_dtype.clone(), other.kv_dtype.clone()),
            (
                "block_size",
                self.block_size.to_string(),
                other.block_size.to_string(),
            ),
            (
                "n_layers",
                self.n_layers.to_string(),
                other.n_layers.to_string(),
            ),
            (
                "n_kv_heads",
                self.n_kv_heads.to_string(),
                other.n_kv_heads.to_string(),
            ),
            (
                "head_dim",
                self.head_dim.to_string(),
                other.head_dim.to_string(),
            ),
        ];
        let diffs: Vec<String> = fields
            .into_iter()
            .filter(|(_, a, b)| a != b)
            .map(|(k, a, b)| format!("{k}: {a} vs {b}"))
            .collect();
        (!diffs.is_empty()).then(|| diffs.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatches_are_named() {
        let a = ModelIdentity {
            model: "m".into(),
            kv_dtype: "f16".into(),
            block_size: 16,
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
        };
        assert_eq!(a.incompatibility(&a.clone()), None);
        let b = ModelIdentity {
            block_size: 32,
            ..a.clone()
        };
        assert_eq!(a.incompatibility(&b).unwrap(), "block_size: 16 vs 32");
    }
}
