//! The tandem router: OpenAI-compatible HTTP in front of the prefill and decode pools.
//!
//! The router owns text: it renders the chat template, tokenises, picks a decode worker (which
//! reserves KV blocks) and a prefill worker (which computes the prompt's KV and sends it straight
//! to that decode worker), and detokenises the decode worker's token stream incrementally into
//! server-sent events. Workers join through the gRPC `Control` service; one whose model cannot
//! exchange KV with the cluster's is refused at join time. Errors become HTTP statuses in one
//! place ([`openai::ApiError`]).

pub mod actuator;
pub mod core;
pub mod front;
pub mod guard;
pub mod http;
pub mod kubernetes;
pub mod kv_index;
pub mod logprobs;
pub mod members;
pub mod openai;
pub mod peers;
pub mod planner;
pub mod registry;
pub mod request;
pub mod response;
pub mod routing;
pub mod status;
pub mod store_watch;
pub mod tokenize;
pub mod wire;

/// How long a request may wait for a decode worker with room before it is refused (503).
pub const ADMISSION_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::{get, post};
use engine::{EngineError, Tokenizer};
use proto::grpc::control_server::ControlServer;

use crate::registry::{ControlService, Registry};

/// How the router runs.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// How the control plane and the calls to workers are secured.
    pub security: pki::Security,
    /// HTTP listen address (`host:0` picks a port): the API and `/health`.
    pub listen: String,
    /// gRPC control listen address.
    pub control: String,
    /// The operator endpoints' listen address (`/metrics`, `/status`, `/status.json`,
    /// `/prometheus/targets`, `/debug/*`; loopback by default): they map the cluster, and are
    /// never served on the API's port.
    pub operator: String,
    /// The model (the router reads its tokenizer, template and shape, not its weights).
    pub model: PathBuf,
    /// KV block size every worker must use.
    pub block_size: usize,
    /// Whether the cluster has a prefill pool.
    pub disaggregated: bool,
    /// Prefill on the decode worker when the prompt's uncached rest there is at most this many
    /// tokens.
    pub local_prefill_max_tokens: u32,
    /// Prefill on the decode worker, when the prompt's uncached rest there is at most this many
    /// tokens, if computing it there takes less than the prefill pool's predicted wait (0: never).
    pub local_prefill_busy_max_tokens: u32,
    /// How workers are picked.
    pub routing: routing::Routing,
    /// When a worker is given up on (heartbeats, stalls).
    pub liveness: registry::Liveness,
    /// How many times a request may move to another decode worker when its own is lost.
    pub migration_limit: u32,
    /// Rebalance the decode pool's KV by live moves past this ratio of the fullest worker's to
    /// the mean (`None`: off).
    pub kv_rebalance: Option<f64>,
    /// The HTTP surface's limits (API keys, sizes, connections).
    pub limits: guard::Limits,
    /// How long a request may take from arrival to its last token.
    pub request_timeout: Duration,
    /// Pools the planner scales (empty: fixed pools).
    pub scaling: Vec<planner::Scaling>,
    /// Each pool's latency target (the status page's reference lines).
    pub slo: status::Targets,
    /// How the planner acts.
    pub actuator: ActuatorConfig,
    /// Other models' routers this one answers for: (model name, `host:port`).
    pub peers: Vec<(String, String)>,
    /// Membership through etcd (`[discovery]`), beside the control endpoint workers may join.
    pub discovery: Option<discovery::Config>,
    /// The cluster KV store's nodes (`http://HOST:PORT`), whose holdings the KV index follows.
    pub store: Vec<String>,
    /// Whether to follow the store nodes registered in etcd too (`[store] discover`).
    pub store_discover: bool,
}

/// Which actuator the planner drives.
#[derive(Debug, Clone)]
pub enum ActuatorConfig {
    /// Start and drain `exe <pool> --config <config> --router <control>` processes here.
    Local {
        /// The tandem binary.
        exe: PathBuf,
        /// The cluster config the workers read.
        config: PathBuf,
    },
    /// Run `<command> <pool> <replicas>`.
    Command(String),
    /// Scale each pool's Deployment through the Kubernetes API server (in-cluster credentials).
    Kubernetes(HashMap<proto::Pool, kubernetes::Target>),
}

