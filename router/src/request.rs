//! One request's tokio driver. The request core ([`crate::core::Request`]) decides what
//! happens; this module does the I/O it asks for — opens the decode stream, calls the prefill
//! worker, tells workers to release a request — and feeds back what comes of it: a
//! reservation or a refusal, the prefill's answer, tokens, a worker lost, a deadline. Waiting
//! for a decode worker with room waits on the registry's change channel (joins, heartbeats,
//! removals), never on a timer; every wait has a deadline. When the client goes away, or the
//! request is recomputed or migrated, the workers are told to release it (`Worker.Cancel`),
//! besides the dropped calls.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{FinishReason, SamplingParams};
use proto::grpc::decode_client::DecodeClient;
use proto::grpc::prefill_client::PrefillClient;
use proto::grpc::worker_client::WorkerClient;
use proto::grpc::{self, generate_event, GenerateEvent, GenerateRequest, PrefillRequest};
use proto::{Cause, Pool};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::{Status, Streaming};
use types::{RequestId, WorkerId};

use crate::core::{self, Action, Cx, Input, Note, Phase, Trace};
use crate::openai::ApiError;
use crate::planner::PendingPrefill;
use crate::registry::{InFlight, Registry};
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

/// A request under way: its first output (a token or the error), the rest of its tokens, and
/// the phases it goes through (known when it ends).
pub struct Started {
    /// The first token, or why there is none.
    pub first: TokenResult,
    /// The decode worker that produced the first token.
    pub decode_worker: Option<WorkerId>,
    /// The tokens after the first.
    pub rest: mpsc::Receiver<TokenResult>,
    /// The path the request took: its phases, in order, its prefill decisions, its
    /// refusals (known when it ends).
    pub trace: JoinHandle<Trace>,
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
    pin: Option<WorkerId>,
) -> Started {
    let (tx, mut rest) = mpsc::channel(64);
    let seen = Arc::new(std::sync::Mutex::new(None));
    let core_params = core::Params {
        max_tokens: params.max_tokens.map(|m| m as u32),
        prompt_logprobs: params.prompt_logprobs.is_some(),
        generated: params.generated as u32,
        cache_root: engine::block_hash::root(params.cache_salt.as_deref()),
    };
    let changes = state.registry.subscribe();
    let (core, first) = with_cx(state, |cx| {
        core::Request::start(prompt, core_params, pin, Instant::now(), cx)
    });
    let deadline = core.deadline(&state.core);
    let driver = Driver {
        state: state.clone(),
        core,
        wire: crate::wire::sampling_params(params),
        tx,
        changes,
        stream: None,
        parked: None,
        prefill: None,
        token: None,
        known: HashMap::new(),
        seen: seen.clone(),
        trace: Trace::default(),
        deadline: Box::pin(tokio::time::sleep_until(deadline.into())),
        lost: Lost::default(),
        prefill_lost: Lost::default(),
        leaving: Leaving::default(),
    };
    let trace = tokio::spawn(driver.run(first));
    let first = rest.recv().await.unwrap_or_else(|| {
        Err(ApiError::Internal(
            "the request ended without output".into(),
        ))
    });
    let decode_worker = *seen.lock().expect("worker lock");
    Started {
        first,
        decode_worker,
        rest,
        trace,
    }
}

