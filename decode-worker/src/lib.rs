//! The tandem decode worker.
//!
//! It serves the `Decode` gRPC service. A request either carries its whole prompt (colocated
//! serving: the worker prefills it itself, chunked between decode steps) or asks for a remote
//! prefill: the worker reserves KV blocks for prompt plus `max_tokens` at once (or refuses with
//! `RESOURCE_EXHAUSTED`, never disturbing running sequences), says so in the first stream event,
//! and admits the request when a prefill worker's KV has arrived whole over `kv-transfer`. One
//! engine thread owns the model and the KV cache and runs continuous batching. A request whose
//! client goes away (its stream is dropped) or whose KV does not arrive in time is aborted and
//! its blocks freed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{Engine, EngineConfig, EngineError, FinishReason, SamplingParams};
use kv_transfer::core::Ledger;
use kv_transfer::KvEvent;
use proto::grpc::decode_server::{Decode, DecodeServer};
use proto::grpc::{self, generate_event, GenerateEvent, GenerateRequest};
use proto::membership::Load;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{TcpListenerStream, UnboundedReceiverStream};
use tonic::{Request, Response, Status};

/// How a decode worker runs.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// Model file or directory.
    pub model: PathBuf,
    /// Where the forward pass runs (`cpu`, `cuda:N`).
    pub device: String,
    /// Run the mock engine with this timing model instead of the model's kernels.
    pub mock: Option<engine::MockTiming>,
    /// Kernel threads.
    pub threads: usize,
    /// Engine sizes (KV blocks, batch budget).
    pub engine: EngineConfig,
    /// Host to bind the gRPC and KV listeners to (ports are picked by the OS).
    pub host: String,
    /// The router's control endpoint, e.g. `http://127.0.0.1:8001`.
    pub router: String,
    /// Name shown in logs.
    pub name: String,
    /// How long reserved blocks wait for their KV.
    pub kv_timeout: Duration,
    /// The only transport allowed, if the cluster requires one.
    pub require: Option<kv_transfer::Transport>,
    /// The cluster secret KV senders must prove (HMAC), if the cluster has one.
    pub secret: Option<Arc<Vec<u8>>>,
    /// The TCP KV endpoint to advertise instead of the bound address (NAT, proxies).
    pub kv_advertise: Option<String>,
}