/// Why the router stopped.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// The planner's actuator cannot work here.
    #[error("actuator: {0}")]
    Actuator(String),
    /// The model's metadata or tokenizer could not be read.
    #[error(transparent)]
    Model(#[from] EngineError),
    /// A listener could not be bound.
    #[error("binding {0}: {1}")]
    Bind(String, std::io::Error),
    /// A server failed.
    #[error("server: {0}")]
    Serve(String),
    /// `[router] models` names this router's own model.
    #[error("[router] models names {0:?}, the model this router serves itself")]
    OwnModelAsPeer(String),
}

/// Shared router state.
pub struct State {
    /// Joined workers.
    pub registry: Arc<Registry>,
    /// The model's tokenizer and chat template.
    pub tokenizer: Tokenizer,
    /// The id clients name the model by.
    pub model_id: String,
    /// The model's context length.
    pub context_len: usize,
    /// The longest token's text in bytes: a text longer than this times the context cannot fit,
    /// and is refused before it is tokenised.
    pub max_token_bytes: usize,
    /// The model's vocabulary size.
    pub vocab_size: usize,
    /// What the planner reads.
    pub signals: Arc<planner::Signals>,
    /// What requests follow: whether they go through a prefill pool, the local-prefill limits,
    /// the migration limit, the admission wait and the request timeout.
    pub core: core::Settings,
    /// The HTTP surface's limits.
    pub limits: guard::Limits,
    /// Other models' routers this one answers for.
    pub peers: peers::Peers,
    /// What the status page shows beside the registry and the signals.
    pub board: status::Board,
    next_id: AtomicU64,
    /// Prometheus rendering of this process's metrics (`None` when another recorder is set).
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    channels: Mutex<HashMap<String, tonic::transport::Channel>>,
    /// How calls to workers are secured (set before the state is shared).
    pub security: pki::Security,
    /// Requests being rendered and tokenised (off the runtime), at most [`TOKENIZING`].
    pub tokenizing: tokio::sync::Semaphore,
}

/// Prompts rendered and tokenised at once, each on the blocking pool.
pub const TOKENIZING: usize = 2;

impl State {
    /// Shared state over `registry` for a model of `config` served as `model_id`.
    pub fn new(
        registry: Arc<Registry>,
        tokenizer: Tokenizer,
        config: &engine::ModelConfig,
        model_id: String,
        disaggregated: bool,
        window: Duration,
    ) -> State {
        let block_seed = engine::block_hash::identity_seed(config, registry.block_size());
        let max_token_bytes = max_token_bytes(&tokenizer);
        State {
            registry,
            tokenizer,
            model_id,
            context_len: config.context_len,
            max_token_bytes,
            vocab_size: config.vocab_size,
            signals: Arc::new(planner::Signals::new(window)),
            core: core::Settings {
                disaggregated,
                block_seed,
                ..core::Settings::default()
            },
            limits: guard::Limits::default(),
            peers: peers::Peers::default(),
            board: status::Board::new(status::Targets::default()),
            next_id: AtomicU64::new(first_request_id()),
            metrics: proto::metrics::install().inspect(|_| describe()),
            channels: Mutex::new(HashMap::new()),
            security: pki::Security::Insecure,
            tokenizing: tokio::sync::Semaphore::new(TOKENIZING),
        }
    }

    /// Every model this router answers for: its own, then the others' (by name).
    pub fn served_models(&self) -> Vec<String> {
        let others = self.peers.names().map(String::from);
        std::iter::once(self.model_id.clone())
            .chain(others)
            .collect()
    }

    /// The error for a request naming model `m`, which is not served here.
    pub fn unknown_model(&self, m: &str) -> openai::ApiError {
        openai::ApiError::ModelNotFound(format!(
            "the model {m:?} does not exist; this cluster serves {:?}",
            self.served_models()
        ))
    }

