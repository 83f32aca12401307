//! The tandem decode worker.
//!
//! It serves the `Decode` gRPC service. A request either carries its whole prompt (colocated
//! serving: the worker prefills it itself, chunked between decode steps) or asks for a remote
//! prefill: the worker reserves KV blocks for prompt plus `max_tokens` at once (or refuses with
//! `RESOURCE_EXHAUSTED`, never disturbing running sequences), says so in the first stream event,
//! and admits the request when a prefill worker's KV has arrived whole over `kv-transfer`. One
//! engine thread owns the model and the KV cache (and its ownership ledger) and runs continuous
//! batching. A request whose client goes away (its stream is dropped) or whose KV does not arrive
//! in time is released and its blocks freed.
//!
//! What it shares with the prefill worker lives in the `worker` crate; this crate is what a
//! decode worker does with arriving KV and generated tokens.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use engine::{Engine, Release, RequestId};
use kv_transfer::{KvEvent, Layers};
use proto::grpc::decode_server::{Decode, DecodeServer};
use proto::grpc::{
    generate_event, GenerateEvent, GenerateRequest, HandoffRequest, KvOffer, PauseReply,
    PauseRequest, PrefillReply, Reservation, WorkerLoad,
};
use proto::{Cause, Pool};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};
use worker::kv_send::{SendConfig, Senders};
use worker::service::ReleaseOnDrop;
use worker::{EngineHandle, Settings, WorkerError};

/// How a decode worker runs.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// What every worker is configured with (`worker.engine.kv_lease`: how long reserved
    /// blocks wait for their KV).
    pub worker: Settings,
    /// The TCP KV endpoint to advertise instead of the bound address (NAT, proxies).
    pub kv_advertise: Option<String>,
    /// How long an arriving transfer may go without a frame (its sender renews it every
    /// second while the prompt computes).
    pub transfer_timeout: Duration,
    /// How a handoff's KV is sent (a live move to another decode worker).
    pub send: SendConfig,
}

type EventTx = mpsc::UnboundedSender<Result<GenerateEvent, Status>>;

/// The decode pool's commands.
enum Cmd {
    Generate {
        req: GenerateRequest,
        /// Its sampling parameters, a constraint compiled ([`worker::grammar::Compiler`]).
        params: Box<engine::SamplingParams>,
        events: EventTx,
    },
    Kv(KvEvent),
    /// Pause a decoding request for a live move (whether it was decoding here), or resume a
    /// paused one (whether it was paused).
    Pause {
        id: RequestId,
        resume: bool,
        reply: oneshot::Sender<bool>,
    },
    /// A paused request's KV for a handoff: after the receiver's first `skip` tokens, for a
    /// receiver that reserved `n_tokens`.
    Export {
        id: RequestId,
        skip: usize,
        n_tokens: usize,
        reply: oneshot::Sender<Result<Vec<Vec<u8>>, Status>>,
    },
    /// A paused request's KV was handed off (`bytes` of it): it leaves this worker.
    Moved {
        id: RequestId,
        bytes: u64,
    },
}

/// The decode pool's engine role: generates, admits arriving KV, streams tokens.
struct Decoder {
    engine: Engine,
    streams: HashMap<RequestId, EventTx>,
    /// The transfer tickets of the reservations waiting for a prefill worker's KV, shared
    /// with the KV listeners.
    tickets: kv_transfer::Tickets,
    /// Sequences handed off to another decode worker since start, and their KV bytes.
    moved_out: (u64, u64),
}

fn token_event(ev: &engine::TokenEvent) -> GenerateEvent {
    GenerateEvent {
        event: Some(generate_event::Event::Token(ev.token)),
        finish: worker::wire::finish(ev.finish) as i32,
        logprobs: ev.logprobs.as_ref().map(worker::wire::logprobs),
        prompt_logprobs: ev
            .prompt_logprobs
            .iter()
            .flatten()
            .map(worker::wire::logprobs)
            .collect(),
        sent_unix_us: proto::unix_us(std::time::SystemTime::now()),
    }
}