/// Why the worker stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The model could not be loaded.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A listener could not be bound.
    #[error("binding {0}: {1}")]
    Bind(String, std::io::Error),
    /// The router refused the worker or could not be reached.
    #[error(transparent)]
    Join(#[from] proto::membership::JoinError),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The thread-count setting failed.
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
    /// The KV transport could not be set up (or a required one is missing).
    #[error(transparent)]
    Transfer(#[from] kv_transfer::TransferError),
}

type EventTx = mpsc::UnboundedSender<Result<GenerateEvent, Status>>;

enum Cmd {
    Generate {
        req: GenerateRequest,
        events: EventTx,
    },
    Kv(KvEvent),
    Cancel {
        id: u64,
        found: oneshot::Sender<bool>,
    },
    Drain,
}

fn status(e: EngineError) -> Status {
    match e {
        EngineError::OutOfBlocks(m) => Status::resource_exhausted(m),
        EngineError::InvalidRequest(m) => Status::invalid_argument(m),
        other => Status::internal(other.to_string()),
    }
}

fn params(p: Option<grpc::SamplingParams>) -> SamplingParams {
    let p = p.unwrap_or_default();
    SamplingParams {
        max_tokens: (p.max_tokens > 0).then_some(p.max_tokens as usize),
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: if p.top_p > 0.0 { p.top_p } else { 1.0 },
        seed: p.seed,
        stop_token_ids: p.stop_token_ids,
        ignore_eos: p.ignore_eos,
    }
}

/// The engine thread: owns the engine; applies commands between steps.
fn engine_loop(
    mut engine: Engine,
    rx: std_mpsc::Receiver<Cmd>,
    load: Arc<Mutex<Load>>,
    kv_timeout: Duration,
) {
    let mut streams: HashMap<u64, EventTx> = HashMap::new();
    // Who holds blocks for KV from a prefill worker, with the lease of each reservation.
    let mut ledger = Ledger::new();
    let mut draining = false;
    loop {
        // Block for a command only when there is nothing to step.
        let first = if engine.has_work() {
            rx.try_recv().ok()
        } else {
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(c) => Some(c),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    // The KV pool may be registered with an RDMA device, which peers can still
                    // write into: it is never freed (the process is ending anyway).
                    std::mem::forget(engine);
                    return;
                }
            }
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            match cmd {
                Cmd::Generate { req, events } => {
                    let id = req.request_id;
                    if draining {
                        let _ =
                            events.send(Err(Status::unavailable("this decode worker is draining")));
                        continue;
                    }
                    let p = params(req.params);
                    let added = if req.remote_prefill {
                        engine.reserve_remote(id, req.prompt, p)
                    } else {
                        engine.add(id, req.prompt, p)
                    };
                    match added {
                        Ok(()) => {
                            if req.remote_prefill {
                                let blocks = engine.blocks_of(id) as u32;
                                ledger.reserve(id, blocks, Some(Instant::now() + kv_timeout));
                                let _ = events.send(Ok(GenerateEvent {
                                    event: Some(generate_event::Event::Reserved(true)),
                                    finish: 0,
                                }));
                            }
                            streams.insert(id, events);
                        }
                        Err(e) => {
                            let _ = events.send(Err(status(e)));
                        }
                    }
                }
                Cmd::Kv(KvEvent::Arriving(id)) => {
                    ledger.in_flight(id);
                }
                Cmd::Kv(KvEvent::Abandoned { request_id, error }) => {
                    metrics::counter!("tandem_kv_receive_failures_total").increment(1);
                    // The transfer broke: free the reservation now rather than at its lease.
                    if ledger.free(request_id).is_some() {
                        engine.abort(request_id);
                        if let Some(tx) = streams.remove(&request_id) {
                            let _ = tx.send(Err(Status::aborted(format!(
                                "the KV of request {request_id} did not arrive: {error}"
                            ))));
                        }
                    }
                }
                Cmd::Kv(KvEvent::Grant {
                    request_id,
                    n_tokens,
                    reply,
                }) => {
                    let blocks = engine.grant(request_id, n_tokens as usize);
                    let _ = reply.send(blocks.map_err(|e| e.to_string()));
                }
                Cmd::Kv(KvEvent::Complete(kv)) => {
                    let bytes = kv.layers.iter().map(|l| l.len() as u64).sum::<u64>();
                    metrics::counter!("tandem_kv_received_bytes_total", "transport" => kv.transport.name()).increment(bytes);
                    let r = if streams.contains_key(&kv.request_id) {
                        let admitted = match &kv.in_place {
                            Some(crcs) => engine.admit_in_place(kv.request_id, crcs),
                            None => engine.admit_remote(kv.request_id, &kv.layers),
                        }
                        .map_err(|e| e.to_string());
                        if admitted.is_ok() {
                            ledger.commit(kv.request_id);
                        }
                        admitted
                    } else {
                        Err(format!(
                            "request {} is not waiting for KV here (cancelled?)",
                            kv.request_id
                        ))
                    };
                    kv.answer(r);
                }
                Cmd::Cancel { id, found } => {
                    streams.remove(&id);
                    ledger.free(id);
                    let _ = found.send(engine.abort(id));
                }
                Cmd::Drain => draining = true,
            }
        }
        // Clients that went away, and reservations whose KV never came.
        let now = Instant::now();
        let gone: Vec<u64> = streams
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            streams.remove(&id);
            ledger.free(id);
            engine.abort(id);
        }
        for id in ledger.expired(now) {
            ledger.free(id);
            engine.abort(id);
            if let Some(tx) = streams.remove(&id) {
                // ABORTED: the request never started here; the router recomputes it.
                let _ = tx.send(Err(Status::aborted(format!(
                    "the KV of request {id} did not arrive within {kv_timeout:?}"
                ))));
            }
        }
        if engine.has_work() {
            let t0 = Instant::now();
            let stepped = engine.step();
            metrics::histogram!("tandem_decode_step_seconds").record(t0.elapsed().as_secs_f64());
            match stepped {
                Ok(events) => {
                    metrics::counter!("tandem_decode_tokens_total").increment(events.len() as u64);
                    for ev in events {
                        let finish = match ev.finish {
                            None => grpc::Finish::None,
                            Some(FinishReason::Stop) => grpc::Finish::Stop,
                            Some(FinishReason::Length) => grpc::Finish::Length,
                        };
                        let msg = GenerateEvent {
                            event: Some(generate_event::Event::Token(ev.token)),
                            finish: finish as i32,
                        };
                        let sent = streams
                            .get(&ev.id)
                            .is_some_and(|tx| tx.send(Ok(msg)).is_ok());
                        if ev.finish.is_some() || !sent {
                            streams.remove(&ev.id);
                            ledger.free(ev.id);
                            if !sent {
                                engine.abort(ev.id);
                            }
                        }
                    }
                }
                Err(e) => {
                    // A failed step poisons every running request; fail them all, keep serving.
                    tracing::error!("decode step failed: {e}");
                    for (id, tx) in streams.drain() {
                        engine.abort(id);
                        ledger.free(id);
                        let _ = tx.send(Err(Status::internal(format!("decode step failed: {e}"))));
                    }
                }
            }
        }
        let counts = ledger.counts();
        let l = engine.load();
        metrics::gauge!("tandem_decode_running").set(l.running as f64);
        metrics::gauge!("tandem_decode_waiting").set(l.waiting as f64);
        metrics::gauge!("tandem_decode_kv_blocks_free").set(l.kv_blocks_free as f64);
        metrics::gauge!("tandem_decode_kv_blocks_used")
            .set((l.kv_blocks_total - l.kv_blocks_free) as f64);
        for (state, n) in [
            ("reserved", counts.reserved),
            ("in_flight", counts.in_flight),
            ("committed", counts.committed),
        ] {
            metrics::gauge!("tandem_decode_kv_ledger_blocks", "state" => state).set(n as f64);
        }
        metrics::gauge!("tandem_decode_kv_ledger_requests_freed").set(counts.freed as f64);
        *load.lock().expect("load lock") = Load {
            kv_blocks_reserved: counts.reserved as u32,
            kv_blocks_in_flight: counts.in_flight as u32,
            kv_blocks_committed: counts.committed as u32,
            kv_requests_freed: counts.freed,
            ..engine.load()
        };
    }
}

