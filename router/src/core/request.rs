//! One request's life in the router, with no I/O:
//!
//! ```text
//! Reserving ─► Prefilling ─► Decoding ─► Done
//!  ▲  │            │  prefill or KV lost      ▲
//!  │  │            └──────► Recomputing ──────┘
//!  │  └─ colocated, or prefilled where it was reserved ─► Decoding
//!  ├── Migrating ◄── the decode worker died, froze or stalled (Prefilling, Decoding)
//!  └── Moving ◄── the decode worker drains or sheds load (Decoding; see [`moving`])
//! any phase ─► Failed (the error goes to the client) | Gone (the client went away)
//! ```
//!
//! Each [`Phase`] carries what it holds: the decode worker asked or reserved on (counted
//! against it while held, [`Held`]), the prefill worker computing the prompt. A driver feeds
//! [`Input`]s — a reservation or a refusal, the prefill's answer, a token, a worker lost, a
//! deadline — to [`Request::handle`] and carries out the [`Action`]s it returns: open a decode
//! stream, start a prefill, release the request on a worker, forget a worker, pass a token on.
//! The router drives it with gRPC calls ([`crate::request`]), the simulator with events on a
//! virtual clock; both read the same table of workers ([`Table`]) through [`Cx`].
//!
//! A migration resumes the request on another decode worker from its prompt plus the tokens
//! already streamed (the sampler's draws depend on the seed and the position only, so greedy
//! and seeded output continue exactly), up to `migration_limit` times; the client sees one
//! stream. A prefill or KV that fails before any token is recomputed on the decode worker.

mod moving;

use std::time::Instant;

use engine::FinishReason;
use proto::{Cause, Pool};
use types::{RequestId, WorkerId};

use super::line::Eligible;
use super::table::{Route, Table, Worker};
use super::vocab::*;
use crate::openai::ApiError;
use crate::planner::Signals;
use crate::routing::Policy;

/// One request.
#[derive(Debug)]
pub struct Request {
    id: RequestId,
    /// The prompt, followed (after a migration) by the tokens streamed before it.
    prompt: Vec<u32>,
    /// The client's prompt's length.
    prompt_len: usize,
    params: Params,
    /// The client's `max_tokens`.
    max_tokens: Option<u32>,
    route: Route,
    /// Whether the prompt goes to the prefill pool (unless it must be recomputed).
    disaggregated: bool,
    recomputed: bool,
    /// The decode worker to use while it is in the table.
    pin: Option<WorkerId>,
    migrations: u32,
    /// A live move under way, the moves made, and why the last one was asked for.
    moving: Option<moving::Moving>,
    moves: u32,
    move_why: MoveWhy,
    /// The decode workers the request left.
    avoid: Vec<WorkerId>,
    /// Every token sent to the client, and how many came before the current stream opened.
    streamed: Vec<u32>,
    stream_from: usize,
    arrived: Instant,
    /// The admission deadline (from arrival, or from the last migration).
    admit_by: Instant,
    reserved: Option<Instant>,
    /// When the prefill call answered (the KV is in the decode worker's cache).
    prefilled: Option<Instant>,
    /// The prefill call in progress, if any (it can outlive Prefilling: a token may come first).
    prefill_call: Option<WorkerId>,
    last_token: Option<Instant>,
    /// The decode worker preempted it and it has sent no token since: it waits there for room.
    preempted: bool,
    phase: Phase,
}