    /// A request id no other router hands out: a random 32-bit prefix for this router, then a
    /// counter (workers key requests by id, and several routers share them).
    pub(crate) fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::SeqCst)
    }

    /// The gRPC channel to a worker's endpoint (one per endpoint, connected lazily).
    pub fn channel(&self, endpoint: &str) -> Result<tonic::transport::Channel, tonic::Status> {
        let mut cache = self.channels.lock().expect("channel cache lock");
        if let Some(c) = cache.get(endpoint) {
            return Ok(c.clone());
        }
        let c = proto::secure::endpoint(&self.security, endpoint, pki::Role::WORKER_DNS)
            .map_err(|e| {
                proto::Cause::Unreachable.status(format!("bad worker endpoint {endpoint}: {e}"))
            })?
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        cache.insert(endpoint.to_string(), c.clone());
        Ok(c)
    }
}

/// The longest token of `tokenizer`'s vocabulary, in bytes (at least 1).
fn max_token_bytes(tokenizer: &Tokenizer) -> usize {
    (0..tokenizer.vocab_size() as u32)
        .filter_map(|id| tokenizer.token_bytes(id).ok())
        .map(|b| b.len())
        .max()
        .unwrap_or(1)
        .max(1)
}

/// This router's first request id: a random prefix in the high 32 bits (from the standard
/// library's randomly seeded hasher), the counter from 1.
fn first_request_id() -> u64 {
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (random << 32) | 1
}

/// The id clients use for a model at `path`: its file or directory name without `.gguf`.
pub fn model_id(path: &std::path::Path) -> String {
    let name = path
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().to_string());
    name.strip_suffix(".gguf").unwrap_or(&name).to_string()
}

/// The API's HTTP routes over `state`, behind its limits: the OpenAI API, the tokenizer
/// endpoints and `/health` — nothing that maps the cluster (see [`operator`]).
pub fn app(state: Arc<State>) -> axum::Router {
    let max_body = state.limits.max_body_bytes;
    axum::Router::new()
        .route("/v1/chat/completions", post(http::chat))
        .route("/v1/completions", post(http::completions))
        .route("/v1/models", get(http::models))
        .route("/health", get(http::health))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            guard::check,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// The operator endpoints over `state`, for the operator's own listener: the metrics, the
/// status page and its data, Prometheus's worker targets (every worker's address), the workers'
/// debug view, and `/health`.
pub fn operator(state: Arc<State>) -> axum::Router {
    axum::Router::new()
        .route("/health", get(http::health))
        .route("/debug/workers", get(http::workers))
        .route("/metrics", get(http::metrics))
        .route("/", get(status::page))
        .route("/status", get(status::page))
        .route("/status.json", get(status::status_json))
        .route("/prometheus/targets", get(status::prometheus_targets))
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .with_state(state)
}

/// Where a router listens, once bound.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// The API.
    pub http: SocketAddr,
    /// The control plane (workers join).
    pub control: SocketAddr,
    /// The operator endpoints.
    pub operator: SocketAddr,
}

/// The router's shared state for `cfg`.
fn state(cfg: &RouterConfig) -> Result<State, RouterError> {
    let (config, tokenizer) = engine::inspect(&cfg.model)?;
    let identity = engine::identity_of(&config, cfg.block_size);
    let registry = Registry::configured(identity, cfg.liveness, cfg.routing);
    let window = cfg
        .scaling
        .iter()
        .map(|s| s.window)
        .max()
        .unwrap_or(Duration::from_secs(5));
    let mut state = State::new(
        registry,
        tokenizer,
        &config,
        model_id(&cfg.model),
        cfg.disaggregated,
        window,
    );
    state.core.local_prefill_max_tokens = cfg.local_prefill_max_tokens;
    state.core.local_prefill_busy_max_tokens = cfg.local_prefill_busy_max_tokens;
    state.core.migration_limit = cfg.migration_limit;
    state.core.request_timeout = cfg.request_timeout;
    state.limits = cfg.limits.clone();
    state.security = cfg.security.clone();
    if let Some((own, _)) = cfg.peers.iter().find(|(n, _)| *n == state.model_id) {
        return Err(RouterError::OwnModelAsPeer(own.clone()));
    }
    state.peers = peers::Peers::new(&cfg.peers, cfg.request_timeout);
    state.board = status::Board::new(cfg.slo);
    Ok(state)
}

