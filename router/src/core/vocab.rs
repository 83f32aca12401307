//! The request core's vocabulary: the settings a request follows, its phases (each with what
//! it holds), what happens to it ([`Input`]), what its driver does next ([`Action`]), and the
//! names the router's metrics and the simulator's report count it by.

use std::sync::Arc;
use std::time::Duration;

use engine::FinishReason;
use proto::{Cause, Pool};
use types::{RequestId, WorkerId};

pub use super::table::PeerFetch;
use super::table::{InFlight, Table};
use crate::openai::ApiError;
use crate::planner::{PendingPrefill, Signals};

/// The router's settings a request follows (`[router]` of cluster.toml).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The cluster has a prefill pool (a request's prefill decision is counted).
    pub disaggregated: bool,
    /// A prompt whose uncached rest on its decode worker is at most this many tokens is
    /// prefilled there.
    pub local_prefill_max_tokens: u32,
    /// ... and, up to this many, while the decode worker would compute it sooner than the
    /// prefill pool could start on it (0: never).
    pub local_prefill_busy_max_tokens: u32,
    /// How many times a request may move to another decode worker when its own is lost.
    pub migration_limit: u32,
    /// How long a request may wait for a decode worker with room.
    pub admission_wait: Duration,
    /// How long a request may take from arrival to its last token.
    pub request_timeout: Duration,
    /// The seed of the model's KV block names (for the KV index).
    pub block_seed: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            disaggregated: true,
            local_prefill_max_tokens: 0,
            local_prefill_busy_max_tokens: 0,
            migration_limit: 1,
            admission_wait: crate::ADMISSION_WAIT,
            request_timeout: Duration::from_secs(600),
            block_seed: 0,
        }
    }
}

/// What a request reads and changes beside itself: the table of workers, the planner's
/// signals, the settings, and where new request ids come from (a recomputed or migrated
/// request gets a new one).
pub struct Cx<'a> {
    /// The workers.
    pub table: &'a mut Table,
    /// The planner's latency windows and prefill counts.
    pub signals: &'a Arc<Signals>,
    /// The router's settings.
    pub settings: &'a Settings,
    /// A fresh request id.
    pub next_id: &'a mut dyn FnMut() -> RequestId,
}

/// What the core follows of the client's sampling parameters (the driver sends the rest as
/// the client gave it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Tokens the current try may still generate (`None`: to the context's end).
    pub max_tokens: Option<u32>,
    /// The prompt's log-probabilities are wanted (computed on the decode worker, whole).
    pub prompt_logprobs: bool,
    /// Tokens of the prompt that are output already streamed (a migrated request's): output to
    /// the penalties and `min_tokens`, prompt to the KV.
    pub generated: u32,
    /// Where the prompt's block names start: [`engine::block_hash::root`] of its cache salt.
    pub cache_root: u64,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            max_tokens: None,
            prompt_logprobs: false,
            generated: 0,
            cache_root: engine::block_hash::ROOT,
        }
    }
}

/// A decode worker's answer to a reservation for a remote prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Prompt tokens it already holds (the prefill sends only the rest).
    pub cached_tokens: u32,
    /// It computes the rest itself.
    pub local: bool,
    /// The ticket its KV listeners require of the transfer (handed to the prefill worker).
    pub ticket: types::TransferTicket,
}

/// A worker a request is on, counted against it while held.
#[derive(Debug)]
pub struct Held {
    /// The worker.
    pub worker: WorkerId,
    _guard: InFlight,
}

impl Held {
    /// `worker`, counted by `guard`.
    pub(super) fn new(worker: WorkerId, guard: InFlight) -> Held {
        Held {
            worker,
            _guard: guard,
        }
    }
}

