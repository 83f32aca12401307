//! The tandem prefill worker.
//!
//! It serves the `Prefill` gRPC service: a request names the tokens whose KV to compute (a
//! prompt less its last token) and the decode worker's KV endpoint. The engine thread batches
//! waiting prompts under a token budget (chunked prefill), and as each completes its KV is copied
//! out, its blocks freed, and the KV sent straight to the decode worker over `kv-transfer` —
//! never through the router. The call returns once the decode worker has acknowledged the KV.
//! A call the router drops is cancelled: the request leaves the engine and its blocks are freed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{Engine, EngineConfig, EngineError};
use kv_transfer::{KvSender, Layers, Offer, Transport};
use proto::grpc::prefill_server::{Prefill, PrefillServer};
use proto::grpc::{self, PrefillReply, PrefillRequest};
use proto::membership::Load;
use tokio::sync::oneshot;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// How a prefill worker runs.
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    /// Model file or directory.
    pub model: PathBuf,
    /// Where the forward pass runs (`cpu`, `cuda:N`).
    pub device: String,
    /// Run the mock engine with this timing model instead of the model's kernels.
    pub mock: Option<engine::MockTiming>,
    /// Kernel threads.
    pub threads: usize,
    /// Engine sizes (KV blocks, chunk budget).
    pub engine: EngineConfig,
    /// Host to bind the gRPC listener to (the port is picked by the OS).
    pub host: String,
    /// The router's control endpoint, e.g. `http://127.0.0.1:8001`.
    pub router: String,
    /// Name shown in logs.
    pub name: String,
    /// Connect and handshake deadline for KV connections.
    pub connect_timeout: Duration,
    /// Deadline for one request's KV transfer.
    pub transfer_timeout: Duration,
    /// Transports in order of preference.
    pub prefer: Vec<Transport>,
    /// The only transport allowed, if the cluster requires one.
    pub require: Option<Transport>,
    /// The cluster secret to prove to decode workers, if the cluster has one.
    pub secret: Option<Arc<Vec<u8>>>,
    /// Send each layer's KV as soon as it is computed (overlapping the transfer with the rest
    /// of the prefill) rather than all at the end.
    pub layerwise: bool,
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
    /// A required KV transport is missing.
    #[error(transparent)]
    Transfer(#[from] kv_transfer::TransferError),
}

/// Where a request's KV layers go, in order, as the engine produces them, and when the last
/// one was computed.
struct LayerTx {
    tx: tokio::sync::mpsc::UnboundedSender<kv_transfer::Layer>,
    done: Arc<std::sync::OnceLock<Instant>>,
}

impl LayerTx {
    /// Hands on one layer, checksummed here on the engine thread while its bytes are hot.
    fn send(&self, bytes: Vec<u8>, last: bool) {
        if last {
            let _ = self.done.set(Instant::now());
        }
        let _ = self.tx.send(kv_transfer::Layer::new(bytes));
    }
}

enum Cmd {
    Prefill {
        id: u64,
        tokens: Vec<u32>,
        /// Admission verdict.
        accepted: oneshot::Sender<Result<(), Status>>,
        layers: LayerTx,
    },
    Cancel {
        id: u64,
        found: oneshot::Sender<bool>,
    },
    Drain,
}

