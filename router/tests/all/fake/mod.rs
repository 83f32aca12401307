//! A fake worker for the router's tests, named as one: an in-process gRPC server that speaks
//! the `Decode`, `Prefill` and `Worker` services the way the real workers do (reservation
//! event, tokens with a finish reason, typed failure causes) but runs no model. What it does
//! with each request is scripted, and everything it is asked is recorded for the tests to
//! assert on.

#![allow(dead_code)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::SamplingParams;
use proto::grpc::decode_server::{Decode, DecodeServer};
use proto::grpc::prefill_server::{Prefill, PrefillServer};
use proto::grpc::worker_server::{Worker, WorkerServer};
use proto::grpc::{
    self, generate_event, GenerateEvent, GenerateRequest, PrefillReply, PrefillRequest,
};
use proto::grpc::{JoinRequest, KvOffer};
use proto::{Cause, Pool};
use router::core::PhaseName;
use router::openai::ApiError;
use router::registry::{Liveness, Registry};
use router::request::{self, Started};
use router::State;
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status};
use types::WorkerId;

// The router under test, and fakes joined to it.

/// The prompt most tests send.
pub const PROMPT: [u32; 6] = [1, 2, 3, 4, 5, 6];

/// A router state over the default model's tokenizer, with no worker yet.
pub fn state(admission_wait: Duration) -> Arc<State> {
    state_with(admission_wait, |_| {})
}

/// [`state`], with `set` changing its settings first.
pub fn state_with(admission_wait: Duration, set: impl FnOnce(&mut State)) -> Arc<State> {
    state_on(Liveness::default(), admission_wait, set)
}

/// A decode script streaming `t`.
pub fn tokens(t: &[u32]) -> DecodeScript {
    DecodeScript::Tokens(t.to_vec())
}

/// Every token of a started request, how it ended, and its phases.
pub async fn finish(s: Started) -> (Vec<u32>, Result<(), ApiError>, Vec<PhaseName>) {
    let mut out = Vec::new();
    let mut end = Ok(());
    let mut next = Some(s.first);
    let mut rest = s.rest;
    while let Some(r) = next {
        match r {
            Ok(t) => {
                out.push(t.id);
                if t.finish.is_some() {
                    break;
                }
            }
            Err(e) => {
                end = Err(e);
                break;
            }
        }
        next = rest.recv().await;
    }
    (out, end, s.trace.await.unwrap().phases)
}

/// Runs [`PROMPT`] for 8 greedy tokens through the router: [`finish`]'s answer.
pub async fn run(state: &Arc<State>) -> (Vec<u32>, Result<(), ApiError>, Vec<PhaseName>) {
    finish(request::start(state, PROMPT.to_vec(), &SamplingParams::greedy(8)).await).await
}

/// Tells the registry, as worker `id`'s heartbeat would, that its cache holds `prompt`'s blocks.
pub fn cached_on(st: &State, id: WorkerId, prompt: &[u32]) {
    let blocks = engine::block_hash::prompt_hashes(
        st.core.block_seed,
        engine::block_hash::ROOT,
        16,
        &prompt[..prompt.len() - 1],
    );
    let kv = grpc::KvEvents {
        first: 0,
        next: blocks.len() as u64,
        hashes: blocks.iter().map(|b| b.0).collect(),
        stored: Vec::new(),
        snapshot: true,
        tiers: Vec::new(),
    };
    let beat = grpc::Heartbeat {
        worker_id: id.0,
        load: Some(grpc::WorkerLoad::default()),
        kv: Some(kv),
    };
    assert!(
        !st.registry.beat(beat).unwrap(),
        "a snapshot needs no resync"
    );
}

/// [`state_with`] over a registry giving up on workers by `liveness`.
pub fn state_on(
    liveness: Liveness,
    admission_wait: Duration,
    set: impl FnOnce(&mut State),
) -> Arc<State> {
    let path = engine::fetch::ensure_default_model().expect("the default model");
    let (config, tokenizer) = engine::inspect(&path).expect("model metadata");
    let identity = engine::identity_of(&config, 16);
    let registry = Registry::configured(identity, liveness, Default::default());
    let mut s = State::new(
        registry,
        tokenizer,
        &config,
        "SmolLM2-135M-Instruct.Q4_1".into(),
        true,
        Duration::from_secs(5),
    );
    s.core.admission_wait = admission_wait;
    set(&mut s);
    Arc::new(s)
}