/// Where a request is, with what it holds.
#[derive(Debug)]
pub enum Phase {
    /// Finding a decode worker that accepts it (and, for a remote prefill, reserves its KV
    /// blocks). `asking`: the one whose answer is awaited; without one, the request waits for
    /// the table to change (a heartbeat, a join) until its admission deadline.
    Reserving {
        /// The decode worker asked.
        asking: Option<Held>,
        /// Workers that refused it for room, each once, with its heartbeat count at its last
        /// refusal: it is asked again only after its next heartbeat (news of its load).
        refused: Vec<(WorkerId, u64)>,
        /// In the line of requests waiting for room.
        waiting: bool,
    },
    /// A prefill worker computes the prompt and sends its KV to the decode worker.
    Prefilling {
        /// The decode worker reserved on.
        decode: Held,
        /// The prefill worker computing it.
        prefill: WorkerId,
    },
    /// The decode worker streams tokens.
    Decoding {
        /// The decode worker.
        decode: Held,
    },
    /// The prefill or its KV failed before any token: the decode worker's stream is opened
    /// again to compute the whole prompt itself.
    Recomputing {
        /// The decode worker.
        decode: Held,
        /// Why.
        why: ApiError,
    },
    /// The last token went to the client.
    Done,
    /// The request failed; the error went to the client.
    Failed,
    /// The client went away.
    Gone,
}

/// A phase's name: metrics labels, traces, and what the router and the simulator compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PhaseName {
    /// See [`Phase::Reserving`].
    Reserving,
    /// See [`Phase::Prefilling`].
    Prefilling,
    /// See [`Phase::Decoding`].
    Decoding,
    /// See [`Phase::Recomputing`].
    Recomputing,
    /// The decode worker was lost: back to Reserving elsewhere (or failed past the limit).
    Migrating,
    /// Leaving a decode worker live (draining, or its pool rebalanced): paused there, its KV
    /// handed to another decode worker, where it goes on exactly (see [`super::moving`]).
    Moving,
    /// See [`Phase::Done`].
    Done,
    /// See [`Phase::Failed`].
    Failed,
    /// See [`Phase::Gone`].
    Gone,
}

impl PhaseName {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            PhaseName::Reserving => "reserving",
            PhaseName::Prefilling => "prefilling",
            PhaseName::Decoding => "decoding",
            PhaseName::Recomputing => "recomputing",
            PhaseName::Migrating => "migrating",
            PhaseName::Moving => "moving",
            PhaseName::Done => "done",
            PhaseName::Failed => "failed",
            PhaseName::Gone => "gone",
        }
    }
}

impl Phase {
    /// Its name.
    pub fn name(&self) -> PhaseName {
        match self {
            Phase::Reserving { .. } => PhaseName::Reserving,
            Phase::Prefilling { .. } => PhaseName::Prefilling,
            Phase::Decoding { .. } => PhaseName::Decoding,
            Phase::Recomputing { .. } => PhaseName::Recomputing,
            Phase::Done => PhaseName::Done,
            Phase::Failed => PhaseName::Failed,
            Phase::Gone => PhaseName::Gone,
        }
    }

    /// The decode worker the request is on (reserved, prefilling, decoding, recomputing).
    pub fn decode_worker(&self) -> Option<WorkerId> {
        match self {
            Phase::Prefilling { decode, .. }
            | Phase::Decoding { decode }
            | Phase::Recomputing { decode, .. } => Some(decode.worker),
            _ => None,
        }
    }
}

/// Where a request's prompt was prefilled, as the router counts it
/// (`tandem_router_prefill_decisions_total{decision}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PrefillDecision {
    /// On a prefill worker, its KV sent to the decode worker.
    Remote,
    /// On the decode worker: the uncached rest was at most `local_prefill_max_tokens`.
    LocalShortSuffix,
    /// On the decode worker: sooner there than the prefill pool could start on it.
    LocalPrefillPoolBusy,
    /// On the decode worker: no prefill worker had joined.
    LocalNoPrefillWorker,
    /// On the decode worker: the prompt's log-probabilities need it whole there.
    LocalPromptLogprobs,
}

impl PrefillDecision {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            PrefillDecision::Remote => "remote",
            PrefillDecision::LocalShortSuffix => "local: short suffix",
            PrefillDecision::LocalPrefillPoolBusy => "local: prefill pool busy",
            PrefillDecision::LocalNoPrefillWorker => "local: no prefill worker",
            PrefillDecision::LocalPromptLogprobs => "local: prompt logprobs",
        }
    }
}

