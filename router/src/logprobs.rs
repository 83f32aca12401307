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
    /// Token, its log-probabilities (none for an echoed prompt's first token), text offset.
    entries: Vec<(u32, Option<TokenLogprobs>, usize)>,
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
        self.entries.push((id, Some(lp), self.offset));
    }

    /// Records an echoed prompt (`ids`, whose text is `text`, emitted before any output): its
    /// first token has no log-probability, token `i` after it has `lps[i - 1]`.
    pub fn prompt(&mut self, ids: &[u32], lps: &[TokenLogprobs], text: &str, tok: &Tokenizer) {
        let start = self.offset;
        for (i, &id) in ids.iter().enumerate() {
            let lp = i.checked_sub(1).and_then(|j| lps.get(j)).cloned();
            self.entries.push((id, lp, self.offset));
            let bytes = tok.token_bytes(id).unwrap_or_default();
            self.offset += String::from_utf8_lossy(&bytes).chars().count();
        }
        self.offset = start + text.chars().count();
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
                .filter_map(|(id, lp, _)| {
                    let lp = lp.as_ref()?;
                    let mut e = item(*id, lp.logprob);
                    e["top_logprobs"] = lp.top.iter().map(|&(t, l)| item(t, l)).collect();
                    Some(e)
                })
                .collect();
            return Some(json!({ "content": content }));
        }
        let tokens: Vec<String> = entries.iter().map(|e| text(e.0).0).collect();
        let logprobs: Vec<Option<f32>> = entries
            .iter()
            .map(|e| e.1.as_ref().map(|l| l.logprob))
            .collect();
        let top: Vec<Value> = entries
            .iter()
            .map(|e| match &e.1 {
                None => Value::Null,
                Some(lp) => {
                    Value::Object(lp.top.iter().map(|&(t, l)| (text(t).0, json!(l))).collect())
                }
            })
            .collect();
        let offsets: Vec<usize> = entries.iter().map(|e| e.2).collect();
        Some(
            json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}),
        )
    }
}
