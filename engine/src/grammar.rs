//! Structured output: the token masks that keep a sequence inside a grammar — a JSON schema, a
//! regular expression or a list of choices ([`Constraint`]) — computed by llguidance (the
//! constrained-decoding library llama.cpp, vLLM and SGLang use) over the model's own vocabulary.
//!
//! [`Grammars`] holds the vocabulary's token trie, built once per worker; a request's
//! [`Guide`] masks the logits before each draw (a token the grammar cannot take next gets
//! `-inf`; the end-of-sequence token only where the grammar may end) and moves past each token
//! drawn. When the grammar is complete the sequence ends.

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};

use crate::error::{EngineError, Result};
use crate::sampler::Constraint;
use crate::Tokenizer;

/// The grammar compiler of one vocabulary.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// The compiler for `tok`'s vocabulary; its end-of-sequence token is the first of the
    /// tokenizer's stop tokens (special tokens are never text to a grammar).
    pub fn new(tok: &Tokenizer) -> Result<Grammars> {
        let words = tok.vocab_words();
        let eos = *tok.stop_ids().first().ok_or_else(|| {
            EngineError::Config("structured output needs an end-of-sequence token".into())
        })?;
        let info = TokRxInfo::new(words.len() as u32, eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| EngineError::Config(format!("grammar setup: {e}")))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A guide for one request's output, or a bad-request error saying why `c` does not
    /// compile.
    pub fn guide(&self, c: &Constraint) -> Result<Guide> {
        let grammar = match c {
            Constraint::JsonSchema(schema) => {
                let mut schema = schema.clone();
                if !schema.is_object() {
                    return Err(EngineError::InvalidRequest(
                        "a JSON schema must be an object".into(),
                    ));
                }
                // Compact separators and no free whitespace: a small model at a high temperature
                // cannot wander off into blank space, and the output is canonical JSON.
                if schema.get("x-guidance").is_none() {
                    let opts = JsonCompileOptions {
                        whitespace_flexible: false,
                        ..Default::default()
                    };
                    opts.apply_to(&mut schema);
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Choice(choices) if choices.is_empty() => {
                return Err(EngineError::InvalidRequest(
                    "guided_choice needs at least one choice".into(),
                ))
            }
            Constraint::Choice(choices) => {
                let alts: Vec<String> = choices.iter().map(|c| escape(c)).collect();
                TopLevelGrammar::from_regex(&alts.join("|"))
            }
            Constraint::Unreadable(why) => {
                return Err(EngineError::InvalidRequest(format!(
                    "the response format could not be read: {why}"
                )))
            }
            Constraint::Compiled(c) => return c.take(),
        };
        let parser = self.factory.create_parser(grammar);
        let m = Matcher::new(parser);
        if let Some(e) = m.get_error() {
            return Err(EngineError::InvalidRequest(format!(
                "the response format does not compile: {e}"
            )));
        }
        Ok(Guide { m })
    }
}

/// A guide compiled ahead of its request, off the engine thread (a decode worker compiles each
/// request's constraint on a blocking thread within a time budget), carried to the engine in
/// [`Constraint::Compiled`], which takes it once.
#[derive(Clone)]
pub struct Compiled(Arc<Mutex<Option<Guide>>>);

impl Compiled {
    /// `guide`, to be taken by the engine.
    pub fn new(guide: Guide) -> Compiled {
        Compiled(Arc::new(Mutex::new(Some(guide))))
    }

    pub(crate) fn take(&self) -> Result<Guide> {
        let taken = self.0.lock().map(|mut g| g.take());
        taken.ok().flatten().ok_or_else(|| {
            EngineError::Internal("a compiled grammar was used by two requests".into())
        })
    }
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled(..)")
    }
}

impl PartialEq for Compiled {
    fn eq(&self, other: &Compiled) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// `text` as a regular expression matching exactly it.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('(');
    for ch in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(ch) {
            out.push('\\');
        }
        out.push(ch);
    }
    out.push(')');
    out
}

/// One request's position in its grammar.
pub struct Guide {
    m: Matcher,
}

impl Guide {
    /// Consumes tokens already in the output (a migrated request resumes with them).
    pub fn replay(&mut self, tokens: &[u32]) -> Result<()> {
        self.m.consume_tokens(tokens).map_err(|e| {
            EngineError::InvalidRequest(format!("the output so far breaks its grammar: {e}"))
        })
    }

    /// Sets to `-inf` the logits of the tokens the grammar cannot take next (logits past the
    /// vocabulary included). Fails only on an internal grammar error.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self
            .m
            .compute_mask()
            .map_err(|e| EngineError::InvalidRequest(format!("grammar: {e}")))?;
        for (t, l) in logits.iter_mut().enumerate() {
            if !allowed.is_allowed(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Moves past `tok`; returns whether the grammar is complete (the output ends here).
    pub fn commit(&mut self, tok: u32) -> Result<bool> {
        self.m
            .consume_token(tok)
            .map_err(|e| EngineError::InvalidRequest(format!("grammar: {e}")))?;
        Ok(self.m.is_stopped())
    }
}
