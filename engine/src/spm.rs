//! SentencePiece tokenisation from GGUF metadata (`tokenizer.ggml.model = "llama"`), exactly as
//! llama.cpp does it: special and user-defined token texts are split out first (longest first),
//! each remaining piece has its spaces written as `▁` and is split into characters, adjacent
//! symbols are merged while their concatenation is a token, highest score first (the leftmost
//! on a tie), and a character no token covers falls back to its bytes (`<0xXX>`).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{EngineError, Result};
use crate::gguf::Gguf;

/// Token types as GGUF stores them (`tokenizer.ggml.token_type`).
const NORMAL: u8 = 1;
const UNKNOWN: u8 = 2;
const CONTROL: u8 = 3;
const USER_DEFINED: u8 = 4;
const BYTE: u8 = 6;

/// A SentencePiece vocabulary: token texts, scores and types.
pub(crate) struct Spm {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<u8>,
    ids: HashMap<String, u32>,
    /// Special tokens by the first byte of their text, to find the few a text contains.
    by_first_byte: HashMap<u8, Vec<u32>>,
    add_space_prefix: bool,
    unk: Option<u32>,
}

/// A piece of the input: text still to tokenise, or a special token already found.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

impl Spm {
    pub(crate) fn from_gguf(g: &Gguf) -> Result<Spm> {
        let tokens: Vec<String> = g
            .get_strings("tokenizer.ggml.tokens")?
            .into_iter()
            .map(str::to_string)
            .collect();
        let num = |key: &str, default: f64| -> Result<Vec<f64>> {
            match g.metadata.get(key).and_then(|v| v.as_array()) {
                Some(a) if a.len() == tokens.len() => {
                    Ok(a.iter().map(|v| v.as_f64().unwrap_or(default)).collect())
                }
                Some(a) => Err(EngineError::model(
                    g.path(),
                    format!("{key} has {} entries for {} tokens", a.len(), tokens.len()),
                )),
                None => Ok(vec![default; tokens.len()]),
            }
        };
        let scores = num("tokenizer.ggml.scores", 0.0)?
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let types: Vec<u8> = num("tokenizer.ggml.token_type", NORMAL as f64)?
            .into_iter()
            .map(|v| v as u8)
            .collect();
        let mut ids = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            ids.insert(t.clone(), i as u32);
        }
        let specials: Vec<u32> = (0..tokens.len() as u32)
            .filter(|&i| matches!(types[i as usize], CONTROL | USER_DEFINED | UNKNOWN))
            .filter(|&i| !tokens[i as usize].is_empty())
            .collect();
        let mut by_first_byte: HashMap<u8, Vec<u32>> = HashMap::new();
        for &i in &specials {
            by_first_byte
                .entry(tokens[i as usize].as_bytes()[0])
                .or_default()
                .push(i);
        }
        let add_space_prefix = g
            .metadata
            .get("tokenizer.ggml.add_space_prefix")
            .map_or(true, |v| matches!(v, crate::gguf::Value::Bool(true)));
        let unk = g
            .metadata
            .get("tokenizer.ggml.unknown_token_id")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32);
        Ok(Spm {
            tokens,
            scores,
            types,
            ids,
            by_first_byte,
            add_space_prefix,
            unk,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn token_to_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Token ids of `text` (no BOS); with `parse_special`, control-token texts become their
    /// ids (user-defined tokens always do, as in llama.cpp).
    pub(crate) fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        let mut prev_special = true;
        for f in self.partition(text, parse_special) {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    let mut s = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && prev_special {
                        s.push(' ');
                    }
                    s.push_str(t);
                    self.tokenize_piece(&s.replace(' ', "\u{2581}"), &mut out);
                    prev_special = false;
                }
            }
        }
        out
    }

    /// Splits out special tokens the way llama.cpp does: each token in turn, longest first,
    /// every occurrence in the text fragments left by the tokens before it.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut frags = vec![Fragment::Text(text)];
        for id in self.specials_in(text) {
            if !parse_special && self.types[id as usize] != USER_DEFINED {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Fragment::Text(mut rest) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = rest.find(pat) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + pat.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }

    /// The special tokens whose text occurs somewhere in `text`, in llama.cpp's order.
    fn specials_in(&self, text: &str) -> Vec<u32> {
        let bytes = text.as_bytes();
        let mut found: Vec<u32> = Vec::new();
        for (at, b) in bytes.iter().enumerate() {
            for &id in self.by_first_byte.get(b).map_or(&[][..], |v| v) {
                if bytes[at..].starts_with(self.tokens[id as usize].as_bytes()) {
                    found.push(id);
                }
            }
        }
        found.sort_unstable();
        found.dedup();
        found.sort_by(|&a, &b| self.special_order(a, b));
        found
    }

    /// llama.cpp's order of special tokens: longest text first (then by id, where its sort
    /// leaves equal lengths unordered).
    fn special_order(&self, a: u32, b: u32) -> Ordering {
        let (ta, tb) = (&self.tokens[a as usize], &self.tokens[b as usize]);
        tb.len().cmp(&ta.len()).then(a.cmp(&b))
    }

    /// SentencePiece merging of one escaped piece.
    fn tokenize_piece(&self, text: &str, out: &mut Vec<u32>) {
        // Symbols: byte ranges, linked as a list; merged-away symbols have len 0.
        let mut sym: Vec<Symbol> = text
            .char_indices()
            .map(|(at, c)| Symbol {
                at,
                len: c.len_utf8(),
                prev: 0,
                next: 0,
            })
            .collect();
        let n = sym.len() as isize;
        for (i, s) in sym.iter_mut().enumerate() {
            s.prev = i as isize - 1;
            s.next = if i as isize + 1 < n {
                i as isize + 1
            } else {
                -1
            };
        }
        let mut queue = BinaryHeap::new();
        for i in 1..sym.len() {
            self.try_bigram(text, &sym, i - 1, i, &mut queue);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (b.left, b.right);
            if sym[l].len == 0 || sym[r].len == 0 || sym[l].len + sym[r].len != b.len {
                continue;
            }
            sym[l].len += sym[r].len;
            sym[r].len = 0;
            sym[l].next = sym[r].next;
            let after = sym[r].next;
            if after >= 0 {
                sym[after as usize].prev = l as isize;
            }
            if sym[l].prev >= 0 {
                self.try_bigram(text, &sym, sym[l].prev as usize, l, &mut queue);
            }
            if sym[l].next >= 0 {
                self.try_bigram(text, &sym, l, sym[l].next as usize, &mut queue);
            }
        }
        let mut i = if sym.is_empty() { -1 } else { 0 };
        while i >= 0 {
            let s = &sym[i as usize];
            let piece = &text[s.at..s.at + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().map(|b| self.byte_token(b))),
            }
            i = s.next;
        }
    }

    fn try_bigram(
        &self,
        text: &str,
        sym: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let len = sym[left].len + sym[right].len;
        let at = sym[left].at;
        if let Some(&id) = self.ids.get(&text[at..at + len]) {
            queue.push(Bigram {
                score: self.scores[id as usize],
                left,
                right,
                len,
            });
        }
    }

    fn byte_token(&self, b: u8) -> u32 {
        self.ids
            .get(&format!("<0x{b:02X}>"))
            .or_else(|| self.ids.get(std::str::from_utf8(&[b]).unwrap_or("")))
            .copied()
            .or(self.unk)
            .unwrap_or(0)
    }

    /// The bytes of `ids` as text (an incomplete UTF-8 sequence becomes U+FFFD); control and
    /// unknown tokens are left out when `skip_special`, written verbatim otherwise.
    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The bytes of `ids` (see [`Spm::decode`]).
    pub(crate) fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        for &id in ids {
            let i = id as usize;
            let text = self.tokens.get(i).ok_or_else(|| {
                EngineError::Tokenizer(format!("token id {id} is outside the vocabulary"))
            })?;
            match self.types[i] {
                CONTROL | UNKNOWN if skip_special => {}
                CONTROL | UNKNOWN | USER_DEFINED => bytes.extend_from_slice(text.as_bytes()),
                BYTE => bytes.push(parse_byte(text).unwrap_or(b'?')),
                NORMAL => bytes.extend_from_slice(text.replace('\u{2581}', " ").as_bytes()),
                // Unused and unknown types are suppressed, as llama.cpp does.
                _ => {}
            }
        }
        Ok(bytes)
    }
}

fn parse_byte(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

struct Symbol {
    at: usize,
    len: usize,
    prev: isize,
    next: isize,
}

/// A candidate merge; the queue pops the highest score, the leftmost among equal scores.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
