//! Who holds which KV blocks, per request, on one worker: the ownership ledger.
//!
//! Every request that holds blocks is in exactly one state. On a decode worker: `Reserved`
//! (blocks set aside, waiting for the prefill's KV, until its lease runs out), `InFlight` (the
//! KV is arriving), `Committed` (the KV is in the cache and the sequence runs). On a prefill
//! worker: `Reserved` (the prompt is being computed), `InFlight` (its KV is being sent). Every
//! end of a request, by any path, calls [`Ledger::free`]; when no request is live, the ledger
//! must be empty, and tests assert exactly that.

use std::collections::HashMap;
use std::time::Instant;

use types::RequestId;

/// The state of a request's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Holding {
    /// Set aside for KV that has not started to arrive (decode) or is being computed (prefill).
    Reserved,
    /// KV on the wire.
    InFlight,
    /// KV in the cache of a running sequence.
    Committed,
}

impl Holding {
    /// The label used in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Holding::Reserved => "reserved",
            Holding::InFlight => "in_flight",
            Holding::Committed => "committed",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    state: Holding,
    blocks: u32,
    lease: Option<Instant>,
    renewals: u32,
}

/// The most times one reservation's lease is renewed (its sender renews it about once a
/// second while the prompt waits or computes): a sender that never sends cannot hold the
/// blocks for ever.
pub const MAX_RENEWALS: u32 = 900;

/// Blocks and requests per state, plus how many requests were freed in all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerCounts {
    /// Blocks reserved.
    pub reserved: u64,
    /// Blocks with KV on the wire.
    pub in_flight: u64,
    /// Blocks committed to running sequences.
    pub committed: u64,
    /// Requests whose blocks were freed, since start.
    pub freed: u64,
}

/// The ledger of one worker.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: HashMap<RequestId, Entry>,
    freed: u64,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Ledger {
        Ledger::default()
    }

    /// Records `blocks` reserved for `request_id`, released by [`Ledger::expired`] once `lease`
    /// passes unless the request moves on. `false` if the request is already recorded.
    pub fn reserve(&mut self, request_id: RequestId, blocks: u32, lease: Option<Instant>) -> bool {
        if self.entries.contains_key(&request_id) {
            return false;
        }
        self.entries.insert(
            request_id,
            Entry {
                state: Holding::Reserved,
                blocks,
                lease,
                renewals: 0,
            },
        );
        true
    }

    fn advance(&mut self, request_id: RequestId, from: &[Holding], to: Holding) -> bool {
        match self.entries.get_mut(&request_id) {
            Some(e) if from.contains(&e.state) => {
                e.state = to;
                if to == Holding::Committed {
                    e.lease = None;
                }
                true
            }
            _ => false,
        }
    }

    /// The request's KV started to move (its lease still runs). `false` unless it was reserved.
    pub fn in_flight(&mut self, request_id: RequestId) -> bool {
        self.advance(request_id, &[Holding::Reserved], Holding::InFlight)
    }

    /// Extends the lease of a request not yet committed to `until` (its sender renewed it);
    /// `false` if there is no such lease, or it was renewed [`MAX_RENEWALS`] times already.
    pub fn renew(&mut self, request_id: RequestId, until: Instant) -> bool {
        match self.entries.get_mut(&request_id) {
            Some(e) if e.lease.is_some() && e.renewals < MAX_RENEWALS => {
                e.lease = Some(until);
                e.renewals += 1;
                true
            }
            _ => false,
        }
    }

    /// The request's KV is in the cache of a running sequence (its lease ends).
    pub fn commit(&mut self, request_id: RequestId) -> bool {
        self.advance(
            request_id,
            &[Holding::Reserved, Holding::InFlight],
            Holding::Committed,
        )
    }

    /// The request ended; its blocks are free. Returns the state they were in, if any.
    pub fn free(&mut self, request_id: RequestId) -> Option<Holding> {
        let e = self.entries.remove(&request_id)?;
        self.freed += 1;
        Some(e.state)
    }

    /// Requests whose lease has passed by `now` without their KV being committed.
    pub fn expired(&self, now: Instant) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.lease.is_some_and(|l| l <= now))
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The earliest lease still running.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.entries.values().filter_map(|e| e.lease).min()
    }

    /// Requests recorded.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no request holds blocks.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Totals per state.
    pub fn counts(&self) -> LedgerCounts {
        let mut c = LedgerCounts {
            freed: self.freed,
            ..LedgerCounts::default()
        };
        for e in self.entries.values() {
            let n = e.blocks as u64;
            match e.state {
                Holding::Reserved => c.reserved += n,
                Holding::InFlight => c.in_flight += n,
                Holding::Committed => c.committed += n,
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn every_path_ends_in_free_and_leases_expire() {
        let t0 = Instant::now();
        let mut l = Ledger::new();
        assert!(l.reserve(RequestId(1), 4, Some(t0 + Duration::from_secs(1))));
        assert!(
            !l.reserve(RequestId(1), 4, None),
            "a request is recorded once"
        );
        assert!(l.reserve(RequestId(2), 2, Some(t0 + Duration::from_secs(2))));
        assert!(l.in_flight(RequestId(2)));
        assert!(
            !l.in_flight(RequestId(2)),
            "only reserved KV starts to move"
        );
        assert_eq!(
            l.counts(),
            LedgerCounts {
                reserved: 4,
                in_flight: 2,
                committed: 0,
                freed: 0
            }
        );
        assert_eq!(l.next_expiry(), Some(t0 + Duration::from_secs(1)));
        assert!(
            l.renew(RequestId(2), t0 + Duration::from_secs(3)),
            "its sender renews it"
        );
        assert!(!l.renew(RequestId(7), t0), "no such request");
        assert!(l.reserve(RequestId(3), 1, Some(t0)));
        let renewed = (0..MAX_RENEWALS + 5)
            .filter(|_| l.renew(RequestId(3), t0))
            .count();
        assert_eq!(
            renewed as u32, MAX_RENEWALS,
            "a lease is renewed a bounded number of times"
        );
        assert_eq!(l.free(RequestId(3)), Some(Holding::Reserved));
        assert!(l.expired(t0).is_empty());
        assert_eq!(l.expired(t0 + Duration::from_secs(1)), vec![RequestId(1)]);
        assert_eq!(l.free(RequestId(1)), Some(Holding::Reserved));
        assert!(
            l.expired(t0 + Duration::from_secs(2)).is_empty(),
            "renewed past 2 s"
        );
        assert!(l.commit(RequestId(2)));
        assert!(
            l.expired(t0 + Duration::from_secs(9)).is_empty(),
            "committed KV has no lease"
        );
        assert!(!l.renew(RequestId(2), t0), "nor a renewal");
        assert_eq!(l.free(RequestId(2)), Some(Holding::Committed));
        assert_eq!(l.free(RequestId(2)), None, "freed exactly once");
        assert!(l.is_empty());
        assert_eq!(l.counts().freed, 3);
    }
}
