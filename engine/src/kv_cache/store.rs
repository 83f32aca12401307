//! The cache's side of the cluster KV store: whole blocks computed here are copied out for it
//! as they are registered, and blocks fetched from it are put in G2, where a prefix lookup
//! loads them like its own (their checksums checked again on the way into the pool).
//!
//! A block travels as one object: its tokens (little-endian `u32`s), then its page's
//! segments in the order a tier stores them (layer by layer, keys then values) — only its
//! tokens where the tiers keep no values (the mock's, the simulator's: what a fetch moves is
//! priced by the timing model). Only a cache of one table (no windowed layer groups) whose
//! pages are in host memory takes part: a GPU pool's pages would have to come off the device
//! first.

use types::sum::sum;
use types::BlockHash;

use super::tiered::segments;
use super::KvCache;
use crate::tiers::Evicted;

/// A whole KV block as the cluster store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreBlock {
    /// Its name (the chain hash of its tokens and every token before).
    pub hash: BlockHash,
    /// Its tokens, then its page's bytes.
    pub bytes: Vec<u8>,
    /// [`types::sum::sum`] of `bytes`.
    pub sum: u64,
}

/// Blocks waiting for the worker to take them to the store.
pub(crate) struct StoreOut {
    /// Whether a block carries its page's bytes (or only its tokens: the mock's).
    values: bool,
    cap: usize,
    queue: Vec<StoreBlock>,
    dropped: u64,
}

/// Why fetched blocks were not staged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Staged {
    /// Blocks put in G2.
    pub staged: u64,
    /// Blocks whose bytes failed their checksum or size (dropped: computed instead).
    pub corrupt: u64,
}

impl KvCache {
    /// From now on, copies each block computed here for the store, up to `cap` waiting at
    /// once (more are dropped, counted), each with its page's bytes where `values` (else its
    /// tokens only: a mock's, whose values no step reads). `false` where this cache cannot:
    /// windowed layer groups, or pages on a device.
    pub fn set_store_out(&mut self, cap: usize, values: bool) -> bool {
        if !self.exports() {
            return false;
        }
        self.store_out = Some(StoreOut {
            values: values && self.page_bytes() > 0,
            cap,
            queue: Vec::new(),
            dropped: 0,
        });
        true
    }

    /// The blocks copied out since the last call, and how many were dropped in all (the
    /// queue was full).
    pub fn take_store_blocks(&mut self) -> (Vec<StoreBlock>, u64) {
        match self.store_out.as_mut() {
            Some(o) => (std::mem::take(&mut o.queue), o.dropped),
            None => (Vec::new(), 0),
        }
    }

    /// Page `b`, just registered as block `hash` holding `tokens`, copied out for the store.
    pub(super) fn offer(&mut self, b: u32, hash: u64, tokens: &[u32]) {
        let Some(out) = self.store_out.as_mut() else {
            return;
        };
        if out.queue.len() >= out.cap {
            out.dropped += 1;
            return;
        }
        let values = out.values;
        let block = self.block(b, BlockHash(hash), tokens, values);
        if let Some(out) = self.store_out.as_mut() {
            out.queue.push(block);
        }
    }

    /// Whether its blocks can be copied out whole: one table (no windowed layer groups), pages
    /// in host memory.
    pub fn exports(&self) -> bool {
        self.one_table() && self.device.is_none()
    }

    /// Page `b` (block `hash`, holding `tokens`) as the store keeps a block: its tokens, then
    /// its page's segments where `values`.
    fn block(&self, b: u32, hash: BlockHash, tokens: &[u32], values: bool) -> StoreBlock {
        let data = match values {
            true => segments(&self.layers, self.block_size * self.width, b),
            false => Vec::new(),
        };
        let len = tokens.len() * 4 + data.iter().map(|s| s.len()).sum::<usize>();
        let mut bytes = Vec::with_capacity(len);
        bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        for s in data {
            bytes.extend_from_slice(s);
        }
        let sum = sum(&bytes);
        StoreBlock { hash, bytes, sum }
    }

