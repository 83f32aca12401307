//! Tokenizer and chat template.
//!
//! Byte-level BPE is built with the `tokenizers` crate, either from the vocabulary and merges
//! stored in a GGUF file (with the pre-tokenizer the file names) or from a `tokenizer.json`.
//! The chat template is the Jinja template stored with the model, rendered by `minijinja`.

use std::path::Path;

use serde::Serialize;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;

use crate::error::{EngineError, Result};
use crate::gguf::Gguf;

/// One chat message.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    /// "system", "user" or "assistant".
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A user message.
    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: "user".into(),
            content: content.into(),
        }
    }
}

/// The vocabulary and its algorithm.
enum Vocab {
    /// Byte-level BPE, by the `tokenizers` crate.
    Bpe(tokenizers::Tokenizer),
    /// SentencePiece as llama.cpp runs it ([`crate::spm`]).
    Spm(crate::spm::Spm),
}

impl Vocab {
    fn token_to_id(&self, text: &str) -> Option<u32> {
        match self {
            Vocab::Bpe(t) => t.token_to_id(text),
            Vocab::Spm(s) => s.token_to_id(text),
        }
    }
}

/// Appends the bytes a character of a byte-level BPE token stands for: GPT-2 maps the
/// printable bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) to themselves and the other 68, in
/// order, to U+0100 on. A character outside the map (an added token's own text) is itself.
fn push_byte_level(c: char, out: &mut Vec<u8>) {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let u = c as u32;
    if u < 256 && printable(u) {
        return out.push(u as u8);
    }
    if (256..256 + 68).contains(&u) {
        if let Some(b) = (0u32..256)
            .filter(|&b| !printable(b))
            .nth((u - 256) as usize)
        {
            return out.push(b as u8);
        }
    }
    out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes());
}

/// A model's tokenizer, special tokens and chat template.
pub struct Tokenizer {
    inner: Vocab,
    bos: Option<String>,
    eos: Option<String>,
    add_bos: Option<u32>,
    stop_ids: Vec<u32>,
    chat_template: Option<String>,
}

/// Token texts that end a turn in common chat formats; any present in the vocabulary stops
/// generation, as does the model's declared end-of-sequence token.
const END_OF_TURN: [&str; 5] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "</s>",
    "<end_of_turn>",
];

impl Tokenizer {
    fn finish(
        inner: Vocab,
        bos: Option<String>,
        eos: Option<String>,
        add_bos: bool,
        chat_template: Option<String>,
    ) -> Tokenizer {
        let mut stop_ids: Vec<u32> = END_OF_TURN
            .iter()
            .chain(
                eos.as_slice()
                    .iter()
                    .map(|s| &**s)
                    .collect::<Vec<_>>()
                    .iter(),
            )
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let add_bos = if add_bos {
            bos.as_deref().and_then(|b| inner.token_to_id(b))
        } else {
            None
        };
        Tokenizer {
            inner,
            bos,
            eos,
            add_bos,
            stop_ids,
            chat_template,
        }
    }

