//! A worker's prefix-cache events on their way to the router's KV index: numbered, the recent
//! ones kept for the next heartbeat, and the set of names held now for a snapshot when the
//! router missed some (or the ring no longer has what it needs).

use std::collections::{HashSet, VecDeque};

use proto::grpc::KvEvents;
use types::{BlockHash, KvEvent};

/// Events kept for heartbeats (older ones are sent as a snapshot instead).
const KEEP: usize = 65_536;

/// The log, written by the engine thread, read by heartbeats.
#[derive(Debug, Default)]
pub struct KvLog {
    next: u64,
    recent: VecDeque<KvEvent>,
    live: HashSet<BlockHash>,
}

impl KvLog {
    /// Appends the engine's events, in order.
    pub fn push(&mut self, events: Vec<KvEvent>) {
        for e in events {
            match e {
                KvEvent::Stored { block, .. } => self.live.insert(block),
                KvEvent::Removed { block, .. } => self.live.remove(&block),
            };
            self.recent.push_back(e);
            if self.recent.len() > KEEP {
                self.recent.pop_front();
            }
            self.next += 1;
        }
    }

    /// What a heartbeat carries after the router has everything before event `from`: the
    /// events since, or a snapshot when the router asked for one or they are no longer kept.
    pub fn since(&self, from: u64, resync: bool) -> KvEvents {
        let oldest = self.next - self.recent.len() as u64;
        if resync || from < oldest || from > self.next {
            return KvEvents {
                first: self.next,
                hashes: self.live.iter().map(|b| b.0).collect(),
                stored: Vec::new(),
                snapshot: true,
                next: self.next,
            };
        }
        let new = self.recent.range((from - oldest) as usize..);
        let (stored, hashes) = new.map(|e| (e.stored(), e.block().0)).unzip();
        KvEvents {
            first: from,
            hashes,
            stored,
            snapshot: false,
            next: self.next,
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
        let s = log.since(1, true);
        assert_eq!((s.snapshot, s.hashes, s.next), (true, vec![2], 3));
        assert!(log.since(7, false).snapshot, "a number from another life");
        assert!(log.since(3, false).hashes.is_empty(), "nothing new");
    }
}
