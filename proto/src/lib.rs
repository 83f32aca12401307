//! tandem's declarative protocol crate: the wire-level facts every process must agree on.
//!
//! It holds the protocol version and the model identity that workers announce when they join,
//! so that the router can refuse a prefill/decode pair that cannot exchange KV. The cluster.toml
//! schema and the gRPC definitions join it with the cluster (issue 3).

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