/// Runs `f` on the request core's view of the router: its table (locked meanwhile), signals,
/// settings and request ids.
fn with_cx<T>(state: &State, f: impl FnOnce(&mut Cx<'_>) -> T) -> T {
    state.registry.with(|table| {
        let mut next_id = || RequestId(state.next_request_id());
        let mut cx = Cx {
            table,
            signals: &state.signals,
            settings: &state.core,
            next_id: &mut next_id,
        };
        f(&mut cx)
    })
}

/// A running prefill call (its own task, so that it completes and is counted even when the
/// decode stream runs ahead of its reply).
struct PrefillCall {
    task: JoinHandle<Result<grpc::PrefillReply, Status>>,
}

/// Where a worker the request used is reached, kept for releasing the request there even
/// after the worker has left the registry.
#[derive(Clone)]
struct Known {
    name: String,
    endpoint: String,
    offers: Vec<grpc::KvOffer>,
    /// Where it serves the KV it holds to prefill workers (empty: it does not).
    peer: String,
}

struct Driver {
    state: Arc<State>,
    core: core::Request,
    /// The client's sampling parameters as sent (the core's own overlaid on each open).
    wire: grpc::SamplingParams,
    tx: mpsc::Sender<TokenResult>,
    changes: watch::Receiver<u64>,
    stream: Option<Streaming<GenerateEvent>>,
    /// A moving request's stream on the decode worker it leaves (by the id that worker knows):
    /// it holds the paused sequence there until the handoff is done.
    parked: Option<(RequestId, Streaming<GenerateEvent>)>,
    prefill: Option<PrefillCall>,
    /// The token handed to the core, passed on at its `Emit`.
    token: Option<Token>,
    known: HashMap<WorkerId, Known>,
    /// The decode worker reserved on, for [`Started::decode_worker`].
    seen: Arc<std::sync::Mutex<Option<WorkerId>>>,
    trace: Trace,
    /// The request's deadline (`request_timeout`).
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// Whether the decode worker, and the prefill worker while prefilling, are lost: kept
    /// across tokens (one watch a worker, not one a token).
    lost: Lost,
    prefill_lost: Lost,
    /// Whether the decode worker is leaving (draining): once a worker.
    leaving: Leaving,
}

/// The loss of one worker, watched for as long as the request is on it.
#[derive(Default)]
struct Lost(Option<(WorkerId, Pin<Box<dyn Future<Output = ()> + Send>>)>);

impl Lost {
    /// Resolves when `worker` is lost (never without one); the watch carries over while the
    /// worker stays the same.
    async fn watch(&mut self, worker: Option<WorkerId>, registry: &Arc<Registry>) {
        let Some(w) = worker else {
            self.0 = None;
            return std::future::pending().await;
        };
        if self.0.as_ref().is_none_or(|(x, _)| *x != w) {
            let registry = registry.clone();
            self.0 = Some((w, Box::pin(async move { registry.lost(w).await })));
        }
        let (_, lost) = self.0.as_mut().expect("set above");
        lost.as_mut().await;
        self.0 = None;
    }
}

/// A request's call to leave the decode worker it decodes on (it drains, or sheds load), told
/// once a worker.
#[derive(Default)]
struct Leaving {
    told: Option<WorkerId>,
    watch: Option<(
        WorkerId,
        Pin<Box<dyn Future<Output = core::MoveWhy> + Send>>,
    )>,
}

impl Leaving {
    /// Resolves when the request is to leave `worker`, and why: once for each worker (never
    /// without one).
    async fn watch(&mut self, worker: Option<WorkerId>, registry: &Arc<Registry>) -> core::MoveWhy {
        let Some(w) = worker.filter(|&w| self.told != Some(w)) else {
            self.watch = None;
            return std::future::pending().await;
        };
        if self.watch.as_ref().is_none_or(|(x, _)| *x != w) {
            let registry = registry.clone();
            self.watch = Some((w, Box::pin(async move { registry.leaving(w).await })));
        }
        let (_, leaving) = self.watch.as_mut().expect("set above");
        let why = leaving.as_mut().await;
        self.watch = None;
        self.told = Some(w);
        why
    }
}

impl Driver {
    async fn run(mut self, first: Vec<Action>) -> Trace {
        let mut actions = first;
        loop {
            let mut inputs = VecDeque::new();
            for a in actions {
                inputs.extend(self.act(a).await);
            }
            if self.core.ended() {
                break;
            }
            if inputs.is_empty() {
                inputs.push_back(self.next().await);
            }
            actions = Vec::new();
            for input in inputs {
                actions.extend(self.handle(input));
            }
        }
        tracing::debug!(request = %self.core.id(), phases = ?self.trace.phases, "request ended");
        self.trace
    }

    /// The core's next move on `input` (a token's without the registry's lock: it needs
    /// only the planner's signals).
    fn handle(&mut self, input: Input) -> Vec<Action> {
        let (now, core) = (Instant::now(), &mut self.core);
        match input {
            Input::Token { id, finish } => core.token(now, id, finish, &self.state.signals),
            input => with_cx(&self.state, |cx| core.handle(now, input, cx)),
        }
    }

    /// Carries out one action; what comes of it at once, if anything.
    async fn act(&mut self, a: Action) -> Option<Input> {
        match a {
            Action::Open {
                worker,
                remote,
                local_max,
            } => {
                let at = self.deadline.deadline();
                let open = tokio::time::timeout_at(at, self.open(worker, remote, local_max));
                Some(open.await.unwrap_or(Input::Timeout))
            }
            Action::Prefill {
                worker,
                decode,
                skip,
                fetch,
                ticket,
                guard,
                pending,
            } => {
                let to = (decode, skip, fetch);
                self.start_prefill(worker, to, ticket, (guard, pending))
            }
            Action::Release {
                pool,
                worker,
                request,
            } => {
                match pool {
                    Pool::Prefill => {
                        if let Some(p) = self.prefill.take() {
                            p.task.abort();
                        }
                    }
                    Pool::Decode => match &self.parked {
                        Some((id, _)) if *id == request => self.parked = None,
                        _ => self.stream = None,
                    },
                }
                self.cancel_on(worker, request);
                None
            }
            Action::Pause { worker, request } => self.pause(worker, request, false).await,
            Action::Resume { worker, request } => {
                if let Some((_, s)) = self.parked.take().filter(|(id, _)| *id == request) {
                    self.stream = Some(s);
                }
                // A failed resume shows on the stream (it ends, or no token comes: the request
                // migrates).
                let _ = self.pause(worker, request, true).await;
                None
            }
            Action::Park { request } => {
                self.parked = self.stream.take().map(|s| (request, s));
                None
            }
            Action::Handoff {
                from,
                request,
                decode,
                skip,
                ticket,
            } => self.start_handoff(from, request, decode, (skip, ticket)),
            Action::Remove(_) | Action::MarkStalled(_) => {
                self.state.registry.announce_gone();
                None
            }
            Action::Emit => {
                let token = self.token.take().expect("a token to pass on");
                self.tx
                    .send(Ok(token))
                    .await
                    .err()
                    .map(|_| Input::ClientGone)
            }
            Action::Fail(e) => {
                let _ = self.tx.send(Err(e)).await;
                None
            }
            Action::Note(n) => {
                self.note(n);
                None
            }
        }
    }

    /// Counts what the core noted.
    fn note(&mut self, n: Note) {
        self.trace.note(&n);
        match n {
            Note::Entered(p) => {
                metrics::counter!("tandem_router_request_phases_total", "phase" => p.label())
                    .increment(1);
            }
            Note::Decided(d) => {
                metrics::counter!("tandem_router_prefill_decisions_total", "decision" => d.label())
                    .increment(1)
            }
            Note::Migrated => metrics::counter!("tandem_router_migrations_total").increment(1),
            Note::Moved(why) => {
                metrics::counter!("tandem_router_moves_total", "why" => why.label()).increment(1)
            }
            Note::Stayed => metrics::counter!("tandem_router_moves_stayed_total").increment(1),
            Note::Recomputed(why) => {
                metrics::counter!("tandem_kv_transfer_failures_total").increment(1);
                metrics::counter!("tandem_router_recomputes_total", "why" => why.label())
                    .increment(1)
            }
            Note::Held => metrics::counter!("tandem_router_admission_holds_total").increment(1),
            Note::PeerFetch(p) => {
                metrics::counter!("tandem_router_peer_fetch_total", "decision" => p.label())
                    .increment(1)
            }
            Note::Refused => {}
            Note::Ttft(t) => {
                let phase = |name: &'static str, d: Duration| {
                    metrics::histogram!("tandem_router_ttft_phase_seconds", "phase" => name)
                        .record(d)
                };
                phase("admission", t.admission);
                if let Some(p) = t.prefill {
                    phase("prefill", p);
                }
                phase("first_token", t.first_token);
            }
        }
    }

    /// Where worker `w` is reached: from the registry, or as last seen there.
    fn known(&mut self, w: WorkerId) -> Option<Known> {
        let here = self.state.registry.with(|t| {
            t.get(w).map(|x| Known {
                name: x.name.clone(),
                endpoint: x.endpoint.clone(),
                offers: x.offers.clone(),
                peer: x.peer_endpoint.clone(),
            })
        });
        if let Some(k) = &here {
            self.known.insert(w, k.clone());
        }
        here.or_else(|| self.known.get(&w).cloned())
    }

    /// Opens the request's stream on decode worker `w`: with a remote prefill, once the worker
    /// has reserved the request's blocks (and said how much of the prompt it holds).
    async fn open(&mut self, w: WorkerId, remote: bool, local_max: u32) -> Input {
        let Some(k) = self.known(w) else {
            return Input::OpenFailed(Cause::Unreachable, format!("worker {w} has left"));
        };
        let p = self.core.params();
        let params = grpc::SamplingParams {
            max_tokens: p.max_tokens.unwrap_or(0),
            generated: p.generated,
            prompt_logprobs: p.prompt_logprobs,
            ..self.wire.clone()
        };
        let req = GenerateRequest {
            request_id: self.core.id().0,
            prompt: self.core.prompt().to_vec(),
            params: Some(params),
            remote_prefill: remote,
            local_prefill_max_tokens: local_max,
        };
        let channel = match self.state.channel(&k.endpoint) {
            Ok(c) => c,
            Err(s) => return Input::OpenFailed(Cause::of(&s), s.message().into()),
        };
        match tokio::time::timeout(OPEN_WAIT, open(channel, req, remote)).await {
            Ok(Ok((stream, reservation))) => {
                self.stream = Some(stream);
                *self.seen.lock().expect("worker lock") = Some(w);
                Input::Opened(reservation)
            }
            Ok(Err(s)) => Input::OpenFailed(Cause::of(&s), s.message().into()),
            Err(_) => Input::OpenFailed(
                Cause::Unreachable,
                format!(
                    "decode worker {} did not accept the request within {OPEN_WAIT:?}",
                    k.name
                ),
            ),
        }
    }

    /// Sends the prompt (less its last token) to prefill worker `w`, whose KV goes straight to
    /// decode worker `decode` — all but the first `skip` tokens, which it holds. With `fetch`,
    /// the prefill worker fetches the first blocks it lacks from that decode worker, which
    /// holds that many tokens. The call runs on its own task, counted by `guards` until it ends.
    fn start_prefill(
        &mut self,
        w: WorkerId,
        (decode, skip, fetch): (WorkerId, u32, Option<(WorkerId, u32)>),
        ticket: types::TransferTicket,
        guards: (InFlight, PendingPrefill),
    ) -> Option<Input> {
        let peer = fetch.and_then(|(p, tokens)| Some((self.known(p)?.peer, tokens)));
        let (Some(pw), Some(dw)) = (self.known(w), self.known(decode)) else {
            return Some(Input::PrefillFailed(
                Cause::Unreachable,
                "the worker has left".into(),
            ));
        };
        let channel = match self.state.channel(&pw.endpoint) {
            Ok(c) => c,
            Err(s) => return Some(Input::PrefillFailed(Cause::Engine, s.message().into())),
        };
        let prompt = self.core.prompt();
        let req = PrefillRequest {
            request_id: self.core.id().0,
            tokens: prompt[..prompt.len() - 1].to_vec(),
            offers: dw.offers,
            skip_tokens: skip,
            cache_salt: self.wire.cache_salt.clone(),
            transfer_ticket: ticket.0.to_vec(),
            // Where the router found fetching cheaper, the prefill worker fetches what it lacks
            // of the first tokens a decode worker holds instead of computing it: the request's
            // (`skip` tokens) or another's.
            peer_tokens: match &peer {
                Some((_, tokens)) if fetch.is_some_and(|(p, _)| p != decode) => *tokens,
                _ => 0,
            },
            peer_endpoint: peer.map(|(endpoint, _)| endpoint).unwrap_or_default(),
        };
        let registry = self.state.registry.clone();
        let task = tokio::spawn(async move {
            let _guards = guards;
            let reply = match PrefillClient::new(channel).prefill(req).await {
                Ok(r) => r.into_inner(),
                Err(s) => {
                    // Counted even when the request no longer waits for it (its KV arrived
                    // first and its reply was lost on the way).
                    metrics::counter!("tandem_router_prefill_call_failures_total").increment(1);
                    return Err(s);
                }
            };
            registry.record_transfer(w, &reply);
            record_transfer(&reply);
            Ok(reply)
        });
        self.prefill = Some(PrefillCall { task });
        None
    }

    /// Asks decode worker `w` to pause `request` for a move: once paused, the stream says so
    /// after its last token ([`Input::Paused`]); else [`Input::NotPaused`] at once.
    /// With `resume`, resumes it instead.
    async fn pause(&mut self, w: WorkerId, request: RequestId, resume: bool) -> Option<Input> {
        let Some(channel) = self
            .known(w)
            .and_then(|k| self.state.channel(&k.endpoint).ok())
        else {
            return Some(Input::NotPaused);
        };
        let mut client = DecodeClient::new(channel);
        let call = client.pause(grpc::PauseRequest {
            request_id: request.0,
            resume,
        });
        match tokio::time::timeout(CANCEL_WAIT, call).await {
            Ok(Ok(r)) if r.get_ref().paused => None,
            _ => Some(Input::NotPaused),
        }
    }

    /// Has decode worker `from` send paused `request`'s KV to decode worker `decode` (which
    /// holds its first `skip` tokens); answered as a prefill call is.
    fn start_handoff(
        &mut self,
        from: WorkerId,
        request: RequestId,
        decode: WorkerId,
        (skip, ticket): (u32, types::TransferTicket),
    ) -> Option<Input> {
        let (Some(fw), Some(dw)) = (self.known(from), self.known(decode)) else {
            let m = "the worker has left".into();
            return Some(Input::PrefillFailed(Cause::Unreachable, m));
        };
        let channel = match self.state.channel(&fw.endpoint) {
            Ok(c) => c,
            Err(s) => return Some(Input::PrefillFailed(Cause::Engine, s.message().into())),
        };
        let req = grpc::HandoffRequest {
            request_id: request.0,
            to_request_id: self.core.id().0,
            offers: dw.offers,
            skip_tokens: skip,
            transfer_ticket: ticket.0.to_vec(),
            n_tokens: self.core.prompt().len() as u32,
        };
        let task = tokio::spawn(async move {
            let reply = DecodeClient::new(channel).handoff(req).await?.into_inner();
            let t = reply.transport.clone();
            metrics::counter!("tandem_router_moved_kv_bytes_total", "transport" => t.clone())
                .increment(reply.kv_bytes);
            metrics::histogram!("tandem_router_move_transfer_seconds", "transport" => t)
                .record(reply.transfer_us as f64 / 1e6);
            Ok(reply)
        });
        self.prefill = Some(PrefillCall { task });
        None
    }

    /// Waits for what happens next to the request in its phase.
    async fn next(&mut self) -> Input {
        let registry = self.state.registry.clone();
        let decode = self.core.phase().decode_worker();
        let prefill = match self.core.phase() {
            Phase::Prefilling { prefill, .. } => Some(*prefill),
            _ => None,
        };
        let lost = self.lost.watch(decode, &registry);
        let prefill_lost = self.prefill_lost.watch(prefill, &registry);
        let on = match self.core.phase() {
            Phase::Decoding { decode } => Some(decode.worker),
            _ => None,
        };
        let leaving = self.leaving.watch(on, &registry);
        let stall = self
            .core
            .owes_token_since()
            .map(|t| tokio::time::Instant::from_std(t + registry.liveness.stall));
        let admit_by = tokio::time::Instant::from_std(self.core.admit_by());
        let reserving = matches!(self.core.phase(), Phase::Reserving { .. });
        let answer = prefill_answer(&mut self.prefill);
        let changes = &mut self.changes;
        let message = message(&mut self.stream, &mut self.token);
        tokio::select! {
            _ = self.tx.closed() => Input::ClientGone,
            _ = &mut self.deadline => Input::Timeout,
            _ = lost => Input::DecodeLost,
            _ = prefill_lost => Input::PrefillLost,
            why = leaving => Input::Leave(why),
            _ = sleep_until(stall) => Input::Stalled,
            r = tokio::time::timeout_at(admit_by, changes.changed()), if reserving => match r {
                Ok(_) => Input::Changed,
                Err(_) => Input::AdmissionDeadline,
            },
            input = answer => input,
            input = message => input,
        }
    }

    fn cancel_on(&mut self, w: WorkerId, request: RequestId) {
        let Some(k) = self.known(w) else { return };
        let Ok(channel) = self.state.channel(&k.endpoint) else {
            return;
        };
        tokio::spawn(async move {
            let mut client = WorkerClient::new(channel);
            let call = client.cancel(grpc::CancelRequest {
                request_id: request.0,
            });
            let _ = tokio::time::timeout(CANCEL_WAIT, call).await;
        });
    }
}