/// The engine thread. With `layerwise`, each layer of a completing prompt is handed over as
/// soon as it is computed; otherwise all layers once the prompt is done.
fn engine_loop(
    mut engine: Engine,
    rx: std_mpsc::Receiver<Cmd>,
    load: Arc<Mutex<Load>>,
    layerwise: bool,
) {
    let n_layers = engine.model().config.n_layers;
    let mut outs: HashMap<u64, LayerTx> = HashMap::new();
    // Prompt tokens per second of engine time (moving average), reported as capacity.
    let mut capacity = 0f64;
    let mut draining = false;
    loop {
        let first = if engine.has_work() {
            rx.try_recv().ok()
        } else {
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(c) => Some(c),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            match cmd {
                Cmd::Prefill {
                    id,
                    tokens,
                    accepted,
                    layers,
                } => {
                    let verdict = if draining {
                        Err(Status::unavailable("this prefill worker is draining"))
                    } else {
                        match engine.add_prefill_only(id, tokens) {
                            Ok(()) => {
                                outs.insert(id, layers);
                                Ok(())
                            }
                            Err(EngineError::OutOfBlocks(m)) => Err(Status::resource_exhausted(m)),
                            Err(e) => Err(Status::invalid_argument(e.to_string())),
                        }
                    };
                    let _ = accepted.send(verdict);
                }
                Cmd::Cancel { id, found } => {
                    outs.remove(&id);
                    let _ = found.send(engine.abort(id));
                }
                Cmd::Drain => draining = true,
            }
        }
        // Callers that went away (their channel closed) are aborted and their blocks freed.
        let gone: Vec<u64> = outs
            .iter()
            .filter(|(_, t)| t.tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            outs.remove(&id);
            engine.abort(id);
        }
        if engine.has_work() {
            let t0 = Instant::now();
            let stepped = if layerwise {
                engine.step_streaming(&mut |id, l, bytes| {
                    if let Some(t) = outs.get(&id) {
                        t.send(bytes, l + 1 == n_layers);
                    }
                    if l + 1 == n_layers {
                        outs.remove(&id);
                    }
                })
            } else {
                engine.step()
            };
            let (prompt_tokens, _) = engine.last_step();
            let secs = t0.elapsed().as_secs_f64();
            if prompt_tokens > 0 && secs > 0.0 {
                let rate = prompt_tokens as f64 / secs;
                capacity = if capacity > 0.0 {
                    0.8 * capacity + 0.2 * rate
                } else {
                    rate
                };
            }
            metrics::histogram!("tandem_prefill_step_seconds").record(t0.elapsed().as_secs_f64());
            metrics::histogram!("tandem_prefill_batch_tokens").record(prompt_tokens as f64);
            metrics::counter!("tandem_prefill_prompt_tokens_total").increment(prompt_tokens as u64);
            if let Err(e) = stepped {
                // Dropping the senders fails every transfer in progress; keep serving.
                tracing::error!("prefill step failed: {e}");
                for (id, _) in outs.drain() {
                    engine.abort(id);
                }
            }
            for id in engine.take_prefilled() {
                let kv = engine.export_kv(id).expect("reported as prefilled");
                if let Some(t) = outs.remove(&id) {
                    let n = kv.len();
                    kv.into_iter()
                        .enumerate()
                        .for_each(|(l, bytes)| t.send(bytes, l + 1 == n));
                }
            }
        }
        let l = proto::membership::Load {
            prompt_tokens_per_s: capacity as f32,
            ..engine.load()
        };
        metrics::gauge!("tandem_prefill_queue_depth").set(l.waiting as f64);
        metrics::gauge!("tandem_prefill_running").set(l.running as f64);
        *load.lock().expect("load lock") = l;
    }
}

struct Service {
    cmds: std_mpsc::Sender<Cmd>,
    load: Arc<Mutex<Load>>,
    local: kv_transfer::Local,
    width: u32,
    /// Idle connections to decode workers, by KV endpoint. A connection is taken out while a
    /// transfer uses it, so a cancelled transfer drops its (possibly half-written) connection.
    conns: Mutex<HashMap<String, Vec<KvSender>>>,
    connect_timeout: Duration,
    transfer_timeout: Duration,
    prefer: Vec<Transport>,
    require: Option<Transport>,
    layerwise: bool,
    n_layers: u32,
    /// Peers whose transport choice has been logged.
    announced: Mutex<std::collections::HashSet<String>>,
    /// Requests between admission and the decode worker's ack (reported in heartbeats).
    inflight: Arc<std::sync::atomic::AtomicUsize>,
}

impl Service {
    fn send(&self, c: Cmd) -> Result<(), Status> {
        self.cmds
            .send(c)
            .map_err(|_| Status::unavailable("the engine thread has stopped"))
    }
}

