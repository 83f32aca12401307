//! The router's admission of requests onto decode workers, as the real router's
//! `Request::reserve` does it: the policy picks a decode worker, which reserves the request's
//! blocks between its steps or refuses (no room); a refused request asks the other workers at
//! once, and with none left to ask waits for a heartbeat of one that refused it (freed room is
//! known no sooner). Heartbeats also carry the workers' prefix-cache events to the index and
//! their loads to the router.

use std::time::Duration;

use engine::SamplingParams;
use proto::grpc::KvEvents;
use proto::Pool;
use router::routing::{self, Candidate};

use crate::{ns, Event, Sim, HEARTBEAT};

impl Sim {
    /// Worker `w`'s heartbeat: its prefix-cache events reach the index, its measured rate and
    /// load the router; the refusals it gave are forgotten, and the requests waiting for room
    /// ask it again (the router wakes them on every heartbeat).
    pub(crate) fn beat(&mut self, w: usize) {
        // (None once every request has ended: the run is over.)
        if self.workers[w].stopped.is_some() || self.open == 0 {
            return;
        }
        self.heartbeat(w);
        let wk = &mut self.workers[w];
        wk.reported = wk.capacity;
        if wk.pool == Pool::Decode {
            wk.seen = wk.engine.load();
        }
        wk.beats += 1;
        let decode = wk.pool == Pool::Decode && wk.serving();
        self.schedule(self.now + ns(HEARTBEAT), Event::Beat(w));
        if decode && !self.admission.is_empty() {
            self.retry_admission(Some(w));
        }
    }

    /// Decode worker `w` refused request `r`: not asked again before its next heartbeat (the
    /// refusals older than their worker's last heartbeat are dropped).
    fn refused(&mut self, r: usize, w: usize) {
        let workers = &self.workers;
        let refused = &mut self.reqs[r].refused_by;
        refused.retain(|&(x, beats)| workers[x].beats == beats);
        refused.push((w, workers[w].beats));
    }

    /// Request `r` starts or stops waiting for room, as the router counts it.
    pub(crate) fn set_waiting(&mut self, r: usize, waiting: bool) {
        if self.reqs[r].waiting != waiting {
            self.reqs[r].waiting = waiting;
            let now = self.instant();
            // (The simulator has no pins, nor a migrated request's list of workers it left.)
            let eligible = Default::default();
            match waiting {
                true => (self.waiting += 1, self.line.join(r as u64, now, eligible)),
                false => (self.waiting -= 1, self.line.leave(r as u64)),
            };
        }
    }

    /// The serving decode workers' free blocks, as their last heartbeats said.
    fn free_blocks(&self, decode: &[usize]) -> Vec<(u64, u32)> {
        let free = |w: usize| self.workers[w].seen.kv_blocks_free;
        decode.iter().map(|&w| (w as u64, free(w))).collect()
    }

    /// The decode worker the line holds for another than request `r` (the router's own line).
    fn kept_off(&mut self, r: usize, free: &[(u64, u32)]) -> Option<usize> {
        let now = self.instant();
        self.line.kept_off(r as u64, now, free).map(|w| w as usize)
    }

    /// Request `r` has waited for room past the router's admission deadline.
    fn past_deadline(&self, r: usize) -> bool {
        self.now - self.reqs[r].admit_from > ns(router::ADMISSION_WAIT)
    }

    /// Request `r` fails as the router fails it at its admission deadline.
    fn no_room(&mut self, r: usize) {
        let why = format!(
            "no decode worker had room within {:?}",
            router::ADMISSION_WAIT
        );
        self.fail(r, why);
    }

    /// A request reaches the router: a decode worker is picked by the policy and reserves its
    /// blocks (or, colocated, takes the whole request); with no room anywhere it waits for a
    /// worker to free some.
    pub(crate) fn arrive(&mut self, r: usize) {
        let bs = self.cfg.decode.engine.block_size;
        if self.reqs[r].error.is_some() || self.reqs[r].done {
            return;
        }
        if self.past_deadline(r) {
            return self.no_room(r);
        }
        // Not those that refused it since their last heartbeat, nor one held for another.
        let mut decode: Vec<usize> = self.pool(Pool::Decode);
        let kept_off = self.kept_off(r, &self.free_blocks(&decode));
        let refused = &self.reqs[r].refused_by;
        decode.retain(|&w| !refused.contains(&(w, self.workers[w].beats)) && Some(w) != kept_off);
        if decode.is_empty() {
            // None to ask: it waits for a heartbeat or a new worker.
            self.admission.push_back(r);
            self.set_waiting(r, true);
            return;
        }
        let overlap = self.overlap(r, Pool::Decode);
        let cands: Vec<Candidate> = decode
            .iter()
            .map(|&w| Candidate {
                load: self.workers[w].in_flight,
                cached: overlap.get(&(w as u64)).copied().unwrap_or(0) * bs,
                queued_tokens: 0,
                rate: 0.0,
            })
            .collect();
        self.rr += 1;
        let Some(pick) = routing::decode(self.cfg.routing.policy, &cands, self.rr) else {
            // None to ask: it waits for a heartbeat or a new worker.
            self.admission.push_back(r);
            self.set_waiting(r, true);
            return;
        };
        let w = decode[pick];
        // The router counts it on the worker from its pick.
        self.workers[w].in_flight += 1;
        self.reqs[r].decode = Some(w);
        if self.workers[w].busy {
            // The worker's engine thread takes the reservation between steps.
            let attempt = self.reqs[r].attempt;
            self.workers[w].reserving.push((r, attempt));
            return;
        }
        self.reserve(r, w);
    }

