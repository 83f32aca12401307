//! Structured output's cost to decoding (issue 15, acceptance 5): inter-token latency of the CPU
//! engine with a JSON schema against the same requests unconstrained, in one run, alternating.
//!
//! ```sh
//! cargo bench -p tandem-tests --bench structured     # TANDEM_BENCH_ROUNDS=N (default 3)
//! ```
//!
//! A round runs 16 chat requests (temperature 1.0, seeded) at batch 1 and then 8 at a time,
//! once unconstrained (64 tokens each, end of sequence ignored) and once with the tests' schema
//! (each ends when its JSON is complete). ITL is the mean time of the engine steps that only
//! decode, with the whole batch still running, over the same steps in both runs (the same
//! contexts); one mask's own time is printed too.

use engine::RequestId;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::grammar::Grammars;
use engine::sampler::Constraint;
use engine::{ChatMessage, Engine, EngineConfig, SamplingParams};
use tandem_tests::load_model;
use tandem_tests::structured::{schema, SUBJECTS};

/// The decode-only steps' durations while running `prompts` `batch` at a time, per group, in
/// order, while the whole group still runs (a batch thinned by finished answers steps faster).
fn steps(
    e: &mut Engine,
    prompts: &[Vec<u32>],
    batch: usize,
    constrained: bool,
) -> Vec<Vec<Duration>> {
    let mut out = Vec::new();
    for (k, group) in prompts.chunks(batch).enumerate() {
        for (i, p) in group.iter().enumerate() {
            let params = SamplingParams {
                temperature: 1.0,
                seed: (k * batch + i) as u64,
                ignore_eos: !constrained,
                constraint: constrained.then(|| Constraint::JsonSchema(schema())),
                ..SamplingParams::greedy(64)
            };
            e.add(RequestId((k * batch + i) as u64), p.clone(), params)
                .unwrap();
        }
        let mut times = Vec::new();
        while e.has_work() {
            let t0 = Instant::now();
            e.step().unwrap();
            let dt = t0.elapsed();
            if e.last_step() == (0, group.len()) {
                times.push(dt);
            }
        }
        out.push(times);
    }
    out
}

/// Mean step time of each run over the same steps (the first ones of each group that both
/// have): the same contexts, so attention costs the same.
fn paired(a: &[Vec<Duration>], b: &[Vec<Duration>]) -> (f64, f64, usize) {
    let (mut ta, mut tb, mut n) = (0.0, 0.0, 0);
    for (x, y) in a.iter().zip(b) {
        let k = x.len().min(y.len());
        ta += x[..k].iter().map(Duration::as_secs_f64).sum::<f64>();
        tb += y[..k].iter().map(Duration::as_secs_f64).sum::<f64>();
        n += k;
    }
    (ta * 1e3 / n.max(1) as f64, tb * 1e3 / n.max(1) as f64, n)
}

fn main() {
    let (model, tok) = load_model();
    let t0 = Instant::now();
    let grammars = Arc::new(Grammars::new(&tok).unwrap());
    println!(
        "grammar compiler for {} tokens built in {:?}",
        tok.vocab_size(),
        t0.elapsed()
    );
    let mut e = Engine::new(model, EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
    e.set_grammars(grammars.clone());
    let prompts: Vec<Vec<u32>> = SUBJECTS[..16]
        .iter()
        .map(|w| {
            let m = [ChatMessage::user(format!("Describe {w} as JSON."))];
            tok.encode(&tok.apply_chat_template(&m, true).unwrap())
                .unwrap()
        })
        .collect();
    // The mask alone: each token of a valid answer in turn, masked then taken.
    let answer = r#"{"name":"Captain Rowan","age":41,"colour":"blue","tags":["sea","gold"]}"#;
    let ids = tok.encode_with(answer, false).unwrap();
    let mut g = grammars.guide(&Constraint::JsonSchema(schema())).unwrap();
    let mut logits = vec![0f32; tok.vocab_size()];
    let mut masking = Duration::ZERO;
    for &t in &ids {
        let t0 = Instant::now();
        g.mask(&mut logits).unwrap();
        masking += t0.elapsed();
        assert!(logits[t as usize].is_finite(), "the answer is valid");
        logits.fill(0.0);
        g.commit(t).unwrap();
    }
    println!(
        "mask: {:?} a token on average over a {}-token answer",
        masking / ids.len() as u32,
        ids.len()
    );
    let rounds: usize = std::env::var("TANDEM_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    println!("| round | batch | ITL unconstrained (ms) | ITL json_schema (ms) | ratio | steps compared |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for r in 0..rounds {
        for batch in [1, 8] {
            let free = steps(&mut e, &prompts, batch, false);
            let json = steps(&mut e, &prompts, batch, true);
            let (f, j, n) = paired(&free, &json);
            println!(
                "| {} | {batch} | {f:.2} | {j:.2} | {:.3} | {n} |",
                r + 1,
                j / f
            );
        }
    }
}