impl Request {
    /// A request for `prompt` arriving at `now` (on decode worker `pin` while it is in the
    /// table: the other choices of an `n > 1` request go where the first one's prompt KV is
    /// cached), and what its driver does first.
    pub fn start(
        prompt: Vec<u32>,
        params: Params,
        pin: Option<WorkerId>,
        now: Instant,
        cx: &mut Cx<'_>,
    ) -> (Request, Vec<Action>) {
        let disaggregated = pin.is_none()
            && prompt.len() >= 2
            && !params.prompt_logprobs
            && cx.table.count(Pool::Prefill) > 0;
        let mut r = Request {
            id: (cx.next_id)(),
            route: route(cx, &prompt, params.cache_root),
            prompt_len: prompt.len(),
            prompt,
            max_tokens: params.max_tokens,
            params,
            disaggregated,
            recomputed: false,
            pin,
            migrations: 0,
            moving: None,
            moves: 0,
            move_why: MoveWhy::Draining,
            avoid: Vec::new(),
            streamed: Vec::new(),
            stream_from: 0,
            arrived: now,
            admit_by: now + cx.settings.admission_wait,
            reserved: None,
            prefilled: None,
            prefill_call: None,
            last_token: None,
            preempted: false,
            phase: Phase::Done,
        };
        if disaggregated {
            cx.signals.prefill_arrived((r.prompt_len - 1) as u64);
        }
        let mut out = Vec::new();
        r.go(reserving(), &mut out);
        r.reserve(now, cx, &mut out);
        (r, out)
    }

    /// The id the workers know the current try by.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Where it is.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// Whether it has ended (done, failed or gone).
    pub fn ended(&self) -> bool {
        matches!(self.phase, Phase::Done | Phase::Failed | Phase::Gone)
    }

    /// The prompt of the current try (the client's, then the tokens streamed before a
    /// migration).
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The sampling parameters of the current try that the core follows.
    pub fn params(&self) -> Params {
        self.params
    }

    /// Tokens passed on to the client so far.
    pub fn streamed(&self) -> usize {
        self.streamed.len()
    }

    /// The admission deadline (while waiting for room).
    pub fn admit_by(&self) -> Instant {
        self.admit_by
    }

    /// The request's deadline.
    pub fn deadline(&self, cx: &Settings) -> Instant {
        self.arrived + cx.request_timeout
    }

    /// Since when the decode worker owes a token (its last one, once this stream has sent
    /// one): it is stalled past that plus the stall timeout.
    pub fn owes_token_since(&self) -> Option<Instant> {
        self.last_token
            .filter(|_| self.streamed.len() > self.stream_from && !self.preempted)
    }

    /// The prefill call in progress, if any.
    pub fn prefill_call(&self) -> Option<WorkerId> {
        self.prefill_call
    }

    /// Moves the request on `input` at `now`; returns what the driver does next.
    pub fn handle(&mut self, now: Instant, input: Input, cx: &mut Cx<'_>) -> Vec<Action> {
        let mut out = Vec::new();
        if self.ended() {
            return out;
        }
        match input {
            Input::ClientGone => {
                self.leave_line(cx);
                self.release_everywhere(&mut out);
                self.go(Phase::Gone, &mut out);
            }
            Input::Timeout => {
                self.leave_line(cx);
                self.release_everywhere(&mut out);
                let t = cx.settings.request_timeout;
                let e = format!("the request did not finish within {t:?} (request_timeout_ms)");
                self.fail(ApiError::Timeout(e), &mut out);
            }
            Input::PrefillDone | Input::PrefillFailed(..) if self.prefill_call.is_none() => {}
            input => match self.phase.name() {
                PhaseName::Reserving => self.reserving(now, input, cx, &mut out),
                PhaseName::Prefilling => self.prefilling(now, input, cx, &mut out),
                PhaseName::Decoding => self.decoding(now, input, cx, &mut out),
                PhaseName::Recomputing => self.recomputing(now, input, cx, &mut out),
                _ => {}
            },
        }
        out
    }

    fn go(&mut self, phase: Phase, out: &mut Vec<Action>) {
        out.push(Action::Note(Note::Entered(phase.name())));
        self.phase = phase;
    }

    fn fail(&mut self, e: ApiError, out: &mut Vec<Action>) {
        out.push(Action::Fail(e));
        self.go(Phase::Failed, out);
    }

    fn remote(&self) -> bool {
        self.disaggregated && !self.recomputed
    }