    /// The cached blocks of `hashes` in the pool or, past it, in G2, in order up to the first
    /// neither holds, as the store keeps them (with their pages' bytes where `values`): what
    /// this worker serves another that lacks them (peer fetch). Nothing where the cache cannot
    /// (windowed layer groups, pages on a device).
    pub fn export(&mut self, hashes: &[BlockHash], values: bool) -> Vec<StoreBlock> {
        if !self.exports() {
            return Vec::new();
        }
        let values = values && self.page_bytes() > 0;
        let mut out = Vec::new();
        for &h in hashes {
            if let Some((b, tokens)) = self.pool.cached(0, h.0) {
                out.push(self.block(b, h, tokens, values));
                continue;
            }
            match self.host_block(h, values) {
                Some(block) => out.push(block),
                None => break,
            }
        }
        out
    }

    /// Block `hash` as the store keeps it, copied out of G2 (its checksum checked there) straight
    /// into the block's bytes after its tokens, if G2 holds it with the bytes `values` asks for.
    fn host_block(&mut self, hash: BlockHash, values: bool) -> Option<StoreBlock> {
        let (seg, head) = (self.block_bytes(), self.block_size * 4);
        let page = if values {
            self.layers.len() * 2 * seg
        } else {
            0
        };
        let tiers = self.tiers.as_mut().filter(|t| t.values() == values)?;
        let mut bytes = vec![0u8; head + page];
        let (top, body) = bytes.split_at_mut(head);
        let mut segs: Vec<&mut [u8]> = match page {
            0 => Vec::new(),
            _ => body.chunks_exact_mut(seg).collect(),
        };
        let tokens = tiers.export_host((0, hash.0), &mut segs)?;
        // G2 keeps whole blocks only (as `stage` takes them).
        if tokens.len() * 4 != head {
            return None;
        }
        for (t, b) in tokens.iter().zip(top.chunks_exact_mut(4)) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        let sum = sum(&bytes);
        Some(StoreBlock { hash, bytes, sum })
    }

    /// Puts `blocks` (fetched from the store) in G2, whatever its write policy, for the next
    /// prefix lookup to load; a block whose bytes fail their checksum or size is dropped and
    /// counted. Nothing is staged without a G2.
    pub fn stage(&mut self, blocks: &[StoreBlock]) -> Staged {
        let mut out = Staged::default();
        let (bs, seg) = (self.block_size, self.block_bytes());
        let Some(tiers) = self.tiers.as_mut().filter(|t| t.has_host()) else {
            return out;
        };
        let page = match tiers.values() {
            true => self.layers.len() * 2 * seg,
            false => 0,
        };
        for b in blocks {
            if b.bytes.len() != bs * 4 + page || sum(&b.bytes) != b.sum {
                out.corrupt += 1;
                tiers.count_corrupt();
                continue;
            }
            let (head, body) = b.bytes.split_at(bs * 4);
            let tokens: Vec<u32> = head
                .chunks_exact(4)
                .map(|t| u32::from_le_bytes(t.try_into().expect("4 bytes")))
                .collect();
            let data: Vec<&[u8]> = match page {
                0 => Vec::new(),
                _ => body.chunks_exact(seg).collect(),
            };
            let key = (0, b.hash.0);
            let hits = 0;
            tiers.swap(Evicted {
                key,
                tokens: &tokens,
                hits,
                data: &data,
            });
            out.staged += 1;
        }
        tiers.count_fetched(out.staged);
        out
    }

    /// The names of the whole blocks of `tokens` from `root` past the leading run this cache
    /// holds (in its pool or a tier): what a fetch from the store could add.
    pub fn missing_blocks(&self, (seed, root): (u64, u64), tokens: &[u32]) -> Vec<BlockHash> {
        let mut parent = root;
        let mut names = Vec::new();
        let mut held = true;
        for block in tokens.chunks_exact(self.block_size) {
            parent = crate::prefix::chain(seed, parent, block);
            held = held
                && (self.pool.find(0, parent, block).is_some()
                    || self
                        .tiers
                        .as_ref()
                        .is_some_and(|t| t.holds((0, parent), block)));
            if !held {
                names.push(BlockHash(parent));
            }
        }
        names
    }
}