/// Opens a decode stream with `req`; with `remote`, reads the worker's reservation first.
async fn open(
    channel: tonic::transport::Channel,
    req: GenerateRequest,
    remote: bool,
) -> Result<(Streaming<GenerateEvent>, Option<core::Reservation>), Status> {
    let mut s = DecodeClient::new(channel).generate(req).await?.into_inner();
    if !remote {
        return Ok((s, None));
    }
    match s.message().await? {
        Some(GenerateEvent {
            event: Some(generate_event::Event::Reserved(r)),
            ..
        }) => Ok((
            s,
            Some(core::Reservation {
                cached_tokens: r.cached_tokens,
                local: r.local,
                ticket: types::TransferTicket::from_slice(&r.transfer_ticket).unwrap_or_default(),
            }),
        )),
        other => {
            let m = format!("expected a reservation, got {other:?}");
            Err(Cause::Engine.status(m))
        }
    }
}

/// The prefill call's answer, once it comes (never without a call).
async fn prefill_answer(call: &mut Option<PrefillCall>) -> Input {
    let Some(c) = call.as_mut() else {
        return std::future::pending().await;
    };
    let r = (&mut c.task).await;
    *call = None;
    match r {
        Ok(Ok(reply)) => {
            tracing::debug!(kv_bytes = reply.kv_bytes, transport = %reply.transport, "prefill done");
            Input::PrefillDone
        }
        Ok(Err(s)) => Input::PrefillFailed(Cause::of(&s), s.message().into()),
        Err(e) => Input::PrefillFailed(Cause::Engine, format!("prefill task failed: {e}")),
    }
}

