//! tandem's worker runtime: everything a prefill worker and a decode worker share.
//!
//! - [`Settings`] and [`load`]: the model (or the mock engine over the model's shape), the
//!   kernel threads, the `kv_transfer.require` check, the worker's KV identity.
//! - [`engine_thread`]: the one thread that owns an [`engine::Engine`], blocked on its command
//!   channel (or the role's next deadline) whenever there is nothing to step; the role plugs in
//!   what differs through [`engine_thread::Role`].
//! - [`grammar`]: structured output's grammars compiled off the engine thread, within a
//!   time budget.
//! - [`kv_send`]: KV sent to decode workers (a prefill's prompt, a decode worker's handoff):
//!   connections per peer, the transport chosen per peer.
//! - [`service`]: the `Worker` gRPC service every worker serves (cancel, drain, stats), and
//!   the guard that releases a request when its caller goes away.
//! - [`serve`]: gRPC listener, metrics endpoint, joining the router and heartbeating.
//! - [`WorkerError`] and [`status`]: one error type, and the one place an engine error becomes a
//!   gRPC status.

pub mod engine_thread;
pub mod grammar;
pub mod kv_log;
pub mod kv_send;
pub mod peer;
pub mod service;
pub mod store;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use engine::{EngineConfig, EngineError, Model, Tokenizer};
use proto::grpc::{self, KvOffer};
use proto::{Cause, Pool};
use tonic::Status;

pub use engine_thread::{EngineHandle, Role};

/// What every worker is configured with, whatever its pool.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Model file or directory.
    pub model: PathBuf,
    /// Where the forward pass runs (`cpu`, `cuda:N`).
    pub device: String,
    /// Run the mock engine with this timing model instead of the model's kernels.
    pub mock: Option<engine::MockTiming>,
    /// Kernel threads.
    pub threads: usize,
    /// Engine sizes (KV blocks, batch budget, running sequences).
    pub engine: EngineConfig,
    /// Host to bind listeners to (ports are picked by the OS).
    pub host: String,
    /// The router's control endpoint, e.g. `http://127.0.0.1:8001`.
    pub router: String,
    /// Name shown in logs.
    pub name: String,
    /// The only KV transport allowed, if the cluster requires one.
    pub require: Option<kv_transfer::Transport>,
    /// How the worker's hops are secured: its credentials (mutual TLS) or `insecure`.
    pub security: pki::Security,
    /// The cluster secret for KV transfers (HMAC), if the cluster has one.
    pub secret: Option<Arc<Vec<u8>>>,
    /// Membership through etcd (`[discovery]`): the worker registers there and heartbeats to
    /// every router registered there, instead of joining `router`.
    pub discovery: Option<discovery::Config>,
    /// Written once the worker serves (a readiness probe's file).
    pub ready_file: Option<PathBuf>,
    /// The cluster KV store's nodes (`http://host:port`; none: no store).
    pub store: Vec<String>,
    /// Whether the store's nodes registered in etcd are used too (`[store] discover`).
    pub store_discover: bool,
    /// Copies of each block among the store's nodes.
    pub store_replicas: usize,
    /// How long a request waits for its prompt's blocks from the store.
    pub store_fetch_timeout: std::time::Duration,
    /// Sent `SIGTERM`, how long the worker lets what it holds finish before it exits.
    pub drain_timeout: std::time::Duration,
    /// Peer fetch (`[kv_transfer] peer_fetch`): a decode worker serves its cached blocks to
    /// prefill workers, a prefill worker fetches from it the blocks it holds ([`peer`]).
    pub peer_fetch: bool,
}