/// Serves `fake` and joins it to the registry as a worker of `pool`; returns its id.
pub async fn join(state: &State, pool: Pool, fake: &Fake) -> WorkerId {
    let addr = fake.serve().await;
    join_at(state, pool, &format!("http://{addr}"))
}

pub fn join_at(state: &State, pool: Pool, endpoint: &str) -> WorkerId {
    let path = engine::fetch::default_model_path();
    let (config, _) = engine::inspect(&path).unwrap();
    let offer = KvOffer {
        transport: "tcp".into(),
        endpoint: "127.0.0.1:9".into(),
        cert_der: Vec::new(),
    };
    let req = JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::from(pool) as i32,
        name: format!("{pool}-{endpoint}"),
        endpoint: endpoint.into(),
        kv_offers: vec![offer],
        identity: Some(engine::identity_of(&config, 16).into()),
        kv_blocks_total: 64,
        metrics_endpoint: String::new(),
        worker_id: 0,
        device: "mock".into(),
        kv_tier_blocks: 0,
        store_model: 0,
        peer_endpoint: String::new(),
    };
    state.registry.join(req).expect("joins")
}

/// Heartbeats for worker `id` every 50 ms, its engine steps standing at `steps` (or moving, if
/// `None`), until the test ends.
pub fn keep_beating(st: &Arc<State>, id: WorkerId, steps: Option<u64>) {
    let st = st.clone();
    tokio::spawn(async move {
        for n in 1.. {
            let load = grpc::WorkerLoad {
                engine_steps: steps.unwrap_or(n),
                running: 1,
                ..Default::default()
            };
            let beat = grpc::Heartbeat {
                worker_id: id.0,
                load: Some(load),
                kv: None,
            };
            if st.registry.beat(beat).is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// What the fake decode worker does with a request.
#[derive(Debug, Clone)]
pub enum DecodeScript {
    /// (Remote prefill: reserves, then waits for the fake prefill's KV.) Streams these tokens,
    /// the last with finish reason `length`.
    Tokens(Vec<u32>),
    /// Refuses for room (`Cause::Full`) this many times, then behaves as `Tokens`.
    FullThen(u32, Vec<u32>),
    /// Refuses the request as malformed.
    BadRequest,
    /// Reserves, then gives up on the KV (`Cause::KvTransfer`) as a real worker does when the
    /// transfer breaks; a request without a remote prefill gets `Tokens`.
    LoseKv(Vec<u32>),
    /// Streams the tokens one every 50 ms (the client may go away meanwhile).
    Slow(Vec<u32>),
    /// Counts on from the prompt's last token (last + 1, last + 2, … up to `max_tokens`), as a
    /// deterministic model would — so a request resumed elsewhere from its prompt plus the
    /// tokens streamed continues exactly — after `n` tokens failing as a killed worker's
    /// stream does (`Die`), or sending nothing more (`Freeze`).
    Count(Fault),
}

/// What a [`DecodeScript::Count`] worker does after some tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// Nothing: it counts to the end.
    None,
    /// After this many tokens the stream fails with a status that names no cause.
    Die(usize),
    /// After this many tokens it sends nothing more (and never ends the stream).
    Freeze(usize),
}

/// What the fake prefill worker does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrefillScript {
    /// Delivers the KV to the fake decode worker and answers.
    Deliver,
    /// Fails the transfer (`Cause::KvTransfer`).
    Fail,
}

/// What a fake worker was asked, for assertions.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Generate calls: (request id, remote prefill, prompt).
    pub generate: Vec<(u64, bool, Vec<u32>)>,
    /// Each generate call's `local_prefill_max_tokens`.
    pub local_max: Vec<u32>,
    /// Each generate call's `max_tokens`.
    pub max_tokens: Vec<u32>,
    /// Each generate call's sampling parameters.
    pub params: Vec<grpc::SamplingParams>,
    /// Prefill calls: (request id, tokens).
    pub prefill: Vec<(u64, Vec<u32>)>,
    /// Cancel calls: request ids.
    pub cancel: Vec<u64>,
    /// Drain calls.
    pub drains: usize,
}

/// KV "delivered" by fake prefill workers, by request id, shared by a test's fakes.
#[derive(Default)]
pub struct Kv {
    delivered: Mutex<HashSet<u64>>,
    arrived: Notify,
}

impl Kv {
    fn deliver(&self, id: u64) {
        self.delivered.lock().unwrap().insert(id);
        self.arrived.notify_waiters();
    }

    /// Waits (at most 5 s) until request `id`'s KV was delivered.
    async fn wait(&self, id: u64) -> bool {
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.delivered.lock().unwrap().contains(&id) {
                return true;
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return false;
            }
        }
    }
}

