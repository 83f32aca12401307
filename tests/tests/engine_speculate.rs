//! Speculative decoding's contract on the real models (issue 37, acceptance 1 at the engine):
//! greedy, seeded and penalised outputs are bitwise those of decoding without speculation, over
//! 56 prompts on SmolLM2 and Gemma 3 — with the path asserted: drafts were verified, accepted
//! and rejected (the engine's counters); the prefix cache registered exactly the blocks it
//! registers without speculation (no rejected token in a block name); and every block is back
//! when the requests end.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use engine::{Engine, EngineConfig, Model, RequestId, SamplingParams, Tokenizer};
use tandem_tests::{load_gemma3, load_model};

/// Prompts whose answers copy from their context, and ordinary ones.
pub fn prompts() -> Vec<String> {
    let texts = [
        "The quick brown fox jumps over the lazy dog.",
        "fn add(a: i32, b: i32) -> i32 { a + b }",
        "Roses are red, violets are blue, sugar is sweet, and so are you.",
        "def area(radius):\n    return 3.14159 * radius * radius",
        "Dear customer, your order number 4417 has shipped and will arrive on Monday.",
        "SELECT name, email FROM users WHERE active = 1 ORDER BY name;",
        "To be, or not to be, that is the question.",
    ];
    let mut out = Vec::new();
    for t in texts {
        out.push(format!(
            "Repeat exactly: {t}\nRepeated: {t}\nRepeat it again: "
        ));
        out.push(format!("{t}\n{t}\n{t}\n"));
        out.push(format!(
            "Quote the text below word for word.\nText: {t}\nQuote: \""
        ));
        out.push(format!(
            "Rename x to total in this code:\nlet x = 0;\nfor v in values {{ x += v; }}\nprintln!(\"{{}}\", x);\n// {t}\nAnswer:\nlet total = 0;\n"
        ));
    }
    let chat = [
        "Write a short poem about the sea.",
        "What is the capital of France?",
        "Explain photosynthesis in two sentences.",
        "Give three tips for learning to cook.",
        "Why is the sky blue?",
        "Describe a cat to someone who has never seen one.",
        "What are prime numbers?",
        "Tell me a story about a robot.",
        "List some fruits that are red.",
        "How do airplanes fly?",
        "Summarise the plot of a detective novel.",
        "What should I pack for a beach trip?",
        "Name four planets.",
        "How does a bicycle work?",
        "What is a good name for a dog?",
        "Count from one to ten in words.",
        "Spell the word necessary.",
        "What is the opposite of hot?",
        "Describe the colour green.",
        "Write a haiku about rain.",
        "Explain what a computer is.",
        "What is two plus two?",
        "Give an example of a verb.",
        "What do bees make?",
        "Name a famous painter.",
        "What is the boiling point of water?",
        "Tell me a fun fact.",
        "What is the largest ocean?",
    ];
    out.extend(chat.iter().map(|c| c.to_string()));
    out
}

/// Greedy, seeded (temperature, top-p) and penalised parameters for prompt `i`.
fn params(i: usize, n: usize, speculation: usize) -> SamplingParams {
    let p = SamplingParams {
        max_tokens: Some(n),
        speculation: Some(speculation),
        ..Default::default()
    };
    match i % 3 {
        0 => p,
        1 => SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            seed: 1000 + i as u64,
            ..p
        },
        _ => SamplingParams {
            temperature: 0.5,
            seed: 7 + i as u64,
            repetition_penalty: 1.1,
            presence_penalty: 0.3,
            ..p
        },
    }
}

/// What one run gives: outputs by prompt, the speculation counters, the blocks the prefix
/// cache registered.
type Outcome = (
    BTreeMap<RequestId, Vec<u32>>,
    engine::SpecStats,
    BTreeSet<u64>,
);

/// Every prompt through one engine, `batch` requests at a time, speculation capped at `k`
/// drafts (0: off).
fn run(model: &Arc<Model>, tok: &Tokenizer, k: usize, batch: usize) -> Outcome {
    run_with(model, tok, k, batch, EngineConfig::default()).0
}

/// [`run`] on an engine of `cfg`; also its preemptions.
fn run_with(
    model: &Arc<Model>,
    tok: &Tokenizer,
    k: usize,
    batch: usize,
    cfg: EngineConfig,
) -> (Outcome, engine::Preemptions) {
    let mut e = Engine::new(model.clone(), cfg, tok.stop_ids().to_vec()).unwrap();
    let free = e.free_blocks();
    let mut out = BTreeMap::new();
    let all: Vec<_> = prompts().iter().map(|p| tok.encode(p).unwrap()).collect();
    for (g, group) in all.chunks(batch).enumerate() {
        for (j, p) in group.iter().enumerate() {
            let i = g * batch + j;
            e.add(RequestId(i as u64), p.clone(), params(i, 40, k))
                .unwrap();
        }
        out.extend(e.run_to_completion().unwrap());
    }
    let stored = e
        .take_kv_events()
        .into_iter()
        .filter(|ev| matches!(ev, engine::KvEvent::Stored { .. }))
        .map(|ev| ev.block().0)
        .collect();
    // No block is held, and none cached from a rejected draft is referenced.
    assert_eq!(
        e.free_blocks(),
        free,
        "every block free or cached-and-unreferenced"
    );
    ((out, e.load().speculation, stored), e.load().preemptions)
}

fn same_tokens_with_and_without(model: Arc<Model>, tok: Tokenizer) {
    let n = prompts().len();
    assert!(n >= 50);
    let (plain, off, blocks) = run(&model, &tok, 0, 8);
    assert_eq!(
        off,
        engine::SpecStats::default(),
        "speculation off drafts nothing"
    );
    for (k, batch) in [(8, 1), (4, 8)] {
        let (spec, s, stored) = run(&model, &tok, k, batch);
        for (id, want) in &plain {
            assert_eq!(
                &spec[id], want,
                "request {id:?}, {k} drafts at batch {batch}"
            );
        }
        assert_eq!(
            stored, blocks,
            "the prefix cache's blocks, {k} drafts at batch {batch}"
        );
        eprintln!("{k} drafts at batch {batch}: {s:?}");
        // The path: drafts were verified, some taken and some refused.
        assert!(s.verifies > 0 && s.accepted > 0, "{s:?}");
        assert!(s.accepted < s.proposed, "{s:?}");
    }
    // Optimistic admission in a pool too small for the batch: drafts take only pages to be
    // had (never preempting for them), preempted speculating sequences resume exactly.
    let small = EngineConfig {
        num_blocks: 24,
        admission: engine::Admission::Optimistic,
        ..Default::default()
    };
    let ((spec, s, _), p) = run_with(&model, &tok, 4, 8, small);
    for (id, want) in &plain {
        assert_eq!(&spec[id], want, "request {id:?}, optimistic admission");
    }
    eprintln!("optimistic, 24 blocks: {s:?}, {p:?}");
    assert!(s.accepted > 0 && p.recomputed > 0, "{s:?} {p:?}");
}

#[test]
fn smollm2_speculation_never_changes_a_token() {
    let (model, tok) = load_model();
    same_tokens_with_and_without(model, tok);
}

#[test]
fn gemma3_speculation_never_changes_a_token() {
    let (model, tok) = load_gemma3();
    same_tokens_with_and_without(model, tok);
}