    /// Reserving's inputs.
    fn reserving(&mut self, now: Instant, input: Input, cx: &mut Cx<'_>, out: &mut Vec<Action>) {
        let handing = self.handing();
        let Phase::Reserving {
            asking, refused, ..
        } = &mut self.phase
        else {
            unreachable!("reserving");
        };
        match (input, asking.take()) {
            (Input::Changed, None) => self.reserve(now, cx, out),
            (Input::AdmissionDeadline, None) if handing => {
                self.leave_line(cx);
                self.stay(out);
            }
            (Input::AdmissionDeadline, None) => {
                let e = no_room(cx);
                self.leave_line(cx);
                self.fail(e, out);
            }
            (Input::Opened(r), Some(held)) => {
                self.leave_line(cx);
                self.reserved(now, held, r, cx, out);
            }
            (Input::OpenFailed(cause, msg), Some(held)) => match cause {
                Cause::BadRequest => {
                    self.leave_line(cx);
                    self.fail(ApiError::BadRequest(msg), out);
                }
                Cause::Unreachable | Cause::Engine => {
                    let w = held.worker;
                    drop(held);
                    tracing::warn!(worker = %w, "decode worker failed: {msg}");
                    out.push(Action::Remove(w));
                    cx.table.remove(w);
                    self.reserve(now, cx, out);
                }
                Cause::Full | Cause::Draining | Cause::KvTransfer => {
                    let w = held.worker;
                    drop(held);
                    out.push(Action::Note(Note::Refused));
                    let beats = cx.table.get(w).map_or(0, |w| w.beats);
                    // One entry a worker: a request waiting for room is refused again after each
                    // heartbeat, and a growing list made every retry slower (quadratic).
                    match refused.iter_mut().find(|(r, _)| *r == w) {
                        Some(e) => e.1 = beats,
                        None => refused.push((w, beats)),
                    }
                    self.reserve(now, cx, out);
                }
            },
            (_, asking_back) => {
                if let Phase::Reserving { asking, .. } = &mut self.phase {
                    *asking = asking_back;
                }
            }
        }
    }

    /// Asks the decode worker the policy picks among those it may go to: not one that refused
    /// it since its last heartbeat, nor one it left, nor (while its pin is in the table) any
    /// other than its pin, nor one the line holds for another. With none to ask, it waits in
    /// the line for the table to change.
    fn reserve(&mut self, now: Instant, cx: &mut Cx<'_>, out: &mut Vec<Action>) {
        let holds = cx.table.line.holds();
        let kept_off = cx.table.kept_off(self.id, now);
        if cx.table.line.holds() > holds {
            out.push(Action::Note(Note::Held));
        }
        let pin = self.pin.filter(|&p| cx.table.get(p).is_some());
        let Phase::Reserving { refused, .. } = &self.phase else {
            unreachable!("reserving");
        };
        let keep = |w: &Worker| {
            !refused
                .iter()
                .any(|&(r, beats)| r == w.id && w.beats == beats)
                && !self.avoid.contains(&w.id)
                && pin.is_none_or(|p| p == w.id)
                && Some(w.id) != kept_off
        };
        let picked = cx.table.pick(Pool::Decode, keep, &self.route);
        let Phase::Reserving {
            asking, waiting, ..
        } = &mut self.phase
        else {
            unreachable!("reserving");
        };
        match picked {
            Some(p) => {
                let worker = p.worker;
                *asking = Some(Held::new(worker, p.guard));
                let (remote, local_max) = match self.handing() {
                    true => (true, 0),
                    false => (self.remote(), self.local_max(worker, cx)),
                };
                out.push(Action::Open {
                    worker,
                    remote,
                    local_max,
                });
            }
            None if !*waiting => {
                *waiting = true;
                let eligible = Eligible {
                    pin: self.pin,
                    avoid: self.avoid.clone(),
                };
                cx.table.line.join(self.id, now, eligible);
            }
            None => {}
        }
    }