/// Why a prompt was recomputed on its decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Recompute {
    /// The prefill call failed, or the decode worker gave up on the KV (its lease lapsed, the
    /// transfer broke).
    TransferFailed,
    /// The prefill worker is unreachable or stopped making progress.
    PrefillWorkerLost,
    /// No prefill worker had joined when the prefill was due.
    NoPrefillWorker,
    /// A live move's handoff failed (the KV computed on the new decode worker instead).
    MoveFailed,
}

impl Recompute {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Recompute::TransferFailed => "recomputed: transfer failed",
            Recompute::PrefillWorkerLost => "recomputed: prefill worker lost",
            Recompute::NoPrefillWorker => "recomputed: no prefill worker",
            Recompute::MoveFailed => "recomputed: move failed",
        }
    }
}

/// Why a request moves off its decode worker live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MoveWhy {
    /// The worker drains (the planner removes it, or it was sent `SIGTERM`).
    Draining,
    /// The decode pool's KV is uneven: the fullest worker sheds sequences.
    Rebalance,
}

impl MoveWhy {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            MoveWhy::Draining => "draining",
            MoveWhy::Rebalance => "rebalance",
        }
    }
}

/// Where a first try's time to its first token went: finding a decode worker that reserved it,
/// the prefill pool's part until its KV was in the decode worker's cache (remote prefills
/// only), and from there to the first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtftPhases {
    /// Arrival to the reservation.
    pub admission: Duration,
    /// Reservation to the KV in the decode worker's cache (sent to a prefill worker only).
    pub prefill: Option<Duration>,
    /// From there to the first token.
    pub first_token: Duration,
}

/// What happened, for the driver to count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Note {
    /// The request entered a phase.
    Entered(PhaseName),
    /// Where its prompt is prefilled.
    Decided(PrefillDecision),
    /// A decode worker refused it for room (or draining, or KV it could not take).
    Refused,
    /// It left a lost decode worker for another.
    Migrated,
    /// It left a decode worker live, its KV handed on (not computed again).
    Moved(MoveWhy),
    /// A move found no room elsewhere in time: it resumed where it was paused.
    Stayed,
    /// Its prompt is recomputed on its decode worker.
    Recomputed(Recompute),
    /// The line's oldest request took a hold on a decode worker.
    Held,
    /// Whether its prefill worker fetches what its decode worker holds.
    PeerFetch(PeerFetch),
    /// A first try's first token came, and where its time went.
    Ttft(TtftPhases),
}

/// The path a request took, as its driver saw the core's notes: what the router and the
/// simulator compare.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// The phases it entered, in order.
    pub phases: Vec<PhaseName>,
    /// Where its prompt was prefilled, each try.
    pub decisions: Vec<PrefillDecision>,
    /// Refusals by decode workers.
    pub refusals: u32,
}

impl Trace {
    /// Keeps what `n` says of the path.
    pub fn note(&mut self, n: &Note) {
        match *n {
            Note::Entered(p) => self.phases.push(p),
            Note::Decided(d) => self.decisions.push(d),
            Note::Refused => self.refusals += 1,
            _ => {}
        }
    }
}

