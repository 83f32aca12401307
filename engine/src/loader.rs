//! Loading a model from a GGUF file or a Hugging Face directory (config.json, tokenizer.json,
//! *.safetensors in f32/f16/bf16).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kernels::{DType, Device, Matrix};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::Gguf;
use crate::model::{Model, Names, TensorSource, Weights};
use crate::tokenizer::Tokenizer;

const GGUF_NAMES: Names = Names {
    norm_offset: 0.0,
    embed: "token_embd.weight",
    norm: "output_norm.weight",
    output: "output.weight",
    layer: |i, s| {
        let t = match s {
            "attn_norm" => "attn_norm.weight",
            "q" => "attn_q.weight",
            "k" => "attn_k.weight",
            "v" => "attn_v.weight",
            "o" => "attn_output.weight",
            "ffn_norm" => "ffn_norm.weight",
            "gate" => "ffn_gate.weight",
            "up" => "ffn_up.weight",
            "q_norm" => "attn_q_norm.weight",
            "k_norm" => "attn_k_norm.weight",
            "post_attn_norm" => "post_attention_norm.weight",
            "post_ffn_norm" => "post_ffw_norm.weight",
            "q_bias" => "attn_q.bias",
            "k_bias" => "attn_k.bias",
            "v_bias" => "attn_v.bias",
            _ => "ffn_down.weight",
        };
        format!("blk.{i}.{t}")
    },
};

const HF_NAMES: Names = Names {
    norm_offset: 0.0,
    embed: "model.embed_tokens.weight",
    norm: "model.norm.weight",
    output: "lm_head.weight",
    layer: |i, s| {
        let t = match s {
            "attn_norm" => "input_layernorm.weight",
            "q" => "self_attn.q_proj.weight",
            "k" => "self_attn.k_proj.weight",
            "v" => "self_attn.v_proj.weight",
            "o" => "self_attn.o_proj.weight",
            "ffn_norm" => "post_attention_layernorm.weight",
            "gate" => "mlp.gate_proj.weight",
            "up" => "mlp.up_proj.weight",
            "q_norm" => "self_attn.q_norm.weight",
            "k_norm" => "self_attn.k_norm.weight",
            "q_bias" => "self_attn.q_proj.bias",
            "k_bias" => "self_attn.k_proj.bias",
            "v_bias" => "self_attn.v_proj.bias",
            _ => "mlp.down_proj.weight",
        };
        format!("model.layers.{i}.{t}")
    },
};

/// Gemma 3's Hugging Face names: its block has four norms (Llama's `post_attention_layernorm`
/// is Gemma's norm on the attention output), and its checkpoints store each RMSNorm weight as
/// `w` for a norm that multiplies by `1 + w` (GGUF stores `1 + w`).
const HF_GEMMA3_NAMES: Names = Names {
    norm_offset: 1.0,
    layer: |i, s| match s {
        "ffn_norm" => format!("model.layers.{i}.pre_feedforward_layernorm.weight"),
        "post_attn_norm" => format!("model.layers.{i}.post_attention_layernorm.weight"),
        "post_ffn_norm" => format!("model.layers.{i}.post_feedforward_layernorm.weight"),
        _ => (HF_NAMES.layer)(i, s),
    },
    ..HF_NAMES
};

impl TensorSource for Gguf {
    fn path(&self) -> &Path {
        Gguf::path(self)
    }
    fn matrix(&self, name: &str) -> Result<Matrix> {
        Gguf::matrix(self, name)
    }
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Gguf::vector(self, name, len)
    }
    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Tensors of all safetensors files of a directory, memory-mapped.
struct SafetensorsDir {
    dir: PathBuf,
    tensors: HashMap<String, (Arc<memmap2::Mmap>, PathBuf, DType, Vec<usize>, usize)>,
}