    fn leave_line(&mut self, cx: &mut Cx<'_>) {
        if let Phase::Reserving { waiting, .. } = &mut self.phase {
            if std::mem::take(waiting) {
                cx.table.line.leave(self.id);
            }
        }
    }

    /// Up to how many uncached prompt tokens decode worker `w` should prefill itself: a short
    /// suffix always (`local_prefill_max_tokens`); more, up to `local_prefill_busy_max_tokens`,
    /// while it would compute them sooner than the prefill pool could start on them (at the
    /// prefill worker's rate, or the decode worker's own where it measured one).
    fn local_max(&self, w: WorkerId, cx: &Cx<'_>) -> u32 {
        let short = cx.settings.local_prefill_max_tokens;
        let cap = cx.settings.local_prefill_busy_max_tokens;
        if !self.remote() || cap == 0 {
            return short;
        }
        let Some((wait, prefill_rate)) = cx.table.prefill_wait() else {
            return short;
        };
        let rate = match cx
            .table
            .get(w)
            .map_or(0.0, |w| w.load.prompt_tokens_per_s as f64)
        {
            r if r > 0.0 => r,
            _ => prefill_rate,
        };
        let sooner = (wait.as_secs_f64() * rate) as u32;
        short.max(sooner.min(cap))
    }

    /// Why a remote-capable request is prefilled where it is, from the decode worker's
    /// reservation.
    fn decision(&self, r: Reservation, cx: &Cx<'_>) -> PrefillDecision {
        let uncached = (self.prompt.len() - 1).saturating_sub(r.cached_tokens as usize);
        match r.local {
            false => PrefillDecision::Remote,
            true if uncached <= cx.settings.local_prefill_max_tokens as usize => {
                PrefillDecision::LocalShortSuffix
            }
            true => PrefillDecision::LocalPrefillPoolBusy,
        }
    }

    /// Reserved on `decode`: to the prefill pool, or decoding at once.
    fn reserved(
        &mut self,
        now: Instant,
        decode: Held,
        r: Option<Reservation>,
        cx: &mut Cx<'_>,
        out: &mut Vec<Action>,
    ) {
        if self.handing() {
            return self.hand_off(decode, r, out);
        }
        self.reserved = Some(now);
        let waited = now.saturating_duration_since(self.arrived);
        cx.signals
            .admission
            .lock()
            .expect("window lock")
            .record(now, waited);
        self.stream_from = self.streamed.len();
        self.preempted = false;
        let decision = match r {
            Some(r) => self.decision(r, cx),
            None if !cx.settings.disaggregated => return self.go(Phase::Decoding { decode }, out),
            None if self.prompt.len() < 2 => PrefillDecision::LocalShortSuffix,
            None if self.params.prompt_logprobs => PrefillDecision::LocalPromptLogprobs,
            None => PrefillDecision::LocalNoPrefillWorker,
        };
        out.push(Action::Note(Note::Decided(decision)));
        match r {
            Some(r) if !r.local => self.start_prefill(decode, r, cx, out),
            _ => self.go(Phase::Decoding { decode }, out),
        }
    }

