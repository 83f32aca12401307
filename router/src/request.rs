//! One request's life in the router, as an explicit state machine:
//!
//! ```text
//! Reserving ─► Prefilling ─► Decoding ─► Done
//!  ▲  │            │  prefill or KV lost      ▲
//!  │  │            └──────► Recomputing ──────┘
//!  │  └─ colocated (no prefill pool) ─► Decoding
//!  └── Migrating ◄── the decode worker died, froze or stalled (Prefilling, Decoding)
//! any phase ─► Failed (the error goes to the client) | Gone (the client went away)
//! ```
//!
//! A migration resumes the request on another decode worker from its prompt plus the tokens
//! already streamed (the sampler's draws depend on the seed and the position only, so greedy
//! and seeded output continue exactly), up to `[router] migration_limit` times; the client sees
//! one stream.
//!
//! Each phase is one small async function returning the next phase. Waiting for a decode worker
//! with room waits on the registry's change channel (joins, heartbeats, requests done), never
//! on a timer; every wait has a deadline. Failures are typed ([`proto::Cause`]): a transfer
//! that broke leads to `Recomputing`, an unreachable worker is dropped from the registry, a
//! bad request is the client's 400. When the client goes away, or the request is recomputed,
//! the workers are told to release it (`Worker.Cancel`), besides the dropped calls.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{FinishReason, SamplingParams};
use proto::grpc::decode_client::DecodeClient;
use proto::grpc::prefill_client::PrefillClient;
use proto::grpc::worker_client::WorkerClient;
use proto::grpc::{self, generate_event, GenerateEvent, GenerateRequest, PrefillRequest};
use proto::{Cause, Pool};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::{Status, Streaming};

use crate::openai::ApiError;
use crate::registry::{InFlight, Picked, Route, Worker};
use crate::routing::Policy;
use crate::State;

/// A generated token as the decode worker sent it.
#[derive(Debug, Clone, PartialEq)]
pub struct Token {
    /// The token id.
    pub id: u32,
    /// On the last token, why generation ended.
    pub finish: Option<FinishReason>,
    /// Its log-probabilities, when the request asked for them.
    pub logprobs: Option<engine::sampler::TokenLogprobs>,
    /// On the first token, when the request asked for them: the log-probabilities of the prompt
    /// tokens after the first.
    pub prompt_logprobs: Vec<engine::sampler::TokenLogprobs>,
    /// The decode worker's wall clock as it sent the token, µs since the Unix epoch (0: not
    /// stamped).
    pub sent_unix_us: u64,
}

/// A generated token, or why the stream failed.
pub type TokenResult = Result<Token, ApiError>;

/// How long a decode worker may take to accept (and reserve for) a request.
const OPEN_WAIT: Duration = Duration::from_secs(10);
/// How long a `Cancel` to a worker may take.
const CANCEL_WAIT: Duration = Duration::from_secs(2);

/// Where a request is.
#[derive(Debug)]
pub enum Phase {
    /// Finding a decode worker that accepts it (and, for a remote prefill, reserves its KV
    /// blocks), waiting for room up to [`State::admission_wait`].
    Reserving,
    /// A prefill worker computes the prompt and sends its KV to the decode worker.
    Prefilling,
    /// The decode worker streams tokens.
    Decoding,
    /// The prefill or its KV failed before any token: the decode worker computes the whole
    /// prompt itself.
    Recomputing(ApiError),
    /// The decode worker is lost (died, frozen, stalled): the request goes on elsewhere.
    Migrating(ApiError),
    /// The last token went to the client.
    Done,
    /// The request failed; the error goes to the client.
    Failed(ApiError),
    /// The client went away.
    Gone,
}

impl Phase {
    /// The phase's name (metrics label, traces).
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Reserving => "reserving",
            Phase::Prefilling => "prefilling",
            Phase::Decoding => "decoding",
            Phase::Recomputing(_) => "recomputing",
            Phase::Migrating(_) => "migrating",
            Phase::Done => "done",
            Phase::Failed(_) => "failed",
            Phase::Gone => "gone",
        }
    }
}

