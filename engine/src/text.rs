//! Streaming text: incremental detokenisation that never splits a UTF-8 character, and stop
//! strings that hold back text which might be the start of a stop.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Turns a stream of token ids into a stream of text pieces.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    /// Adds a token and returns the text it completes (possibly empty, e.g. half a character).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            if let Some(new) = now.get(before.len()..) {
                let new = new.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                return Ok(new);
            }
        }
        Ok(String::new())
    }

    /// The text still held back when generation ends: the tokens' decode beyond what was
    /// returned (an incomplete character comes out as U+FFFD, as in a decode of all the tokens
    /// at once).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        (self.prefix, self.read) = (self.ids.len(), self.ids.len());
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}

/// Watches generated text for stop strings.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
}

impl StopStrings {
    /// Stops on any of `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopStrings {
        StopStrings {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds text; returns the text safe to emit and whether a stop string was reached (the stop
    /// string and anything after it are dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(i) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..i].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest tail that could still grow into a stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.pending.char_indices() {
                let tail = &self.pending[i..];
                if s.starts_with(tail) {
                    keep = keep.max(tail.len());
                    break;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Text still held back, released when generation ends without a stop.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_hold_back_prefixes_and_cut_at_stop() {
        let mut s = StopStrings::new(&["END".to_string(), "\n\n".to_string()]);
        assert_eq!(s.push("hello E"), ("hello ".to_string(), false));
        assert_eq!(s.push("N"), (String::new(), false));
        assert_eq!(s.push("Xy"), ("ENXy".to_string(), false));
        assert_eq!(s.push("a\n"), ("a".to_string(), false));
        assert_eq!(s.push("\nrest"), (String::new(), true));
        let mut s = StopStrings::new(&["é!".to_string()]);
        assert_eq!(s.push("caféé"), ("café".to_string(), false));
        assert_eq!(s.flush(), "é");
    }
}
