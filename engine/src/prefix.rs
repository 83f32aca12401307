//! The KV block pool with a prefix cache: which blocks are free, which are held (and by how
//! many sequences), and which hold a known prefix.
//!
//! A full block whose KV is computed can be *registered* under a hash chained over its
//! parent block's hash and its own tokens (seeded by the model identity, so two models never
//! share): a later sequence whose prompt starts with the same tokens takes the same blocks
//! (reference counted) instead of computing them. A block nobody references any more stays
//! cached until its space is needed; allocation then evicts the least recently used cached
//! block. Free space reported to the router counts those evictable blocks: a full cache never
//! refuses work it could evict for. A lookup compares the block's tokens too, so a hash
//! collision can never hand out the wrong KV.

use std::collections::BTreeMap;

use types::{BlockHash, KvEvent, Tier};

use crate::block_hash::NameMap;

pub use crate::block_hash::{chain, seed, ROOT};

/// What the cache knows of a cached block; an allocation that evicts one hands it on, for a
/// tier below the pool to keep (its page's bytes are still there until the new owner writes
/// them).
#[derive(Debug)]
pub struct Cached {
    /// The layer group whose KV the block holds (see [`crate::KvCache`]): a prefix is
    /// cached once per group, each group's blocks under its own key.
    pub group: u32,
    /// Its prefix's name.
    pub hash: u64,
    /// Its tokens.
    pub tokens: Box<[u32]>,
    /// Times a sequence shared it from the cache (a tier's write policy reads it).
    pub hits: u32,
}

/// Counts of the pool's blocks by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// Held by at least one sequence.
    pub held: usize,
    /// Unreferenced and holding a known prefix: reusable, evictable.
    pub cached: usize,
    /// Unreferenced and empty.
    pub free: usize,
}

/// The block pool.
#[derive(Debug)]
pub struct BlockPool {
    refs: Vec<u32>,
    free: Vec<u32>,
    by_hash: NameMap<(u32, u64), u32>,
    meta: Vec<Option<Cached>>,
    /// Unreferenced cached blocks by the tick they were last released at (oldest first).
    lru: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    tick: u64,
    /// Prefixes registered and forgotten since the last [`BlockPool::take_events`].
    events: Vec<KvEvent>,
    /// Cached blocks evicted for new owners since the pool was made.
    evicted: u64,
}

impl BlockPool {
    /// A pool of `n` free blocks.
    pub fn new(n: usize) -> BlockPool {
        BlockPool {
            refs: vec![0; n],
            // Pop from the end: hand out low ids first.
            free: (0..n as u32).rev().collect(),
            by_hash: NameMap::default(),
            meta: (0..n).map(|_| None).collect(),
            lru: BTreeMap::new(),
            released_at: vec![0; n],
            tick: 0,
            events: Vec::new(),
            evicted: 0,
        }
    }

    /// Blocks in all.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks an allocation can take: free ones and evictable cached ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Cached blocks evicted (their prefix forgotten) for new owners so far.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Blocks by state.
    pub fn counts(&self) -> PoolCounts {
        let (free, cached) = (self.free.len(), self.lru.len());
        PoolCounts {
            held: self.total() - free - cached,
            cached,
            free,
        }
    }

    /// A block for a new owner: a free one, else the least recently used cached one (its
    /// prefix forgotten). `None` when every block is held.
    pub fn alloc(&mut self) -> Option<u32> {
        self.alloc_evicting().map(|(b, _)| b)
    }

    /// [`BlockPool::alloc`], with what it evicted to make room.
    pub fn alloc_evicting(&mut self) -> Option<(u32, Option<Cached>)> {
        let (b, forgotten) = match self.free.pop() {
            Some(b) => (b, None),
            None => {
                let (_, b) = self.lru.pop_first()?;
                let old = self.meta[b as usize]
                    .take()
                    .expect("an LRU block is cached");
                self.by_hash.remove(&(old.group, old.hash));
                if old.group == 0 {
                    let block = BlockHash(old.hash);
                    self.events.push(KvEvent::Removed {
                        block,
                        tier: Tier::Pool,
                    });
                }
                self.evicted += 1;
                (b, Some(old))
            }
        };
        debug_assert_eq!(self.refs[b as usize], 0);
        self.refs[b as usize] = 1;
        Some((b, forgotten))
    }