/// A request under way: its first output (a token or the error), the rest of its tokens, and
/// the phases it goes through (known when it ends).
pub struct Started {
    /// The first token, or why there is none.
    pub first: TokenResult,
    /// The decode worker that produced the first token.
    pub decode_worker: Option<u64>,
    /// The tokens after the first.
    pub rest: mpsc::Receiver<TokenResult>,
    /// The phases the request went through, in order.
    pub phases: JoinHandle<Vec<&'static str>>,
}

/// Whether the prompt's KV may come from the prefill pool: there is one, and the request needs
/// neither the prompt's log-probabilities (the decode worker computes those, whole) nor a
/// prompt too short to split.
fn disaggregate(state: &State, prompt: &[u32], params: &SamplingParams) -> bool {
    prompt.len() >= 2 && params.prompt_logprobs.is_none() && state.registry.count(Pool::Prefill) > 0
}

/// Starts `prompt`; returns once its first token (or error) is known, so that errors before
/// any output can still become an HTTP status.
pub async fn start(state: &Arc<State>, prompt: Vec<u32>, params: &SamplingParams) -> Started {
    start_on(state, prompt, params, None).await
}

/// [`start`], on decode worker `pin` while it is in the registry, prefilling there (the other
/// choices of an `n > 1` request go where the first one's prompt KV is cached).
pub async fn start_on(
    state: &Arc<State>,
    prompt: Vec<u32>,
    params: &SamplingParams,
    pin: Option<u64>,
) -> Started {
    let (tx, mut rest) = mpsc::channel(64);
    let route = route(state, &prompt);
    let now = Instant::now();
    let first_worker = Arc::new(std::sync::Mutex::new(None));
    let run = Request {
        route,
        id: state.next_request_id(),
        disaggregated: pin.is_none() && disaggregate(state, &prompt, params),
        pin,
        worker_seen: first_worker.clone(),
        state: state.clone(),
        prompt_len: prompt.len(),
        prompt,
        params: params.into(),
        tx,
        arrived: now,
        admit_by: now + state.admission_wait,
        migrations: 0,
        avoid: Vec::new(),
        max_tokens: params.max_tokens.map_or(0, |m| m as u32),
        streamed: Vec::new(),
        stream_from: 0,
        reserved: None,
        prefilled: None,
        decode: None,
        stream: None,
        prefill: None,
        recomputed: false,
        tokens: 0,
        last_token: None,
    };
    let phases = tokio::spawn(run.run());
    let first = rest.recv().await.unwrap_or_else(|| {
        Err(ApiError::Internal(
            "the request ended without output".into(),
        ))
    });
    let decode_worker = *first_worker.lock().expect("worker lock");
    Started {
        first,
        decode_worker,
        rest,
        phases,
    }
}

/// A decode stream just opened, and the worker's reservation for a remote prefill.
type Opened = (Streaming<GenerateEvent>, Option<grpc::Reservation>);

/// A running prefill: its worker and the call (its own task, so that it completes and is
/// counted even when the decode stream runs ahead of its reply).
struct PrefillCall {
    worker: Worker,
    task: JoinHandle<Result<grpc::PrefillReply, Status>>,
}

/// What the routing policy needs of a prompt: its blocks' names (under the `kv` policy) and
/// the tokens a prefill would compute.
fn route(state: &State, prompt: &[u32]) -> Route {
    let known = &prompt[..prompt.len().saturating_sub(1)];
    let blocks = match state.registry.policy() {
        Policy::Kv => {
            let bs = state.registry.block_size();
            engine::block_hash::prompt_hashes(state.block_seed, bs, known)
        }
        _ => Vec::new(),
    };
    Route {
        blocks,
        prompt_tokens: known.len(),
    }
}

