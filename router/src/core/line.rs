//! The line of requests waiting for a decode worker with room (the router's requests and the
//! simulator's share it, in the [`super::Table`]).
//!
//! A request refused by every decode worker waits, and asks again on each heartbeat; so do
//! the newer ones, and the room a finished request frees goes to whichever asks first and
//! fits. Small requests always fit somewhere soon; a long one needs a worker with much room
//! free at once, which a busy pool never has — it would wait until its admission deadline
//! and fail (the simulation of the whole Mooncake trace on a saturated pool failed 201 such
//! requests). So the line remembers who waits, oldest first, and once the oldest has waited
//! [`HOLD_AFTER`], it holds the decode worker with the most free blocks (of those it may go
//! to): no other request is reserved there until it is (that one worker drains to fit it; the
//! rest of the pool admits as before, and the holder takes room wherever it comes first).
//! Each router keeps its own line: behind etcd's several routers, another router's requests
//! may still be reserved on a worker one router holds.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use types::{RequestId, WorkerId};

/// How long the oldest waiting request waits before it holds a decode worker for itself.
pub const HOLD_AFTER: Duration = Duration::from_secs(5);

/// The requests waiting for room, and the one worker held for the oldest, if any.
#[derive(Debug, Default)]
pub struct Line {
    /// By when each began to wait (and id, for ties).
    order: BTreeSet<(Instant, RequestId)>,
    waiting: HashMap<RequestId, (Instant, Eligible)>,
    /// The oldest request's hold, and the decode worker it holds.
    hold: Option<(RequestId, WorkerId)>,
    /// Holds taken so far.
    holds: u64,
}

/// The decode workers a waiting request may be reserved on: its pin (while that worker
/// serves) and not those it left (a migrated request's).
#[derive(Debug, Clone, Default)]
pub struct Eligible {
    /// The one worker it is pinned to, if any.
    pub pin: Option<WorkerId>,
    /// Workers it must not go back to.
    pub avoid: Vec<WorkerId>,
}

