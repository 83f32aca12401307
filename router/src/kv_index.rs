//! The cluster-wide KV index: which worker's prefix cache holds which block, by the block's
//! name (the chained hash of `engine::block_hash`), and in which of its tiers (the pool, host
//! memory, disk), fed by the workers' numbered events in their heartbeats. A gap in a worker's numbers (a lost heartbeat) asks it for a snapshot; a
//! worker that leaves takes its entries with it. Memory is bounded by the blocks actually
//! cached.

use std::collections::HashMap;

use engine::block_hash::NameMap;
use proto::grpc::KvEvents;
use types::{BlockHash, Tier, WorkerId};

#[derive(Debug, Default)]
struct Held {
    /// The next event number expected; `None` until a snapshot arrives.
    next: Option<u64>,
    /// Each block it holds, with the tiers holding it (bit `1 << tier`, never 0).
    blocks: NameMap<u64, u8>,
}

/// A worker's leading run of a prompt's blocks, counted by the nearest tier holding each —
/// and, where the worker holds none, the cluster store holding it (the worker fetches it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Blocks by [`Tier::index`]: in the pool, in host memory only, on disk only.
    pub tiers: [usize; 3],
    /// Blocks only the cluster store holds.
    pub store: usize,
}

impl Overlap {
    /// Leading blocks held in any tier or in the store.
    pub fn blocks(&self) -> usize {
        self.tiers.iter().sum::<usize>() + self.store
    }

    /// Leading blocks held in `tier` (nearest tier first).
    pub fn of(&self, tier: Tier) -> usize {
        self.tiers[tier.index() as usize]
    }

    /// The blocks worth as many as computed ones: each tier's count times its weight (the
    /// pool's 1, a lower tier's — and last the store's — what loading it saves against
    /// computing it).
    pub fn weighed(&self, weights: &[f64; 4]) -> f64 {
        self.tiers
            .iter()
            .chain([&self.store])
            .zip(weights)
            .map(|(&n, &w)| n as f64 * w)
            .sum()
    }
}

/// The nearest tier in `mask`.
fn nearest(mask: u8) -> Tier {
    Tier::from_index(mask.trailing_zeros()).unwrap_or(Tier::Disk)
}

/// The tier of the `i`-th name of `ev` (the pool when a sender names none: an older worker).
fn tier_of(ev: &KvEvents, i: usize) -> u8 {
    match ev.tiers.get(i).copied().and_then(Tier::from_index) {
        Some(t) => 1 << t.index(),
        None => 1,
    }
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
    /// Entries (a block of a worker) by tier holding them, by [`Tier::index`].
    by_tier: [usize; 3],
    /// What each of the cluster store's nodes holds of this model (by node number).
    store_nodes: Vec<Held>,
    /// Each block some node holds, with how many: a holder every worker reaches.
    store: NameMap<u64, u32>,
}

/// Blocks of the store's the index keeps at most (its events beyond are dropped: a block not
/// indexed is only not counted as cached).
pub const MAX_STORE_BLOCKS: usize = 1 << 24;

/// Adds (or takes away) one entry for each tier in `bits`.
fn tally(by_tier: &mut [usize; 3], bits: u8, add: bool) {
    for (i, n) in by_tier.iter_mut().enumerate() {
        if bits & (1 << i) != 0 {
            *n = if add { *n + 1 } else { n.saturating_sub(1) };
        }
    }
}