/// The decode stream's next message as an input (a token is kept in `token` for its `Emit`);
/// never without a stream.
async fn message(
    stream: &mut Option<Streaming<GenerateEvent>>,
    token: &mut Option<Token>,
) -> Input {
    let Some(s) = stream.as_mut() else {
        return std::future::pending().await;
    };
    match s.message().await {
        Ok(Some(GenerateEvent {
            event: Some(generate_event::Event::Token(t)),
            finish,
            logprobs,
            prompt_logprobs,
            sent_unix_us,
        })) => {
            let finish = crate::wire::finish(finish);
            *token = Some(Token {
                sent_unix_us,
                id: t,
                finish,
                logprobs: logprobs.map(crate::wire::logprobs),
                prompt_logprobs: prompt_logprobs
                    .into_iter()
                    .map(crate::wire::logprobs)
                    .collect(),
            });
            Input::Token { id: t, finish }
        }
        Ok(Some(GenerateEvent {
            event: Some(generate_event::Event::Paused(p)),
            ..
        })) => Input::Paused {
            generated: p.generated,
        },
        Ok(Some(GenerateEvent {
            event: Some(generate_event::Event::Preempted(_)),
            ..
        })) => Input::Preempted,
        Ok(Some(other)) => Input::Unexpected(format!("{other:?}")),
        Ok(None) => Input::StreamEnded,
        Err(s) => Input::DecodeFailed(Cause::of(&s), s.message().into()),
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