impl Line {
    /// Request `id` found no decode worker with room at `now` (again: it keeps its place).
    pub fn join(&mut self, id: RequestId, now: Instant, eligible: Eligible) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.waiting.entry(id) {
            e.insert((now, eligible));
            self.order.insert((now, id));
        }
    }

    /// Request `id` no longer waits (reserved, failed or gone); its hold ends with it.
    pub fn leave(&mut self, id: RequestId) {
        if let Some((t, _)) = self.waiting.remove(&id) {
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
        self.waiting.len()
    }

    /// How long each waiting request has waited at `now`.
    pub fn ages(&self, now: Instant) -> impl Iterator<Item = Duration> + '_ {
        self.order
            .iter()
            .map(move |&(t, _)| now.saturating_duration_since(t))
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The decode worker request `id` must keep off at `now`: the one held for another. `free`
    /// has each serving decode worker's free blocks; once the oldest waiting request has
    /// waited [`HOLD_AFTER`], it holds the one of them with the most that it may be reserved
    /// on, and keeps it while that worker serves. The holder itself may ask any worker (room
    /// elsewhere may come sooner).
    pub fn kept_off(
        &mut self,
        id: RequestId,
        now: Instant,
        free: &[(WorkerId, u32)],
    ) -> Option<WorkerId> {
        if let Some((_, w)) = self.hold {
            if !free.iter().any(|&(x, _)| x == w) {
                self.hold = None;
            }
        }
        if self.hold.is_none() {
            self.hold = self.take_hold(now, free);
        }
        self.hold.filter(|&(r, _)| r != id).map(|(_, w)| w)
    }

    /// The oldest request's hold, if it has waited long enough and a worker it may take serves.
    fn take_hold(
        &mut self,
        now: Instant,
        free: &[(WorkerId, u32)],
    ) -> Option<(RequestId, WorkerId)> {
        let &(since, oldest) = self.order.first()?;
        if now.saturating_duration_since(since) < HOLD_AFTER {
            return None;
        }
        let e = &self.waiting[&oldest].1;
        let allowed = |w: WorkerId, pin: bool| {
            !e.avoid.contains(&w) && (!pin || e.pin.is_none_or(|p| p == w))
        };
        // Its pin while that serves, else any it has not left; the most free, the lowest id
        // among equals.
        let pinned = e.pin.is_some_and(|p| free.iter().any(|&(x, _)| x == p));
        let (w, _) = free
            .iter()
            .filter(|&&(w, _)| allowed(w, pinned))
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))?;
        self.holds += 1;
        Some((oldest, *w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_waiting_request_holds_the_emptiest_worker_after_a_while() {
        let t0 = Instant::now();
        let free = [(WorkerId(1), 100), (WorkerId(2), 700), (WorkerId(3), 700)];
        let mut line = Line::default();
        assert_eq!(line.kept_off(RequestId(9), t0, &free), None, "nobody waits");
        line.join(RequestId(10), t0, Eligible::default());
        line.join(
            RequestId(11),
            t0 + Duration::from_secs(1),
            Eligible::default(),
        );
        line.join(
            RequestId(10),
            t0 + Duration::from_secs(2),
            Eligible::default(),
        ); // keeps its place
        assert_eq!(line.len(), 2);
        // Not yet.
        let soon = t0 + HOLD_AFTER - Duration::from_millis(1);
        assert_eq!(line.kept_off(RequestId(11), soon, &free), None);
        // The oldest (10) holds worker 2 (most free; 3 ties, higher id): others keep off it,
        // whoever asks first; it may ask any.
        let later = t0 + HOLD_AFTER;
        assert_eq!(
            line.kept_off(RequestId(12), later, &free),
            Some(WorkerId(2))
        );
        assert_eq!(line.kept_off(RequestId(10), later, &free), None);
        // Its worker left: the hold moves to the emptiest that remains.
        let free = [(WorkerId(1), 100), (WorkerId(3), 50)];
        assert_eq!(
            line.kept_off(RequestId(11), later, &free),
            Some(WorkerId(1))
        );
        // Reserved: the next oldest (11, waiting since t0+1s) holds one once it has waited
        // long enough itself.
        line.leave(RequestId(10));
        assert_eq!(line.kept_off(RequestId(12), later, &free), None);
        let t = t0 + Duration::from_secs(1) + HOLD_AFTER;
        assert_eq!(line.kept_off(RequestId(12), t, &free), Some(WorkerId(1)));
        line.leave(RequestId(11));
        assert!(line.is_empty());
        assert_eq!(line.kept_off(RequestId(12), t, &free), None);
        assert_eq!(line.holds(), 3);
    }

    /// A pinned request holds its pin while that worker serves; one that left a worker (a
    /// migration) never holds it.
    #[test]
    fn a_hold_is_taken_only_where_the_request_may_go() {
        let t0 = Instant::now();
        let later = t0 + HOLD_AFTER;
        let free = [(WorkerId(1), 100), (WorkerId(2), 700), (WorkerId(3), 50)];
        let mut line = Line::default();
        line.join(
            RequestId(10),
            t0,
            Eligible {
                pin: Some(WorkerId(3)),
                avoid: vec![],
            },
        );
        assert_eq!(
            line.kept_off(RequestId(11), later, &free),
            Some(WorkerId(3))
        );
        line.leave(RequestId(10));
        line.join(
            RequestId(10),
            t0,
            Eligible {
                pin: Some(WorkerId(9)),
                avoid: vec![WorkerId(2)],
            },
        );
        assert_eq!(
            line.kept_off(RequestId(11), later, &free),
            Some(WorkerId(1)),
            "pin gone; 2 avoided"
        );
        line.leave(RequestId(10));
        line.join(
            RequestId(10),
            t0,
            Eligible {
                pin: None,
                avoid: vec![WorkerId(1), WorkerId(2), WorkerId(3)],
            },
        );
        assert_eq!(
            line.kept_off(RequestId(11), later, &free),
            None,
            "nowhere it may go"
        );
    }
}