    /// Sends the prompt (less its last token) to the prefill worker the policy picks, whose KV
    /// goes straight to the decode worker — all but the first tokens it holds, under its ticket.
    fn start_prefill(
        &mut self,
        decode: Held,
        r: Reservation,
        cx: &mut Cx<'_>,
        out: &mut Vec<Action>,
    ) {
        let source = cx
            .table
            .peer_source(decode.worker, r.cached_tokens as usize, &self.route);
        self.route.peer_blocks = source.map_or(0, |(_, tokens)| tokens / cx.table.block_size());
        let picked = cx.table.pick(Pool::Prefill, |_| true, &self.route);
        self.route.peer_blocks = 0;
        let Some(p) = picked else {
            let why = ApiError::Unavailable("no prefill worker has joined the cluster".into());
            return self.recompute(decode, why, Recompute::NoPrefillWorker, cx, out);
        };
        if p.peer != PeerFetch::Nothing {
            out.push(Action::Note(Note::PeerFetch(p.peer)));
        }
        let tokens = (self.prompt.len() - 1) as u64;
        self.prefill_call = Some(p.worker);
        out.push(Action::Prefill {
            worker: p.worker,
            decode: decode.worker,
            skip: r.cached_tokens,
            fetch: source
                .filter(|_| p.peer.fetches())
                .map(|(w, tokens)| (w, tokens as u32)),
            ticket: r.ticket,
            guard: p.guard,
            pending: cx.signals.prefill_started(tokens),
        });
        self.go(
            Phase::Prefilling {
                decode,
                prefill: p.worker,
            },
            out,
        );
    }

    /// Prefilling's inputs.
    fn prefilling(&mut self, now: Instant, input: Input, cx: &mut Cx<'_>, out: &mut Vec<Action>) {
        let prefill = match &self.phase {
            Phase::Prefilling { prefill, .. } => *prefill,
            _ => unreachable!("prefilling"),
        };
        match input {
            Input::PrefillDone => {
                self.prefill_call = None;
                self.prefilled = Some(now);
                self.moved_off(out);
                let decode = self.take_decode();
                self.go(Phase::Decoding { decode }, out);
            }
            Input::PrefillFailed(cause, msg) => {
                let name = name(cx.table, prefill);
                let why = match cause {
                    _ if self.handing() => {
                        if cause == Cause::Unreachable {
                            out.push(Action::Remove(prefill));
                            cx.table.remove(prefill);
                        }
                        Recompute::MoveFailed
                    }
                    Cause::Unreachable => {
                        tracing::warn!(worker = %prefill, "prefill worker failed: {msg}");
                        out.push(Action::Remove(prefill));
                        cx.table.remove(prefill);
                        Recompute::PrefillWorkerLost
                    }
                    _ => Recompute::TransferFailed,
                };
                let e = ApiError::Upstream(format!("prefill on worker {name} failed: {msg}"));
                let decode = self.take_decode();
                self.recompute(decode, e, why, cx, out);
            }
            Input::PrefillLost => {
                let name = name(cx.table, prefill);
                let (e, why) = match self.handing() {
                    true => ("the decode worker it moves from", Recompute::MoveFailed),
                    false => ("prefill worker", Recompute::PrefillWorkerLost),
                };
                let e = ApiError::Upstream(format!("{e} {name} stopped making progress"));
                let decode = self.take_decode();
                self.recompute(decode, e, why, cx, out);
            }
            Input::Token { id, finish } => out.extend(self.token(now, id, finish, cx.signals)),
            Input::Preempted => self.preempted = true,
            input => self.stream_trouble(now, input, cx, out),
        }
    }

    /// Decoding's inputs.
    fn decoding(&mut self, now: Instant, input: Input, cx: &mut Cx<'_>, out: &mut Vec<Action>) {
        match input {
            Input::Token { id, finish } => out.extend(self.token(now, id, finish, cx.signals)),
            // The prefill's (or handoff's) late answer: the call has ended.
            Input::PrefillDone | Input::PrefillFailed(..) => {
                if !self.moved_off(out) {
                    self.prefill_call = None;
                }
            }
            Input::PrefillLost => {}
            Input::Leave(why) => self.leave(why, cx, out),
            Input::Paused { generated } => self.paused(now, generated, cx, out),
            Input::NotPaused => self.moving = None,
            Input::Preempted => self.preempted = true,
            input => self.stream_trouble(now, input, cx, out),
        }
    }