impl Decoder {
    /// Releases request `id` from the engine (blocks and ledger entry) and its stream, telling
    /// the caller `status` if there is one.
    fn end(&mut self, id: RequestId, why: Release, status: Option<Status>) -> bool {
        self.tickets.revoke(id);
        let held = self.engine.release(id, why);
        if let (Some(tx), Some(s)) = (self.streams.remove(&id), status) {
            let _ = tx.send(Err(s));
        }
        held
    }

    fn generate(
        &mut self,
        cmd: (GenerateRequest, engine::SamplingParams),
        events: EventTx,
        draining: bool,
    ) {
        if draining {
            let _ = events.send(Err(Cause::Draining.status("this decode worker is draining")));
            return;
        }
        let (req, params) = cmd;
        let id = RequestId(req.request_id);
        let added = if req.remote_prefill {
            let n = req.prompt.len();
            let local_max = req.local_prefill_max_tokens as usize;
            let reserved = self
                .engine
                .reserve_remote(id, req.prompt, params, local_max);
            reserved.map(|r| {
                let n = u32::try_from(n).unwrap_or(u32::MAX);
                let ticket = (!r.local).then(|| self.tickets.issue(id, n));
                let r = Reservation {
                    cached_tokens: r.cached as u32,
                    local: r.local,
                    transfer_ticket: ticket.map_or_else(Vec::new, |t| t.0.to_vec()),
                };
                let event = generate_event::Event::Reserved(r.clone());
                let _ = events.send(Ok(GenerateEvent {
                    event: Some(event),
                    ..Default::default()
                }));
                tracing::debug!(request = %id, prompt = n, cached = r.cached_tokens, local = r.local, "reserved");
            })
        } else {
            self.engine.add(id, req.prompt, params)
        };
        match added {
            Ok(()) => {
                self.streams.insert(id, events);
            }
            Err(e) => {
                let _ = events.send(Err(worker::status(e)));
            }
        }
    }

    /// Tells the callers of the requests the step preempted that they wait for room (their
    /// next token may be long in coming; the router must not take this worker for stalled).
    fn preempted(&mut self) {
        for id in self.engine.take_preempted() {
            let ev = GenerateEvent {
                event: Some(generate_event::Event::Preempted(proto::grpc::Preempted {})),
                ..Default::default()
            };
            let sent = self
                .streams
                .get(&id)
                .is_some_and(|tx| tx.send(Ok(ev)).is_ok());
            if !sent {
                self.end(id, Release::Cancelled, None);
            }
        }
    }

    /// Pauses decoding request `id` for a live move: its stream says so after its last token.
    fn pause(&mut self, id: RequestId) -> bool {
        let Some(generated) = self.engine.pause(id) else {
            return false;
        };
        let paused = proto::grpc::Paused {
            generated: generated as u32,
        };
        tracing::debug!(request = %id, generated, "paused for a move");
        match self.streams.get(&id) {
            Some(tx) => {
                let event = Some(generate_event::Event::Paused(paused));
                let ev = GenerateEvent {
                    event,
                    ..Default::default()
                };
                tx.send(Ok(ev)).is_ok()
            }
            None => false,
        }
    }

