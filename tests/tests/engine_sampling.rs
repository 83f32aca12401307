//! Penalties, logit bias and min_tokens on the real model (issue 15, acceptance 3): the engine's
//! tokens are what a direct computation on the model's own logits picks — the formula written
//! out here, value by value, independently of the sampler's code.

use engine::RequestId;
use engine::{Engine, EngineConfig, Model, SamplingParams};
use tandem_tests::{decode_by_hand, load_model};

/// The module doc of `engine::sampler`, read literally for one vocabulary entry at a time.
fn adjust(p: &SamplingParams, logits: &[f32], seq: &[u32], out0: usize, stops: &[u32]) -> Vec<f32> {
    let output = &seq[out0..];
    let mut l = logits.to_vec();
    for (t, v) in l.iter_mut().enumerate() {
        let t = t as u32;
        *v += p
            .logit_bias
            .iter()
            .filter(|b| b.0 == t)
            .map(|b| b.1)
            .sum::<f32>();
        if output.len() < p.min_tokens && stops.contains(&t) {
            *v = f32::NEG_INFINITY;
        }
        if seq.contains(&t) {
            let r = p.repetition_penalty;
            *v = if *v > 0.0 { *v / r } else { *v * r };
        }
        let n = output.iter().filter(|&&o| o == t).count();
        if n > 0 {
            *v -= p.frequency_penalty * n as f32 + p.presence_penalty;
        }
    }
    l
}

/// Greedy decoding by hand: the model's logits each step, adjusted, argmax.
fn by_hand(model: &Model, prompt: &[u32], p: &SamplingParams, stops: &[u32], n: usize) -> Vec<u32> {
    let pick =
        |l: &[f32], seq: &[u32]| engine::sampler::argmax(&adjust(p, l, seq, prompt.len(), stops));
    decode_by_hand(model, prompt, n, stops, pick).0
}

#[test]
fn penalties_bias_and_min_tokens_pick_what_the_direct_computation_picks() {
    let (model, tok) = load_model();
    let prompt = tok
        .encode("List the days of the week, then list them again, then once more:")
        .unwrap();
    let n = 40;
    let run = |p: &SamplingParams| {
        let mut e = Engine::new(
            model.clone(),
            EngineConfig::default(),
            tok.stop_ids().to_vec(),
        )
        .unwrap();
        e.add(RequestId(0), prompt.clone(), p.clone()).unwrap();
        e.run_to_completion()
            .unwrap()
            .remove(&RequestId(0))
            .unwrap()
    };
    let plain = SamplingParams::greedy(n);
    let base = run(&plain);
    let monday = tok.encode(" Monday").unwrap()[0];
    let cases = [
        SamplingParams {
            presence_penalty: 1.5,
            ..plain.clone()
        },
        SamplingParams {
            frequency_penalty: 1.2,
            ..plain.clone()
        },
        SamplingParams {
            repetition_penalty: 1.8,
            ..plain.clone()
        },
        SamplingParams {
            logit_bias: vec![(monday, 8.0)],
            ..plain.clone()
        },
        SamplingParams {
            min_tokens: 30,
            presence_penalty: -0.5,
            ..plain.clone()
        },
    ];
    for p in &cases {
        let got = run(p);
        let want = by_hand(&model, &prompt, p, tok.stop_ids(), n);
        assert_eq!(got, want, "{p:?}");
        assert_ne!(got, base, "the parameters change the output: {p:?}");
    }
}

/// What OpenAI's log-probabilities report as a token's `bytes`: a character split over tokens
/// (the emoji, the CJK) comes back whole when they are put together.
#[test]
fn token_bytes_put_together_are_the_text() {
    let text = "Grüße, 世界! Tabs\tand  spaces, emoji 🦀, digits 12345.";
    let (_, smol) = load_model();
    let (_, gemma) = tandem_tests::load_gemma3();
    for tok in [&smol, &gemma] {
        let ids = tok.encode(text).unwrap();
        let bytes: Vec<u8> = ids
            .iter()
            .filter(|&&id| tok.decode(&[id], true).is_ok_and(|t| !t.is_empty()))
            .flat_map(|&id| tok.token_bytes(id).unwrap())
            .collect();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            tok.decode(&ids, true).unwrap(),
            "{ids:?}"
        );
    }
}