/// Why a worker stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The model could not be loaded.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A listener could not be bound.
    #[error("binding {0}: {1}")]
    Bind(String, std::io::Error),
    /// The readiness file could not be written.
    #[error("writing the ready file {path}: {error}", path = .0.display(), error = .1)]
    ReadyFile(PathBuf, std::io::Error),
    /// The router refused the worker or could not be reached.
    #[error(transparent)]
    Join(#[from] proto::membership::JoinError),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The thread-count setting failed.
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
    /// The worker's credentials could not be used.
    #[error("security: {0}")]
    Security(String),
    /// The KV transport could not be set up (or a required one is missing).
    #[error(transparent)]
    Transfer(#[from] kv_transfer::TransferError),
}

/// The gRPC status of an engine error — the one place the mapping is made: a request that
/// could never fit or is malformed is the caller's fault; no room now is [`Cause::Full`] (the
/// router tries another worker); KV that arrived wrong or corrupted is a broken transfer (the
/// router recomputes the prompt); anything else is the worker's.
pub fn status(e: EngineError) -> Status {
    let cause = match &e {
        EngineError::OutOfBlocks(_) => Cause::Full,
        EngineError::InvalidRequest(_) => Cause::BadRequest,
        EngineError::KvMismatch { .. } | EngineError::CorruptKv { .. } => Cause::KvTransfer,
        _ => Cause::Engine,
    };
    match e {
        EngineError::OutOfBlocks(m) | EngineError::InvalidRequest(m) => cause.status(m),
        other => cause.status(other.to_string()),
    }
}

/// A loaded model and what a worker announces about it.
pub struct Loaded {
    /// The model (mock or real).
    pub model: Arc<Model>,
    /// Its tokenizer (stop tokens).
    pub tokenizer: Tokenizer,
    /// What KV this worker can exchange.
    pub identity: proto::ModelIdentity,
}

/// Checks `require`, sets the kernel threads and loads the model — as the mock engine (the
/// model's shape and tokenizer, no weights) when the pool runs one.
pub async fn load(s: &Settings) -> Result<Loaded, WorkerError> {
    let (local, missing) = kv_transfer::negotiate::local_transports();
    if let Some(t) = s.require.filter(|t| !local.contains(t)) {
        return Err(kv_transfer::TransferError::Refused(format!(
            "kv_transfer.require = {t:?} but {}",
            missing.join("; ")
        ))
        .into());
    }
    kernels::set_threads(s.threads)?;
    let (path, device, mock) = (s.model.clone(), s.device.clone(), s.mock);
    let (model, tokenizer) = tokio::task::spawn_blocking(move || match mock {
        Some(timing) => engine::load_mock(&path, timing),
        None => engine::load(&path, kernels::Device::parse(&device)?),
    })
    .await
    .expect("model loading does not panic")?;
    let identity = engine::identity(&model, s.engine.block_size);
    Ok(Loaded {
        model: Arc::new(model),
        tokenizer,
        identity,
    })
}

/// Binds a TCP listener on `host` with a port the OS picks; `what` names it in errors.
pub async fn bind(host: &str, what: &str) -> Result<tokio::net::TcpListener, WorkerError> {
    let addr = format!("{host}:0");
    tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| WorkerError::Bind(format!("{what} {addr}"), e))
}

/// How a worker presents itself to the router.
pub struct Announce<'a> {
    /// Its pool.
    pub pool: Pool,
    /// Where prefill workers may send it KV (decode workers).
    pub kv_offers: Vec<KvOffer>,
    /// What it says at start, after "serving gRPC on ADDR" (e.g. its KV endpoints).
    pub detail: String,
    /// Its metrics, with help text.
    pub metrics: &'a [(&'static str, proto::metrics::Kind, &'static str)],
    /// The cluster store's key for its blocks, when it uses a store (0: none).
    pub store_model: u64,
    /// Where it serves its cached blocks to prefill workers (decode, with peer fetch; empty:
    /// nowhere).
    pub peer_endpoint: String,
}