    fn kv(&mut self, ev: KvEvent) {
        match ev {
            KvEvent::Arriving(id) => {
                self.engine.kv_arriving(id);
                self.engine.renew_lease(id);
            }
            KvEvent::Renewed(id) => {
                self.engine.renew_lease(id);
            }
            KvEvent::Abandoned { request_id, error } => {
                metrics::counter!("tandem_kv_receive_failures_total").increment(1);
                // The transfer broke: free the reservation now rather than at its lease.
                // ABORTED: the request never started here; the router recomputes it.
                let msg = format!("the KV of request {request_id} did not arrive: {error}");
                self.end(
                    request_id,
                    Release::TransferFailed,
                    Some(Cause::KvTransfer.status(msg)),
                );
            }
            KvEvent::Grant {
                request_id,
                n_tokens,
                reply,
            } => {
                let blocks = self.engine.grant(request_id, n_tokens as usize);
                let _ = reply.send(blocks.map_err(|e| e.to_string()));
            }
            KvEvent::Complete(kv) => {
                let bytes = kv.layers.iter().map(|l| l.len() as u64).sum::<u64>();
                metrics::counter!("tandem_kv_received_bytes_total", "transport" => kv.transport.name()).increment(bytes);
                let id = kv.request_id;
                let r = if !self.streams.contains_key(&id) {
                    Err(format!(
                        "request {id} is not waiting for KV here (cancelled?)"
                    ))
                } else {
                    let t0 = std::time::Instant::now();
                    metrics::histogram!("tandem_decode_kv_queue_seconds")
                        .record(t0.saturating_duration_since(kv.landed).as_secs_f64());
                    let r = match &kv.in_place {
                        Some(crcs) => self.engine.admit_in_place(id, crcs),
                        None => self.engine.admit_remote(id, &kv.layers),
                    };
                    metrics::histogram!("tandem_decode_kv_admit_seconds")
                        .record(t0.elapsed().as_secs_f64());
                    r.map_err(|e| e.to_string())
                };
                kv.answer(r);
            }
        }
    }
}

impl worker::Role for Decoder {
    type Cmd = Cmd;

    fn has_work(&self) -> bool {
        self.engine.has_work()
    }

    fn command(&mut self, cmd: Cmd, draining: bool) {
        match cmd {
            Cmd::Generate {
                req,
                params,
                events,
            } => self.generate((req, *params), events, draining),
            Cmd::Kv(ev) => self.kv(ev),
            Cmd::Pause { id, resume, reply } => {
                let done = match resume {
                    true => self.engine.resume(id),
                    false => self.pause(id),
                };
                let _ = reply.send(done);
            }
            Cmd::Export {
                id,
                skip,
                n_tokens,
                reply,
            } => {
                let kv = self.engine.export_paused(id, skip, n_tokens);
                let _ = reply.send(kv.map_err(worker::status));
            }
            Cmd::Moved { id, bytes } => {
                if self.end(id, Release::Moved, None) {
                    self.moved_out.0 += 1;
                    self.moved_out.1 += bytes;
                    metrics::counter!("tandem_decode_moved_out_total").increment(1);
                }
            }
        }
    }

    fn release(&mut self, id: RequestId) -> bool {
        self.end(id, Release::Cancelled, None)
    }

    fn step(&mut self) {
        let t0 = Instant::now();
        let stepped = self.engine.step();
        let took = t0.elapsed();
        metrics::histogram!("tandem_decode_step_seconds").record(took.as_secs_f64());
        if let Some(modelled) = self.engine.model().take_modelled_time() {
            metrics::histogram!("tandem_decode_step_overhead_seconds")
                .record(took.saturating_sub(modelled).as_secs_f64());
        }
        let events = match stepped {
            Ok(events) => events,
            Err(e) => {
                // A failed step poisons every running request; fail them all, keep serving.
                tracing::error!("decode step failed: {e}");
                let ids: Vec<RequestId> = self.streams.keys().copied().collect();
                for id in ids {
                    let s = Cause::Engine.status(format!("decode step failed: {e}"));
                    self.end(id, Release::StepFailed, Some(s));
                }
                return;
            }
        };
        self.preempted();
        metrics::counter!("tandem_decode_tokens_total").increment(events.len() as u64);
        for ev in events {
            let sent = self
                .streams
                .get(&ev.id)
                .is_some_and(|tx| tx.send(Ok(token_event(&ev))).is_ok());
            if !sent {
                // Its caller is gone: free it now.
                self.end(ev.id, Release::Cancelled, None);
            } else if ev.finish.is_some() {
                // Finished: the engine freed its blocks and ledger entry in the step.
                self.streams.remove(&ev.id);
            }
        }
    }

    fn deadline(&self) -> Option<Instant> {
        self.engine.next_lease()
    }

    fn expire(&mut self, now: Instant) {
        for id in self.engine.expired(now) {
            let msg = format!("the KV of request {id} did not arrive within its lease");
            self.end(
                id,
                Release::LeaseExpired,
                Some(Cause::KvTransfer.status(msg)),
            );
        }
    }