    /// Block `b` was shared from the cache once more.
    pub fn note_hit(&mut self, b: u32) {
        if let Some(c) = self.meta[b as usize].as_mut() {
            c.hits = c.hits.saturating_add(1);
        }
    }

    /// Times cached block `b` was shared from the cache (0 for one not cached).
    pub fn hits(&self, b: u32) -> u32 {
        self.meta[b as usize].as_ref().map_or(0, |c| c.hits)
    }

    /// One more owner of block `b` (a sequence sharing a cached prefix).
    pub fn retain(&mut self, b: u32) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.lru.remove(&self.released_at[i]);
        }
        self.refs[i] += 1;
    }

    /// One owner fewer; at none, a cached block waits in the LRU, another is free. Returns
    /// whether it has no owner left (an allocation can take it).
    pub fn release(&mut self, b: u32) -> bool {
        let i = b as usize;
        assert!(self.refs[i] > 0, "KV block {b} freed twice");
        self.refs[i] -= 1;
        if self.refs[i] > 0 {
            return false;
        }
        if self.meta[i].is_some() {
            self.tick += 1;
            self.released_at[i] = self.tick;
            self.lru.insert(self.tick, b);
        } else {
            self.free.push(b);
        }
        true
    }

    /// Whether block `b` has no owner (free, or cached and evictable).
    pub fn unreferenced(&self, b: u32) -> bool {
        self.refs[b as usize] == 0
    }

    /// Records that held block `b` holds `tokens` after the prefix hashed `parent`; returns the
    /// block's hash. When another block already holds that prefix, `b` stays unregistered
    /// (and is freed, not cached, when released).
    pub fn register(&mut self, seed: u64, b: u32, parent: u64, tokens: &[u32]) -> u64 {
        let hash = chain(seed, parent, tokens);
        let _ = self.register_in(0, b, hash, tokens);
        hash
    }

    /// [`BlockPool::register`] for layer group `group`'s block `b`, whose prefix hashes to
    /// `hash`. Only group 0's prefixes are reported as events (the router's index names a
    /// prefix once, whatever groups a worker's model has). Returns whether `b` is registered
    /// now (no other block held that prefix).
    pub fn register_in(&mut self, group: u32, b: u32, hash: u64, tokens: &[u32]) -> bool {
        self.register_with(group, b, hash, tokens, 0)
    }

    /// [`BlockPool::register_in`] for a block shared `hits` times before (one loaded back from
    /// a tier below the pool).
    pub fn register_with(
        &mut self,
        group: u32,
        b: u32,
        hash: u64,
        tokens: &[u32],
        hits: u32,
    ) -> bool {
        let new = self.meta[b as usize].is_none() && !self.by_hash.contains_key(&(group, hash));
        if new {
            self.by_hash.insert((group, hash), b);
            self.meta[b as usize] = Some(Cached {
                group,
                hash,
                tokens: tokens.into(),
                hits,
            });
            if group == 0 {
                let block = BlockHash(hash);
                self.events.push(KvEvent::Stored {
                    block,
                    tier: Tier::Pool,
                });
            }
        }
        new
    }

    /// The prefixes registered and forgotten since the last call, in order: what the worker
    /// reports to the router's KV index.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Group 0's cached blocks holding the longest prefix of `tokens` in whole blocks of
    /// `block_size` whose chain starts at `root`, in order (not yet retained), each with its
    /// prefix's hash.
    pub fn lookup(
        &self,
        seed: u64,
        root: u64,
        block_size: usize,
        tokens: &[u32],
    ) -> Vec<(u32, u64)> {
        let mut parent = root;
        let mut out = Vec::new();
        for block in tokens.chunks_exact(block_size) {
            let hash = chain(seed, parent, block);
            let Some(b) = self.find(0, hash, block) else {
                break;
            };
            out.push((b, hash));
            parent = hash;
        }
        out
    }

    /// Group `group`'s cached block of the prefix hashed `hash`, and its tokens.
    pub fn cached(&self, group: u32, hash: u64) -> Option<(u32, &[u32])> {
        let &b = self.by_hash.get(&(group, hash))?;
        let c = self.meta[b as usize].as_ref()?;
        Some((b, &c.tokens))
    }

    /// Group `group`'s cached block of the prefix hashed `hash` whose last block is `tokens`.
    pub fn find(&self, group: u32, hash: u64, tokens: &[u32]) -> Option<u32> {
        let &b = self.by_hash.get(&(group, hash))?;
        let same = self.meta[b as usize]
            .as_ref()
            .is_some_and(|c| &*c.tokens == tokens);
        same.then_some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(p: &BlockPool, seed: u64, tokens: &[u32]) -> Vec<u32> {
        p.lookup(seed, ROOT, 2, tokens)
            .into_iter()
            .map(|(b, _)| b)
            .collect()
    }

    #[test]
    fn shared_blocks_are_counted_cached_when_unreferenced_and_evicted_oldest_first() {
        let mut p = BlockPool::new(3);
        let (a, b) = (p.alloc().unwrap(), p.alloc().unwrap());
        let ha = p.register(7, a, ROOT, &[1, 2]);
        p.register(7, b, ha, &[3, 4]);
        assert_eq!(blocks(&p, 7, &[1, 2, 3, 4, 5]), vec![a, b]);
        assert!(
            blocks(&p, 8, &[1, 2]).is_empty(),
            "another model's seed shares nothing"
        );
        assert!(blocks(&p, 7, &[1, 9]).is_empty());
        p.retain(a); // a second sequence shares block a
        p.release(a);
        p.release(a);
        p.release(b);
        assert_eq!(
            p.counts(),
            PoolCounts {
                held: 0,
                cached: 2,
                free: 1
            }
        );
        assert_eq!(p.available(), 3, "cached blocks are reclaimable");
        assert_eq!(blocks(&p, 7, &[1, 2, 3, 4]), vec![a, b], "still cached");
        p.retain(b); // reuse takes b out of the LRU
        let (c, d) = (p.alloc().unwrap(), p.alloc().unwrap());
        assert_eq!(c, 2, "free blocks go first");
        assert_eq!(d, a, "then the least recently released cached block");
        assert!(blocks(&p, 7, &[1, 2]).is_empty(), "a's prefix is forgotten");
        assert!(p.alloc().is_none(), "b is held, c and d too");
        let hb = chain(7, ha, &[3, 4]);
        let (stored, removed) = (
            |h| KvEvent::Stored {
                block: BlockHash(h),
                tier: Tier::Pool,
            },
            |h| KvEvent::Removed {
                block: BlockHash(h),
                tier: Tier::Pool,
            },
        );
        assert_eq!(
            p.take_events(),
            [stored(ha), stored(hb), removed(ha)],
            "the eviction is reported, for the router's index"
        );
        assert_eq!(p.evicted(), 1);
    }

    #[test]
    fn a_duplicate_prefix_stays_unregistered_and_is_freed() {
        let mut p = BlockPool::new(2);
        let (a, b) = (p.alloc().unwrap(), p.alloc().unwrap());
        p.register(1, a, ROOT, &[5]);
        p.register(1, b, ROOT, &[5]);
        p.release(b);
        assert_eq!(p.counts().free, 1, "the duplicate is not cached");
        assert_eq!(p.lookup(1, ROOT, 1, &[5]), vec![(a, chain(1, ROOT, &[5]))]);
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn a_block_is_freed_once() {
        let mut p = BlockPool::new(1);
        let a = p.alloc().unwrap();
        p.release(a);
        p.release(a);
    }
}