#[tonic::async_trait]
impl Prefill for Service {
    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<PrefillReply>, Status> {
        let req = req.into_inner();
        let n = req.tokens.len() as u32;
        let t0 = Instant::now();
        let (accepted, verdict) = oneshot::channel();
        let (layers_tx, mut layers_rx) = tokio::sync::mpsc::unbounded_channel();
        let done = Arc::new(std::sync::OnceLock::new());
        let layers = LayerTx {
            tx: layers_tx,
            done: done.clone(),
        };
        self.send(Cmd::Prefill {
            id: req.request_id,
            tokens: req.tokens,
            accepted,
            layers,
        })?;
        verdict
            .await
            .map_err(|_| Status::unavailable("the engine thread has stopped"))??;
        // Counted until this call ends, however it ends.
        struct Counted(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        self.inflight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _counted = Counted(self.inflight.clone());
        let offers: Vec<Offer> = req
            .offers
            .iter()
            .filter_map(|o| {
                Some(Offer {
                    transport: Transport::parse(&o.transport)?,
                    endpoint: o.endpoint.clone(),
                    cert_der: o.cert_der.clone(),
                })
            })
            .collect();
        let (local, _) = kv_transfer::negotiate::local_transports();
        let (offer, why) =
            kv_transfer::negotiate::choose(&offers, &local, &self.prefer, self.require)
                .map_err(|e| Status::failed_precondition(e.to_string()))?;
        if self
            .announced
            .lock()
            .expect("announced lock")
            .insert(offer.endpoint.clone())
        {
            tracing::info!(peer = %offer.endpoint, transport = %offer.transport, "KV transport chosen: {why}");
            eprintln!("tandem prefill: KV to {} over {why}", offer.endpoint);
        }
        let idle = self
            .conns
            .lock()
            .expect("conns lock")
            .get_mut(&offer.endpoint)
            .and_then(Vec::pop);
        let mut conn = match idle {
            Some(c) => c,
            None => KvSender::connect(&offer, &self.local, self.connect_timeout)
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?,
        };
        // Connected while the prompt computes; now the layers, streamed or whole.
        let all: Vec<kv_transfer::Layer>;
        let layers = if self.layerwise {
            Layers::Stream {
                n_layers: self.n_layers,
                rx: &mut layers_rx,
            }
        } else {
            let mut v = Vec::with_capacity(self.n_layers as usize);
            while v.len() < self.n_layers as usize {
                v.push(
                    layers_rx
                        .recv()
                        .await
                        .ok_or_else(|| Status::internal("the prefill of this request failed"))?,
                );
            }
            all = v;
            Layers::Ready(&all)
        };
        let transport = offer.transport.name();
        let stats = conn
            .send(req.request_id, n, self.width, layers, self.transfer_timeout)
            .await
            .map_err(|e| {
                metrics::counter!("tandem_kv_send_failures_total", "transport" => transport)
                    .increment(1);
                Status::unavailable(e.to_string())
            })?;
        metrics::counter!("tandem_kv_sent_bytes_total", "transport" => transport)
            .increment(stats.bytes);
        metrics::histogram!("tandem_kv_send_seconds", "transport" => transport)
            .record(stats.elapsed.as_secs_f64());
        self.conns
            .lock()
            .expect("conns lock")
            .entry(offer.endpoint)
            .or_default()
            .push(conn);
        Ok(Response::new(PrefillReply {
            kv_bytes: stats.bytes,
            compute_us: done
                .get()
                .map_or(0, |d| d.duration_since(t0).as_micros() as u64),
            transfer_us: done.get().map_or(0, |d| d.elapsed().as_micros() as u64),
            transport: stats.transport.name().into(),
            transport_reason: why,
        }))
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

/// Loads the model, starts the gRPC service, joins the router and serves until the process ends.
pub async fn run(cfg: PrefillConfig) -> Result<(), WorkerError> {
    let (local, missing) = kv_transfer::negotiate::local_transports();
    if let Some(t) = cfg.require.filter(|t| !local.contains(t)) {
        return Err(kv_transfer::TransferError::Refused(format!(
            "kv_transfer.require = {t:?} but {}",
            missing.join("; ")
        ))
        .into());
    }
    kernels::set_threads(cfg.threads)?;
    let model_path = cfg.model.clone();
    let device = cfg.device.clone();
    let (model, _) = tokio::task::spawn_blocking(move || {
        engine::load(&model_path, kernels::Device::parse(&device)?)
    })
    .await
    .expect("model loading does not panic")?;
    let model = Arc::new(match cfg.mock {
        Some(timing) => model.into_mock(timing),
        None => model,
    });
    let identity = engine::identity(&model, cfg.engine.block_size);
    let engine = Engine::new(model.clone(), cfg.engine.clone(), Vec::new())?;
    let load = Arc::new(Mutex::new(engine.load()));
    let (cmd_tx, cmd_rx) = std_mpsc::channel();
    let (l2, layerwise) = (load.clone(), cfg.layerwise);
    std::thread::Builder::new()
        .name("prefill-engine".into())
        .spawn(move || engine_loop(engine, cmd_rx, l2, layerwise))
        .expect("engine thread starts");

    let addr = format!("{}:0", cfg.host);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| WorkerError::Bind(addr.clone(), e))?;
    let grpc_addr = listener
        .local_addr()
        .map_err(|e| WorkerError::Bind(addr, e))?;
    let inflight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let service = Service {
        cmds: cmd_tx,
        load: load.clone(),
        width: model.config.kv_width() as u32,
        local: kv_transfer::Local {
            identity: identity.clone(),
            secret: cfg.secret.clone(),
        },
        conns: Mutex::new(HashMap::new()),
        inflight: inflight.clone(),
        connect_timeout: cfg.connect_timeout,
        transfer_timeout: cfg.transfer_timeout,
        prefer: cfg.prefer.clone(),
        require: cfg.require,
        layerwise: cfg.layerwise,
        n_layers: model.config.n_layers as u32,
        announced: Mutex::new(Default::default()),
    };
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PrefillServer::new(service))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let metrics_at = proto::metrics::start(&cfg.host)
        .await
        .map_err(|e| WorkerError::Bind("metrics".into(), e))?;
    proto::metrics::describe(METRICS);
    if let Some(a) = metrics_at {
        eprintln!("tandem prefill {}: metrics on http://{a}/metrics", cfg.name);
    }
    let join = grpc::JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::Prefill as i32,
        name: cfg.name.clone(),
        endpoint: format!("http://{grpc_addr}"),
        kv_offers: Vec::new(),
        identity: Some(identity.into()),
        kv_blocks_total: cfg.engine.num_blocks as u32,
        metrics_endpoint: metrics_at.map(|a| a.to_string()).unwrap_or_default(),
    };
    let l3 = load.clone();
    let inflight = inflight.clone();
    let id = proto::membership::join(
        cfg.router.clone(),
        join,
        Duration::from_secs(60),
        Duration::from_millis(250),
        move || {
            let inflight = inflight.load(std::sync::atomic::Ordering::SeqCst) as u32;
            l3.lock().expect("load lock").heartbeat(inflight)
        },
    )
    .await?;
    tracing::info!(worker_id = id, grpc = %grpc_addr, "prefill worker {} joined {}", cfg.name, cfg.router);
    eprintln!(
        "tandem prefill {}: serving gRPC on {grpc_addr} ({})",
        cfg.name,
        model.device_name()
    );
    server.await.expect("server task does not panic")?;
    Ok(())
}

use proto::metrics::Kind::{Counter, Gauge, Histogram};

/// Every metric a prefill worker exports, with its help text.
const METRICS: &[(&str, proto::metrics::Kind, &str)] = &[
    (
        "tandem_prefill_queue_depth",
        Gauge,
        "Prompts waiting for the engine.",
    ),
    ("tandem_prefill_running", Gauge, "Prompts being computed."),
    (
        "tandem_prefill_step_seconds",
        Histogram,
        "Duration of one engine step.",
    ),
    (
        "tandem_prefill_batch_tokens",
        Histogram,
        "Prompt tokens in one engine step.",
    ),
    (
        "tandem_prefill_prompt_tokens_total",
        Counter,
        "Prompt tokens computed (rate: prompt tokens per second).",
    ),
    (
        "tandem_kv_sent_bytes_total",
        Counter,
        "KV bytes delivered to decode workers, by transport.",
    ),
    (
        "tandem_kv_send_seconds",
        Histogram,
        "One request's KV transfer, first byte to ack, by transport.",
    ),
    (
        "tandem_kv_send_failures_total",
        Counter,
        "KV transfers that failed, by transport.",
    ),
];