/// Binds `addr`; the listener and its address.
async fn bind(addr: &str) -> Result<(tokio::net::TcpListener, SocketAddr), RouterError> {
    let bad = |e| RouterError::Bind(addr.to_string(), e);
    let l = tokio::net::TcpListener::bind(addr).await.map_err(bad)?;
    let at = l.local_addr().map_err(bad)?;
    Ok((l, at))
}

/// The planner's actuator for `cfg`, its local workers joining at `control`.
fn actuator(
    cfg: &RouterConfig,
    control: String,
) -> Result<Box<dyn actuator::Actuator>, RouterError> {
    Ok(match &cfg.actuator {
        ActuatorConfig::Local { exe, config } => Box::new(actuator::Local::new(
            exe.clone(),
            config.clone(),
            control,
            cfg.security.clone(),
        )),
        ActuatorConfig::Command(c) => Box::new(actuator::Command::new(c.clone())),
        ActuatorConfig::Kubernetes(targets) => {
            let api = kubernetes::KubeApi::in_cluster().ok_or(RouterError::Actuator(
                "the kubernetes actuator runs in a pod: KUBERNETES_SERVICE_HOST and the service account are missing".into(),
            ))?;
            let k =
                kubernetes::Kubernetes::new(api, targets.clone()).map_err(RouterError::Actuator)?;
            Box::new(k)
        }
    })
}

/// Binds the three listeners, reports their addresses (`on_ready`), and serves until the
/// process ends.
pub async fn run(cfg: RouterConfig, on_ready: impl FnOnce(Bound)) -> Result<(), RouterError> {
    let state = Arc::new(state(&cfg)?);
    tokio::spawn(status::sampler(state.clone()));
    let (http_l, http_addr) = bind(&cfg.listen).await?;
    let (ctrl_l, ctrl_addr) = bind(&cfg.control).await?;
    let (op_l, op_addr) = bind(&cfg.operator).await?;
    let app = app(state.clone());
    let ops = operator(state.clone());
    // Only workers join and heartbeat.
    let workers = [pki::Role::Prefill, pki::Role::Decode];
    let incoming = proto::secure::incoming(ctrl_l, &cfg.security, &workers, "control")
        .map_err(|e| RouterError::Serve(e.to_string()))?;
    let control = tonic::transport::Server::builder()
        .add_service(ControlServer::new(ControlService::new(
            state.registry.clone(),
            cfg.security.credentials().is_some(),
        )))
        .serve_with_incoming(incoming);
    on_ready(Bound {
        http: http_addr,
        control: ctrl_addr,
        operator: op_addr,
    });
    let router_id = discovery::random_id();
    for (node, uri) in cfg.store.iter().enumerate() {
        let (registry, security) = (state.registry.clone(), cfg.security.clone());
        let at = (node, store_watch::Source::Config);
        tokio::spawn(store_watch::follow(registry, security, at, uri.clone()));
    }
    if let (Some(d), true) = (&cfg.discovery, cfg.store_discover) {
        let (registry, security) = (state.registry.clone(), cfg.security.clone());
        store_watch::discover(d, registry, security, &cfg.store);
    }
    if let Some(d) = &cfg.discovery {
        members::start(d, router_id, state.registry.clone(), http_addr, ctrl_addr);
    }
    if let Some(trigger) = cfg.kv_rebalance {
        tokio::spawn(rebalance(state.clone(), trigger));
    }
    if !cfg.scaling.is_empty() {
        // With etcd, one planner acts at a time: the others follow until the leader is gone.
        let leader = cfg.discovery.as_ref().map(|d| {
            let me = format!("router {router_id:016x} http://{http_addr}");
            d.lead("planner", me.into_bytes())
        });
        let actuator = actuator(&cfg, format!("http://{ctrl_addr}"))?;
        let plans = cfg
            .scaling
            .iter()
            .cloned()
            .map(planner::PoolPlan::new)
            .collect();
        tokio::spawn(planner::run(state.clone(), plans, actuator, leader));
    }
    tokio::select! {
        r = front::serve(http_l, app, cfg.limits.caps()) => r.map_err(|e| RouterError::Serve(e.to_string())),
        r = front::serve(op_l, ops, cfg.limits.caps()) => r.map_err(|e| RouterError::Serve(e.to_string())),
        r = control => r.map_err(|e| RouterError::Serve(e.to_string())),
    }
}