/// What the driver does next.
#[derive(Debug)]
pub enum Action {
    /// Open the request's stream on decode worker `worker`; with `remote`, the worker
    /// reserves its blocks first and answers with a [`Reservation`], computing the prompt
    /// itself when at most `local_max` of it is uncached there.
    Open {
        /// The decode worker.
        worker: WorkerId,
        /// A remote prefill follows.
        remote: bool,
        /// The most uncached prompt tokens it should compute itself.
        local_max: u32,
    },
    /// Send the prompt less its last token to prefill worker `worker`; its KV goes to
    /// `decode`, all but the first `skip` tokens (which that worker holds). The guards count
    /// the call on the worker and in the prefill pool's pending tokens until it ends.
    Prefill {
        /// The prefill worker.
        worker: WorkerId,
        /// Where its KV goes.
        decode: WorkerId,
        /// Tokens the decode worker holds already.
        skip: u32,
        /// The decode worker the prefill worker fetches the prompt's first blocks it lacks from
        /// (peer fetch: the request's, or another holding more) instead of computing them, and
        /// the tokens that worker holds.
        fetch: Option<(WorkerId, u32)>,
        /// The decode worker's ticket for the transfer.
        ticket: types::TransferTicket,
        /// Counts the call against the prefill worker.
        guard: InFlight,
        /// Counts its tokens as pending in the prefill pool.
        pending: PendingPrefill,
    },
    /// Drop the request's call on `worker` of `pool` and tell the worker to release `request`.
    Release {
        /// Which call: the prefill or the decode stream.
        pool: Pool,
        /// The worker.
        worker: WorkerId,
        /// The request id that worker knows it by.
        request: RequestId,
    },
    /// Ask decode worker `worker` to pause `request` for a live move (its stream then says
    /// [`Input::Paused`]; or [`Input::NotPaused`]).
    Pause {
        /// The decode worker.
        worker: WorkerId,
        /// The request id it knows.
        request: RequestId,
    },
    /// Keep the current decode stream (of `request`, paused) aside: it holds the paused KV
    /// until the handoff, and its [`Action::Release`] drops it. A new stream opens beside it.
    Park {
        /// The paused request's id.
        request: RequestId,
    },
    /// Have decode worker `from` send paused `request`'s KV to decode worker `decode`, which
    /// reserved the request (under its current id and prompt) and holds its first `skip`
    /// tokens; answered as a prefill is ([`Input::PrefillDone`], [`Input::PrefillFailed`]).
    Handoff {
        /// The decode worker it leaves.
        from: WorkerId,
        /// The id `from` knows it by.
        request: RequestId,
        /// The decode worker it goes to.
        decode: WorkerId,
        /// Tokens `decode` holds already.
        skip: u32,
        /// `decode`'s ticket for the transfer.
        ticket: types::TransferTicket,
    },
    /// Resume paused `request` on decode worker `worker` (a move that found no room): its
    /// parked stream is the request's stream again, and the worker steps it again.
    Resume {
        /// The decode worker.
        worker: WorkerId,
        /// The id it knows the request by.
        request: RequestId,
    },
    /// Forget a worker: it is unreachable or its engine failed.
    Remove(WorkerId),
    /// A decode worker made no progress: route nothing to it until its steps move again.
    MarkStalled(WorkerId),
    /// Pass the token just handed in on to the client.
    Emit,
    /// The request failed: this error goes to the client.
    Fail(ApiError),
    /// Something to count.
    Note(Note),
}

/// What happens to a request.
#[derive(Debug)]
pub enum Input {
    /// The table changed (a join, a heartbeat, a removal): a request waiting for room asks again.
    Changed,
    /// The decode worker asked accepted: its stream is open, with its reservation when a
    /// remote prefill follows.
    Opened(Option<Reservation>),
    /// The decode worker asked refused, or could not be reached.
    OpenFailed(Cause, String),
    /// The prefill call answered: the KV is in the decode worker's cache.
    PrefillDone,
    /// The prefill call failed.
    PrefillFailed(Cause, String),
    /// The prefill worker stopped heartbeating, was removed, or is stalled.
    PrefillLost,
    /// A token from the decode worker, the last one with its finish.
    Token {
        /// The token.
        id: u32,
        /// Set on the last one.
        finish: Option<FinishReason>,
    },
    /// The decode stream sent something other than a token.
    Unexpected(String),
    /// The decode stream ended before the last token.
    StreamEnded,
    /// The decode stream failed.
    DecodeFailed(Cause, String),
    /// The decode worker stopped heartbeating, was removed, or is stalled.
    DecodeLost,
    /// No token from the decode worker within the stall timeout.
    Stalled,
    /// The decode worker's pool ran out and preempted the request: it waits there for room and
    /// resumes on its own, so no token coming is no stall until it sends one again (a wedged
    /// engine still shows in its heartbeats' steps; the request's deadline still holds).
    Preempted,
    /// The decode worker is leaving (draining) or sheds sequences: move off it live, if
    /// another decode worker can take the request.
    Leave(MoveWhy),
    /// The decode worker paused the request after `generated` tokens of this stream.
    Paused {
        /// Tokens this stream carried.
        generated: u32,
    },
    /// The decode worker could not pause it (no longer decoding there).
    NotPaused,
    /// The admission deadline passed while waiting for room.
    AdmissionDeadline,
    /// The request's deadline (`request_timeout`) passed.
    Timeout,
    /// The client went away.
    ClientGone,
}
