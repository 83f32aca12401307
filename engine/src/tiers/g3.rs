//! G3 as the tiers use it: block files in a directory ([`Disk`]), or — for a cache without
//! values (the simulator's engines on a virtual clock) — the same bounded LRU index kept in
//! memory, its time priced by the timing model instead of spent.

use std::time::Duration;

use super::disk::{Disk, Fault};
use super::host::Host;
use super::{Evicted, Key};

pub(super) enum G3 {
    /// Block files on disk, written behind a queue.
    Files(Disk),
    /// Only the index: what files would be held, and the changes a writer would report.
    Modelled { index: Host, done: Vec<(Key, bool)> },
}

impl G3 {
    /// A modelled G3 of `cap` blocks.
    pub(super) fn modelled(cap: u64) -> G3 {
        G3::Modelled {
            index: Host::new(cap, 0),
            done: Vec::new(),
        }
    }

    pub(super) fn has(&self, key: Key, tokens: &[u32]) -> bool {
        match self {
            G3::Files(d) => d.has(key, tokens),
            G3::Modelled { index, .. } => index.has(key, tokens),
        }
    }

    /// Times block `key` was shared from a cache before.
    pub(super) fn hits(&self, key: Key) -> u32 {
        match self {
            G3::Files(d) => d.hits(key),
            G3::Modelled { index, .. } => index.hits(key),
        }
    }

    /// Marks block `key` used now.
    pub(super) fn touch(&mut self, key: Key) {
        match self {
            G3::Files(d) => d.touch(key),
            G3::Modelled { index, .. } => index.touch(key),
        }
    }

    /// Blocks held.
    /// The block files, when G3 has them (not only its index).
    pub(super) fn files(&self) -> Option<&Disk> {
        match self {
            G3::Files(d) => Some(d),
            G3::Modelled { .. } => None,
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            G3::Files(d) => d.len(),
            G3::Modelled { index, .. } => index.len(),
        }
    }

    /// Writes block `b` down (queued, for files); `false` when the write was skipped.
    pub(super) fn write(&mut self, b: Evicted<'_>) -> bool {
        match self {
            G3::Files(d) => d.write(b),
            G3::Modelled { index, done } => {
                let key = b.key;
                if index.store(key, b.tokens, b.hits, &[], |old| {
                    done.push((old.key, false))
                }) {
                    done.push((key, true));
                }
                true
            }
        }
    }

    /// Reads block `key` holding `tokens` into `out`, checked.
    pub(super) fn load(
        &mut self,
        key: Key,
        tokens: &[u32],
        out: &mut [&mut [u8]],
    ) -> Result<(), Fault> {
        match self {
            G3::Files(d) => d.load(key, tokens, out),
            G3::Modelled { index, .. } => match index.load(key, out) {
                true => Ok(()),
                false => Err(Fault::Gone),
            },
        }
    }

    /// What was stored or deleted since the last call.
    pub(super) fn take_done(&mut self) -> Vec<(Key, bool)> {
        match self {
            G3::Files(d) => d.take_done(),
            G3::Modelled { done, .. } => std::mem::take(done),
        }
    }

    /// Writes that failed since the last call (the modelled G3 never fails one).
    pub(super) fn take_failed(&mut self) -> u64 {
        match self {
            G3::Files(d) => d.take_failed(),
            G3::Modelled { .. } => 0,
        }
    }

    /// Whether writes are queued, or finished and not yet taken.
    pub(super) fn busy(&self) -> bool {
        match self {
            G3::Files(d) => d.busy(),
            G3::Modelled { done, .. } => !done.is_empty(),
        }
    }

    /// Waits at most `limit` for queued writes; whether none is left.
    pub(super) fn flush(&self, limit: Duration) -> bool {
        match self {
            G3::Files(d) => d.flush(limit),
            G3::Modelled { .. } => true,
        }
    }
}