    /// What may befall a decode stream, prefilling or decoding.
    fn stream_trouble(
        &mut self,
        now: Instant,
        input: Input,
        cx: &mut Cx<'_>,
        out: &mut Vec<Action>,
    ) {
        let Some(w) = self.phase.decode_worker() else {
            return;
        };
        let name = name(cx.table, w);
        match input {
            Input::Unexpected(what) => {
                let m = format!("unexpected event from decode worker {name}: {what}");
                self.release_everywhere(out);
                self.fail(ApiError::Upstream(m), out);
            }
            Input::StreamEnded => {
                let m =
                    format!("decode worker {name} ended the stream before the request finished");
                self.migrate(now, ApiError::Upstream(m), cx, out);
            }
            Input::DecodeFailed(cause, msg) => self.decode_failed(now, cause, msg, cx, out),
            Input::DecodeLost => {
                let wait = cx.table.liveness.heartbeat;
                let m = format!(
                    "decode worker {name} stopped making progress (no heartbeat for {wait:?}, or stalled)"
                );
                self.migrate(now, ApiError::Upstream(m), cx, out);
            }
            Input::Stalled => {
                out.push(Action::MarkStalled(w));
                cx.table.set_stalled(w);
                let stall = cx.table.liveness.stall;
                let m = format!("decode worker {name} sent no token for {stall:?}");
                self.migrate(now, ApiError::Upstream(m), cx, out);
            }
            _ => {}
        }
    }

    /// The decode stream failed with `cause`.
    fn decode_failed(
        &mut self,
        now: Instant,
        cause: Cause,
        msg: String,
        cx: &mut Cx<'_>,
        out: &mut Vec<Action>,
    ) {
        let w = self.phase.decode_worker().expect("on a decode worker");
        let name = name(cx.table, w);
        if cause == Cause::KvTransfer && self.remote() && self.streamed.len() == self.stream_from {
            // The decode worker gave up on the KV (the transfer broke or its lease ran out)
            // before any token: recompute there, whatever the prefill says.
            let decode = self.take_decode();
            let why = ApiError::Upstream(msg);
            return self.recompute(decode, why, Recompute::TransferFailed, cx, out);
        }
        if matches!(cause, Cause::Unreachable | Cause::Engine) {
            out.push(Action::Remove(w));
            cx.table.remove(w);
            let why = format!("decode worker {name} failed: {msg}");
            return self.migrate(now, ApiError::Upstream(why), cx, out);
        }
        self.release_everywhere(out);
        self.fail(
            match cause {
                Cause::BadRequest => ApiError::BadRequest(msg),
                _ => ApiError::Upstream(format!("decode worker {name} failed: {msg}")),
            },
            out,
        );
    }

    /// A token from the decode worker at `now` ([`Input::Token`]; it needs none of the table,
    /// so a driver may hand it in without one): passed on, counted in the planner's signals;
    /// the last one ends the request.
    pub fn token(
        &mut self,
        now: Instant,
        id: u32,
        finish: Option<FinishReason>,
        signals: &Signals,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        match self.phase.name() {
            PhaseName::Prefilling => {
                // The KV arrived before the prefill's reply did; the call finishes on its own.
                let decode = self.take_decode();
                self.go(Phase::Decoding { decode }, &mut out);
            }
            PhaseName::Decoding => {}
            _ => return out,
        }
        self.pass_on(now, id, finish, signals, &mut out);
        out
    }

    /// Passes token `id` on and counts it in the planner's signals.
    fn pass_on(
        &mut self,
        now: Instant,
        id: u32,
        finish: Option<FinishReason>,
        signals: &Signals,
        out: &mut Vec<Action>,
    ) {
        match (self.last_token, self.reserved) {
            (None, reserved) => {
                if let Some(t) = self.ttft_phases(now) {
                    out.push(Action::Note(Note::Ttft(t)));
                }
                if let (Some(reserved), true) = (reserved, self.disaggregated) {
                    let mut w = signals.prefill_ttft.lock().expect("window lock");
                    w.record(now, now.saturating_duration_since(reserved));
                }
            }
            (Some(prev), _) => signals
                .itl
                .lock()
                .expect("window lock")
                .record(now, now.saturating_duration_since(prev)),
        }
        self.last_token = Some(now);
        self.preempted = false;
        self.streamed.push(id);
        out.push(Action::Emit);
        if finish.is_some() {
            self.go(Phase::Done, out);
        }
    }