    /// Decode worker `w` reserves request `r`'s blocks (or, colocated, takes the whole
    /// request); without room, it refuses, and the router asks the others at once.
    fn reserve(&mut self, r: usize, w: usize) {
        let params = SamplingParams {
            // What is left of it (a migrated request streamed the rest already).
            max_tokens: Some(self.requests[r].output - self.reqs[r].tokens),
            ignore_eos: true,
            ..Default::default()
        };
        let prompt = self.requests[r].prompt.clone();
        let colocated = self.cfg.prefill.is_none() || prompt.len() < 2;
        let added = if colocated {
            self.workers[w]
                .engine
                .add(r as u64, prompt, params)
                .map(|()| None)
        } else {
            self.workers[w]
                .engine
                .reserve_remote(r as u64, prompt, params)
                .map(Some)
        };
        let Ok(cached) = added else {
            self.workers[w].in_flight -= 1;
            self.reqs[r].decode = None;
            match added {
                Err(engine::EngineError::OutOfBlocks(_)) => {
                    self.refused(r, w);
                    // The refusal's way back, the call to the next worker.
                    let at = self.now + 2 * ns(self.cfg.hop);
                    self.schedule(at, Event::Arrive(r));
                }
                Err(e) => self.fail(r, e.to_string()),
                Ok(_) => unreachable!(),
            }
            return;
        };
        self.set_waiting(r, false);
        self.reqs[r].refused_by.clear();
        let now = self.instant();
        let waited = Duration::from_nanos(self.now - self.reqs[r].at);
        self.signals.admission.record(now, waited);
        // The router hears of a reservation a hop later.
        self.reqs[r].admitted = Some(self.now + cached.map_or(0, |_| ns(self.cfg.hop)));
        if let Some(cached) = cached {
            // The reservation's way back to the router, the router's call to a prefill
            // worker: two hops (a decode worker prefilling itself decides at once).
            let known = self.requests[r].prompt.len() - 1;
            if known - cached <= self.cfg.local_prefill_max_tokens {
                self.prefill(r, w, cached);
            } else {
                let at = self.now + 2 * ns(self.cfg.hop);
                let attempt = self.reqs[r].attempt;
                self.schedule(
                    at,
                    Event::Dispatch {
                        req: r,
                        decode: w,
                        cached,
                        attempt,
                    },
                );
            }
        }
        self.kick(w);
    }

    /// The reservations decode worker `w` took while it stepped, in the order they came
    /// (those of requests that have left it since are dropped).
    pub(crate) fn take_reservations(&mut self, w: usize) {
        for (r, attempt) in std::mem::take(&mut self.workers[w].reserving) {
            let q = &self.reqs[r];
            if q.attempt == attempt && q.decode == Some(w) && q.error.is_none() {
                self.reserve(r, w);
            }
        }
    }

    /// The requests waiting for room ask again, in the order they came to wait (those with no
    /// worker to ask wait on, in that order). After decode worker `beat`'s heartbeat each asks
    /// it, the only worker new to them (unless the line holds it for another); those it
    /// plainly has no room for — more blocks than it has free, less what the requests before
    /// them take — are refused here, as its engine would refuse them, without the call
    /// (thousands waiting on a cluster of hundreds would spend the simulation on calls
    /// refused; the reckoning counts none of a prompt the worker may hold, so a request
    /// fitting only thanks to its prefix cache waits longer).
    pub(crate) fn retry_admission(&mut self, beat: Option<usize>) {
        let bs = self.cfg.decode.engine.block_size;
        let mut room = beat.map(|w| self.workers[w].engine.free_blocks());
        let free = self.free_blocks(&self.pool(Pool::Decode));
        for r in std::mem::take(&mut self.admission) {
            if self.past_deadline(r) {
                self.no_room(r);
                continue;
            }
            if let (Some(w), Some(room)) = (beat, room.as_mut()) {
                if self.kept_off(r, &free) == Some(w) {
                    self.admission.push_back(r);
                    continue;
                }
                let left = self.requests[r].output - self.reqs[r].tokens;
                let need = (self.requests[r].prompt.len() + left).div_ceil(bs);
                if need > *room {
                    self.refused(r, w);
                    self.admission.push_back(r);
                    continue;
                }
                *room -= need;
            }
            self.arrive(r);
        }
    }

    /// Worker `w`'s prefix-cache events, as its heartbeat carries them to the index.
    pub(crate) fn heartbeat(&mut self, w: usize) {
        let events = self.workers[w].engine.take_kv_events();
        if events.is_empty() {
            return;
        }
        let first = self.workers[w].kv_next;
        let next = first + events.len() as u64;
        self.workers[w].kv_next = next;
        let ev = KvEvents {
            first,
            hashes: events.iter().map(|e| e.1).collect(),
            stored: events.iter().map(|e| e.0).collect(),
            snapshot: false,
            next,
        };
        self.index.apply(w as u64, &ev);
    }
}
