//! A worker's prefix-cache events on their way to the router's KV index: numbered, the recent
//! ones kept for the next heartbeat, and the set of names held now for a snapshot when the
//! router missed some (or the ring no longer has what it needs).

use std::collections::{HashMap, VecDeque};

use proto::grpc::KvEvents;
use types::{BlockHash, KvEvent, Tier};

/// Events kept for heartbeats (older ones are sent as a snapshot instead).
const KEEP: usize = 65_536;

/// The log, written by the engine thread, read by heartbeats.
#[derive(Debug, Default)]
pub struct KvLog {
    next: u64,
    recent: VecDeque<KvEvent>,
    /// Each block held now, with the tiers holding it (bit `1 << tier`).
    live: HashMap<BlockHash, u8>,
}

impl KvLog {
    /// Appends the engine's events, in order.
    pub fn push(&mut self, events: Vec<KvEvent>) {
        for e in events {
            let bit = 1u8 << e.tier().index();
            let mask = self.live.entry(e.block()).or_default();
            match e.stored() {
                true => *mask |= bit,
                false => *mask &= !bit,
            }
            if *mask == 0 {
                self.live.remove(&e.block());
            }
            self.recent.push_back(e);
            if self.recent.len() > KEEP {
                self.recent.pop_front();
            }
            self.next += 1;
        }
    }

    /// How many of `blocks`, from the first, this worker holds in some tier (as of the last
    /// events): what a prefix lookup would find without the cluster store.
    pub fn held_run(&self, blocks: &[BlockHash]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.live.contains_key(b))
            .count()
    }

    /// What a heartbeat carries after the router has everything before event `from`: the
    /// events since, or a snapshot when the router asked for one or they are no longer kept.
    pub fn since(&self, from: u64, resync: bool) -> KvEvents {
        let oldest = self.next - self.recent.len() as u64;
        if resync || from < oldest || from > self.next {
            let held = self.live.iter().flat_map(|(b, &mask)| {
                let tiers = Tier::ALL
                    .into_iter()
                    .filter(move |t| mask & (1 << t.index()) != 0);
                tiers.map(move |t| (b.0, t.index()))
            });
            let (hashes, tiers) = held.unzip();
            return KvEvents {
                first: self.next,
                hashes,
                stored: Vec::new(),
                snapshot: true,
                next: self.next,
                tiers,
            };
        }
        let new = self.recent.range((from - oldest) as usize..);
        let (mut hashes, mut stored, mut tiers) = (Vec::new(), Vec::new(), Vec::new());
        for e in new {
            hashes.push(e.block().0);
            stored.push(e.stored());
            tiers.push(e.tier().index());
        }
        KvEvents {
            first: from,
            hashes,
            stored,
            snapshot: false,
            next: self.next,
            tiers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_since_a_number_or_a_snapshot_when_asked_or_lost() {
        let tier = types::Tier::Pool;
        let stored = |h| KvEvent::Stored {
            block: BlockHash(h),
            tier,
        };
        let removed = |h| KvEvent::Removed {
            block: BlockHash(h),
            tier,
        };
        let mut log = KvLog::default();
        log.push(vec![stored(1), stored(2)]);
        log.push(vec![removed(1)]);
        let e = log.since(1, false);
        assert_eq!((e.first, e.next, e.snapshot), (1, 3, false));
        assert_eq!((e.hashes, e.stored), (vec![2, 1], vec![true, false]));
        assert_eq!(e.tiers, vec![0, 0]);
        let s = log.since(1, true);
        assert_eq!((s.snapshot, s.hashes, s.next), (true, vec![2], 3));
        // A block in two tiers is listed once per tier; leaving one keeps the other.
        let host = |h, stored| match stored {
            true => KvEvent::Stored {
                block: BlockHash(h),
                tier: Tier::Host,
            },
            false => KvEvent::Removed {
                block: BlockHash(h),
                tier: Tier::Host,
            },
        };
        log.push(vec![
            host(2, true),
            removed(2),
            host(5, true),
            host(5, false),
        ]);
        let s = log.since(0, true);
        assert_eq!((s.hashes, s.tiers), (vec![2], vec![1]));
        assert!(log.since(8, false).snapshot, "a number from another life");
        assert!(log.since(7, false).hashes.is_empty(), "nothing new");
    }
}
