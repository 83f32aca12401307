//! G2: one bounded arena of page-sized slots in host memory, least recently used first out.
//! The arena is allocated zeroed and untouched (the OS maps its pages as blocks are first
//! written), so an idle tier costs no memory; it never grows past its slots.

use std::collections::{BTreeMap, HashMap};

use super::{Evicted, Key};
use crate::error::Result;
use crate::forward::{Mapped, PageDevice};
use types::sum::{block_sum, Summer};

struct Entry {
    slot: usize,
    tokens: Box<[u32]>,
    hits: u32,
    /// Bytes stored (a page's, or none for a cache without values).
    len: usize,
    sum: u64,
    tick: u64,
}

pub(super) struct Host {
    /// The arena mapped into a device (a GPU worker's): loads copy from it there. Declared
    /// before the arena, so it is unmapped before the arena is freed.
    mapped: Option<Mapped>,
    slots: usize,
    /// Bytes a slot holds (0 for a cache without values: only the accounting is kept).
    slot_bytes: usize,
    arena: Vec<u8>,
    free: Vec<usize>,
    map: HashMap<Key, Entry>,
    lru: BTreeMap<u64, Key>,
    tick: u64,
}

impl Host {
    /// A tier of `slots` pages of `slot_bytes` bytes.
    pub(super) fn new(slots: u64, slot_bytes: usize) -> Host {
        let slots = slots as usize;
        Host {
            mapped: None,
            slots,
            slot_bytes,
            arena: vec![0; slots * slot_bytes],
            free: (0..slots).rev().collect(),
            map: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Maps the arena into `device` (page-locked: it takes its memory now), so loads can
    /// copy from it there ([`Host::verified`]).
    pub(super) fn map(&mut self, device: &dyn PageDevice) -> Result<()> {
        if self.arena.is_empty() {
            return Ok(());
        }
        // SAFETY: the arena is never resized, and the mapping is dropped before it (field
        // order).
        self.mapped = Some(unsafe { device.map(self.arena.as_mut_ptr(), self.arena.len()) }?);
        Ok(())
    }

    /// Block `key`'s place in the arena, to copy from before its checksum is checked (see
    /// [`Host::copy_checked`], [`Host::check`]), the block marked used; `None` when it is not
    /// here.
    pub(super) fn take(&mut self, key: Key) -> Option<usize> {
        let at = self.map.get(&key)?.slot * self.slot_bytes;
        self.touch(key);
        Some(at)
    }

    /// Where a device sees arena offset `at`, when the arena is mapped into one.
    pub(super) fn device_addr(&self, at: usize) -> Option<u64> {
        Some(self.mapped.as_ref()?.addr + at as u64)
    }

    /// Block `key`'s entry, while it still lies at arena offset `at`.
    fn at(&self, key: Key, at: usize) -> Option<&Entry> {
        self.map
            .get(&key)
            .filter(|e| e.slot * self.slot_bytes == at)
    }

    /// Whether block `key`, copied from arena offset `at`, passes its checksum there: `None`
    /// when another block holds that slot now (its bytes were replaced: not a corruption).
    pub(super) fn check(&self, key: Key, at: usize) -> Option<bool> {
        let e = self.at(key, at)?;
        let mut s = Summer::default();
        s.sum(&self.arena[at..at + e.len]);
        Some(e.len > 0 && block_sum(&e.tokens, s.finish()) == e.sum)
    }

    /// Copies block `key` from arena offset `at` into `out` (a page's segments, in order),
    /// checking its checksum in the same pass: as [`Host::check`].
    pub(super) fn copy_checked(&self, key: Key, at: usize, out: &mut [&mut [u8]]) -> Option<bool> {
        let e = self.at(key, at)?;
        if out.iter().map(|o| o.len()).sum::<usize>() != e.len {
            return Some(false);
        }
        let (mut from, mut s) = (at, Summer::default());
        for o in out.iter_mut() {
            s.copy(o, &self.arena[from..from + o.len()]);
            from += o.len();
        }
        Some(block_sum(&e.tokens, s.finish()) == e.sum)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn has(&self, key: Key, tokens: &[u32]) -> bool {
        self.map.get(&key).is_some_and(|e| *e.tokens == *tokens)
    }

    /// Block `key`'s tokens and its bytes' length, if held.
    pub(super) fn stored(&self, key: Key) -> Option<(&[u32], usize)> {
        self.map.get(&key).map(|e| (&*e.tokens, e.len))
    }

    /// Times block `key` was shared from a cache before.
    pub(super) fn hits(&self, key: Key) -> u32 {
        self.map.get(&key).map_or(0, |e| e.hits)
    }

    /// Marks block `key` used now.
    pub(super) fn touch(&mut self, key: Key) {
        let Some(e) = self.map.get_mut(&key) else {
            return;
        };
        self.lru.remove(&e.tick);
        self.tick += 1;
        e.tick = self.tick;
        self.lru.insert(self.tick, key);
    }

    /// Stores block `key`, evicting the least recently used block into `down` when full.
    /// Returns whether it was stored (`false`: already here, only marked used).
    pub(super) fn store(
        &mut self,
        key: Key,
        tokens: &[u32],
        hits: u32,
        data: &[&[u8]],
        mut down: impl FnMut(Evicted<'_>),
    ) -> bool {
        if let Some(e) = self.map.get_mut(&key) {
            e.hits = e.hits.max(hits);
            self.touch(key);
            return false;
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let (_, old) = self.lru.pop_first().expect("a full tier has blocks");
                let e = self.map.remove(&old).expect("the LRU names held blocks");
                let at = e.slot * self.slot_bytes;
                down(Evicted {
                    key: old,
                    tokens: &e.tokens,
                    hits: e.hits,
                    data: &[&self.arena[at..at + e.len]],
                });
                e.slot
            }
        };
        let len: usize = data.iter().map(|d| d.len()).sum();
        let len = if len > self.slot_bytes { 0 } else { len };
        let (mut at, mut s) = (slot * self.slot_bytes, Summer::default());
        for d in data.iter().filter(|_| len > 0) {
            s.copy(&mut self.arena[at..at + d.len()], d);
            at += d.len();
        }
        let s = s.finish();
        self.tick += 1;
        let entry = Entry {
            slot,
            tokens: tokens.into(),
            hits,
            len,
            sum: block_sum(tokens, s),
            tick: self.tick,
        };
        self.map.insert(key, entry);
        self.lru.insert(self.tick, key);
        debug_assert!(self.map.len() <= self.slots);
        true
    }

    /// Copies block `key` into `out` (a page's segments, in order), checking its checksum;
    /// `false` when it fails (the caller drops it).
    pub(super) fn load(&mut self, key: Key, out: &mut [&mut [u8]]) -> bool {
        let Some(e) = self.map.get(&key) else {
            return false;
        };
        if out.iter().map(|o| o.len()).sum::<usize>() != e.len {
            return false;
        }
        let (mut at, mut s) = (e.slot * self.slot_bytes, Summer::default());
        for o in out.iter_mut() {
            s.copy(o, &self.arena[at..at + o.len()]);
            at += o.len();
        }
        let ok = block_sum(&e.tokens, s.finish()) == e.sum;
        if ok {
            self.touch(key);
        }
        ok
    }

    /// Forgets block `key` (its slot is free again).
    pub(super) fn remove(&mut self, key: Key) {
        if let Some(e) = self.map.remove(&key) {
            self.lru.remove(&e.tick);
            self.free.push(e.slot);
        }
    }

    /// The stored bytes of block `key`, to damage in tests.
    #[cfg(test)]
    pub(super) fn bytes_mut(&mut self, key: Key) -> Option<&mut [u8]> {
        let e = self.map.get(&key)?;
        let at = e.slot * self.slot_bytes;
        Some(&mut self.arena[at..at + e.len])
    }
}
