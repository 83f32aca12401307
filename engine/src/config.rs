//! Model hyper-parameters, read from GGUF metadata or a Hugging Face config.json.

use std::path::Path;

use kernels::RopeStyle;

use crate::error::{EngineError, Result};
use crate::gguf::Gguf;

/// The shape of a Llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Human-readable model name.
    pub name: String,
    /// Transformer layers.
    pub n_layers: usize,
    /// Hidden size.
    pub dim: usize,
    /// Feed-forward inner size.
    pub ffn_dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA groups).
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence the model was trained for.
    pub context_len: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// RoPE pairing convention of this file's Q/K weights.
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
}

impl ModelConfig {
    /// Key/value values per token per layer.
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    fn check(self, path: &Path) -> Result<ModelConfig> {
        let bad = |m: String| Err(EngineError::model(path, m));
        if self.n_heads == 0 || self.n_kv_heads == 0 || self.n_heads % self.n_kv_heads != 0 {
            return bad(format!(
                "{} heads cannot be grouped over {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.dim % self.n_heads != 0 || self.head_dim % 2 != 0 {
            return bad(format!(
                "hidden size {} does not split into {} even-sized heads",
                self.dim, self.n_heads
            ));
        }
        if self.n_layers == 0 || self.vocab_size == 0 || self.context_len == 0 {
            return bad("model has no layers, vocabulary or context".into());
        }
        Ok(self)
    }

    /// Reads a Llama config from GGUF metadata; other architectures are refused.
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(EngineError::model(
                g.path(),
                format!("unsupported architecture {arch:?} (tandem runs the llama architecture)"),
            ));
        }
        let u = |k: &str| g.get_u64(&format!("llama.{k}")).map(|v| v as usize);
        let f = |k: &str, d: f64| {
            g.metadata
                .get(&format!("llama.{k}"))
                .and_then(|v| v.as_f64())
                .unwrap_or(d) as f32
        };
        let dim = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let vocab_size = match g.metadata.get("llama.vocab_size").and_then(|v| v.as_u64()) {
            Some(v) => v as usize,
            None => g
                .get("tokenizer.ggml.tokens")?
                .as_array()
                .map_or(0, |a| a.len()),
        };
        ModelConfig {
            name: g
                .metadata
                .get("general.name")
                .and_then(|v| v.as_str())
                .unwrap_or("unnamed")
                .to_string(),
            n_layers: u("block_count")?,
            dim,
            ffn_dim: u("feed_forward_length")?,
            n_heads,
            n_kv_heads: g
                .metadata
                .get("llama.attention.head_count_kv")
                .and_then(|v| v.as_u64())
                .map_or(n_heads, |v| v as usize),
            head_dim: if n_heads > 0 { dim / n_heads } else { 0 },
            vocab_size,
            context_len: u("context_length")?,
            rope_base: f("rope.freq_base", 10000.0),
            rope_style: RopeStyle::Interleaved,
            rms_eps: f("attention.layer_norm_rms_epsilon", 1e-5),
        }
        .check(g.path())
    }

    /// Reads a Llama config from a Hugging Face `config.json`.
    pub fn from_hf_json(path: &Path, json: &serde_json::Value) -> Result<ModelConfig> {
        let arch_ok = json["architectures"]
            .as_array()
            .is_some_and(|a| a.iter().any(|v| v == "LlamaForCausalLM"))
            || json["model_type"] == "llama";
        if !arch_ok {
            return Err(EngineError::model(
                path,
                format!(
                    "unsupported architecture {} (tandem runs LlamaForCausalLM)",
                    json["architectures"]
                ),
            ));
        }
        let u = |k: &str| {
            json[k]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::model(path, format!("missing or non-integer key {k}")))
        };
        let dim = u("hidden_size")?;
        let n_heads = u("num_attention_heads")?;
        if json["rope_scaling"].is_object() {
            return Err(EngineError::model(path, "rope_scaling is not supported"));
        }
        ModelConfig {
            name: json["_name_or_path"]
                .as_str()
                .unwrap_or("hf-llama")
                .to_string(),
            n_layers: u("num_hidden_layers")?,
            dim,
            ffn_dim: u("intermediate_size")?,
            n_heads,
            n_kv_heads: json["num_key_value_heads"]
                .as_u64()
                .map_or(n_heads, |v| v as usize),
            head_dim: json["head_dim"]
                .as_u64()
                .map_or(if n_heads > 0 { dim / n_heads } else { 0 }, |v| v as usize),
            vocab_size: u("vocab_size")?,
            context_len: u("max_position_embeddings")?,
            rope_base: json["rope_theta"].as_f64().unwrap_or(10000.0) as f32,
            rope_style: RopeStyle::Halves,
            rms_eps: json["rms_norm_eps"].as_f64().unwrap_or(1e-5) as f32,
        }
        .check(path)
    }
}

/// Whether `path` is a model directory (Hugging Face layout) rather than a single file.
pub(crate) fn is_dir(path: &Path) -> crate::Result<bool> {
    let meta = std::fs::metadata(path).map_err(|source| EngineError::Io {
        path: path.into(),
        source,
    })?;
    Ok(meta.is_dir())
}

/// Reads `dir/config.json`: the model's configuration and the raw JSON (for loader options).
pub(crate) fn read_hf_config(dir: &Path) -> crate::Result<(ModelConfig, serde_json::Value)> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| EngineError::Io {
        path: cfg_path.clone(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| EngineError::model(&cfg_path, format!("invalid JSON: {e}")))?;
    Ok((ModelConfig::from_hf_json(&cfg_path, &json)?, json))
}