/// Rebalances the decode pool's KV every second (see [`core::Rebalancer`]).
async fn rebalance(state: Arc<State>, trigger: f64) {
    let mut r = core::Rebalancer::new(trigger);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        if let Some(shed) = state.registry.rebalance(&mut r, std::time::Instant::now()) {
            metrics::counter!("tandem_router_rebalances_total").increment(1);
            metrics::counter!("tandem_router_rebalance_shed_total")
                .increment(shed.sequences as u64);
        }
    }
}

use proto::metrics::Kind::{Counter, Gauge, Histogram};

/// Every metric the router exports, with its help text (beside one gauge per worker load
/// figure, `tandem_worker_<field>`, described from [`proto::grpc::LOAD_FIELDS`]).
const METRICS: &[(&str, proto::metrics::Kind, &str)] = &[
    (
        "tandem_router_connections_refused_total",
        Counter,
        "HTTP connections closed at accept, by reason (per_address: the client's address held max_connections_per_address already).",
    ),
    (
        "tandem_router_requests_total",
        Counter,
        "Requests by outcome (ok, client_error, server_error, stream_error).",
    ),
    (
        "tandem_router_ttft_seconds",
        Histogram,
        "Time to first token, from arrival at the router (queueing included).",
    ),
    (
        "tandem_router_ttft_phase_seconds",
        Histogram,
        "Where a first try's time to first token went: admission (to a decode worker's reservation), prefill (the prefill pool's part until the KV is in the decode worker's cache; remote prefills), first_token (from there to the first token).",
    ),
    (
        "tandem_router_token_delay_seconds",
        Histogram,
        "A token's way from its decode worker handing it to its stream to the router's HTTP response (by the two machines' wall clocks; the simulator draws its tokens' delays from it).",
    ),
    (
        "tandem_router_itl_seconds",
        Histogram,
        "Time between consecutive tokens of a stream.",
    ),
    (
        "tandem_router_e2e_seconds",
        Histogram,
        "Arrival to last token.",
    ),
    (
        "tandem_kv_transfers_total",
        Counter,
        "KV transfers completed, by transport.",
    ),
    (
        "tandem_kv_transfer_bytes_total",
        Counter,
        "KV bytes moved, by transport.",
    ),
    (
        "tandem_kv_transfer_failures_total",
        Counter,
        "Prefills or KV transfers that failed (the prompt was recomputed on the decode worker).",
    ),
    (
        "tandem_router_recomputes_total",
        Counter,
        "Prompts recomputed on their decode worker, by why: the transfer failed, the prefill worker was lost, no prefill worker, a live move failed.",
    ),
    (
        "tandem_router_peer_fetch_total",
        Counter,
        "Prefills whose decode worker holds part of the prompt and serves it (peer fetch), by the router's decision: fetch, compute (fetching measured dearer than computing), probe (fetched to measure again), nothing (the prefill worker holds it all).",
    ),
    (
        "tandem_kv_transport_chosen_total",
        Counter,
        "Transfers by the transport negotiated and why it was chosen.",
    ),
    (
        "tandem_kv_exposed_wait_seconds",
        Histogram,
        "From a prompt's last layer computed to the decode worker's ack, by transport.",
    ),
    (
        "tandem_worker_in_flight",
        Gauge,
        "Requests the router has in flight on a worker.",
    ),
    ("tandem_router_prefill_decisions_total", Counter, "Where each prompt was prefilled and why: remote, local: short suffix (its uncached rest on the decode worker is short), local: no prefill worker."),
    ("tandem_router_forwarded_total", Counter, "Requests passed to another model's router ([router] models), by model."),
    ("tandem_router_kv_index_blocks", Gauge, "Blocks in the router's KV index (one entry per block per worker caching it)."),
    ("tandem_router_store_nodes", Gauge, "The cluster store's nodes the router follows, by how it knows of them (config: named in cluster.toml; etcd: registered there)."),
    ("tandem_router_kv_index_tier_blocks", Gauge, "The KV index's entries by the tier holding them (pool, host, disk; a block in two tiers of a worker counts in each), and the blocks of the cluster store's it follows (store)."),
    ("tandem_router_request_phases_total", Counter, "Requests entering each phase of their life (reserving, prefilling, decoding, recomputing, done, failed, gone)."),
    ("tandem_planner_desired_replicas", Gauge, "Replicas the planner wants, by pool."),
    ("tandem_planner_live_replicas", Gauge, "Replicas serving (joined, not draining), by pool."),
    ("tandem_planner_p90_seconds", Gauge, "The p90 the planner read over its window (prefill: TTFT from decode reservation; decode: ITL)."),
    ("tandem_planner_predicted_seconds", Gauge, "Latency the queue predicts (prefill: pending prompt tokens over measured capacity; decode: admission wait while requests queue)."),
    ("tandem_planner_queued", Gauge, "Work queued in front of the pool (prefill: prompt tokens; decode: requests waiting for room)."),
    ("tandem_planner_margin", Gauge, "What the planner multiplies a pool's measured demand by when it sizes the pool: 1, raised a tenth each tick the pool's latency p90 is over target, lowered back while it is under 80% of it."),
    ("tandem_planner_needed_replicas", Gauge, "Replicas the demand needs: observed now (horizon=now) and predicted a start-up ahead on its trend, times the planner's margin (horizon=lead)."),
    ("tandem_planner_start_up_seconds", Gauge, "The replicas' start-up the planner measured (asked for to serving; 0 until measured), by pool: how far ahead it sizes."),
    ("tandem_planner_replica_seconds", Gauge, "Worker-seconds so far: live replicas integrated over planner ticks, by pool."),
    ("tandem_planner_decisions_total", Counter, "Planner decisions by pool and action (up, down, hold)."),
    ("tandem_router_rebalances_total", Counter, "Times the decode pool's fullest worker was asked to shed sequences ([router] kv_rebalance: its KV in use past that ratio to the pool's mean)."),
    ("tandem_router_rebalance_shed_total", Counter, "Sequences the rebalancer asked to move off the fullest decode worker."),
    ("tandem_router_moves_total", Counter, "Requests moved off a decode worker live (paused, their KV handed to another decode worker, nothing computed again), by why (draining, rebalance)."),
    ("tandem_router_moves_stayed_total", Counter, "Live moves that found no decode worker with room in time: the request resumed where it was paused."),
    ("tandem_router_moved_kv_bytes_total", Counter, "KV bytes live moves handed from one decode worker to another, by transport."),
    ("tandem_router_move_transfer_seconds", Histogram, "A live move's handoff: the old decode worker's KV transfer to the new one's ack, by transport."),
    ("tandem_router_prefill_call_failures_total", Counter, "Prefill calls that ended in an error (the prompt recomputed, or its KV already arrived and only the reply was lost)."),
    ("tandem_router_admission_holds_total", Counter, "Decode workers held for the oldest request waiting for room (after router::core::HOLD_AFTER): no other request is reserved there until it is."),
    ("tandem_planner_leader", Gauge, "1 while this router's planner leads (decides and scales), 0 while it follows another router's (etcd election); absent without etcd."),
];

fn describe() {
    proto::metrics::describe(METRICS);
    for &(_, metric, help) in proto::grpc::LOAD_FIELDS {
        metrics::describe_gauge!(metric, help);
    }
}
