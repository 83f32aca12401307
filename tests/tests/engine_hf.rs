//! The Hugging Face path: a safetensors copy of the default model, written by
//! `scripts/export_hf.py` (f16 weights dequantised by the `gguf` package, Q/K rows in HF's
//! rotate-half order), loads and gives the GGUF's greedy tokens on the golden prompts.

use std::path::PathBuf;
use std::process::Command;

use engine::Model;
use tandem_tests::{decode_by_hand, golden, model_path};

fn hf_copy() -> PathBuf {
    let dir = engine::fetch::cache_dir().join("SmolLM2-135M-Instruct-hf");
    if !dir.join("model.safetensors").exists() {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/export_hf.py");
        let tmp = dir.with_extension("part");
        let status = Command::new("python3")
            .arg(&script)
            .arg("--gguf")
            .arg(model_path())
            .arg("--out")
            .arg(&tmp)
            .status()
            .expect("python3 runs");
        assert!(
            status.success(),
            "scripts/export_hf.py failed (it needs `pip install gguf numpy`)"
        );
        std::fs::rename(&tmp, &dir).unwrap();
    }
    dir
}

/// Greedy continuation with each step's logits.
fn greedy(model: &Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    decode_by_hand(model, prompt, n, &[], |l, _| engine::sampler::argmax(l))
}

fn margin(logits: &[f32]) -> f32 {
    let mut v = logits.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

#[test]
fn hf_copy_gives_the_ggufs_greedy_tokens() {
    let cpu = || kernels::Device::parse("cpu").unwrap();
    let (gguf, gtok) = engine::load(&model_path(), cpu()).unwrap();
    let (hf, htok) = engine::load(&hf_copy(), cpu()).unwrap();
    assert_eq!(hf.config.rope_style, kernels::RopeStyle::Halves);
    assert_eq!(gguf.config.n_layers, hf.config.n_layers);
    let g = golden();
    let noise = g.noise_margin() as f32;
    for case in &g.cases {
        let ids = gtok.encode(&case.text).unwrap();
        assert_eq!(
            htok.encode(&case.text).unwrap(),
            ids,
            "tokenizer.json tokenises {:?} like the GGUF",
            case.text
        );
        let (a, logits) = greedy(&gguf, &ids, 32);
        let (b, _) = greedy(&hf, &ids, 32);
        let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        // f16 weights with f32 activations vs 4-bit weights with 8-bit activations: the two may
        // part only at a near-tie of the GGUF run (margin inside llama.cpp's own noise floor).
        let first_tie = logits.iter().position(|l| margin(l) <= noise).unwrap_or(32);
        println!(
            "{:?}: {same} of 32 greedy tokens identical (GGUF's first near-tie: {first_tie})",
            case.source
        );
        assert!(
            same >= first_tie.min(32),
            "{:?}: HF {:?} vs GGUF {:?}",
            case.source,
            htok.decode(&b, false),
            gtok.decode(&a, false)
        );
    }
    let chat = htok
        .apply_chat_template(
            &[engine::ChatMessage::user(
                "What is the capital city of Germany?",
            )],
            true,
        )
        .unwrap();
    let (ans, _) = greedy(&hf, &htok.encode(&chat).unwrap(), 12);
    assert!(htok.decode(&ans, true).unwrap().contains("Berlin"));
}

/// Gemma 3 270M's `config.json` (the Hugging Face `gemma3_text` keys, values as published for
/// google/gemma-3-270m) describes the same model as its GGUF's metadata: every field of the
/// description equal but the name.
#[test]
fn gemma3_config_json_matches_the_gguf_metadata() {
    let mut types = vec!["sliding_attention"; 18];
    for t in types.iter_mut().skip(5).step_by(6) {
        *t = "full_attention";
    }
    let json = serde_json::json!({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "sliding_window": 512, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 262144, "rope_scaling": null,
        "attention_bias": false, "layer_types": types,
    });
    let path = std::path::Path::new("config.json");
    let hf = engine::ModelConfig::from_hf_json(path, &json).unwrap();
    let (mut gguf, _) = engine::inspect(&tandem_tests::gemma3_path()).unwrap();
    gguf.name = hf.name.clone();
    assert_eq!(hf, gguf);
    // A layer pattern other than every sixth: read from layer_types, not assumed.
    let mut other = json.clone();
    other["layer_types"][0] = "full_attention".into();
    let c = engine::ModelConfig::from_hf_json(path, &other).unwrap();
    assert_eq!(c.layers[0].window, None);
    assert_eq!(c.layers[0].rope_base, 1_000_000.0);
}

/// Qwen2.5, Qwen3 and Llama 3.2 `config.json`s (their published keys and values; no such
/// weights are at hand here, so these models are tested as configuration only): QKV biases,
/// query/key norms and Llama 3's RoPE scaling are read as the description's settings; what
/// tandem cannot run is refused by name.
#[test]
fn qwen_and_llama3_config_json_are_configuration() {
    let path = std::path::Path::new("config.json");
    let read = |j: serde_json::Value| engine::ModelConfig::from_hf_json(path, &j);
    let qwen2 = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "vocab_size": 151936, "use_sliding_window": false,
        "sliding_window": 32768, "tie_word_embeddings": true,
    });
    let c = read(qwen2.clone()).unwrap();
    assert!(c.qkv_bias && !c.qk_norm && c.layers.iter().all(|l| l.window.is_none()));
    assert_eq!(
        (c.head_dim, c.n_kv_heads, c.arch.as_str()),
        (64, 2, "qwen2")
    );
    let mut sliding = qwen2;
    sliding["use_sliding_window"] = true.into();
    let e = read(sliding).unwrap_err().to_string();
    assert!(e.contains("use_sliding_window"), "{e}");

    let qwen3 = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "vocab_size": 151936,
        "attention_bias": false, "rope_scaling": null,
    });
    let c = read(qwen3).unwrap();
    assert!(c.qk_norm && !c.qkv_bias && !c.is_plain_llama());
    assert_eq!((c.head_dim, c.attn_scale), (128, 1.0 / 128f32.sqrt()));

    let llama = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "vocab_size": 128256,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    });
    let c = read(llama.clone()).unwrap();
    // The divisors of HF's llama3 scaling for this config, computed in Python from the formula
    // of transformers' `_compute_llama3_parameters` (the values llama.cpp's converter writes as
    // rope_freqs.weight): 15 pairs unscaled, three smoothed, 14 divided by the factor.
    let f = c.rope_freq_factors.expect("llama3 scaling gives factors");
    assert_eq!(f.len(), 32);
    assert!(f[..15].iter().all(|&x| x == 1.0) && f[18..].iter().all(|&x| x == 32.0));
    for (got, want) in f[15..18].iter().zip([1.651_329_2, 3.292_262_1, 9.666_729]) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
    let mut yarn = llama;
    yarn["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    let e = read(yarn).unwrap_err().to_string();
    assert!(e.contains("yarn"), "{e}");
    let e = read(serde_json::json!({"model_type": "mistral"}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported architecture"), "{e}");
}