    /// Where a first try's time to its first token (at `now`) went; `None` for a migrated or
    /// recomputed request (their phases overlap).
    fn ttft_phases(&self, now: Instant) -> Option<TtftPhases> {
        let reserved = self
            .reserved
            .filter(|_| self.migrations == 0 && !self.recomputed)?;
        // Sent to a prefill worker (not prefilled where it was reserved). A token can overtake
        // the prefill's reply (the reply follows the decode worker's ack).
        let sent = self.prefill_call.is_some() || self.prefilled.is_some();
        let kv = match sent {
            true => self.prefilled.map_or(now, |p| p.min(now)),
            false => reserved,
        };
        Some(TtftPhases {
            admission: reserved.saturating_duration_since(self.arrived),
            prefill: sent.then(|| kv.saturating_duration_since(reserved)),
            first_token: now.saturating_duration_since(kv),
        })
    }

    /// Recomputing: the whole prompt on `decode`, under a new id; the old request is released
    /// on both workers.
    fn recompute(
        &mut self,
        decode: Held,
        why: ApiError,
        cause: Recompute,
        cx: &mut Cx<'_>,
        out: &mut Vec<Action>,
    ) {
        tracing::warn!(
            "{why}; recomputing the prompt on decode worker {}",
            decode.worker
        );
        out.push(Action::Note(Note::Recomputed(cause)));
        self.release_prefill(out);
        out.push(Action::Release {
            pool: Pool::Decode,
            worker: decode.worker,
            request: self.id,
        });
        self.recomputed = true;
        self.id = (cx.next_id)();
        let worker = decode.worker;
        self.go(Phase::Recomputing { decode, why }, out);
        let local_max = cx.settings.local_prefill_max_tokens;
        out.push(Action::Open {
            worker,
            remote: false,
            local_max,
        });
    }

    /// Recomputing's inputs: the reopened stream.
    fn recomputing(&mut self, now: Instant, input: Input, cx: &mut Cx<'_>, out: &mut Vec<Action>) {
        match input {
            Input::Opened(_) => {
                self.stream_from = self.streamed.len();
                self.preempted = false;
                let decode = self.take_decode();
                self.go(Phase::Decoding { decode }, out);
            }
            Input::OpenFailed(cause, msg) => {
                let Phase::Recomputing { decode, why } = &self.phase else {
                    unreachable!("recomputing");
                };
                let w = decode.worker;
                let (name, endpoint) =
                    cx.table.get(w).map_or((w.to_string(), String::new()), |x| {
                        (x.name.clone(), x.endpoint.clone())
                    });
                let failed = format!(
                    "{why}; recomputing on decode worker {name} ({endpoint}) failed too: {msg}"
                );
                if !matches!(cause, Cause::Unreachable | Cause::Engine) {
                    return self.fail(ApiError::Upstream(failed), out);
                }
                // The decode worker is gone as well: elsewhere, as a migration.
                out.push(Action::Remove(w));
                cx.table.remove(w);
                self.migrate(now, ApiError::Upstream(failed), cx, out);
            }
            _ => {}
        }
    }

    /// Migrating: leaves the decode worker and starts over from Reserving with the prompt plus
    /// every token streamed, the rest of `max_tokens`, a new id and a new admission deadline —
    /// unless the request has been migrated `migration_limit` times already.
    fn migrate(&mut self, now: Instant, why: ApiError, cx: &mut Cx<'_>, out: &mut Vec<Action>) {
        out.push(Action::Note(Note::Entered(PhaseName::Migrating)));
        let limit = cx.settings.migration_limit;
        if self.migrations >= limit {
            self.release_everywhere(out);
            let e = format!("{why}; not migrated again (migration_limit = {limit})");
            return self.fail(ApiError::Upstream(e), out);
        }
        let left = self.phase.decode_worker().expect("on a decode worker");
        tracing::warn!(request = %self.id, tokens = self.streamed.len(), "{why}; migrating");
        out.push(Action::Note(Note::Migrated));
        self.release_everywhere(out);
        self.migrations += 1;
        self.avoid.push(left);
        self.restart(now, cx);
        self.go(reserving(), out);
        self.reserve(now, cx, out);
    }

