//! The cluster-wide KV index: which worker's prefix cache holds which block, by the block's
//! name (the chained hash of `engine::block_hash`), fed by the workers' numbered events in
//! their heartbeats. A gap in a worker's numbers (a lost heartbeat) asks it for a snapshot; a
//! worker that leaves takes its entries with it. Memory is bounded by the blocks actually
//! cached.

use std::collections::HashMap;

use engine::block_hash::{NameMap, NameSet};
use proto::grpc::KvEvents;
use types::{BlockHash, WorkerId};

#[derive(Debug, Default)]
struct Held {
    /// The next event number expected; `None` until a snapshot arrives.
    next: Option<u64>,
    blocks: NameSet,
}

/// The workers holding one block: a short list, or a set once it is long — a block every
/// worker holds (a shared system prompt's) is then forgotten by each in one lookup, not a scan
/// of a thousand entries.
#[derive(Debug)]
enum Holders {
    Few(Vec<WorkerId>),
    Many(NameMap<WorkerId, ()>),
}

/// Holders past this many are kept as a set.
const MANY: usize = 16;

impl Holders {
    fn insert(&mut self, w: WorkerId) {
        match self {
            Holders::Few(v) => {
                v.push(w);
                if v.len() > MANY {
                    *self = Holders::Many(v.drain(..).map(|w| (w, ())).collect());
                }
            }
            Holders::Many(s) => {
                s.insert(w, ());
            }
        }
    }

    /// Removes `w`; whether none is left.
    fn remove(&mut self, w: WorkerId) -> bool {
        match self {
            Holders::Few(v) => {
                if let Some(i) = v.iter().position(|&x| x == w) {
                    v.swap_remove(i);
                }
                v.is_empty()
            }
            Holders::Many(s) => {
                s.remove(&w);
                s.is_empty()
            }
        }
    }

    fn to_vec(&self) -> Vec<WorkerId> {
        match self {
            Holders::Few(v) => v.clone(),
            Holders::Many(s) => s.keys().copied().collect(),
        }
    }
}

/// The index.
#[derive(Debug, Default)]
pub struct KvIndex {
    /// Block name → workers holding it.
    holders: NameMap<u64, Holders>,
    workers: NameMap<WorkerId, Held>,
}

impl KvIndex {
    /// Applies worker `w`'s events, holding no more than `cap` blocks for it (its cache's
    /// size: a worker cannot cache more, so what it claims beyond is dropped); `true` when the
    /// index missed some and wants a snapshot.
    pub fn apply(&mut self, w: WorkerId, ev: &KvEvents, cap: usize) -> bool {
        if ev.snapshot {
            self.remove_worker(w);
            for &h in &ev.hashes {
                self.store(w, h, cap);
            }
            self.workers.entry(w).or_default().next = Some(ev.next);
            return false;
        }
        let held = self.workers.entry(w).or_default();
        if held.next != Some(ev.first) {
            // Missed events (or none seen yet): what is known of this worker may be stale.
            return true;
        }
        held.next = Some(ev.next);
        for (&h, &stored) in ev.hashes.iter().zip(&ev.stored) {
            if stored {
                self.store(w, h, cap);
            } else {
                self.forget(w, h);
            }
        }
        false
    }

    fn store(&mut self, w: WorkerId, h: u64, cap: usize) {
        let held = &mut self.workers.entry(w).or_default().blocks;
        if held.len() >= cap {
            return;
        }
        if held.insert(h) {
            self.holders
                .entry(h)
                .or_insert_with(|| Holders::Few(Vec::new()))
                .insert(w);
        }
    }

    fn forget(&mut self, w: WorkerId, h: u64) {
        let held = self.workers.entry(w).or_default();
        if !held.blocks.remove(&h) {
            return;
        }
        self.unhold(w, h);
    }

    fn unhold(&mut self, w: WorkerId, h: u64) {
        if self.holders.get_mut(&h).is_some_and(|ws| ws.remove(w)) {
            self.holders.remove(&h);
        }
    }

    /// Forgets everything worker `w` held (it left).
    pub fn remove_worker(&mut self, w: WorkerId) {
        let Some(held) = self.workers.remove(&w) else {
            return;
        };
        for h in held.blocks {
            self.unhold(w, h);
        }
    }

    /// For each worker holding the first of `blocks` (a prompt's block names, in order), how
    /// many leading blocks it holds.
    pub fn overlap(&self, blocks: &[BlockHash]) -> HashMap<WorkerId, usize> {
        self.overlap_in(blocks, |_| true)
    }

