//! Structured output on the real model (issue 15): at temperature 1.0 every answer parses and
//! validates against its schema — checked here field by field, not by the grammar's own code —
//! and ends because the grammar is complete (finish `stop`), never by running out of tokens;
//! regular expressions and choices likewise; a schema that cannot compile is refused.

use engine::RequestId;
use std::sync::Arc;

use engine::grammar::Grammars;
use engine::sampler::Constraint;
use engine::{ChatMessage, Engine, EngineConfig, FinishReason, SamplingParams};
use serde_json::{json, Value};
use tandem_tests::load_model;
use tandem_tests::structured::{schema, valid, SUBJECTS};

struct Run {
    text: String,
    finish: Option<FinishReason>,
}

fn generate(
    e: &mut Engine,
    tok: &engine::Tokenizer,
    id: u64,
    prompt: &str,
    p: SamplingParams,
) -> Run {
    let msgs = [ChatMessage::user(prompt)];
    let text = tok.apply_chat_template(&msgs, true).unwrap();
    e.add(RequestId(id), tok.encode(&text).unwrap(), p).unwrap();
    let (mut ids, mut finish) = (Vec::new(), None);
    while e.has_work() {
        for ev in e.step().unwrap() {
            ids.push(ev.token);
            finish = ev.finish;
        }
    }
    Run {
        text: tok.decode(&ids, true).unwrap(),
        finish,
    }
}

#[test]
fn json_schema_answers_parse_validate_and_end_with_the_grammar() {
    let (model, tok) = load_model();
    let t0 = std::time::Instant::now();
    let grammars = Arc::new(Grammars::new(&tok).unwrap());
    eprintln!(
        "grammar compiler for {} tokens: {:?}",
        tok.vocab_size(),
        t0.elapsed()
    );
    let mut e = Engine::new(model, EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
    e.set_grammars(grammars);
    for (i, who) in SUBJECTS.iter().enumerate() {
        let p = SamplingParams {
            temperature: 1.0,
            seed: i as u64,
            constraint: Some(Constraint::JsonSchema(schema())),
            ..SamplingParams::greedy(160)
        };
        let prompt = format!("Describe {who} as JSON with a name, an age, a colour and tags.");
        let r = generate(&mut e, &tok, i as u64, &prompt, p);
        let v: Value =
            serde_json::from_str(&r.text).unwrap_or_else(|e| panic!("{who}: {e}: {}", r.text));
        assert!(valid(&v), "{who}: {v}");
        assert_eq!(r.finish, Some(FinishReason::Stop), "{who}: {}", r.text);
    }
}

#[test]
fn regexes_and_choices_are_matched_and_bad_grammars_refused() {
    let (model, tok) = load_model();
    let mut e = Engine::new(model, EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
    e.set_grammars(Arc::new(Grammars::new(&tok).unwrap()));
    let with = |c: Constraint, seed: u64| SamplingParams {
        temperature: 1.0,
        seed,
        constraint: Some(c),
        ..SamplingParams::greedy(40)
    };
    for seed in 0..5 {
        let rx = Constraint::Regex(r"[0-9]{3}-[0-9]{4}".into());
        let r = generate(
            &mut e,
            &tok,
            seed,
            "Give me a phone number.",
            with(rx, seed),
        );
        let b = r.text.as_bytes();
        assert!(
            b.len() == 8
                && b[3] == b'-'
                && b.iter()
                    .enumerate()
                    .all(|(i, c)| i == 3 || c.is_ascii_digit()),
            "{:?}",
            r.text
        );
        let choice = Constraint::Choice(vec!["yes".into(), "no".into(), "maybe (later)".into()]);
        let r = generate(
            &mut e,
            &tok,
            100 + seed,
            "Will it rain?",
            with(choice, seed),
        );
        assert!(
            ["yes", "no", "maybe (later)"].contains(&r.text.as_str()),
            "{:?}",
            r.text
        );
        assert_eq!(r.finish, Some(FinishReason::Stop));
    }
    let bad = [
        Constraint::JsonSchema(
            json!({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
        ),
        Constraint::Regex("(unclosed".into()),
        Constraint::Choice(vec![]),
        Constraint::Unreadable("expected value at line 1 column 1".into()),
    ];
    for c in bad {
        let err = e
            .add(RequestId(999), vec![1, 2, 3], with(c.clone(), 0))
            .unwrap_err();
        assert!(
            matches!(err, engine::EngineError::InvalidRequest(_)),
            "{c:?}: {err}"
        );
    }
}

/// A decode worker compiles each grammar before its request reaches the engine thread: an
/// engine with no grammar compiler of its own takes the compiled guide, and only once.
#[test]
fn a_grammar_compiled_ahead_is_taken_by_an_engine_without_a_compiler_once() {
    let (model, tok) = load_model();
    let grammars = Grammars::new(&tok).unwrap();
    let mut e = Engine::new(model, EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
    let rx = Constraint::Regex(r"[0-9]{3}-[0-9]{4}".into());
    let compiled = engine::grammar::Compiled::new(grammars.guide(&rx).unwrap());
    let params = SamplingParams {
        constraint: Some(Constraint::Compiled(compiled)),
        ..SamplingParams::greedy(40)
    };
    let r = generate(&mut e, &tok, 1, "Give me a phone number.", params.clone());
    assert_eq!(r.text.len(), 8, "{:?}", r.text);
    assert_eq!(r.finish, Some(FinishReason::Stop));
    let again = e.add(RequestId(7), vec![1, 2, 3], params).unwrap_err();
    assert!(matches!(again, engine::EngineError::Internal(_)), "{again}");
    let plain = Constraint::Regex("a".into());
    let without = SamplingParams {
        constraint: Some(plain),
        ..SamplingParams::greedy(4)
    };
    let refused = e.add(RequestId(8), vec![1, 2, 3], without).unwrap_err();
    assert!(
        matches!(refused, engine::EngineError::InvalidRequest(_)),
        "{refused}"
    );
}
