//! Log-probabilities in the OpenAI response formats: chat's `{"content": [{token, logprob,
//! bytes, top_logprobs}]}` and the legacy completions' `{tokens, token_logprobs, top_logprobs,
//! text_offset}`. The values are the decode worker's (see `engine::sampler::TokenLogprobs`);
//! a token's text here is its own bytes, read as UTF-8 (a piece of a character shows as U+FFFD,
//! and `bytes` has the piece).

use engine::sampler::TokenLogprobs;
use engine::Tokenizer;
use serde_json::{json, Value};

/// The entries gathered since the last [`LogprobsOut::take`], in one response format.
pub struct LogprobsOut {
    chat: bool,
    entries: Vec<(u32, TokenLogprobs, usize)>,
    /// Characters of the response text so far (the legacy format's `text_offset`).
    offset: usize,
}

impl LogprobsOut {
    /// For a chat response (`chat`) or a completion.
    pub fn new(chat: bool) -> LogprobsOut {
        LogprobsOut {
            chat,
            entries: Vec::new(),
            offset: 0,
        }
    }

    /// Records token `id`, whose text starts after the text emitted so far.
    pub fn push(&mut self, id: u32, lp: TokenLogprobs) {
        self.entries.push((id, lp, self.offset));
    }

    /// Counts `text` as emitted.
    pub fn emitted(&mut self, text: &str) {
        self.offset += text.chars().count();
    }

    /// The recorded entries in the response's format (`None` when there are none), cleared.
    pub fn take(&mut self, tok: &Tokenizer) -> Option<Value> {
        if self.entries.is_empty() {
            return None;
        }
        let entries = std::mem::take(&mut self.entries);
        let text = |id: u32| {
            let bytes = tok.token_bytes(id).unwrap_or_default();
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        if self.chat {
            let item = |id: u32, logprob: f32| {
                let (token, bytes) = text(id);
                json!({"token": token, "logprob": logprob, "bytes": bytes})
            };
            let content: Vec<Value> = entries
                .iter()
                .map(|(id, lp, _)| {
                    let mut e = item(*id, lp.logprob);
                    e["top_logprobs"] = lp.top.iter().map(|&(t, l)| item(t, l)).collect();
                    e
                })
                .collect();
            return Some(json!({ "content": content }));
        }
        let tokens: Vec<String> = entries.iter().map(|e| text(e.0).0).collect();
        let logprobs: Vec<f32> = entries.iter().map(|e| e.1.logprob).collect();
        let top: Vec<Value> = entries
            .iter()
            .map(|e| {
                let m: serde_json::Map<String, Value> =
                    e.1.top
                        .iter()
                        .map(|&(t, l)| (text(t).0, json!(l)))
                        .collect();
                Value::Object(m)
            })
            .collect();
        let offsets: Vec<usize> = entries.iter().map(|e| e.2).collect();
        Some(
            json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}),
        )
    }
}