    fn kv_events(&mut self) -> Vec<engine::KvEvent> {
        self.engine.take_kv_events()
    }

    fn store_blocks(&mut self) -> Vec<engine::StoreBlock> {
        self.engine.take_store_blocks().0
    }

    fn stage(&mut self, blocks: Vec<engine::StoreBlock>) {
        self.engine.stage_store(&blocks);
    }

    fn export(&mut self, hashes: &[types::BlockHash]) -> Vec<engine::StoreBlock> {
        self.engine.export_blocks(hashes)
    }

    fn tiers_busy(&self) -> bool {
        self.engine.tier_writes_pending()
    }

    fn load(&self) -> WorkerLoad {
        let l = WorkerLoad {
            moved_out: self.moved_out.0,
            moved_out_bytes: self.moved_out.1,
            ..worker::wire::load(&self.engine.load())
        };
        metrics::gauge!("tandem_decode_running").set(l.running as f64);
        metrics::gauge!("tandem_decode_waiting").set(l.waiting as f64);
        metrics::gauge!("tandem_decode_kv_blocks_free").set(l.kv_blocks_free as f64);
        metrics::gauge!("tandem_decode_kv_blocks_used")
            .set((l.kv_blocks_total - l.kv_blocks_free) as f64);
        for (state, n) in [
            ("reserved", l.kv_blocks_reserved),
            ("in_flight", l.kv_blocks_in_flight),
            ("committed", l.kv_blocks_committed),
        ] {
            metrics::gauge!("tandem_decode_kv_ledger_blocks", "state" => state).set(n as f64);
        }
        metrics::gauge!("tandem_decode_kv_ledger_requests_freed").set(l.kv_requests_freed as f64);
        l
    }
}

/// A request's event stream; dropping it (the router went away) releases the request.
pub struct Events {
    rx: UnboundedReceiverStream<Result<GenerateEvent, Status>>,
    _release: ReleaseOnDrop<Cmd>,
}

impl tokio_stream::Stream for Events {
    type Item = Result<GenerateEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.rx).poll_next(cx)
    }
}

struct Service {
    engine: EngineHandle<Cmd>,
    grammars: worker::grammar::Compiler,
    /// The cluster KV store, when the cluster has one this engine can use.
    store: Option<worker::store::StoreLink>,
    /// Where handed-off KV goes: connections to other decode workers.
    senders: Senders,
    width: u32,
}

impl Service {
    /// Asks the engine thread and waits for its answer.
    async fn ask<T>(&self, cmd: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T, Status> {
        let (tx, rx) = oneshot::channel();
        self.engine.follow(cmd(tx))?;
        rx.await
            .map_err(|_| Cause::Engine.status("the engine thread has stopped"))
    }
}

#[tonic::async_trait]
impl Decode for Service {
    type GenerateStream = Events;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let mut req = req.into_inner();
        let id = RequestId(req.request_id);
        let mut params = worker::wire::sampling_params(req.params.take().unwrap_or_default());
        self.grammars.prepare(&mut params.constraint).await?;
        // Prompt log-probabilities need every position computed: nothing is reused for them.
        if let (Some(link), None) = (&self.store, params.prompt_logprobs) {
            let salt = params.cache_salt.as_deref();
            worker::store::prefetch(link, &self.engine, &req.prompt, salt, 0).await?;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let events = tx;
        self.engine.send(Cmd::Generate {
            req,
            params: Box::new(params),
            events,
        })?;
        Ok(Response::new(Events {
            rx: UnboundedReceiverStream::new(rx),
            _release: ReleaseOnDrop::new(&self.engine, id),
        }))
    }

    async fn pause(&self, req: Request<PauseRequest>) -> Result<Response<PauseReply>, Status> {
        let req = req.into_inner();
        let (id, resume) = (RequestId(req.request_id), req.resume);
        let paused = self.ask(|reply| Cmd::Pause { id, resume, reply }).await?;
        Ok(Response::new(PauseReply { paused }))
    }