impl SafetensorsDir {
    fn open(dir: &Path) -> Result<SafetensorsDir> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|source| EngineError::Io {
                path: dir.into(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(EngineError::model(
                dir,
                "no *.safetensors files in the model directory",
            ));
        }
        let mut tensors = HashMap::new();
        for f in files {
            let file = std::fs::File::open(&f).map_err(|source| EngineError::Io {
                path: f.clone(),
                source,
            })?;
            // SAFETY: read-only map of a model file that is not modified while in use.
            let map = Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(|source| {
                EngineError::Io {
                    path: f.clone(),
                    source,
                }
            })?);
            let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| {
                EngineError::model(&f, format!("not a valid safetensors file: {e}"))
            })?;
            for (name, view) in st.tensors() {
                let dt = match view.dtype() {
                    safetensors::Dtype::F32 => DType::F32,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::BF16 => DType::BF16,
                    other => {
                        return Err(EngineError::model(
                            &f,
                            format!("tensor {name} has dtype {other:?}; supported: F32, F16, BF16"),
                        ))
                    }
                };
                let offset = view.data().as_ptr() as usize - map.as_ptr() as usize;
                tensors.insert(
                    name,
                    (map.clone(), f.clone(), dt, view.shape().to_vec(), offset),
                );
            }
        }
        Ok(SafetensorsDir {
            dir: dir.into(),
            tensors,
        })
    }
}

impl TensorSource for SafetensorsDir {
    fn path(&self) -> &Path {
        &self.dir
    }
    fn matrix(&self, name: &str) -> Result<Matrix> {
        let (map, file, dt, shape, off) = self
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::model(&self.dir, format!("missing tensor {name}")))?;
        let (rows, cols) = match shape.as_slice() {
            [c] => (1, *c),
            [r, c] => (*r, *c),
            _ => {
                return Err(EngineError::model(
                    file,
                    format!("tensor {name} has shape {shape:?}, expected 1 or 2 dims"),
                ))
            }
        };
        let backing: kernels::Backing = map.clone();
        Matrix::new(*dt, rows, cols, backing, *off)
            .map_err(|e| EngineError::model(file, format!("tensor {name}: {e}")))
    }
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let m = self.matrix(name)?;
        if m.rows() * m.cols() != len {
            return Err(EngineError::model(
                &self.dir,
                format!(
                    "tensor {name} has {} values, expected {len}",
                    m.rows() * m.cols()
                ),
            ));
        }
        let mut out = vec![0f32; len];
        m.dequantize_row(0, &mut out[..m.cols()]);
        for r in 1..m.rows() {
            m.dequantize_row(r, &mut out[r * m.cols()..(r + 1) * m.cols()]);
        }
        Ok(out)
    }
    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Loads a model and its tokenizer from a `.gguf` file or a Hugging Face directory.
pub fn load(path: &Path, device: Device) -> Result<(Model, Tokenizer)> {
    if crate::config::is_dir(path)? {
        let (config, json) = crate::config::read_hf_config(path)?;
        let src = SafetensorsDir::open(path)?;
        let names = match config.arch.as_str() {
            "gemma3" => &HF_GEMMA3_NAMES,
            _ => &HF_NAMES,
        };
        let mut weights = Weights::load(&src, names, &config)?;
        if json["tie_word_embeddings"] == false && !src.has(names.output) {
            return Err(EngineError::model(
                path,
                "tie_word_embeddings is false but lm_head.weight is missing",
            ));
        }
        if json["tie_word_embeddings"] == true {
            weights.output = weights.embed.clone();
        }
        let tok = Tokenizer::from_hf_dir(path)?;
        Ok((Model::new(config, weights, device)?, tok))
    } else {
        let g = Gguf::open(path)?;
        let config = ModelConfig::from_gguf(&g)?;
        let weights = Weights::load(&g, &GGUF_NAMES, &config)?;
        let tok = Tokenizer::from_gguf(&g)?;
        Ok((Model::new(config, weights, device)?, tok))
    }
}

/// The model at `path` as the mock engine (see [`crate::mock`]): its shape and tokenizer, and a
/// timing model instead of kernels.
pub fn load_mock(path: &Path, timing: crate::MockTiming) -> Result<(Model, Tokenizer)> {
    let (config, tok) = crate::inspect(path)?;
    Ok((Model::mock(config, timing), tok))
}
