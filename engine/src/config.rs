//! Model hyper-parameters, read from GGUF metadata or a Hugging Face config.json.

use std::path::Path;

use kernels::{Activation, RopeStyle};

use crate::error::{EngineError, Result};
use crate::gguf::Gguf;

/// How one layer attends: what a query sees and how its positions turn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    /// Tokens a query sees, itself included (`None`: the whole sequence so far).
    pub window: Option<usize>,
    /// RoPE frequency base of this layer.
    pub rope_base: f32,
}

/// The shape of a decoder-only transformer of the Llama family, with what each architecture
/// adds to Llama's block as configuration: Gemma 3's embedding scale, query/key norms,
/// post-norms, GeGLU and sliding windows; Qwen2's projection biases; Qwen3's query/key norms.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Human-readable model name.
    pub name: String,
    /// The architecture as the file names it (`llama`, `gemma3`, `qwen2`, `qwen3`).
    pub arch: String,
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
    /// Factor on the token embeddings (Gemma: sqrt(dim); 1 elsewhere).
    pub embed_scale: f32,
    /// Factor on each query·key product (1/sqrt(head_dim) unless the architecture says
    /// otherwise).
    pub attn_scale: f32,
    /// RMSNorm over each query and key head before RoPE (Gemma 3, Qwen3).
    pub qk_norm: bool,
    /// RMSNorm on the attention and feed-forward outputs before each residual add (Gemma 3).
    pub post_norms: bool,
    /// Biases on the query, key and value projections (Qwen2).
    pub qkv_bias: bool,
    /// The gated feed-forward unit's activation.
    pub activation: Activation,
    /// Per layer: its attention window and RoPE base.
    pub layers: Vec<LayerAttention>,
    /// Per rotated pair, the divisor of its RoPE frequency (Llama 3.x's long-context scaling,
    /// GGUF's `rope_freqs.weight`).
    pub rope_freq_factors: Option<Vec<f32>>,
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
        if self.head_dim == 0 || self.head_dim % 2 != 0 {
            return bad(format!(
                "head size {} is not a positive even number",
                self.head_dim
            ));
        }
        if self.layers.len() != self.n_layers {
            return bad(format!(
                "{} layer descriptions for {} layers",
                self.layers.len(),
                self.n_layers
            ));
        }
        if self.n_layers == 0 || self.vocab_size == 0 || self.context_len == 0 {
            return bad("model has no layers, vocabulary or context".into());
        }
        Ok(self)
    }

    /// Llama's block: every layer full attention at one RoPE base, SwiGLU, nothing added.
    #[allow(clippy::too_many_arguments)]
    fn llama_like(
        name: String,
        arch: &str,
        n_layers: usize,
        dim: usize,
        ffn_dim: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        vocab_size: usize,
        context_len: usize,
        rope_base: f32,
        rope_style: RopeStyle,
        rms_eps: f32,
    ) -> ModelConfig {
        ModelConfig {
            name,
            arch: arch.into(),
            n_layers,
            dim,
            ffn_dim,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            context_len,
            rope_base,
            rope_style,
            rms_eps,
            embed_scale: 1.0,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            qk_norm: false,
            post_norms: false,
            qkv_bias: false,
            activation: Activation::Silu,
            rope_freq_factors: None,
            layers: vec![
                LayerAttention {
                    window: None,
                    rope_base
                };
                n_layers
            ],
        }
    }

    /// Whether this is Llama's block exactly (what the CUDA forward runs).
    pub fn is_plain_llama(&self) -> bool {
        !self.qk_norm
            && !self.post_norms
            && !self.qkv_bias
            && self.embed_scale == 1.0
            && self.activation == Activation::Silu
            && self.attn_scale == 1.0 / (self.head_dim as f32).sqrt()
            && self.rope_freq_factors.is_none()
            && self
                .layers
                .iter()
                .all(|l| l.window.is_none() && l.rope_base == self.rope_base)
    }

    /// Reads the config from GGUF metadata (`general.architecture` = llama, qwen2, qwen3 or
    /// gemma3, under that prefix); other architectures are refused.
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig> {
        let arch = g.get_str("general.architecture")?.to_string();
        const ARCHES: [&str; 4] = ["llama", "qwen2", "qwen3", "gemma3"];
        if !ARCHES.contains(&arch.as_str()) {
            return Err(EngineError::model(
                g.path(),
                format!(
                    "unsupported architecture {arch:?} (tandem runs {})",
                    ARCHES.join(", ")
                ),
            ));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| g.get_u64(&key(k)).map(|v| v as usize);
        let opt_u = |k: &str| {
            g.metadata
                .get(&key(k))
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
        };
        let f = |k: &str, d: f64| {
            g.metadata
                .get(&key(k))
                .and_then(|v| v.as_f64())
                .unwrap_or(d) as f32
        };
        if let Some(t) = g
            .metadata
            .get(&key("rope.scaling.type"))
            .and_then(|v| v.as_str())
        {
            if t != "none" {
                return Err(EngineError::model(
                    g.path(),
                    format!(
                        "{} = {t:?}: RoPE scaling is not supported",
                        key("rope.scaling.type")
                    ),
                ));
            }
        }
        let dim = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let head_dim =
            opt_u("attention.key_length").unwrap_or(dim.checked_div(n_heads).unwrap_or(0));
        if opt_u("attention.value_length").is_some_and(|v| v != head_dim) {
            return Err(EngineError::model(
                g.path(),
                "key and value heads of different sizes are not supported",
            ));
        }
        let vocab_size = match opt_u("vocab_size") {
            Some(v) => v,
            None => g
                .get("tokenizer.ggml.tokens")?
                .as_array()
                .map_or(0, |a| a.len()),
        };
        let rope_base = f("rope.freq_base", 10000.0);
        let style = if arch == "llama" {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Halves
        };
        let name = g
            .metadata
            .get("general.name")
            .and_then(|v| v.as_str())
            .unwrap_or("unnamed")
            .to_string();
        let mut c = ModelConfig::llama_like(
            name,
            &arch,
            u("block_count")?,
            dim,
            u("feed_forward_length")?,
            n_heads,
            opt_u("attention.head_count_kv").unwrap_or(n_heads),
            head_dim,
            vocab_size,
            u("context_length")?,
            rope_base,
            style,
            f("attention.layer_norm_rms_epsilon", 1e-5),
        );
        // The factors are weights the forward pass reads (a build without it, like the
        // router's, needs the configuration only).
        #[cfg(feature = "runtime")]
        if g.tensors.contains_key("rope_freqs.weight") {
            c.rope_freq_factors = Some(g.vector("rope_freqs.weight", head_dim / 2)?);
        }
        match arch.as_str() {
            "qwen2" => c.qkv_bias = true,
            "qwen3" => c.qk_norm = true,
            "gemma3" => c.gemma3(opt_u("attention.sliding_window")),
            _ => {}
        }
        c.check(g.path())
    }

    /// Gemma 3 on top of Llama's block, as llama.cpp runs it: embeddings scaled by sqrt(dim),
    /// query/key norms, post-norms, GeGLU, and every sixth layer global (the model's RoPE base)
    /// between five of sliding-window attention at RoPE base 10,000.
    fn gemma3(&mut self, window: Option<usize>) {
        self.embed_scale = (self.dim as f32).sqrt();
        self.qk_norm = true;
        self.post_norms = true;
        self.activation = Activation::GeluTanh;
        for (i, l) in self.layers.iter_mut().enumerate() {
            if i % 6 < 5 {
                *l = LayerAttention {
                    window: Some(window.unwrap_or(4096)),
                    rope_base: 10_000.0,
                };
            }
        }
    }

    /// Reads a Hugging Face `config.json` of a text model: `llama` (Llama 3.x's `rope_scaling`
    /// of type `llama3` included), `qwen2`, `qwen3` or `gemma3_text` — each maps onto the same
    /// description as its GGUF metadata does. What tandem cannot run (other RoPE scalings, MLP
    /// biases, Qwen2's sliding window) is refused by name, never ignored.
    pub fn from_hf_json(path: &Path, json: &serde_json::Value) -> Result<ModelConfig> {
        let bad = |m: String| EngineError::model(path, m);
        let model_type = json["model_type"].as_str().unwrap_or_default();
        let arch = match model_type {
            "llama" | "qwen2" | "qwen3" => model_type,
            "gemma3_text" => "gemma3",
            "gemma3" => {
                return Err(bad(
                    "model_type gemma3 is the multimodal model; tandem runs the text model \
                     (gemma3_text)"
                        .into(),
                ))
            }
            _ => {
                return Err(bad(format!(
                    "unsupported architecture {} / model_type {model_type:?} (tandem runs \
                     llama, qwen2, qwen3, gemma3_text)",
                    json["architectures"]
                )))
            }
        };
        let u = |k: &str| {
            json[k]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("missing or non-integer key {k}")))
        };
        let f = |k: &str, d: f64| json[k].as_f64().unwrap_or(d) as f32;
        for (key, what) in [
            ("mlp_bias", "biases in the MLP"),
            ("use_sliding_window", "Qwen2's sliding window"),
        ] {
            if json[key] == true {
                return Err(bad(format!("{key} = true: {what} are not supported")));
            }
        }
        let dim = u("hidden_size")?;
        let n_heads = u("num_attention_heads")?;
        let head_dim = json["head_dim"]
            .as_u64()
            .map_or(dim.checked_div(n_heads).unwrap_or(0), |v| v as usize);
        let rope_base = f("rope_theta", 10000.0);
        let mut c = ModelConfig::llama_like(
            json["_name_or_path"]
                .as_str()
                .unwrap_or(&format!("hf-{arch}"))
                .to_string(),
            arch,
            u("num_hidden_layers")?,
            dim,
            u("intermediate_size")?,
            n_heads,
            json["num_key_value_heads"]
                .as_u64()
                .map_or(n_heads, |v| v as usize),
            head_dim,
            u("vocab_size")?,
            u("max_position_embeddings")?,
            rope_base,
            RopeStyle::Halves,
            f("rms_norm_eps", 1e-5),
        );
        c.qkv_bias = arch == "qwen2" || json["attention_bias"] == true;
        c.qk_norm = arch == "qwen3";
        if arch == "gemma3" {
            c.hf_gemma3(path, json)?;
        }
        c.rope_freq_factors = hf_rope_scaling(path, json, rope_base, head_dim)?;
        c.check(path)
    }

    /// Gemma 3's additions from its `config.json`: the window and which layers use it
    /// (`layer_types`, else every sixth layer global), the local RoPE base, the query scale.
    fn hf_gemma3(&mut self, path: &Path, json: &serde_json::Value) -> Result<()> {
        self.gemma3(json["sliding_window"].as_u64().map(|v| v as usize));
        if let Some(act) = json["hidden_activation"].as_str() {
            if act != "gelu_pytorch_tanh" {
                return Err(EngineError::model(
                    path,
                    format!("hidden_activation {act:?} is not supported (gelu_pytorch_tanh)"),
                ));
            }
        }
        if let Some(s) = json["query_pre_attn_scalar"].as_f64() {
            self.attn_scale = (1.0 / s.sqrt()) as f32;
        }
        let local = json["rope_local_base_freq"].as_f64().unwrap_or(10_000.0) as f32;
        let window = self.layers[0].window;
        let types = json["layer_types"].as_array();
        for (i, l) in self.layers.iter_mut().enumerate() {
            let sliding = match types.and_then(|t| t.get(i)).and_then(|t| t.as_str()) {
                Some(t) => t == "sliding_attention",
                None => i % 6 < 5,
            };
            *l = match sliding {
                true => LayerAttention {
                    window,
                    rope_base: local,
                },
                false => LayerAttention {
                    window: None,
                    rope_base: self.rope_base,
                },
            };
        }
        Ok(())
    }
}