struct Service {
    cmds: std_mpsc::Sender<Cmd>,
    load: Arc<Mutex<Load>>,
}

impl Service {
    fn send(&self, c: Cmd) -> Result<(), Status> {
        self.cmds
            .send(c)
            .map_err(|_| Status::unavailable("the engine thread has stopped"))
    }
}

#[tonic::async_trait]
impl Decode for Service {
    type GenerateStream = UnboundedReceiverStream<Result<GenerateEvent, Status>>;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.send(Cmd::Generate {
            req: req.into_inner(),
            events: tx,
        })?;
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn cancel(
        &self,
        req: Request<grpc::CancelRequest>,
    ) -> Result<Response<grpc::CancelReply>, Status> {
        let (found, rx) = oneshot::channel();
        self.send(Cmd::Cancel {
            id: req.into_inner().request_id,
            found,
        })?;
        Ok(Response::new(grpc::CancelReply {
            found: rx.await.unwrap_or(false),
        }))
    }

    async fn drain(
        &self,
        _: Request<grpc::DrainRequest>,
    ) -> Result<Response<grpc::DrainReply>, Status> {
        self.send(Cmd::Drain)?;
        Ok(Response::new(grpc::DrainReply {}))
    }

    async fn stats(
        &self,
        _: Request<grpc::StatsRequest>,
    ) -> Result<Response<grpc::WorkerStats>, Status> {
        Ok(Response::new(self.load.lock().expect("load lock").stats()))
    }
}

