//! A worker's prefix-cache events on their way to the router's KV index: numbered, the recent
//! ones kept for the next heartbeat, and the set of names held now for a snapshot when the
//! router missed some (or the ring no longer has what it needs).

use std::collections::{HashSet, VecDeque};

use proto::grpc::KvEvents;

/// Events kept for heartbeats (older ones are sent as a snapshot instead).
const KEEP: usize = 65_536;

/// The log, written by the engine thread, read by heartbeats.
#[derive(Debug, Default)]
pub struct KvLog {
    next: u64,
    recent: VecDeque<(bool, u64)>,
    live: HashSet<u64>,
}

impl KvLog {
    /// Appends the engine's events (registered: `true`, forgotten: `false`), in order.
    pub fn push(&mut self, events: Vec<(bool, u64)>) {
        for (stored, hash) in events {
            if stored {
                self.live.insert(hash);
            } else {
                self.live.remove(&hash);
            }
            self.recent.push_back((stored, hash));
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
                hashes: self.live.iter().copied().collect(),
                stored: Vec::new(),
                snapshot: true,
                next: self.next,
            };
        }
        let new = self.recent.range((from - oldest) as usize..);
        let (stored, hashes) = new.copied().unzip();
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
        let mut log = KvLog::default();
        log.push(vec![(true, 1), (true, 2)]);
        log.push(vec![(false, 1)]);
        let e = log.since(1, false);
        assert_eq!((e.first, e.next, e.snapshot), (1, 3, false));
        assert_eq!((e.hashes, e.stored), (vec![2, 1], vec![true, false]));
        let s = log.since(1, true);
        assert_eq!((s.snapshot, s.hashes, s.next), (true, vec![2], 3));
        assert!(log.since(7, false).snapshot, "a number from another life");
        assert!(log.since(3, false).hashes.is_empty(), "nothing new");
    }
}