struct Request {
    route: Route,
    state: Arc<State>,
    id: u64,
    /// The prompt, followed (after a migration) by the tokens streamed before it.
    prompt: Vec<u32>,
    /// The client's prompt's length.
    prompt_len: usize,
    params: grpc::SamplingParams,
    /// Whether the prompt goes to the prefill pool (unless it must be recomputed).
    disaggregated: bool,
    /// The decode worker to use while it is in the registry.
    pin: Option<u64>,
    /// The decode worker reserved on, for [`Started::decode_worker`].
    worker_seen: Arc<std::sync::Mutex<Option<u64>>>,
    tx: mpsc::Sender<TokenResult>,
    arrived: Instant,
    /// The admission deadline (from arrival, or from the last migration).
    admit_by: Instant,
    /// Migrations so far, and the decode workers the request left.
    migrations: u32,
    avoid: Vec<u64>,
    /// The client's `max_tokens` (0: none).
    max_tokens: u32,
    /// Every token sent to the client, and how many of them came before the current decode
    /// stream opened.
    streamed: Vec<u32>,
    stream_from: usize,
    reserved: Option<Instant>,
    /// When the prefill call answered (the KV is in the decode worker's cache).
    prefilled: Option<Instant>,
    decode: Option<(Worker, InFlight)>,
    stream: Option<Streaming<GenerateEvent>>,
    prefill: Option<PrefillCall>,
    recomputed: bool,
    tokens: usize,
    last_token: Option<Instant>,
}

