//! What two workers must agree on to exchange KV.

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
    /// Per layer, the attention window whose keys the layer keeps (0: every token); empty
    /// when no layer has one.
    pub windows: Vec<u32>,
}

impl ModelIdentity {
    /// Explains why KV computed under `self` cannot be used under `other`, if it cannot.
    pub fn incompatibility(&self, other: &ModelIdentity) -> Option<String> {
        let num = |a: u32, b: u32| (a.to_string(), b.to_string());
        let fields = [
            ("model", (self.model.clone(), other.model.clone())),
            ("kv_dtype", (self.kv_dtype.clone(), other.kv_dtype.clone())),
            ("block_size", num(self.block_size, other.block_size)),
            ("n_layers", num(self.n_layers, other.n_layers)),
            ("n_kv_heads", num(self.n_kv_heads, other.n_kv_heads)),
            ("head_dim", num(self.head_dim, other.head_dim)),
            (
                "windows",
                (
                    format!("{:?}", self.windows),
                    format!("{:?}", other.windows),
                ),
            ),
        ];
        let diffs: Vec<String> = fields
            .into_iter()
            .filter(|(_, (a, b))| a != b)
            .map(|(k, (a, b))| format!("{k}: {a} vs {b}"))
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
            windows: vec![],
        };
        assert_eq!(a.incompatibility(&a.clone()), None);
        let b = ModelIdentity {
            block_size: 32,
            ..a.clone()
        };
        assert_eq!(a.incompatibility(&b).unwrap(), "block_size: 16 vs 32");
    }
}