/// Serves `routes` (the pool's own gRPC service) beside the `Worker` service, starts the
/// metrics endpoint, joins the router with heartbeats of the engine's load, and serves until
/// the process ends — or, sent `SIGTERM`, drains ([`drain`]) and returns.
pub async fn serve<C: Send + 'static>(
    s: &Settings,
    loaded: &Loaded,
    engine: &EngineHandle<C>,
    routes: tonic::service::Routes,
    announce: Announce<'_>,
) -> Result<(), WorkerError> {
    let listener = bind(&s.host, "gRPC").await?;
    let grpc_addr = listener
        .local_addr()
        .map_err(|e| WorkerError::Bind("gRPC".into(), e))?;
    let routes = routes.add_service(service::server(engine.clone()));
    // Only the router calls a worker (reserve, generate, prefill, cancel, drain).
    let incoming = proto::secure::incoming(listener, &s.security, &[pki::Role::Router], "worker")
        .map_err(|e| WorkerError::Security(e.to_string()))?;
    // Installed before the worker joins: a SIGTERM from then on drains it.
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| WorkerError::Bind("a SIGTERM handler".into(), e))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            }),
    );
    let metrics_at = start_metrics(s, announce.pool, announce.metrics).await?;
    let join = grpc::JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::from(announce.pool) as i32,
        name: s.name.clone(),
        endpoint: format!("http://{grpc_addr}"),
        kv_offers: announce.kv_offers,
        identity: Some(loaded.identity.clone().into()),
        kv_blocks_total: loaded.model.kv_pages(s.engine.num_blocks) as u32,
        metrics_endpoint: metrics_at.map(|a| a.to_string()).unwrap_or_default(),
        worker_id: 0,
        device: loaded.model.device_name(),
        kv_tier_blocks: loaded.model.kv_tier_blocks(&s.engine),
        store_model: announce.store_model,
        peer_endpoint: announce.peer_endpoint,
    };
    let period = proto::membership::HEARTBEAT_PERIOD;
    match &s.discovery {
        None => {
            let beat = beats(engine.clone());
            let joining = proto::membership::join(
                s.router.clone(),
                s.security.clone(),
                join,
                Duration::from_secs(60),
                period,
                beat,
            );
            // Sent SIGTERM while it joins, it holds nothing yet: it goes at once.
            let id = tokio::select! {
                id = joining => id?,
                _ = sigterm.recv() => return Ok(()),
            };
            tracing::info!(worker_id = id, grpc = %grpc_addr, "{} worker {} joined {}", announce.pool, s.name, s.router);
        }
        Some(d) => etcd_membership(d, join, s.security.clone(), engine.clone(), period),
    }
    if let Some(f) = &s.ready_file {
        std::fs::write(f, format!("{grpc_addr}\n"))
            .map_err(|e| WorkerError::ReadyFile(f.clone(), e))?;
    }
    eprintln!(
        "tandem {} {}: serving gRPC on {grpc_addr}{} ({})",
        announce.pool,
        s.name,
        announce.detail,
        loaded.model.device_name()
    );
    tokio::select! {
        served = &mut server => served.expect("server task does not panic")?,
        _ = sigterm.recv() => {
            // Drained, the calls still answering (a stream's last tokens) end, new ones
            // refused; past the deadline the worker just goes (the router moves its streams).
            if drain(engine, &s.name, s.drain_timeout).await {
                let _ = stop.send(());
                if tokio::time::timeout(SERVER_GRACE, server).await.is_err() {
                    tracing::warn!("calls still open {SERVER_GRACE:?} after the drain: ended");
                }
            }
        }
    }
    Ok(())
}

/// How long the gRPC server may take, once drained, to finish the calls still answering (the
/// last messages of streams whose work is done: short, so a drain that stopped too early
/// cuts a stream rather than hiding behind it).
const SERVER_GRACE: Duration = Duration::from_secs(1);

