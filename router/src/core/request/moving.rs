//! A live move: a decoding request leaves its decode worker without computing anything again.
//!
//! ```text
//! Decoding ─Leave─► (Pause asked) ─Paused─► Moving: the stream parked, Reserving elsewhere
//!   ─► Prefilling (the old worker hands its KV to the new one, as a prefill would) ─► Decoding
//! ```
//!
//! The old decode worker pauses the sequence between two steps and says how many tokens its
//! stream carried (all of them before the pause). The request reserves on another decode
//! worker with its prompt plus every token streamed, as a migration does, but the KV of
//! those tokens (all but the newest) comes from the old worker, which holds it, over the KV
//! transports; the new worker's first step computes the newest token's KV and samples the
//! next one. The sampler's draws depend on the seed and the position only, and the kernels
//! are batch-invariant, so the output goes on bit for bit. The old worker keeps the paused
//! sequence until the handoff is done (its parked stream holds it); a handoff that fails is
//! computed on the new worker instead ([`Recompute::MoveFailed`]).

use std::time::{Duration, Instant};

use proto::Pool;
use types::RequestId;

use super::{reserving, Request};
use crate::core::vocab::*;
use crate::openai::ApiError;

/// Moves a request may make (beyond, it finishes where it is, or migrates when that worker
/// goes away).
pub const MOVE_LIMIT: u32 = 4;

/// How long a move waits for room elsewhere before the request resumes where it was.
pub const MOVE_WAIT: Duration = Duration::from_secs(2);

/// Where a move stands.
#[derive(Debug)]
pub enum Moving {
    /// The decode worker was asked to pause the request.
    Pausing,
    /// Paused on `held.worker` under `id`, held there until its KV is handed on.
    From {
        /// The decode worker it leaves (counted against it until released).
        held: Held,
        /// The id that worker knows it by.
        id: RequestId,
    },
}

impl Request {
    /// Decoding's [`Input::Leave`]: asks the decode worker to pause the request, unless it
    /// moved too often, no other decode worker has room for it, or requests wait for room
    /// (then it finishes there: a draining worker's capacity serves until it is done).
    pub(super) fn leave(&mut self, why: MoveWhy, cx: &Cx<'_>, out: &mut Vec<Action>) {
        let Phase::Decoding { decode } = &self.phase else {
            return;
        };
        let from = decode.worker;
        // Room for all it will hold, by the last heartbeats.
        let tokens = self.prompt_len + self.max_tokens.map_or(self.streamed.len(), |m| m as usize);
        let pages = tokens.div_ceil(cx.table.block_size().max(1)) as u32;
        let elsewhere = cx.table.pool(Pool::Decode).any(|w| {
            w.id != from
                && w.usable()
                && !self.avoid.contains(&w.id)
                && w.load.kv_blocks_free >= pages
        });
        // Requests waiting for room come first: the pool has none to spare for a move.
        let waiting = !cx.table.line.is_empty();
        if self.moving.is_some() || self.moves >= MOVE_LIMIT || !elsewhere || waiting {
            return;
        }
        tracing::debug!(request = %self.id, why = why.label(), "asking to pause for a move");
        self.moving = Some(Moving::Pausing);
        self.move_why = why;
        out.push(Action::Pause {
            worker: from,
            request: self.id,
        });
    }

    /// Decoding's [`Input::Paused`]: parks the stream and reserves elsewhere with the prompt
    /// plus every token streamed; the old worker's KV follows once reserved.
    pub(super) fn paused(
        &mut self,
        now: Instant,
        generated: u32,
        cx: &mut Cx<'_>,
        out: &mut Vec<Action>,
    ) {
        let carried = (self.streamed.len() - self.stream_from) as u32;
        if generated != carried {
            let m = format!(
                "the decode worker paused after {generated} tokens; its stream carried {carried}"
            );
            return self.migrate(now, ApiError::Upstream(m), cx, out);
        }
        // A late prefill reply has nothing left to tell.
        self.release_prefill(out);
        let held = self.take_decode();
        out.push(Action::Note(Note::Entered(PhaseName::Moving)));
        out.push(Action::Note(Note::Moved(self.move_why)));
        out.push(Action::Park { request: self.id });
        tracing::debug!(request = %self.id, tokens = self.streamed.len(), "moving");
        self.moves += 1;
        self.avoid.push(held.worker);
        // Pinned (an `n > 1` choice) to the worker it leaves: free to go anywhere now.
        self.pin = None;
        self.moving = Some(Moving::From { held, id: self.id });
        self.restart(now, cx);
        self.admit_by = now + MOVE_WAIT.min(cx.settings.admission_wait);
        self.go(reserving(), out);
        self.reserve(now, cx, out);
    }

    /// No decode worker had room for a move within [`MOVE_WAIT`]: the request resumes where it
    /// was paused, on its parked stream.
    pub(super) fn stay(&mut self, out: &mut Vec<Action>) {
        let Some(Moving::From { held, id }) = self.moving.take() else {
            unreachable!("handing off");
        };
        tracing::debug!(request = %id, "no room to move to: resuming where it was");
        out.push(Action::Note(Note::Stayed));
        out.push(Action::Resume {
            worker: held.worker,
            request: id,
        });
        self.avoid.retain(|&w| w != held.worker);
        self.id = id;
        self.go(Phase::Decoding { decode: held }, out);
    }

    /// Whether the request is reserving for a move's handoff (the new worker must take the
    /// KV from the old one: a remote prefill, never computed there).
    pub(super) fn handing(&self) -> bool {
        matches!(self.moving, Some(Moving::From { .. }))
    }

    /// Reserved on `decode` for a move: the old worker hands its KV over (or nothing need
    /// come: the new worker held all of it).
    pub(super) fn hand_off(&mut self, decode: Held, r: Option<Reservation>, out: &mut Vec<Action>) {
        let Some(Moving::From { held, id }) = &self.moving else {
            unreachable!("handing off");
        };
        match r {
            Some(r) if !r.local => {
                let from = held.worker;
                out.push(Action::Handoff {
                    from,
                    request: *id,
                    decode: decode.worker,
                    skip: r.cached_tokens,
                    ticket: r.ticket,
                });
                self.prefill_call = Some(from);
                self.go(
                    Phase::Prefilling {
                        decode,
                        prefill: from,
                    },
                    out,
                );
            }
            _ => {
                self.moved_off(out);
                self.go(Phase::Decoding { decode }, out);
            }
        }
    }

    /// The handoff is over (answered, or the new worker's first token came): the old worker
    /// releases the paused request. Returns whether a move was under way.
    pub(super) fn moved_off(&mut self, out: &mut Vec<Action>) -> bool {
        match self.moving.take() {
            Some(Moving::From { held, id }) => {
                self.prefill_call = self.prefill_call.filter(|&w| w != held.worker);
                out.push(Action::Release {
                    pool: Pool::Decode,
                    worker: held.worker,
                    request: id,
                });
                true
            }
            other => {
                self.moving = other;
                false
            }
        }
    }
}