    /// [`KvIndex::overlap`] for the workers `among` keeps only (a pool's candidates: the
    /// others' leading blocks are not counted).
    pub fn overlap_in(
        &self,
        blocks: &[BlockHash],
        among: impl Fn(WorkerId) -> bool,
    ) -> HashMap<WorkerId, usize> {
        let mut out: HashMap<WorkerId, usize> = HashMap::new();
        let Some(first) = blocks.first().and_then(|h| self.holders.get(&h.0)) else {
            return out;
        };
        // Each candidate's own set, looked up once: per block, one membership test a worker
        // (a block every worker holds — a shared system prompt — costs one lookup a worker,
        // not a scan of its holder list).
        let mut live: Vec<(WorkerId, &NameSet)> = first
            .to_vec()
            .into_iter()
            .filter(|&w| among(w))
            .filter_map(|w| Some((w, &self.workers.get(&w)?.blocks)))
            .collect();
        for (i, h) in blocks.iter().enumerate() {
            live.retain(|(w, held)| {
                let keep = held.contains(&h.0);
                if !keep {
                    out.insert(*w, i);
                }
                keep
            });
            if live.is_empty() {
                return out;
            }
        }
        for (w, _) in live {
            out.insert(w, blocks.len());
        }
        out
    }

    /// Block entries in all (one per block per worker holding it).
    pub fn len(&self) -> usize {
        self.workers.values().map(|h| h.blocks.len()).sum()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(hashes: &[u64]) -> Vec<BlockHash> {
        hashes.iter().map(|&h| BlockHash(h)).collect()
    }

    fn events(first: u64, ev: &[(bool, u64)]) -> KvEvents {
        KvEvents {
            first,
            hashes: ev.iter().map(|e| e.1).collect(),
            stored: ev.iter().map(|e| e.0).collect(),
            snapshot: false,
            next: first + ev.len() as u64,
        }
    }

    fn snapshot(next: u64, hashes: &[u64]) -> KvEvents {
        KvEvents {
            first: next,
            hashes: hashes.to_vec(),
            stored: Vec::new(),
            snapshot: true,
            next,
        }
    }

    #[test]
    fn a_worker_is_held_to_no_more_blocks_than_its_cache() {
        let mut ix = KvIndex::default();
        let many: Vec<u64> = (0..1000).collect();
        assert!(!ix.apply(WorkerId(1), &snapshot(0, &many), 8));
        assert_eq!(ix.len(), 8);
    }

    #[test]
    fn events_overlap_gaps_and_leaving() {
        let mut ix = KvIndex::default();
        assert!(
            ix.apply(WorkerId(1), &events(0, &[(true, 10)]), 100),
            "no snapshot yet: resync"
        );
        assert!(!ix.apply(WorkerId(1), &snapshot(0, &[]), 100));
        assert!(!ix.apply(
            WorkerId(1),
            &events(0, &[(true, 10), (true, 11), (true, 12)]),
            100
        ));
        assert!(!ix.apply(WorkerId(2), &snapshot(5, &[10, 11]), 100));
        let o = ix.overlap(&b(&[10, 11, 12, 13]));
        assert_eq!((o[&WorkerId(1)], o[&WorkerId(2)]), (3, 2));
        assert!(!ix.apply(WorkerId(1), &events(3, &[(false, 11)]), 100));
        assert_eq!(
            ix.overlap(&b(&[10, 11, 12]))[&WorkerId(1)],
            1,
            "a forgotten block ends the run"
        );
        assert!(
            ix.apply(WorkerId(2), &events(9, &[(true, 12)]), 100),
            "events 5..9 were missed"
        );
        assert_eq!(
            ix.overlap(&b(&[10, 11]))[&WorkerId(2)],
            2,
            "nothing applied past the gap"
        );
        ix.remove_worker(WorkerId(2));
        assert!(!ix.overlap(&b(&[10])).contains_key(&WorkerId(2)));
        assert_eq!(ix.len(), 2);
        assert!(ix.overlap(&b(&[99])).is_empty());
        // Among some workers only: the others are not counted.
        let among = ix.overlap_in(&b(&[10, 11, 12, 13]), |w| w == WorkerId(1));
        assert_eq!(among.keys().collect::<Vec<_>>(), vec![&WorkerId(1)]);
    }
}