/// How often a draining worker looks whether it holds anything still (only while draining:
/// its engine is told nothing of the gRPC streams and KV sends that finish the work).
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// `SIGTERM`: the worker admits nothing new (its heartbeats say so, and the router routes
/// nothing more to it) and lets what it holds finish, at most `timeout`: whether it did.
async fn drain<C: Send + 'static>(engine: &EngineHandle<C>, name: &str, timeout: Duration) -> bool {
    eprintln!("tandem worker {name}: SIGTERM: draining (at most {timeout:?})");
    if engine.drain().is_err() {
        return false;
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut poll = tokio::time::interval(DRAIN_POLL);
    loop {
        poll.tick().await;
        if engine.idle() {
            eprintln!("tandem worker {name}: drained: exiting");
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            let l = engine.load();
            eprintln!(
                "tandem worker {name}: still {} running, {} waiting after {timeout:?}: exiting",
                l.running, l.waiting
            );
            return false;
        }
    }
}

/// A heartbeat builder for one router: each router has its own place in the KV event log.
fn beats<C: Send + 'static>(handle: EngineHandle<C>) -> impl FnMut(bool) -> grpc::Heartbeat + Send {
    // The first KV event the router does not have yet.
    let mut sent = 0;
    move |resync: bool| {
        let kv = handle.kv_events(sent, resync);
        sent = kv.next;
        grpc::Heartbeat {
            worker_id: 0,
            load: Some(handle.load()),
            kv: Some(kv),
        }
    }
}

/// Registers the worker in etcd under a fresh cluster-wide id and follows every router
/// registered there (one heartbeat task each, ended when the router's registration goes).
fn etcd_membership<C: Send + 'static>(
    d: &discovery::Config,
    mut join: grpc::JoinRequest,
    security: pki::Security,
    engine: EngineHandle<C>,
    period: Duration,
) {
    use discovery::{Change, Kind};
    use prost::Message;
    let id = discovery::random_id();
    join.worker_id = id;
    drop(d.register(Kind::Worker, id, join.encode_to_vec()));
    let mut routers = d.watch(Kind::Router);
    tokio::spawn(async move {
        let mut following = std::collections::HashMap::<u64, tokio::task::JoinHandle<()>>::new();
        let follow = |rid: u64, value: &[u8], following: &mut std::collections::HashMap<_, _>| {
            let Some(control) = router_control(value) else {
                return tracing::warn!(router = rid, "unreadable router registration in etcd");
            };
            let task = proto::membership::follow(
                control,
                security.clone(),
                join.clone(),
                period,
                beats(engine.clone()),
            );
            if let Some(old) = following.insert(rid, tokio::spawn(task)) {
                old.abort();
            }
        };
        while let Some(c) = routers.recv().await {
            match c {
                Change::All(all) => {
                    following.retain(|rid, t: &mut tokio::task::JoinHandle<()>| {
                        let keep = all.iter().any(|(r, _)| r == rid);
                        if !keep {
                            t.abort();
                        }
                        keep
                    });
                    for (rid, v) in all {
                        if !following.contains_key(&rid) {
                            follow(rid, &v, &mut following);
                        }
                    }
                }
                Change::Put(rid, v) => follow(rid, &v, &mut following),
                Change::Delete(rid) => {
                    if let Some(t) = following.remove(&rid) {
                        t.abort();
                    }
                }
            }
        }
    });
    tracing::info!(
        worker_id = id,
        "registered in etcd; following the routers registered there"
    );
}

/// The control endpoint in a router's etcd registration (`{"control": "http://…", …}`).
fn router_control(value: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(value).ok()?;
    Some(v.get("control")?.as_str()?.to_string())
}

async fn start_metrics(
    s: &Settings,
    pool: Pool,
    catalogue: &[(&'static str, proto::metrics::Kind, &'static str)],
) -> Result<Option<SocketAddr>, WorkerError> {
    let at = proto::metrics::start(&s.host)
        .await
        .map_err(|e| WorkerError::Bind("metrics".into(), e))?;
    proto::metrics::describe(catalogue);
    metrics::describe_counter!(
        "tandem_worker_commands_refused_total",
        "New requests refused because engine_thread::MAX_QUEUED commands already waited for the engine."
    );
    if let Some(a) = at {
        eprintln!("tandem {pool} {}: metrics on http://{a}/metrics", s.name);
    }
    Ok(at)
}