/// The per-pair RoPE divisors of `rope_scaling` (the values llama.cpp's converter writes as
/// `rope_freqs.weight`): Llama 3.x's `llama3` type; none without scaling; other types refused.
fn hf_rope_scaling(
    path: &Path,
    json: &serde_json::Value,
    base: f32,
    head_dim: usize,
) -> Result<Option<Vec<f32>>> {
    let rs = &json["rope_scaling"];
    if rs.is_null() {
        return Ok(None);
    }
    let kind = rs["rope_type"]
        .as_str()
        .or(rs["type"].as_str())
        .unwrap_or_default();
    if kind == "default" {
        return Ok(None);
    }
    let g = |k: &str| {
        rs[k].as_f64().ok_or_else(|| {
            EngineError::model(path, format!("rope_scaling.{k} is missing or not a number"))
        })
    };
    if kind != "llama3" {
        return Err(EngineError::model(
            path,
            format!("rope_scaling type {kind:?} is not supported (llama3 is)"),
        ));
    }
    let (factor, low, high) = (g("factor")?, g("low_freq_factor")?, g("high_freq_factor")?);
    let old = g("original_max_position_embeddings")?;
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    let pairs = (0..head_dim / 2).map(|i| {
        let freq = (base as f64).powf(-((2 * i) as f64) / head_dim as f64);
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor as f32
        } else {
            let smooth = (old / wavelen - low) / (high - low);
            (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
        }
    });
    Ok(Some(pairs.collect()))
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