    /// Builds the tokenizer stored in a GGUF file: byte-level BPE (`tokenizer.ggml.model =
    /// gpt2`) or SentencePiece (`llama`).
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        let model = g.get_str("tokenizer.ggml.model")?;
        let inner = match model {
            "gpt2" => Vocab::Bpe(Tokenizer::bpe_from_gguf(g)?),
            "llama" => Vocab::Spm(crate::spm::Spm::from_gguf(g)?),
            _ => return Err(EngineError::model(g.path(), format!("tokenizer model {model:?} is not supported (tandem reads byte-level BPE, \"gpt2\", and SentencePiece, \"llama\")"))),
        };
        let tokens = g.get_strings("tokenizer.ggml.tokens")?;
        let name = |k: &str| {
            g.metadata
                .get(k)
                .and_then(|v| v.as_u64())
                .and_then(|i| tokens.get(i as usize))
                .map(|s| s.to_string())
        };
        let add_bos = matches!(
            g.metadata.get("tokenizer.ggml.add_bos_token"),
            Some(crate::gguf::Value::Bool(true))
        );
        let template = g
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        Ok(Tokenizer::finish(
            inner,
            name("tokenizer.ggml.bos_token_id"),
            name("tokenizer.ggml.eos_token_id"),
            add_bos,
            template,
        ))
    }

    fn bpe_from_gguf(g: &Gguf) -> Result<tokenizers::Tokenizer> {
        let bad = |m: String| EngineError::model(g.path(), m);
        let tokens = g.get_strings("tokenizer.ggml.tokens")?;
        let merges = g.get_strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = match g
            .metadata
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
        {
            Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| bad(format!("malformed merge {m:?}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| bad(format!("tokenizer: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = g
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let byte_level: PreTokenizerWrapper = ByteLevel::new(false, true, true).into();
        let pre_tok: PreTokenizerWrapper = match pre {
            "smollm" | "starcoder" | "refact" => Sequence::new(vec![Digits::new(true).into(), byte_level]).into(),
            "default" | "gpt2" => byte_level,
            other => return Err(bad(format!("pre-tokenizer {other:?} is not supported (supported: smollm, starcoder, refact, gpt2)"))),
        };
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        // Control (3) tokens are special; user-defined (4) tokens are matched verbatim.
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == 3 || **t == 4)
            .map(|(s, t)| AddedToken::from(s.to_string(), *t == 3))
            .collect();
        inner
            .add_special_tokens(added)
            .map_err(|e| bad(format!("tokenizer: {e}")))?;
        Ok(inner)
    }

    /// Loads `tokenizer.json` (and `tokenizer_config.json` for special tokens and the chat
    /// template) from a Hugging Face model directory.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let tj = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&tj)
            .map_err(|e| EngineError::model(&tj, format!("cannot load tokenizer: {e}")))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(s) => serde_json::from_str(&s)
                .map_err(|e| EngineError::model(&cfg_path, format!("invalid JSON: {e}")))?,
            Err(_) => serde_json::Value::Null,
        };
        let tok = |k: &str| match &cfg[k] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Object(o) => o
                .get("content")
                .and_then(|c| c.as_str())
                .map(str::to_string),
            _ => None,
        };
        let template = match &cfg["chat_template"] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(a) => a
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => None,
        };
        Ok(Tokenizer::finish(
            Vocab::Bpe(inner),
            tok("bos_token"),
            tok("eos_token"),
            cfg["add_bos_token"] == true,
            template,
        ))
    }

    /// Token ids of `text`, after the beginning-of-sequence token where the model adds one;
    /// special-token texts (like `<|im_start|>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// [`Tokenizer::encode`], without the beginning-of-sequence token unless `add_special`.
    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if add_special {
            ids.extend(self.add_bos);
        }
        match &self.inner {
            Vocab::Bpe(t) => {
                let enc = t
                    .encode(text, false)
                    .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Vocab::Spm(s) => ids.extend(s.encode(text, true)),
        }
        Ok(ids)
    }

    /// Text of `ids`, special tokens included verbatim unless `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.inner {
            Vocab::Bpe(t) => t
                .decode(ids, skip_special)
                .map_err(|e| EngineError::Tokenizer(e.to_string())),
            Vocab::Spm(s) => s.decode(ids, skip_special),
        }
    }

    /// The bytes one token stands for (a piece of a UTF-8 character, for some; a special
    /// token's text), as OpenAI's log-probabilities report them.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        match &self.inner {
            Vocab::Bpe(t) => {
                let piece = t.id_to_token(id).ok_or_else(|| {
                    EngineError::Tokenizer(format!("token id {id} is outside the vocabulary"))
                })?;
                let mut bytes = Vec::new();
                piece.chars().for_each(|c| push_byte_level(c, &mut bytes));
                Ok(bytes)
            }
            Vocab::Spm(s) => s.decode_bytes(&[id], false),
        }
    }

    /// Token ids that end generation (end of sequence / end of turn).
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Vocab::Bpe(t) => t.get_vocab_size(true),
            Vocab::Spm(s) => s.len(),
        }
    }

    /// Every token's bytes, in id order, for a grammar's token trie: a special token's text
    /// (one that decoding with `skip_special` drops) after the marker byte 0xFF, so that no
    /// grammar matches it as text.
    pub fn vocab_words(&self) -> Vec<Vec<u8>> {
        (0..self.vocab_size() as u32)
            .map(|id| {
                let bytes = self.token_bytes(id).unwrap_or_default();
                let special = !bytes.is_empty()
                    && self.decode(&[id], true).is_ok_and(|t| t.is_empty())
                    && self.decode(&[id], false).is_ok_and(|t| !t.is_empty());
                match special {
                    true => [&[0xFF], &bytes[..]].concat(),
                    false => bytes,
                }
            })
            .collect()
    }

    /// The beginning- and end-of-sequence tokens' texts, where the model names them.
    pub fn special_tokens(&self) -> (Option<&str>, Option<&str>) {
        (self.bos.as_deref(), self.eos.as_deref())
    }

    /// The chat template text, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders `messages` through the model's own chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let src = self
            .chat_template
            .as_deref()
            .ok_or_else(|| EngineError::Tokenizer("the model has no chat template".into()))?;
        let mut env = minijinja::Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", src)
            .map_err(|e| EngineError::Tokenizer(format!("chat template: {e}")))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| EngineError::Tokenizer(format!("chat template: {e}")))
    }
}