impl Request {
    async fn run(mut self) -> Vec<&'static str> {
        let mut trace = Vec::new();
        let mut phase = Phase::Reserving;
        let deadline = tokio::time::Instant::from_std(self.arrived + self.state.request_timeout);
        loop {
            trace.push(phase.name());
            metrics::counter!("tandem_router_request_phases_total", "phase" => phase.name())
                .increment(1);
            phase = match phase {
                Phase::Done => break,
                Phase::Failed(e) => {
                    let _ = self.tx.send(Err(e)).await;
                    break;
                }
                Phase::Gone => {
                    self.release_everywhere();
                    break;
                }
                p => match tokio::time::timeout_at(deadline, self.advance(p)).await {
                    Ok(next) => next,
                    Err(_) => {
                        self.release_everywhere();
                        let t = self.state.request_timeout;
                        Phase::Failed(ApiError::Timeout(format!(
                            "the request did not finish within {t:?} (request_timeout_ms)"
                        )))
                    }
                },
            };
        }
        tracing::debug!(request = self.id, phases = ?trace, "request ended");
        trace
    }

    /// Runs one phase to the next.
    async fn advance(&mut self, phase: Phase) -> Phase {
        match phase {
            Phase::Reserving => self.reserve().await,
            Phase::Prefilling => self.prefilling().await,
            Phase::Decoding => self.decoding().await,
            Phase::Recomputing(why) => self.recompute(why).await,
            Phase::Migrating(why) => self.migrate(why),
            end @ (Phase::Done | Phase::Failed(_) | Phase::Gone) => end,
        }
    }

    fn remote(&self) -> bool {
        self.disaggregated && !self.recomputed
    }

    fn decode_worker(&self) -> &Worker {
        &self.decode.as_ref().expect("reserved on a decode worker").0
    }

    /// Reserving: the least-loaded decode worker that accepts. A worker that refused for room
    /// is asked again only once it has sent a heartbeat since (news of its load); one that is
    /// unreachable is dropped from the registry. With nobody to ask, the request waits for the
    /// registry to change, up to the admission deadline.
    async fn reserve(&mut self) -> Phase {
        let deadline = tokio::time::Instant::from_std(self.admit_by);
        let mut changes = self.state.registry.subscribe();
        let mut refused: HashMap<u64, Instant> = HashMap::new();
        let mut waiting = None;
        loop {
            let workers = self.state.registry.workers();
            let mut stale: Vec<u64> = workers
                .iter()
                .filter(|w| refused.get(&w.id).is_some_and(|&at| w.last_beat() <= at))
                .map(|w| w.id)
                .collect();
            stale.extend(&self.avoid);
            if let Some(p) = self.pin.filter(|p| workers.iter().any(|w| w.id == *p)) {
                stale.extend(workers.iter().map(|w| w.id).filter(|&id| id != p));
            }
            // Not a worker held for the oldest request waiting for room (unless it is this one).
            stale.extend(self.kept_off(&workers));
            let picked = self.state.registry.pick(Pool::Decode, &stale, &self.route);
            if let Some(Picked {
                worker: w, guard, ..
            }) = picked
            {
                match self.open(&w).await {
                    Ok(opened) => return self.reserved(w, guard, opened),
                    Err(s) => match Cause::of(&s) {
                        Cause::BadRequest => {
                            return Phase::Failed(ApiError::BadRequest(s.message().into()))
                        }
                        Cause::Unreachable | Cause::Engine => {
                            tracing::warn!(worker = w.id, "decode worker failed: {s}");
                            self.state.registry.remove(w.id);
                        }
                        Cause::Full | Cause::Draining | Cause::KvTransfer => {
                            refused.insert(w.id, Instant::now());
                        }
                    },
                }
                continue;
            }
            waiting.get_or_insert_with(|| WaitingForRoom::new(self));
            tokio::select! {
                _ = self.tx.closed() => return Phase::Gone,
                r = tokio::time::timeout_at(deadline, changes.changed()) => {
                    if r.is_err() {
                        return Phase::Failed(self.no_room());
                    }
                }
            }
        }
    }

    /// The decode worker the line of requests waiting for room holds for another, if any.
    fn kept_off(&self, workers: &[Worker]) -> Option<u64> {
        let free: Vec<(u64, u32)> = workers
            .iter()
            .filter(|w| w.pool == Pool::Decode && !w.draining && !w.stalled)
            .map(|w| (w.id, w.load.kv_blocks_free))
            .collect();
        let mut line = self.state.line.lock().expect("line lock");
        let holds = line.holds();
        let kept_off = line.kept_off(self.id, Instant::now(), &free);
        metrics::counter!("tandem_router_admission_holds_total").increment(line.holds() - holds);
        kept_off
    }

    fn no_room(&self) -> ApiError {
        ApiError::Unavailable(if self.state.registry.count(Pool::Decode) == 0 {
            "no decode worker has joined the cluster".into()
        } else {
            let wait = self.state.admission_wait;
            format!("no decode worker had room for the request within {wait:?}")
        })
    }

    /// Opens the request's stream on decode worker `w`: with a remote prefill, once the worker
    /// has reserved the request's blocks (and said how much of the prompt it holds).
    async fn open(&self, w: &Worker) -> Result<Opened, Status> {
        let req = GenerateRequest {
            request_id: self.id,
            prompt: self.prompt.clone(),
            params: Some(self.params.clone()),
            remote_prefill: self.remote(),
            local_prefill_max_tokens: self.local_max(w),
        };
        let channel = self.state.channel(&w.endpoint)?;
        let remote = self.remote();
        let open = async move {
            let mut s = DecodeClient::new(channel).generate(req).await?.into_inner();
            if !remote {
                return Ok((s, None));
            }
            match s.message().await? {
                Some(GenerateEvent {
                    event: Some(generate_event::Event::Reserved(r)),
                    ..
                }) => Ok((s, Some(r))),
                other => {
                    let m = format!("expected a reservation, got {other:?}");
                    Err(Cause::Engine.status(m))
                }
            }
        };
        tokio::time::timeout(OPEN_WAIT, open)
            .await
            .unwrap_or_else(|_| {
                Err(Cause::Unreachable.status(format!(
                    "decode worker {} did not accept the request within {OPEN_WAIT:?}",
                    w.name
                )))
            })
    }

    /// Up to how many uncached prompt tokens decode worker `w` should prefill itself: a short
    /// suffix always (`local_prefill_max_tokens`); more, up to `local_prefill_busy_max_tokens`,
    /// while it would compute them sooner than the prefill pool could start on them (at the
    /// prefill worker's rate, or the decode worker's own where it measured one).
    fn local_max(&self, w: &Worker) -> u32 {
        let short = self.state.local_prefill_max_tokens;
        let cap = self.state.local_prefill_busy_max_tokens;
        if !self.remote() || cap == 0 {
            return short;
        }
        let Some((wait, prefill_rate)) = self.state.registry.prefill_wait() else {
            return short;
        };
        let rate = match w.load.prompt_tokens_per_s as f64 {
            r if r > 0.0 => r,
            _ => prefill_rate,
        };
        let sooner = (wait.as_secs_f64() * rate) as u32;
        short.max(sooner.min(cap))
    }

    /// Why a remote-capable request is prefilled where it is, from the decode worker's
    /// reservation.
    fn decision(&self, r: &grpc::Reservation) -> &'static str {
        let uncached = (self.prompt.len() - 1).saturating_sub(r.cached_tokens as usize);
        match r.local {
            false => "remote",
            true if uncached <= self.state.local_prefill_max_tokens as usize => {
                "local: short suffix"
            }
            true => "local: prefill pool busy",
        }
    }

    fn reserved(&mut self, w: Worker, guard: InFlight, (stream, r): Opened) -> Phase {
        let now = Instant::now();
        self.reserved = Some(now);
        let mut window = self.state.signals.admission.lock().expect("window lock");
        window.record(now, now - self.arrived);
        drop(window);
        *self.worker_seen.lock().expect("worker lock") = Some(w.id);
        self.decode = Some((w, guard));
        self.stream = Some(stream);
        self.stream_from = self.streamed.len();
        let decision = match &r {
            Some(r) => self.decision(r),
            None if !self.state.disaggregated => return Phase::Decoding,
            None if self.prompt.len() < 2 => "local: short suffix",
            None if self.params.prompt_logprobs => "local: prompt logprobs",
            None => "local: no prefill worker",
        };
        metrics::counter!("tandem_router_prefill_decisions_total", "decision" => decision)
            .increment(1);
        match r {
            Some(r) if !r.local => self.start_prefill(r.cached_tokens),
            _ => Phase::Decoding,
        }
    }

    /// Sends the prompt (less its last token) to the least-loaded prefill worker, whose KV goes
    /// straight to the decode worker — all but the first `skip` tokens, which it holds.
    fn start_prefill(&mut self, skip: u32) -> Phase {
        let picked = self.state.registry.pick(Pool::Prefill, &[], &self.route);
        let Some(Picked {
            worker: pw, guard, ..
        }) = picked
        else {
            return Phase::Recomputing(ApiError::Unavailable(
                "no prefill worker has joined the cluster".into(),
            ));
        };
        let channel = match self.state.channel(&pw.endpoint) {
            Ok(c) => c,
            Err(s) => return Phase::Recomputing(ApiError::Internal(s.message().into())),
        };
        let req = PrefillRequest {
            request_id: self.id,
            tokens: self.prompt[..self.prompt.len() - 1].to_vec(),
            offers: self.decode_worker().offers.clone(),
            skip_tokens: skip,
        };
        let pending = self.state.signals.prefill_started(req.tokens.len() as u64);
        let (registry, id) = (self.state.registry.clone(), pw.id);
        let task = tokio::spawn(async move {
            let (_guard, _pending) = (guard, pending);
            let reply = match PrefillClient::new(channel).prefill(req).await {
                Ok(r) => r.into_inner(),
                Err(s) => {
                    // Counted even when the request no longer waits for it (its KV arrived
                    // first and its reply was lost on the way).
                    metrics::counter!("tandem_router_prefill_call_failures_total").increment(1);
                    return Err(s);
                }
            };
            registry.record_transfer(id, &reply);
            record_transfer(&reply);
            Ok(reply)
        });
        self.prefill = Some(PrefillCall { worker: pw, task });
        Phase::Prefilling
    }

    /// Prefilling: until the prefill answers, a token arrives, either fails, or the decode
    /// worker is lost.
    async fn prefilling(&mut self) -> Phase {
        let registry = self.state.registry.clone();
        let decode_id = self.decode_worker().id;
        let call = self.prefill.as_mut().expect("a prefill runs");
        let stream = self.stream.as_mut().expect("a decode stream is open");
        tokio::select! {
            _ = self.tx.closed() => Phase::Gone,
            _ = registry.lost(decode_id) => self.lost(),
            r = &mut call.task => match r {
                Ok(Ok(reply)) => {
                    self.prefill = None;
                    self.prefilled = Some(Instant::now());
                    tracing::debug!(request = self.id, kv_bytes = reply.kv_bytes, transport = %reply.transport, "prefill done");
                    Phase::Decoding
                }
                // The call stays recorded: recomputing tells its worker to release it too.
                Ok(Err(s)) => Phase::Recomputing(self.prefill_failed(s)),
                Err(e) => Phase::Recomputing(ApiError::Internal(format!("prefill task failed: {e}"))),
            },
            m = stream.message() => match self.on_message(m).await {
                // The KV arrived before the prefill's reply did; the call finishes on its own.
                Ok(None) => Phase::Decoding,
                Ok(Some(end)) => end,
                Err(s) => self.decode_failed(s),
            },
        }
    }

    /// Decoding: relays tokens until the last one. A decode worker that is lost (silent, or
    /// stalled), or that lets the stall timeout pass without a token once it has sent one, is
    /// left: the request migrates.
    async fn decoding(&mut self) -> Phase {
        let registry = self.state.registry.clone();
        let lost = registry.lost(self.decode_worker().id);
        tokio::pin!(lost);
        loop {
            let stall = self
                .last_token
                .filter(|_| self.streamed.len() > self.stream_from)
                .map(|t| tokio::time::Instant::from_std(t + registry.liveness.stall));
            let stream = self.stream.as_mut().expect("a decode stream is open");
            let m = tokio::select! {
                _ = self.tx.closed() => return Phase::Gone,
                _ = &mut lost => return self.lost(),
                _ = sleep_until(stall) => return self.stalled(),
                m = stream.message() => m,
            };
            match self.on_message(m).await {
                Ok(None) => {}
                Ok(Some(end)) => return end,
                Err(s) => return self.decode_failed(s),
            }
        }
    }

    /// A message of the decode stream: a token passed on (`None`: more follow), the end, or a
    /// failure.
    async fn on_message(
        &mut self,
        m: Result<Option<GenerateEvent>, Status>,
    ) -> Result<Option<Phase>, Status> {
        let name = &self.decode_worker().name;
        let token = match m? {
            Some(GenerateEvent {
                event: Some(generate_event::Event::Token(t)),
                finish,
                logprobs,
                prompt_logprobs,
                sent_unix_us,
            }) => Token {
                sent_unix_us,
                id: t,
                finish: FinishReason::from_wire(finish),
                logprobs: logprobs.map(Into::into),
                prompt_logprobs: prompt_logprobs.into_iter().map(Into::into).collect(),
            },
            Some(other) => {
                let m = format!("unexpected event from decode worker {name}: {other:?}");
                return Ok(Some(Phase::Failed(ApiError::Upstream(m))));
            }
            None => {
                let m =
                    format!("decode worker {name} ended the stream before the request finished");
                return Ok(Some(Phase::Migrating(ApiError::Upstream(m))));
            }
        };
        self.record_token();
        self.streamed.push(token.id);
        let finish = token.finish;
        if self.tx.send(Ok(token)).await.is_err() {
            return Ok(Some(Phase::Gone));
        }
        Ok(finish.map(|_| Phase::Done))
    }

    /// The planner's signals: the prefill pool's share of TTFT, and token gaps.
    fn record_token(&mut self) {
        let now = Instant::now();
        let signals = &self.state.signals;
        if self.last_token.is_none() {
            self.record_ttft_phases(now);
        }
        match (self.last_token, self.reserved) {
            (None, Some(reserved)) if self.disaggregated => {
                let mut w = signals.prefill_ttft.lock().expect("window lock");
                w.record(now, now - reserved);
            }
            (None, _) => {}
            (Some(prev), _) => signals
                .itl
                .lock()
                .expect("window lock")
                .record(now, now - prev),
        }
        self.last_token = Some(now);
        self.tokens += 1;
    }

    /// Where a first try's time to first token went (`tandem_router_ttft_phase_seconds`):
    /// finding a decode worker that reserved it (`admission`), the prefill pool's part until
    /// its KV is in the decode worker's cache (`prefill`: queue, compute, transfer, admission;
    /// remote prefills only), and from there to the first token (`first_token`: the decode
    /// worker's next step, or its own prefill, and the token's way back). Migrated and
    /// recomputed requests are left out: their phases overlap.
    fn record_ttft_phases(&self, now: Instant) {
        let Some(reserved) = self
            .reserved
            .filter(|_| self.migrations == 0 && !self.recomputed)
        else {
            return;
        };
        let phase = |name: &'static str, d: Duration| {
            metrics::histogram!("tandem_router_ttft_phase_seconds", "phase" => name).record(d)
        };
        phase("admission", reserved - self.arrived);
        // Sent to a prefill worker (not prefilled where it was reserved). A token can overtake
        // the prefill's reply (the reply follows the decode worker's ack).
        let sent = self.prefill.is_some() || self.prefilled.is_some();
        let kv = match sent {
            true => self.prefilled.map_or(now, |p| p.min(now)),
            false => reserved,
        };
        if sent {
            phase("prefill", kv - reserved);
        }
        phase("first_token", now - kv);
    }

    fn prefill_failed(&self, s: Status) -> ApiError {
        let pw = &self.prefill.as_ref().expect("a prefill ran").worker;
        if Cause::of(&s) == Cause::Unreachable {
            tracing::warn!(worker = pw.id, "prefill worker failed: {s}");
            self.state.registry.remove(pw.id);
        }
        ApiError::Upstream(format!(
            "prefill on worker {} failed: {}",
            pw.name,
            s.message()
        ))
    }

    fn decode_failed(&mut self, s: Status) -> Phase {
        let cause = Cause::of(&s);
        let (id, name) = (self.decode_worker().id, self.decode_worker().name.clone());
        if cause == Cause::KvTransfer && self.remote() && self.streamed.len() == self.stream_from {
            // The decode worker gave up on the KV (the transfer broke or its lease ran out)
            // before any token: recompute there, whatever the prefill says.
            return Phase::Recomputing(ApiError::Upstream(s.message().into()));
        }
        if matches!(cause, Cause::Unreachable | Cause::Engine) {
            self.state.registry.remove(id);
            let why = format!("decode worker {name} failed: {}", s.message());
            return Phase::Migrating(ApiError::Upstream(why));
        }
        Phase::Failed(match cause {
            Cause::BadRequest => ApiError::BadRequest(s.message().into()),
            _ => ApiError::Upstream(format!("decode worker {name} failed: {}", s.message())),
        })
    }

    /// The decode worker stopped heartbeating or is stalled.
    fn lost(&self) -> Phase {
        let w = self.decode_worker();
        let wait = self.state.registry.liveness.heartbeat;
        Phase::Migrating(ApiError::Upstream(format!(
            "decode worker {} stopped making progress (no heartbeat for {wait:?}, or stalled)",
            w.name
        )))
    }

    /// No token from the decode worker within the stall timeout: it is marked stalled.
    fn stalled(&self) -> Phase {
        let w = self.decode_worker();
        self.state.registry.set_stalled(w.id);
        let stall = self.state.registry.liveness.stall;
        Phase::Migrating(ApiError::Upstream(format!(
            "decode worker {} sent no token for {stall:?}",
            w.name
        )))
    }

    /// Migrating: leaves the decode worker and starts over from Reserving with the prompt plus
    /// every token streamed, the rest of `max_tokens`, a new id and a new admission deadline —
    /// unless the request has been migrated `migration_limit` times already.
    fn migrate(&mut self, why: ApiError) -> Phase {
        let limit = self.state.migration_limit;
        if self.migrations >= limit {
            return Phase::Failed(ApiError::Upstream(format!(
                "{why}; not migrated again (migration_limit = {limit})"
            )));
        }
        let left = self.decode_worker().id;
        tracing::warn!(
            request = self.id,
            tokens = self.streamed.len(),
            "{why}; migrating"
        );
        metrics::counter!("tandem_router_migrations_total").increment(1);
        self.release_everywhere();
        self.decode = None;
        self.migrations += 1;
        self.avoid.push(left);
        self.prompt.truncate(self.prompt_len);
        self.prompt.extend(&self.streamed);
        // The streamed tokens are output to the penalties and min_tokens, prompt to the KV.
        self.params.generated = self.streamed.len() as u32;
        // The prompt's log-probabilities went out with the first token.
        self.params.prompt_logprobs &= self.streamed.is_empty();
        if self.max_tokens > 0 {
            // Not finished, so fewer tokens than asked for were streamed.
            self.params.max_tokens = self.max_tokens - self.streamed.len() as u32;
        }
        self.route = route(&self.state, &self.prompt);
        self.recomputed = false;
        self.disaggregated =
            !self.params.prompt_logprobs && self.state.registry.count(Pool::Prefill) > 0;
        self.id = self.state.next_request_id();
        self.admit_by = Instant::now() + self.state.admission_wait;
        Phase::Reserving
    }

    /// Recomputing: the whole prompt on the decode worker, under a new id; the old request
    /// is released on both workers.
    async fn recompute(&mut self, why: ApiError) -> Phase {
        let w = self.decode_worker().clone();
        tracing::warn!("{why}; recomputing the prompt on decode worker {}", w.name);
        metrics::counter!("tandem_kv_transfer_failures_total").increment(1);
        self.release_everywhere();
        self.recomputed = true;
        self.id = self.state.next_request_id();
        match self.open(&w).await {
            Ok((s, _)) => {
                self.stream = Some(s);
                self.stream_from = self.streamed.len();
                Phase::Decoding
            }
            Err(s) => {
                let failed = format!(
                    "{why}; recomputing on decode worker {} ({}) failed too: {}",
                    w.name,
                    w.endpoint,
                    s.message()
                );
                if !matches!(Cause::of(&s), Cause::Unreachable | Cause::Engine) {
                    return Phase::Failed(ApiError::Upstream(failed));
                }
                // The decode worker is gone as well: elsewhere, as a migration.
                self.state.registry.remove(w.id);
                Phase::Migrating(ApiError::Upstream(failed))
            }
        }
    }

    /// Drops the request's calls and tells its workers to release it.
    fn release_everywhere(&mut self) {
        self.stream = None;
        if let Some(p) = self.prefill.take() {
            p.task.abort();
            self.cancel_on(&p.worker);
        }
        if let Some((w, _)) = &self.decode {
            self.cancel_on(w);
        }
    }

    fn cancel_on(&self, w: &Worker) {
        let Ok(channel) = self.state.channel(&w.endpoint) else {
            return;
        };
        let request_id = self.id;
        tokio::spawn(async move {
            let mut client = WorkerClient::new(channel);
            let call = client.cancel(grpc::CancelRequest { request_id });
            let _ = tokio::time::timeout(CANCEL_WAIT, call).await;
        });
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn record_transfer(r: &grpc::PrefillReply) {
    let t = r.transport.clone();
    metrics::counter!("tandem_kv_transfers_total", "transport" => t.clone()).increment(1);
    // The negotiation's reason as a label: a fallback from a preferred transport is visible in
    // metrics, not only in a worker's log.
    metrics::counter!("tandem_kv_transport_chosen_total", "transport" => t.clone(), "why" => r.transport_reason.clone())
        .increment(1);
    metrics::counter!("tandem_kv_transfer_bytes_total", "transport" => t.clone())
        .increment(r.kv_bytes);
    metrics::histogram!("tandem_kv_exposed_wait_seconds", "transport" => t)
        .record(r.transfer_us as f64 / 1e6);
}

/// A request waiting for a decode worker with room: in the line, and counted for the planner,
/// while it lives.
struct WaitingForRoom(Arc<State>, u64);

impl WaitingForRoom {
    fn new(r: &Request) -> WaitingForRoom {
        let state = &r.state;
        let waiting = &state.signals.decode_waiting;
        waiting.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let eligible = crate::admission::Eligible {
            pin: r.pin,
            avoid: r.avoid.clone(),
        };
        let mut line = state.line.lock().expect("line lock");
        line.join(r.id, Instant::now(), eligible);
        WaitingForRoom(state.clone(), r.id)
    }
}

impl Drop for WaitingForRoom {
    fn drop(&mut self) {
        let waiting = &self.0.signals.decode_waiting;
        waiting.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        self.0.line.lock().expect("line lock").leave(self.1);
    }
}
