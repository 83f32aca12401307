//! Bad input gives a clear error naming what is wrong: missing, truncated and non-GGUF files,
//! unsupported quantisation types and architectures, prompts longer than the context.

use engine::RequestId;
use std::path::Path;

use engine::{EngineConfig, SamplingParams};
use tandem_tests::{load_model, model_path};

fn load_err(path: &Path) -> String {
    match engine::load(path, kernels::Device::parse("cpu").unwrap()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

/// A metadata value for [`gguf`].
enum Meta<'a> {
    Str(&'a str),
    U32(u32),
}

/// A minimal GGUF v3 file: metadata and tensors `(name, dims, ggml type, bytes)`.
fn gguf(meta: &[(&str, Meta<'_>)], tensors: &[(&str, &[u64], u32, usize)]) -> Vec<u8> {
    let s = |b: &mut Vec<u8>, v: &str| {
        b.extend((v.len() as u64).to_le_bytes());
        b.extend(v.as_bytes());
    };
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        s(&mut b, k);
        match v {
            Meta::Str(v) => {
                b.extend(8u32.to_le_bytes());
                s(&mut b, v);
            }
            Meta::U32(v) => {
                b.extend(4u32.to_le_bytes());
                b.extend(v.to_le_bytes());
            }
        }
    }
    let mut off = 0u64;
    for (name, dims, ty, bytes) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
        b.extend(ty.to_le_bytes());
        b.extend(off.to_le_bytes());
        off += (*bytes as u64).div_ceil(32) * 32;
    }
    b.resize(b.len().div_ceil(32) * 32 + off as usize, 0);
    b
}

#[test]
fn bad_model_files_are_named_and_explained() {
    let dir = std::env::temp_dir().join(format!("tandem-bad-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("nope.gguf");
    let e = load_err(&missing);
    assert!(e.contains("nope.gguf") && e.contains("No such file"), "{e}");

    let text = dir.join("text.gguf");
    std::fs::write(&text, "this is not a model").unwrap();
    let e = load_err(&text);
    assert!(
        e.contains("text.gguf") && e.contains("not a GGUF file"),
        "{e}"
    );

    let real = std::fs::read(model_path()).unwrap();
    for (cut, what) in [
        (100_000, "truncated GGUF file"),
        (real.len() - 1000, "lies past the end of the file"),
    ] {
        let p = dir.join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &real[..cut]).unwrap();
        let e = load_err(&p);
        assert!(
            e.contains(&format!("cut{cut}.gguf")) && e.contains(what),
            "{e}"
        );
    }

    let arch = dir.join("gpt2.gguf");
    std::fs::write(
        &arch,
        gguf(&[("general.architecture", Meta::Str("gpt2"))], &[]),
    )
    .unwrap();
    let e = load_err(&arch);
    assert!(e.contains("unsupported architecture \"gpt2\""), "{e}");

    // A llama GGUF whose embedding is Q2_K (type 10), which tandem does not run.
    let q2 = dir.join("q2.gguf");
    let meta = [
        ("general.architecture", Meta::Str("llama")),
        ("llama.block_count", Meta::U32(1)),
        ("llama.embedding_length", Meta::U32(256)),
        ("llama.feed_forward_length", Meta::U32(128)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.context_length", Meta::U32(128)),
        ("llama.vocab_size", Meta::U32(4)),
    ];
    std::fs::write(
        &q2,
        gguf(&meta, &[("token_embd.weight", &[256, 4], 10, 4 * 84)]),
    )
    .unwrap();
    let e = load_err(&q2);
    assert!(
        e.contains("token_embd.weight") && e.contains("Q2_K") && e.contains("not support"),
        "{e}"
    );

    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prompts_beyond_the_context_are_refused() {
    let (model, tok) = load_model();
    let ctx = model.config.context_len;
    let mut e =
        engine::Engine::new(model, EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
    let err = e
        .add(RequestId(1), vec![42; ctx + 5], SamplingParams::greedy(1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("{} tokens", ctx + 5)) && err.contains("context"),
        "{err}"
    );
    let err = e
        .add(RequestId(2), vec![42; 100], SamplingParams::greedy(ctx))
        .unwrap_err()
        .to_string();
    assert!(err.contains("exceeds the model's context"), "{err}");
    let err = e
        .add(RequestId(3), vec![], SamplingParams::greedy(1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("empty"), "{err}");
    let err = e
        .add(RequestId(4), vec![1_000_000], SamplingParams::greedy(1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    let err = e
        .add(
            RequestId(5),
            vec![1],
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("temperature"), "{err}");
    assert!(!e.has_work());
}
