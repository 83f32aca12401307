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