/// One fake worker (decode or prefill, by which service the test uses).
#[derive(Clone)]
pub struct Fake {
    pub decode: DecodeScript,
    pub prefill: PrefillScript,
    pub seen: Arc<Mutex<Seen>>,
    pub kv: Arc<Kv>,
    refusals: Arc<AtomicU32>,
    recorded: Arc<Notify>,
}

impl Fake {
    /// A fake with these scripts, sharing `kv` with the test's other fakes.
    pub fn new(decode: DecodeScript, prefill: PrefillScript, kv: Arc<Kv>) -> Fake {
        Fake {
            decode,
            prefill,
            seen: Arc::default(),
            kv,
            refusals: Arc::default(),
            recorded: Arc::default(),
        }
    }

    fn record(&self, f: impl FnOnce(&mut Seen)) {
        f(&mut self.seen.lock().unwrap());
        self.recorded.notify_waiters();
    }

    /// Waits (at most 5 s) until what the fake saw satisfies `cond`; whether it did.
    pub async fn wait_until(&self, cond: impl Fn(&Seen) -> bool) -> bool {
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let notified = self.recorded.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if cond(&self.seen.lock().unwrap()) {
                return true;
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return cond(&self.seen.lock().unwrap());
            }
        }
    }

    /// Serves the fake on 127.0.0.1 (port chosen by the OS) until the test ends.
    pub async fn serve(&self) -> SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tonic::transport::Server::builder()
            .add_service(DecodeServer::new(self.clone()))
            .add_service(PrefillServer::new(self.clone()))
            .add_service(WorkerServer::new(self.clone()))
            .serve_with_incoming(TcpListenerStream::new(l));
        tokio::spawn(server);
        addr
    }

    fn refused_enough(&self, times: u32) -> bool {
        self.refusals.fetch_add(1, Ordering::SeqCst) >= times
    }
}

fn token(t: u32, last: bool) -> Result<GenerateEvent, Status> {
    let finish = if last {
        grpc::Finish::Length
    } else {
        grpc::Finish::None
    };
    Ok(GenerateEvent {
        event: Some(generate_event::Event::Token(t)),
        finish: finish as i32,
        ..Default::default()
    })
}

/// The fake decode worker's transfer ticket for request `id`: its reservation carries it, and
/// the fake prefill delivers KV only with it (a router that did not hand it on fails there).
pub fn ticket(id: u64) -> Vec<u8> {
    [id.to_le_bytes(), (!id).to_le_bytes()].concat()
}

fn reserved(id: u64, local: bool) -> Result<GenerateEvent, Status> {
    Ok(GenerateEvent {
        event: Some(generate_event::Event::Reserved(grpc::Reservation {
            cached_tokens: 0,
            local,
            transfer_ticket: if local { Vec::new() } else { ticket(id) },
        })),
        ..Default::default()
    })
}