    async fn handoff(
        &self,
        req: Request<HandoffRequest>,
    ) -> Result<Response<PrefillReply>, Status> {
        let req = req.into_inner();
        let id = RequestId(req.request_id);
        let ticket = kv_transfer::TransferTicket::from_slice(&req.transfer_ticket)
            .ok_or_else(|| Cause::BadRequest.status("transfer_ticket must be 16 bytes"))?;
        let (skip, n_tokens) = (req.skip_tokens as usize, req.n_tokens as usize);
        let layers = self
            .ask(|reply| Cmd::Export {
                id,
                skip,
                n_tokens,
                reply,
            })
            .await??;
        let layers: Vec<kv_transfer::Layer> =
            layers.into_iter().map(kv_transfer::Layer::new).collect();
        let _counted = self.senders.count();
        let (offer, why) = self.senders.choose(&req.offers)?;
        let t0 = Instant::now();
        let mut conn = self.senders.connection(&offer).await?;
        let transport = offer.transport.name();
        let to = (RequestId(req.to_request_id), ticket);
        let n = (n_tokens - 1 - skip) as u32;
        let timeout = self.senders.cfg.transfer_timeout;
        let sent = conn
            .send(to, n, self.width, Layers::Ready(&layers), timeout)
            .await;
        Senders::record(transport, &sent);
        let stats = sent.map_err(|e| Cause::KvTransfer.status(e.to_string()))?;
        self.senders.put_back(offer.endpoint, conn);
        let bytes = stats.bytes;
        self.engine.follow(Cmd::Moved { id, bytes })?;
        Ok(Response::new(PrefillReply {
            kv_bytes: bytes,
            compute_us: 0,
            transfer_us: t0.elapsed().as_micros() as u64,
            transport: stats.transport.name().into(),
            transport_reason: why,
        }))
    }
}

/// Loads the model, starts the KV listeners and the gRPC service, joins the router and serves
/// until the process ends.
pub async fn run(cfg: DecodeConfig) -> Result<(), WorkerError> {
    let s = &cfg.worker;
    let loaded = worker::load(s).await?;
    let stop = loaded.tokenizer.stop_ids().to_vec();
    let mut engine = Engine::new(loaded.model.clone(), s.engine.clone(), stop)?;
    // Structured output: the vocabulary's token trie, built once; each request's grammar is
    // compiled before it reaches the engine thread.
    let grammars = engine::grammar::Grammars::new(&loaded.tokenizer)?;
    let grammars = worker::grammar::Compiler::new(std::sync::Arc::new(grammars));
    let regions = engine.kv_regions().map_err(|e| e.to_string());
    let tickets = kv_transfer::Tickets::default();
    let (store, out) = worker::store::link(s, &mut engine)?.unzip();
    // Peer fetch: its cached blocks served to prefill workers, on a listener of its own.
    let peer = match (s.peer_fetch, engine.can_export(), engine.store_names()) {
        (true, true, Some((_, model))) => Some((worker::bind(&s.host, "peer fetch").await?, model)),
        (true, ..) => {
            tracing::warn!("peer fetch is on, but this engine cannot serve its blocks (no prefix cache, windowed layer groups or a GPU pool): not served");
            None
        }
        _ => None,
    };
    let decoder = Decoder {
        engine,
        streams: HashMap::new(),
        tickets: tickets.clone(),
        moved_out: (0, 0),
    };
    let local = kv_transfer::Local {
        tickets: None,
        identity: loaded.identity.clone(),
        secret: s.secret.clone(),
        security: s.security.clone(),
        max_kv_tokens: u32::MAX,
    };
    let senders = Senders::new(local, cfg.send.clone());
    let counted = senders.transfers.clone();
    let mut handle = worker::engine_thread::spawn_with("decode-engine", decoder, out)
        .with_live(move |l| l.transfers_in_flight = counted.load(Ordering::SeqCst) as u32);
    if let Some(link) = &store {
        let counters = link.counters.clone();
        handle = handle.with_live(move |l| worker::store::fill(&counters, l));
    }
    let mut peer_endpoint = String::new();
    if let Some((listener, model)) = peer {
        let at = listener
            .local_addr()
            .map_err(|e| WorkerError::Bind("peer fetch".into(), e))?;
        peer_endpoint = at.to_string();
        let counters = std::sync::Arc::new(worker::peer::PeerCounters::default());
        let c = counters.clone();
        handle = handle.with_live(move |l| worker::peer::fill(&c, l));
        let security = s.security.clone();
        worker::peer::serve(listener, security, handle.clone(), model, counters);
    }
    let (offers, detail) = kv_endpoints(&cfg, &loaded, (regions, tickets), &handle).await?;
    let store_model = store.as_ref().map_or(0, |l| l.model());
    let service = Service {
        engine: handle.clone(),
        grammars,
        store,
        senders,
        width: loaded.model.config.kv_width() as u32,
    };
    let routes = tonic::service::Routes::new(DecodeServer::new(service));
    let announce = worker::Announce {
        pool: Pool::Decode,
        kv_offers: offers,
        detail,
        metrics: METRICS,
        store_model,
        peer_endpoint,
    };
    worker::serve(s, &loaded, &handle, routes, announce).await
}

fn offer(transport: &str, endpoint: String, cert_der: Vec<u8>) -> KvOffer {
    KvOffer {
        transport: transport.into(),
        endpoint,
        cert_der,
    }
}

/// Starts the KV listeners (TCP, QUIC, and RDMA where this build and machine have it), whose
/// arriving KV goes to the engine thread; returns the offers to announce and a line saying
/// where they are.
async fn kv_endpoints(
    cfg: &DecodeConfig,
    loaded: &worker::Loaded,
    (regions, tickets): (Result<kv_transfer::KvRegions, String>, kv_transfer::Tickets),
    engine: &EngineHandle<Cmd>,
) -> Result<(Vec<KvOffer>, String), WorkerError> {
    let s = &cfg.worker;
    let (kv_tx, mut kv_rx) = mpsc::channel::<KvEvent>(16);
    let local = kv_transfer::Local {
        identity: loaded.identity.clone(),
        secret: s.secret.clone(),
        security: s.security.clone(),
        max_kv_tokens: (loaded.model.kv_pages(s.engine.num_blocks) * s.engine.block_size)
            .try_into()
            .unwrap_or(u32::MAX),
        tickets: Some(tickets),
    };
    // A transfer ends when its sender goes silent this long (renewals count).
    let timeouts = kv_transfer::Timeouts {
        transfer: cfg.transfer_timeout,
        ..Default::default()
    };
    let tcp = worker::bind(&s.host, "KV listener (tcp)").await?;
    let tcp_addr = tcp
        .local_addr()
        .map_err(|e| WorkerError::Bind("KV listener".into(), e))?;
    let ip = s.host.parse().map_err(|_| {
        WorkerError::Bind(s.host.clone(), std::io::Error::other("not an IP address"))
    })?;
    let quic =
        kv_transfer::quic::QuicKvReceiver::bind(std::net::SocketAddr::new(ip, 0), &s.security)?;
    let quic_addr = quic.local_addr()?;
    let tcp_endpoint = cfg
        .kv_advertise
        .clone()
        .unwrap_or_else(|| tcp_addr.to_string());
    let mut offers = vec![
        offer("quic", quic_addr.to_string(), quic.cert_der.clone()),
        offer("tcp", tcp_endpoint, Vec::new()),
    ];
    if let Some(r) = rdma(s, regions).await? {
        offers.insert(0, offer("rdma", r.local_addr()?.to_string(), Vec::new()));
        tokio::spawn(r.serve(local.clone(), kv_tx.clone(), timeouts));
    }
    tokio::spawn(kv_transfer::tcp::serve(
        tcp,
        local.clone(),
        kv_tx.clone(),
        timeouts,
    ));
    tokio::spawn(quic.serve(local, kv_tx, timeouts));
    let engine = engine.clone();
    tokio::spawn(async move {
        while let Some(kv) = kv_rx.recv().await {
            if engine.follow(Cmd::Kv(kv)).is_err() {
                return;
            }
        }
    });
    Ok((
        offers,
        format!(", KV on tcp {tcp_addr} and quic {quic_addr}"),
    ))
}

/// The RDMA receiver over the engine's KV pool, where this build and machine have RDMA and
/// in-place writes can address the pool (one layer group, see `engine::KvCache`).
async fn rdma(
    s: &Settings,
    regions: Result<kv_transfer::KvRegions, String>,
) -> Result<Option<kv_transfer::rdma::RdmaKvReceiver>, WorkerError> {
    let (local, _) = kv_transfer::negotiate::local_transports();
    if !local.contains(&kv_transfer::Transport::Rdma) {
        return Ok(None);
    }
    let regions = match regions {
        Ok(r) => r,
        Err(why) => {
            tracing::warn!("RDMA not offered: {why}; prefill workers send over TCP or QUIC");
            return Ok(None);
        }
    };
    let side = worker::bind(&s.host, "KV listener (rdma side channel)").await?;
    // SAFETY: the regions come from the engine's KV cache, and `regions.owners` are that
    // cache's pools: the receiver keeps them allocated as long as it lives.
    let r = unsafe { kv_transfer::rdma::RdmaKvReceiver::bind(side, &regions) }?;
    if s.device.starts_with("cuda") {
        // Said once, where operators look: RDMA writes land in host memory here.
        tracing::warn!(
            "RDMA into {}: prefill workers write KV into this worker's host KV mirror \
             (pinned by its registration), uploaded to the GPU at admission; GPUDirect \
             RDMA into device memory is not implemented",
            s.device
        );
    }
    Ok(Some(r))
}

use proto::metrics::Kind::{Counter, Gauge, Histogram};

/// Every metric a decode worker exports, with its help text.
const METRICS: &[(&str, proto::metrics::Kind, &str)] = &[
    ("tandem_decode_running", Gauge, "Sequences in the running batch."),
    ("tandem_decode_waiting", Gauge, "Requests queued for the batch."),
    ("tandem_decode_kv_blocks_free", Gauge, "Free KV blocks."),
    ("tandem_decode_kv_blocks_used", Gauge, "KV blocks in use."),
    ("tandem_decode_kv_ledger_blocks", Gauge, "KV ownership ledger: blocks of remotely prefilled requests by state (reserved, in_flight, committed)."),
    ("tandem_decode_kv_ledger_requests_freed", Gauge, "KV ownership ledger: requests freed since start."),
    ("tandem_decode_step_seconds", Histogram, "Duration of one decode step (the inter-token latency of its batch)."),
    ("tandem_decode_tokens_total", Counter, "Tokens generated."),
    ("tandem_kv_received_bytes_total", Counter, "KV bytes received from prefill workers, by transport."),
    ("tandem_decode_step_overhead_seconds", Histogram, "A mock engine's decode step beyond its timing model's time: what this machine adds (the simulator draws its steps' overheads from it)."),
    ("tandem_decode_kv_queue_seconds", Histogram, "From a request's KV landing whole to the engine thread taking it (it takes arrivals between steps); the prefill's exposed wait includes it."),
    ("tandem_decode_kv_admit_seconds", Histogram, "Engine-thread time to admit one request's arrived KV (written into the cache, or checked in place); the batch's next step waits for it."),
    ("tandem_decode_moved_out_total", Counter, "Sequences handed off live to another decode worker (a move: their KV sent, not computed again)."),
    ("tandem_kv_sent_bytes_total", Counter, "KV bytes this worker's handoffs delivered to other decode workers, by transport."),
    ("tandem_kv_send_seconds", Histogram, "One handoff's KV transfer, first byte to ack, by transport."),
    ("tandem_kv_send_failures_total", Counter, "Handoffs whose KV transfer failed, by transport."),
    ("tandem_kv_receive_failures_total", Counter, "Incoming KV transfers that broke before completing."),
    ("tandem_decode_grammar_timeouts_total", Counter, "Requests refused because their response format did not compile within grammar::BUDGET."),
];