impl KvIndex {
    /// Applies worker `w`'s events, holding no more than `cap` blocks for it (its cache's
    /// size: a worker cannot cache more, so what it claims beyond is dropped); `true` when the
    /// index missed some and wants a snapshot.
    pub fn apply(&mut self, w: WorkerId, ev: &KvEvents, cap: usize) -> bool {
        if ev.snapshot {
            self.remove_worker(w);
            for (i, &h) in ev.hashes.iter().enumerate() {
                self.store(w, h, tier_of(ev, i), cap);
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
        for (i, (&h, &stored)) in ev.hashes.iter().zip(&ev.stored).enumerate() {
            if stored {
                self.store(w, h, tier_of(ev, i), cap);
            } else {
                self.forget(w, h, tier_of(ev, i));
            }
        }
        false
    }

    /// Notes `h` in the tiers `bits` of `w`.
    fn store(&mut self, w: WorkerId, h: u64, bits: u8, cap: usize) {
        let held = &mut self.workers.entry(w).or_default().blocks;
        if let Some(mask) = held.get_mut(&h) {
            tally(&mut self.by_tier, bits & !*mask, true);
            *mask |= bits;
            return;
        }
        if held.len() >= cap {
            return;
        }
        held.insert(h, bits);
        tally(&mut self.by_tier, bits, true);
        self.holders
            .entry(h)
            .or_insert_with(|| Holders::Few(Vec::new()))
            .insert(w);
    }

    /// Notes `h` gone from the tiers `bits` of `w`; gone from the worker when no tier is left.
    fn forget(&mut self, w: WorkerId, h: u64, bits: u8) {
        let held = self.workers.entry(w).or_default();
        let Some(mask) = held.blocks.get_mut(&h) else {
            return;
        };
        tally(&mut self.by_tier, *mask & bits, false);
        *mask &= !bits;
        if *mask == 0 {
            held.blocks.remove(&h);
            self.unhold(w, h);
        }
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
        for (h, mask) in held.blocks {
            tally(&mut self.by_tier, mask, false);
            self.unhold(w, h);
        }
    }

    /// Applies store node `node`'s events (a snapshot first: [`proto::grpc::KvEvents`] as its
    /// `Watch` sends them); `true` when some were missed (follow it again from a snapshot).
    pub fn apply_store(&mut self, node: usize, ev: &KvEvents) -> bool {
        if self.store_nodes.len() <= node {
            self.store_nodes.resize_with(node + 1, Held::default);
        }
        if ev.snapshot {
            self.clear_store(node);
        } else if self.store_nodes[node].next != Some(ev.first) {
            return true;
        }
        self.store_nodes[node].next = Some(ev.next);
        let stored = ev.stored.iter().copied().chain(std::iter::repeat(true));
        for (&h, stored) in ev.hashes.iter().zip(stored) {
            let held = &mut self.store_nodes[node].blocks;
            let counted = match stored {
                true if held.len() < MAX_STORE_BLOCKS => held.insert(h, 1).is_none(),
                true => false,
                false => held.remove(&h).is_some(),
            };
            if counted {
                self.count_store(h, stored);
            }
        }
        false
    }

    /// One node more (or fewer) holding block `h`.
    fn count_store(&mut self, h: u64, add: bool) {
        let n = self.store.entry(h).or_insert(0);
        *n = if add { *n + 1 } else { n.saturating_sub(1) };
        if *n == 0 {
            self.store.remove(&h);
        }
    }

    /// Forgets what store node `node` holds (its watch broke: until it is followed again,
    /// nothing only it holds is counted as fetched from the store).
    pub fn clear_store(&mut self, node: usize) {
        let Some(held) = self.store_nodes.get_mut(node) else {
            return;
        };
        let gone = std::mem::take(held);
        for h in gone.blocks.into_keys() {
            self.count_store(h, false);
        }
    }

    /// Blocks the store holds (on any node) indexed.
    pub fn store_blocks(&self) -> usize {
        self.store.len()
    }

    /// The leading run of `blocks` the store holds: what any worker holding none of them
    /// would fetch.
    pub fn store_run(&self, blocks: &[BlockHash]) -> usize {
        blocks
            .iter()
            .take_while(|h| self.store.contains_key(&h.0))
            .count()
    }

    /// For each worker holding the first of `blocks` (a prompt's block names, in order), how
    /// many leading blocks it holds, in any tier.
    pub fn overlap(&self, blocks: &[BlockHash]) -> HashMap<WorkerId, usize> {
        let all = self.overlap_in(blocks, |_| true);
        all.into_iter().map(|(w, o)| (w, o.blocks())).collect()
    }

    /// [`KvIndex::overlap`] for the workers `among` keeps only (a pool's candidates: the
    /// others' leading blocks are not counted). A worker's run goes on through blocks only the
    /// store holds; a worker holding none of the first block is not listed: its run is the
    /// store's ([`KvIndex::store_run`]).
    pub fn overlap_in(
        &self,
        blocks: &[BlockHash],
        among: impl Fn(WorkerId) -> bool,
    ) -> HashMap<WorkerId, Overlap> {
        let mut out: HashMap<WorkerId, Overlap> = HashMap::new();
        let Some(first) = blocks.first().and_then(|h| self.holders.get(&h.0)) else {
            return out;
        };
        // Each candidate's own map, looked up once: per block, one lookup a worker (a block
        // every worker holds — a shared system prompt — costs one lookup a worker, not a scan
        // of its holder list).
        let mut live: Vec<(WorkerId, &NameMap<u64, u8>, Overlap)> = first
            .to_vec()
            .into_iter()
            .filter(|&w| among(w))
            .filter_map(|w| Some((w, &self.workers.get(&w)?.blocks, Overlap::default())))
            .collect();
        let store = &self.store;
        for h in blocks {
            let in_store = store.contains_key(&h.0);
            live.retain_mut(|(w, held, run)| match held.get(&h.0) {
                Some(&mask) => {
                    run.tiers[nearest(mask).index() as usize] += 1;
                    true
                }
                None if in_store => {
                    run.store += 1;
                    true
                }
                None => {
                    out.insert(*w, *run);
                    false
                }
            });
            if live.is_empty() {
                return out;
            }
        }
        out.extend(live.into_iter().map(|(w, _, run)| (w, run)));
        out
    }

    /// Block entries in all (one per block per worker holding it).
    pub fn len(&self) -> usize {
        self.workers.values().map(|h| h.blocks.len()).sum()
    }

    /// Entries by the tiers holding them (a block in two tiers of a worker counts in each):
    /// the pool's, host memory's, disk's.
    pub fn by_tier(&self) -> [usize; 3] {
        self.by_tier
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
            tiers: Vec::new(),
        }
    }

    fn snapshot(next: u64, hashes: &[u64]) -> KvEvents {
        KvEvents {
            first: next,
            hashes: hashes.to_vec(),
            stored: Vec::new(),
            snapshot: true,
            next,
            tiers: Vec::new(),
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

    /// Events naming tiers, as a worker with host and disk tiers sends them.
    fn tiered(first: u64, ev: &[(bool, u64, Tier)]) -> KvEvents {
        KvEvents {
            tiers: ev.iter().map(|e| e.2.index()).collect(),
            ..events(first, &ev.iter().map(|e| (e.0, e.1)).collect::<Vec<_>>())
        }
    }

    #[test]
    fn a_block_moving_down_the_tiers_stays_held_and_is_counted_by_its_nearest_tier() {
        let (w, mut ix) = (WorkerId(1), KvIndex::default());
        assert!(!ix.apply(w, &snapshot(0, &[]), 100));
        let (pool, host, disk) = (Tier::Pool, Tier::Host, Tier::Disk);
        let ev = [
            (true, 1, pool),
            (true, 2, pool),
            (true, 3, pool),
            (true, 4, pool),
        ];
        assert!(!ix.apply(w, &tiered(0, &ev), 100));
        // Blocks 2 and 3 leave the pool for host memory; 3 goes on to disk, 4 is written to
        // disk while still in the pool.
        let ev = [
            (true, 2, host),
            (false, 2, pool),
            (true, 3, host),
            (false, 3, pool),
            (true, 3, disk),
            (false, 3, host),
            (true, 4, disk),
        ];
        assert!(!ix.apply(w, &tiered(4, &ev), 100));
        let o = ix.overlap_in(&b(&[1, 2, 3, 4, 5]), |_| true)[&w];
        assert_eq!(o.tiers, [2, 1, 1], "4 counts as the pool's, its nearest");
        assert_eq!(ix.len(), 4, "a block in two tiers is one entry");
        assert_eq!(
            ix.by_tier(),
            [2, 1, 2],
            "pool: 1 and 4; host: 2; disk: 3 and 4"
        );
        assert_eq!(o.weighed(&[1.0, 0.5, 0.25, 0.0]), 2.75);
        // Gone from its last tier, a block ends the run.
        assert!(!ix.apply(w, &tiered(11, &[(false, 3, disk)]), 100));
        assert_eq!(ix.overlap(&b(&[1, 2, 3, 4]))[&w], 2);
        // A snapshot lists a block once per tier.
        let s = KvEvents {
            tiers: vec![0, 2, 1, 2],
            ..snapshot(12, &[1, 1, 2, 3])
        };
        assert!(!ix.apply(w, &s, 100));
        let o = ix.overlap_in(&b(&[1, 2, 3]), |_| true)[&w];
        assert_eq!((o.tiers, ix.len()), ([1, 1, 1], 3));
        assert_eq!(ix.by_tier(), [1, 1, 2]);
        ix.remove_worker(w);
        assert_eq!(ix.by_tier(), [0, 0, 0]);
    }

    #[test]
    fn a_workers_run_goes_on_through_the_stores_blocks() {
        let (w1, w2, mut ix) = (WorkerId(1), WorkerId(2), KvIndex::default());
        assert!(!ix.apply(w1, &snapshot(0, &[1, 2]), 100));
        assert!(!ix.apply(w2, &snapshot(0, &[7]), 100));
        // The store's watch: a snapshot, then its changes, numbered as a worker's.
        assert!(!ix.apply_store(0, &snapshot(0, &[1, 2, 3, 4])));
        assert!(!ix.apply_store(0, &events(0, &[(true, 5), (false, 4)])));
        assert_eq!(ix.store_blocks(), 4);
        let o = ix.overlap_in(&b(&[1, 2, 3, 4, 5]), |_| true);
        assert_eq!(
            (o[&w1].tiers, o[&w1].store),
            ([2, 0, 0], 1),
            "1 and 2 its own, 3 the store's, 4 nowhere"
        );
        assert!(!o.contains_key(&w2), "holding none of the first block");
        assert_eq!(ix.store_run(&b(&[1, 2, 3, 4, 5])), 3, "what w2 would fetch");
        assert_eq!(o[&w1].weighed(&[1.0, 0.9, 0.7, 0.5]), 2.5);
        assert!(
            ix.apply_store(0, &events(5, &[(true, 4)])),
            "2..5 missed: resync"
        );
        ix.clear_store(0);
        assert_eq!(ix.store_run(&b(&[1, 2, 3])), 0);
        assert_eq!(ix.overlap(&b(&[1, 2, 3]))[&w1], 2);
        assert!(
            ix.apply_store(0, &events(0, &[(true, 1)])),
            "no snapshot since"
        );
    }

    #[test]
    fn a_block_stays_in_the_store_while_any_node_holds_it() {
        let mut ix = KvIndex::default();
        assert!(!ix.apply_store(0, &snapshot(0, &[1, 2, 3])));
        assert!(!ix.apply_store(1, &snapshot(0, &[1, 2, 4])));
        assert_eq!(ix.store_blocks(), 4);
        assert_eq!(ix.store_run(&b(&[1, 2, 3])), 3);
        // Node 0 lost: what node 1 also holds stays.
        ix.clear_store(0);
        assert_eq!((ix.store_blocks(), ix.store_run(&b(&[1, 2, 3]))), (3, 2));
        // Node 1 removes block 1; a new snapshot of node 0 brings it back.
        assert!(!ix.apply_store(1, &events(0, &[(false, 1), (false, 9)])));
        assert_eq!(ix.store_run(&b(&[1, 2])), 0);
        assert!(!ix.apply_store(0, &snapshot(5, &[1])));
        assert_eq!((ix.store_blocks(), ix.store_run(&b(&[1, 2]))), (3, 2));
        ix.clear_store(1);
        ix.clear_store(7);
        assert_eq!(ix.store_blocks(), 1);
    }
}