#[tonic::async_trait]
impl Decode for Fake {
    type GenerateStream = ReceiverStream<Result<GenerateEvent, Status>>;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let r = req.into_inner();
        let (id, remote) = (r.request_id, r.remote_prefill);
        self.record(|s| {
            s.generate.push((id, remote, r.prompt.clone()));
            s.local_max.push(r.local_prefill_max_tokens);
            s.max_tokens
                .push(r.params.as_ref().map_or(0, |p| p.max_tokens));
            s.params.push(r.params.clone().unwrap_or_default());
        });
        // As a real decode worker decides (it caches nothing): the whole rest is short enough.
        let local = r.prompt.len() - 1 <= r.local_prefill_max_tokens as usize;
        if let DecodeScript::Count(fault) = self.decode {
            return Ok(Response::new(count(&r, fault, self.kv.clone())));
        }
        let (tokens, lose, gap) = match self.decode.clone() {
            DecodeScript::BadRequest => return Err(Cause::BadRequest.status("scripted: bad")),
            DecodeScript::FullThen(n, t) => {
                if !self.refused_enough(n) {
                    return Err(Cause::Full.status("scripted: full"));
                }
                (t, false, 0)
            }
            DecodeScript::Tokens(t) => (t, false, 0),
            DecodeScript::LoseKv(t) => (t, remote, 0),
            DecodeScript::Slow(t) => (t, false, 50),
            DecodeScript::Count(_) => unreachable!("answered above"),
        };
        let (tx, rx) = mpsc::channel(64);
        let kv = self.kv.clone();
        tokio::spawn(async move {
            if remote {
                let _ = tx.send(reserved(id, local)).await;
                if lose {
                    let _ = tx
                        .send(Err(Cause::KvTransfer.status("scripted: KV lost")))
                        .await;
                    return;
                }
                if !local && !kv.wait(id).await {
                    let _ = tx.send(Err(Cause::KvTransfer.status("no KV came"))).await;
                    return;
                }
            }
            for (i, &t) in tokens.iter().enumerate() {
                if gap > 0 {
                    tokio::time::sleep(Duration::from_millis(gap)).await;
                }
                if tx.send(token(t, i + 1 == tokens.len())).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    /// The fake pauses nothing: its requests finish where they are.
    async fn pause(
        &self,
        _: Request<grpc::PauseRequest>,
    ) -> Result<Response<grpc::PauseReply>, Status> {
        Ok(Response::new(grpc::PauseReply { paused: false }))
    }

    async fn handoff(
        &self,
        _: Request<grpc::HandoffRequest>,
    ) -> Result<Response<PrefillReply>, Status> {
        Err(Status::unimplemented(
            "the fake decode worker pauses nothing",
        ))
    }
}

/// The stream of a [`DecodeScript::Count`] worker: with a remote prefill, its reservation
/// first and the tokens once the fake prefill delivered the KV.
fn count(
    r: &GenerateRequest,
    fault: Fault,
    kv: Arc<Kv>,
) -> ReceiverStream<Result<GenerateEvent, Status>> {
    let (tx, rx) = mpsc::channel(64);
    let last = r.prompt.last().copied().unwrap_or(0);
    let n = r.params.as_ref().map_or(8, |p| p.max_tokens) as usize;
    let (id, remote) = (r.request_id, r.remote_prefill);
    let local = r.prompt.len() - 1 <= r.local_prefill_max_tokens as usize;
    tokio::spawn(async move {
        if remote {
            let _ = tx.send(reserved(id, local)).await;
            if !local && !kv.wait(id).await {
                let _ = tx.send(Err(Cause::KvTransfer.status("no KV came"))).await;
                return;
            }
        }
        for i in 0..n {
            match fault {
                Fault::Die(k) if i == k => {
                    let _ = tx.send(Err(Status::unavailable("scripted: killed"))).await;
                    return;
                }
                Fault::Freeze(k) if i == k => {
                    // Held open, silent, until the router drops the stream.
                    tx.closed().await;
                    return;
                }
                _ => {}
            }
            let t = last + 1 + i as u32;
            if tx.send(token(t, i + 1 == n)).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

#[tonic::async_trait]
impl Prefill for Fake {
    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<PrefillReply>, Status> {
        let r = req.into_inner();
        self.record(|s| s.prefill.push((r.request_id, r.tokens.clone())));
        if self.prefill == PrefillScript::Fail {
            return Err(Cause::KvTransfer.status("scripted: the transfer broke"));
        }
        if r.transfer_ticket != ticket(r.request_id) {
            return Err(Cause::KvTransfer.status("refused: wrong transfer ticket"));
        }
        self.kv.deliver(r.request_id);
        Ok(Response::new(PrefillReply {
            kv_bytes: r.tokens.len() as u64 * 100,
            compute_us: 1,
            transfer_us: 1,
            transport: "tcp".into(),
            transport_reason: "tcp (fake)".into(),
        }))
    }
}

#[tonic::async_trait]
impl Worker for Fake {
    async fn cancel(
        &self,
        req: Request<grpc::CancelRequest>,
    ) -> Result<Response<grpc::CancelReply>, Status> {
        let id = req.into_inner().request_id;
        self.record(|s| s.cancel.push(id));
        Ok(Response::new(grpc::CancelReply { found: true }))
    }

    async fn drain(
        &self,
        _: Request<grpc::DrainRequest>,
    ) -> Result<Response<grpc::DrainReply>, Status> {
        self.record(|s| s.drains += 1);
        Ok(Response::new(grpc::DrainReply {}))
    }

    async fn stats(
        &self,
        _: Request<grpc::StatsRequest>,
    ) -> Result<Response<grpc::WorkerLoad>, Status> {
        Ok(Response::new(grpc::WorkerLoad {
            kv_blocks_total: 64,
            kv_blocks_free: 64,
            ..Default::default()
        }))
    }
}