/// Prompt log-probabilities (`echo` with `logprobs`): each is the log-softmax, at the next prompt
/// token, of the model's own logits at that position — here from one forward over the whole
/// prompt, every row asked for — bitwise, although the engine computes the prompt in chunks of
/// 7 tokens, and with the prompt's prefix already in its cache (none of it reused: the path is
/// read from the engine's counters).
#[test]
fn prompt_logprobs_are_each_positions_log_softmax_and_nothing_is_reused() {
    let (model, tok) = load_model();
    let prompt = tok
        .encode(
            "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
        )
        .unwrap();
    let rows = tandem_tests::prompt_rows(&model, &prompt);
    let vocab = model.config.vocab_size;
    let want: Vec<_> = rows
        .chunks_exact(vocab)
        .zip(&prompt[1..])
        .map(|(row, &next)| engine::sampler::TokenLogprobs::of(row, next, 3))
        .collect();
    let config = EngineConfig {
        max_batch_tokens: 7,
        ..Default::default()
    };
    let mut e = Engine::new(model.clone(), config, tok.stop_ids().to_vec()).unwrap();
    // The same prompt once without: its blocks are cached after it.
    e.add(RequestId(0), prompt.clone(), SamplingParams::greedy(1))
        .unwrap();
    e.run_to_completion().unwrap();
    let hits = e.load().prefix_hit_tokens;
    let p = SamplingParams {
        prompt_logprobs: Some(3),
        ..SamplingParams::greedy(2)
    };
    e.add(RequestId(1), prompt.clone(), p).unwrap();
    let mut events = Vec::new();
    while e.has_work() {
        events.extend(e.step().unwrap());
    }
    assert_eq!(
        e.load().prefix_hit_tokens,
        hits,
        "no cached block was reused"
    );
    let got = events[0]
        .prompt_logprobs
        .clone()
        .expect("with the first token");
    assert_eq!(got.len(), prompt.len() - 1);
    assert_eq!(got, want);
    assert!(
        events[1].prompt_logprobs.is_none(),
        "only with the first token"
    );
    // The last prompt row is the first token's distribution: the greedy pick is its argmax.
    let last = &rows[(prompt.len() - 1) * vocab..];
    assert_eq!(events[0].token, engine::sampler::argmax(last));
    // A long prompt's rows are computed 64 at a time (each row's logits are held at once).
    let long = [&prompt[..]; 8].concat();
    let mut e2 = Engine::new(
        model.clone(),
        EngineConfig::default(),
        tok.stop_ids().to_vec(),
    )
    .unwrap();
    let p = SamplingParams {
        prompt_logprobs: Some(0),
        ..SamplingParams::greedy(1)
    };
    e2.add(RequestId(3), long.clone(), p).unwrap();
    e2.step().unwrap();
    assert_eq!(
        e2.last_step().0,
        64,
        "one capped chunk of a {}-token prompt",
        long.len()
    );
    let mut long_events = Vec::new();
    while e2.has_work() {
        long_events.extend(e2.step().unwrap());
    }
    assert_eq!(
        long_events[0].prompt_logprobs.as_ref().unwrap().len(),
        long.len() - 1
    );
    // The blocks were there to reuse: the same prompt without prompt log-probabilities hits.
    e.add(RequestId(2), prompt.clone(), SamplingParams::greedy(1))
        .unwrap();
    e.run_to_completion().unwrap();
    assert!(
        e.load().prefix_hit_tokens > hits,
        "a plain request reuses the prefix"
    );
}
