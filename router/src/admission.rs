//! The line of requests waiting for a decode worker with room, with no I/O (the router's
//! requests and the simulator share it).
//!
//! A request refused by every decode worker waits, and asks again on each heartbeat; so do
//! the newer ones, and the room a finished request frees goes to whichever asks first and
//! fits. Small requests always fit somewhere soon; a long one needs a worker with much room
//! free at once, which a busy pool never has — it would wait until its admission deadline
//! and fail (the simulation of the whole Mooncake trace on a saturated pool failed 201 such
//! requests). So the line remembers who waits, oldest first, and once the oldest has waited
//! [`HOLD_AFTER`], it holds the decode worker with the most free blocks: no other request is
//! reserved there until it is (that one worker drains to fit it; the rest of the pool admits
//! as before).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// How long the oldest waiting request waits before it holds a decode worker for itself.
pub const HOLD_AFTER: Duration = Duration::from_secs(5);

/// The requests waiting for room, and the one worker held for the oldest, if any.
#[derive(Debug, Default)]
pub struct Line {
    /// By when each began to wait (and id, for ties).
    order: BTreeSet<(Instant, u64)>,
    since: HashMap<u64, Instant>,
    /// The oldest request's hold: (request, decode worker).
    hold: Option<(u64, u64)>,
    /// Holds taken so far.
    holds: u64,
}

impl Line {
    /// Request `id` found no decode worker with room at `now` (again: it keeps its place).
    pub fn join(&mut self, id: u64, now: Instant) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.since.entry(id) {
            e.insert(now);
            self.order.insert((now, id));
        }
    }

    /// Request `id` no longer waits (reserved, failed or gone); its hold ends with it.
    pub fn leave(&mut self, id: u64) {
        if let Some(t) = self.since.remove(&id) {
            self.order.remove(&(t, id));
        }
        if self.hold.is_some_and(|(r, _)| r == id) {
            self.hold = None;
        }
    }

    /// Holds taken so far (`tandem_router_admission_holds_total`).
    pub fn holds(&self) -> u64 {
        self.holds
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.since.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.since.is_empty()
    }

    /// The decode worker request `id` may ask at `now`: `Only(w)` when it holds `w` (the
    /// oldest, waiting [`HOLD_AFTER`] or more: it takes the worker of `free` — each serving
    /// decode worker's free blocks — with the most, and keeps it while it serves); `AllBut(w)`
    /// when `w` is held for another; else `Any`.
    pub fn may_ask(&mut self, id: u64, now: Instant, free: &[(u64, u32)]) -> Ask {
        if let Some((r, w)) = self.hold {
            if !free.iter().any(|&(x, _)| x == w) {
                self.hold = None;
            } else if r == id {
                return Ask::Only(w);
            } else {
                return Ask::AllBut(w);
            }
        }
        let Some(&(since, oldest)) = self.order.first() else {
            return Ask::Any;
        };
        if now.saturating_duration_since(since) < HOLD_AFTER {
            return Ask::Any;
        }
        // Most free blocks; the lowest id among equals.
        let best = free.iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)));
        let Some(&(w, _)) = best else {
            return Ask::Any;
        };
        self.hold = Some((oldest, w));
        self.holds += 1;
        match oldest == id {
            true => Ask::Only(w),
            false => Ask::AllBut(w),
        }
    }
}

/// Which decode workers a request may ask (see [`Line::may_ask`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// Any.
    Any,
    /// Only this one (held for it).
    Only(u64),
    /// All but this one (held for another).
    AllBut(u64),
}

impl Ask {
    /// Whether worker `w` may be asked.
    pub fn allows(self, w: u64) -> bool {
        match self {
            Ask::Any => true,
            Ask::Only(x) => x == w,
            Ask::AllBut(x) => x != w,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_waiting_request_holds_the_emptiest_worker_after_a_while() {
        let t0 = Instant::now();
        let free = [(1, 100), (2, 700), (3, 700)];
        let mut line = Line::default();
        assert_eq!(line.may_ask(9, t0, &free), Ask::Any, "nobody waits");
        line.join(10, t0);
        line.join(11, t0 + Duration::from_secs(1));
        line.join(10, t0 + Duration::from_secs(2)); // keeps its place
        assert_eq!(line.len(), 2);
        // Not yet.
        let soon = t0 + HOLD_AFTER - Duration::from_millis(1);
        assert_eq!(line.may_ask(11, soon, &free), Ask::Any);
        // The oldest (10) holds worker 2 (most free; 3 ties, higher id): others keep off it,
        // whoever asks first.
        let later = t0 + HOLD_AFTER;
        assert_eq!(line.may_ask(12, later, &free), Ask::AllBut(2));
        assert_eq!(line.may_ask(10, later, &free), Ask::Only(2));
        assert!(!Ask::AllBut(2).allows(2) && Ask::AllBut(2).allows(3));
        // Its worker left: the hold moves to the emptiest that remains.
        let free = [(1, 100), (3, 50)];
        assert_eq!(line.may_ask(10, later, &free), Ask::Only(1));
        // Reserved: the next oldest (11, waiting since t0+1s) holds one once it has waited
        // long enough itself.
        line.leave(10);
        assert_eq!(line.may_ask(12, later, &free), Ask::Any);
        let t = t0 + Duration::from_secs(1) + HOLD_AFTER;
        assert_eq!(line.may_ask(12, t, &free), Ask::AllBut(1));
        line.leave(11);
        assert!(line.is_empty());
        assert_eq!(line.holds(), 3);
        assert_eq!(line.may_ask(12, t, &free), Ask::Any);
    }
}