    /// A new try from the prompt plus every token streamed, with the rest of `max_tokens`, a
    /// new id and a new admission deadline (a migration's, a move's).
    fn restart(&mut self, now: Instant, cx: &mut Cx<'_>) {
        self.prompt.truncate(self.prompt_len);
        self.prompt.extend(&self.streamed);
        let streamed = self.streamed.len() as u32;
        self.params.generated = streamed;
        // The prompt's log-probabilities went out with the first token.
        self.params.prompt_logprobs &= streamed == 0;
        // Not finished, so fewer tokens than asked for were streamed.
        self.params.max_tokens = self.max_tokens.map(|m| m - streamed);
        self.route = route(cx, &self.prompt, self.params.cache_root);
        self.recomputed = false;
        self.disaggregated = !self.params.prompt_logprobs && cx.table.count(Pool::Prefill) > 0;
        self.id = (cx.next_id)();
        self.admit_by = now + cx.settings.admission_wait;
        // No token is owed until the new stream opens.
        self.stream_from = self.streamed.len();
        self.preempted = false;
    }

    /// The decode worker held, out of the phase (which the caller replaces).
    fn take_decode(&mut self) -> Held {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Prefilling { decode, .. }
            | Phase::Decoding { decode }
            | Phase::Recomputing { decode, .. } => decode,
            _ => unreachable!("on a decode worker"),
        }
    }

    fn release_prefill(&mut self, out: &mut Vec<Action>) {
        if self.moved_off(out) {
            return;
        }
        if let Some(worker) = self.prefill_call.take() {
            out.push(Action::Release {
                pool: Pool::Prefill,
                worker,
                request: self.id,
            });
        }
    }

    /// Drops the request's calls and tells its workers to release it.
    fn release_everywhere(&mut self, out: &mut Vec<Action>) {
        self.release_prefill(out);
        if let Some(worker) = self.phase.decode_worker() {
            out.push(Action::Release {
                pool: Pool::Decode,
                worker,
                request: self.id,
            });
        }
    }
}

pub(super) fn reserving() -> Phase {
    Phase::Reserving {
        asking: None,
        refused: Vec::new(),
        waiting: false,
    }
}

/// A worker's name for messages (its id once it has left the table).
fn name(t: &Table, w: WorkerId) -> String {
    t.get(w).map_or_else(|| w.to_string(), |x| x.name.clone())
}

/// No decode worker had room for the request in time.
fn no_room(cx: &Cx<'_>) -> ApiError {
    ApiError::Unavailable(if cx.table.count(Pool::Decode) == 0 {
        "no decode worker has joined the cluster".into()
    } else {
        let wait = cx.settings.admission_wait;
        format!("no decode worker had room for the request within {wait:?}")
    })
}

/// What the routing policy needs of a prompt: its blocks' names (under the `kv` policy) and
/// the tokens a prefill would compute.
fn route(cx: &Cx<'_>, prompt: &[u32], root: u64) -> Route {
    let known = &prompt[..prompt.len().saturating_sub(1)];
    let blocks = match cx.table.policy() {
        Policy::Kv => {
            let bs = cx.table.block_size();
            engine::block_hash::prompt_hashes(cx.settings.block_seed, root, bs, known)
        }
        _ => Vec::new(),
    };
    Route {
        blocks,
        prompt_tokens: known.len(),
        peer_blocks: 0,
    }
}