/// Loads the model, starts the KV listener and the gRPC service, joins the router and serves
/// until the process ends.
pub async fn run(cfg: DecodeConfig) -> Result<(), WorkerError> {
    kernels::set_threads(cfg.threads)?;
    let model_path = cfg.model.clone();
    let device = cfg.device.clone();
    let (model, tok) = tokio::task::spawn_blocking(move || {
        engine::load(&model_path, kernels::Device::parse(&device)?)
    })
    .await
    .expect("model loading does not panic")?;
    let model = Arc::new(match cfg.mock {
        Some(timing) => model.into_mock(timing),
        None => model,
    });
    let identity = engine::identity(&model, cfg.engine.block_size);
    let mut engine = Engine::new(model.clone(), cfg.engine.clone(), tok.stop_ids().to_vec())?;
    let load = Arc::new(Mutex::new(engine.load()));
    let (layers, block_bytes) = engine.kv_regions();
    let regions = kv_transfer::KvRegions {
        layers,
        block_bytes,
    };

    let (cmd_tx, cmd_rx) = std_mpsc::channel();
    let (l2, timeout) = (load.clone(), cfg.kv_timeout);
    std::thread::Builder::new()
        .name("decode-engine".into())
        .spawn(move || engine_loop(engine, cmd_rx, l2, timeout))
        .expect("engine thread starts");

    let bind = |what: &str| {
        let addr = format!("{}:0", cfg.host);
        let what = what.to_string();
        async move {
            tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|e| WorkerError::Bind(format!("{what} {addr}"), e))
        }
    };
    let (local, missing) = kv_transfer::negotiate::local_transports();
    if let Some(t) = cfg.require.filter(|t| !local.contains(t)) {
        return Err(kv_transfer::TransferError::Refused(format!(
            "kv_transfer.require = {t:?} but {}",
            missing.join("; ")
        ))
        .into());
    }
    let kv_listener = bind("KV listener (tcp)").await?;
    let kv_addr = kv_listener
        .local_addr()
        .map_err(|e| WorkerError::Bind("KV listener".into(), e))?;
    let quic =
        kv_transfer::quic::QuicKvReceiver::bind(format!("{}:0", cfg.host).parse().map_err(
            |_| WorkerError::Bind(cfg.host.clone(), std::io::Error::other("not an IP address")),
        )?)?;
    let quic_addr = quic.local_addr()?;
    // RDMA where this build and machine have it: the KV pool is registered with the device
    // and prefill workers write into it; the side channel is a TCP listener of its own.
    let rdma = if local.contains(&kv_transfer::Transport::Rdma) {
        let side = bind("KV listener (rdma side channel)").await?;
        // SAFETY: the engine owning the pool lives in its thread until the process ends and
        // is never dropped (see `engine_loop`), so the registered memory stays valid.
        let r = unsafe { kv_transfer::rdma::RdmaKvReceiver::bind(side, &regions) }?;
        if cfg.device.starts_with("cuda") {
            // Said once, where operators look: RDMA writes land in host memory here.
            tracing::warn!(
                "RDMA into {}: prefill workers write KV into this worker's host KV mirror \
                 (pinned by its registration), uploaded to the GPU at admission; GPUDirect \
                 RDMA into device memory is not implemented",
                cfg.device
            );
        }
        Some(r)
    } else {
        None
    };
    let mut offers = vec![
        grpc::KvOffer {
            transport: "quic".into(),
            endpoint: quic_addr.to_string(),
            cert_der: quic.cert_der.clone(),
        },
        grpc::KvOffer {
            transport: "tcp".into(),
            endpoint: cfg
                .kv_advertise
                .clone()
                .unwrap_or_else(|| kv_addr.to_string()),
            cert_der: Vec::new(),
        },
    ];
    if let Some(r) = &rdma {
        offers.insert(
            0,
            grpc::KvOffer {
                transport: "rdma".into(),
                endpoint: r.local_addr()?.to_string(),
                cert_der: Vec::new(),
            },
        );
    }
    let (kv_tx, mut kv_rx) = mpsc::channel::<KvEvent>(16);
    let kv_local = kv_transfer::Local {
        identity: identity.clone(),
        secret: cfg.secret.clone(),
    };
    // A transfer must finish within the reservation's lease.
    let timeouts = kv_transfer::Timeouts {
        transfer: cfg.kv_timeout,
        ..Default::default()
    };
    tokio::spawn(kv_transfer::tcp::serve(
        kv_listener,
        kv_local.clone(),
        kv_tx.clone(),
        timeouts,
    ));
    if let Some(r) = rdma {
        tokio::spawn(r.serve(kv_local.clone(), kv_tx.clone(), timeouts));
    }
    tokio::spawn(quic.serve(kv_local, kv_tx, timeouts));
    let fwd = cmd_tx.clone();
    tokio::spawn(async move {
        while let Some(kv) = kv_rx.recv().await {
            if fwd.send(Cmd::Kv(kv)).is_err() {
                return;
            }
        }
    });

    let grpc_listener = bind("gRPC").await?;
    let grpc_addr = grpc_listener
        .local_addr()
        .map_err(|e| WorkerError::Bind("gRPC".into(), e))?;
    let service = Service {
        cmds: cmd_tx,
        load: load.clone(),
    };
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DecodeServer::new(service))
            .serve_with_incoming(TcpListenerStream::new(grpc_listener)),
    );

    let metrics_at = proto::metrics::start(&cfg.host)
        .await
        .map_err(|e| WorkerError::Bind("metrics".into(), e))?;
    proto::metrics::describe(METRICS);
    if let Some(a) = metrics_at {
        eprintln!("tandem decode {}: metrics on http://{a}/metrics", cfg.name);
    }
    let join = grpc::JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::Decode as i32,
        name: cfg.name.clone(),
        endpoint: format!("http://{grpc_addr}"),
        kv_offers: offers,
        identity: Some(identity.into()),
        kv_blocks_total: cfg.engine.num_blocks as u32,
        metrics_endpoint: metrics_at.map(|a| a.to_string()).unwrap_or_default(),
    };
    let l3 = load.clone();
    let id = proto::membership::join(
        cfg.router.clone(),
        join,
        Duration::from_secs(60),
        Duration::from_millis(250),
        move || l3.lock().expect("load lock").heartbeat(0),
    )
    .await?;
    tracing::info!(worker_id = id, grpc = %grpc_addr, kv = %kv_addr, "decode worker {} joined {}", cfg.name, cfg.router);
    eprintln!(
        "tandem decode {}: serving gRPC on {grpc_addr}, KV on tcp {kv_addr} and quic {quic_addr} ({})",
        cfg.name,
        model.device_name()
    );
    server.await.expect("server task does not panic")?;
    Ok(())
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
    ("tandem_kv_receive_failures_total", Counter, "Incoming KV transfers that broke before completing."),
];
