//! `cluster.toml`: the one file a deployment is described by. Parsed and validated once at start;
//! every error names the file, the line and the key.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

mod check;
mod names;

use check::Ctx;
pub use names::{Actuator, Admission, EngineKind, MockPreset, Policy, Transport, WritePolicy};

/// A config error, already formatted as `file:line: key: what is wrong`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The whole cluster.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// The model every worker serves.
    #[serde(default)]
    pub model: ModelSection,
    /// The HTTP front end.
    #[serde(default)]
    pub router: RouterSection,
    /// The prefill pool; absent means colocated serving (decode workers prefill themselves).
    pub prefill: Option<PoolSection>,
    /// The decode pool.
    pub decode: PoolSection,
    /// KV-transfer settings.
    #[serde(default)]
    pub kv_transfer: KvTransferSection,
    /// More models, each a cluster file of its own (model, pools, SLOs) that `tandem up`
    /// starts beside this one; this cluster's router answers for them (`[[models]]`).
    #[serde(default)]
    pub models: Vec<MoreModel>,
    /// Membership through etcd instead of (beside) the router's control address.
    pub discovery: Option<DiscoverySection>,
    /// How the internal hops are secured.
    #[serde(default)]
    pub security: SecuritySection,
    /// The cluster KV store's node (`tandem store`).
    #[serde(default)]
    pub store: StoreSection,
}

/// `[store]`: a node of the cluster KV store (`tandem store`), where workers keep KV blocks
/// apart from any one of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    /// Where the node serves (gRPC, mutual TLS); port 0 picks a free one.
    #[serde(default = "default_store_listen")]
    pub listen: Spanned<String>,
    /// The port of its data connections (the bytes of puts and gets), on `listen`'s host; 0
    /// picks a free one (workers learn it from the node).
    #[serde(default)]
    pub data_port: u16,
    /// Bytes of objects it keeps (evicting from 90% down to 85%).
    #[serde(default = "default_store_capacity")]
    pub capacity_bytes: Spanned<u64>,
    /// Largest object (a KV block of every layer).
    #[serde(default = "default_store_max_object")]
    pub max_object_bytes: Spanned<u64>,
    /// A read lease's length (renewable up to six times this).
    #[serde(default = "default_store_lease_ms")]
    pub lease_ms: Spanned<u64>,
    /// A put not published within this is abandoned and freed.
    #[serde(default = "default_store_put_deadline_ms")]
    pub put_deadline_ms: Spanned<u64>,
    /// Workers and the router: the node workers put their computed KV blocks in and fetch
    /// prompts' blocks from (`http://HOST:PORT`); none (and no `nodes`): no store.
    #[serde(default)]
    pub node: Option<Spanned<String>>,
    /// Or several nodes: each block placed on `replicas` of them by rendezvous hashing, so a
    /// node that leaves loses no block another holds.
    #[serde(default)]
    pub nodes: Option<Spanned<Vec<String>>>,
    /// Workers and the router: also use every node registered in etcd (`[discovery]`), as
    /// they come and go; store nodes register there whenever `[discovery]` is set.
    #[serde(default = "default_off")]
    pub discover: Spanned<bool>,
    /// A node registered in etcd: the address workers and the router dial
    /// (`http://HOST:PORT`; default: the address it serves on, which must then be a
    /// specific one, not 0.0.0.0).
    #[serde(default)]
    pub advertise: Option<Spanned<String>>,
    /// Copies of each block among `nodes` (all of them when fewer).
    #[serde(default = "default_store_replicas")]
    pub replicas: Spanned<u64>,
    /// Workers: how long a request waits for its prompt's blocks from the node.
    #[serde(default = "default_store_fetch_timeout_ms")]
    pub fetch_timeout_ms: Spanned<u64>,
    /// `tandem up` starts a node of its own (on `listen`) for its workers and router when no
    /// `node` is set and every pool has a host tier to stage fetched blocks in; `false`: never.
    #[serde(default = "default_true")]
    pub embedded: bool,
}

fn default_store_fetch_timeout_ms() -> Spanned<u64> {
    Spanned::new(0..0, 500)
}

impl Default for StoreSection {
    fn default() -> Self {
        StoreSection {
            listen: default_store_listen(),
            data_port: 0,
            capacity_bytes: default_store_capacity(),
            max_object_bytes: default_store_max_object(),
            lease_ms: default_store_lease_ms(),
            put_deadline_ms: default_store_put_deadline_ms(),
            node: None,
            nodes: None,
            discover: default_off(),
            advertise: None,
            replicas: default_store_replicas(),
            fetch_timeout_ms: default_store_fetch_timeout_ms(),
            embedded: true,
        }
    }
}

fn default_store_replicas() -> Spanned<u64> {
    Spanned::new(0..0, 2)
}

impl StoreSection {
    /// The nodes workers and the router use (`node` or `nodes`); empty: no store.
    pub fn node_uris(&self) -> Vec<String> {
        match (&self.node, &self.nodes) {
            (Some(n), _) => vec![n.get_ref().clone()],
            (None, Some(ns)) => ns.get_ref().clone(),
            (None, None) => Vec::new(),
        }
    }

    /// Where the nodes are set, and the key: for errors about them.
    pub fn nodes_span(&self) -> Option<(std::ops::Range<usize>, &'static str)> {
        match (&self.node, &self.nodes) {
            (Some(n), _) => Some((n.span(), "store.node")),
            (None, Some(ns)) => Some((ns.span(), "store.nodes")),
            (None, None) => None,
        }
    }

    /// Where workers are told to use a store (nodes named, or found through etcd), and the
    /// key: for errors about it; `None`: no store set.
    pub fn used_span(&self) -> Option<(std::ops::Range<usize>, &'static str)> {
        let discover = *self.discover.get_ref();
        self.nodes_span()
            .or_else(|| discover.then(|| (self.discover.span(), "store.discover")))
    }
}

fn default_store_listen() -> Spanned<String> {
    Spanned::new(0..0, "127.0.0.1:0".to_string())
}

fn default_store_capacity() -> Spanned<u64> {
    Spanned::new(0..0, 4 << 30)
}

fn default_store_max_object() -> Spanned<u64> {
    Spanned::new(0..0, 64 << 20)
}

fn default_store_lease_ms() -> Spanned<u64> {
    Spanned::new(0..0, 10_000)
}

fn default_store_put_deadline_ms() -> Spanned<u64> {
    Spanned::new(0..0, 30_000)
}

/// `[security]`: every internal hop (the control plane, the workers' gRPC, the KV transports)
/// is mutual TLS 1.3 under a cluster CA, each end's role checked, unless `insecure = true`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecuritySection {
    /// Plain TCP with no certificates: anyone who reaches an internal listener is believed.
    /// Only for a network nobody else reaches; every process says so loudly at start.
    #[serde(default)]
    pub insecure: bool,
    /// The cluster's certificates (`ca.crt`, and `ca.key` or a role's `<role>.crt`/`.key`),
    /// relative to this file; default `.tandem/pki` beside it, made with a new CA at the first
    /// start when empty.
    pub dir: Option<Spanned<PathBuf>>,
}

impl ClusterConfig {
    /// The certificate directory of the cluster described by the file at `config`.
    pub fn pki_dir(&self, config: &Path) -> PathBuf {
        let beside = config.parent().unwrap_or(Path::new("."));
        match &self.security.dir {
            Some(d) => beside.join(d.get_ref()),
            None => beside.join(".tandem").join("pki"),
        }
    }
}

/// `[discovery]`: workers and routers find each other through etcd.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoverySection {
    /// etcd's client endpoints, e.g. `["http://10.0.0.5:2379"]`.
    pub etcd: Spanned<Vec<String>>,
    /// The key prefix of this cluster's members (clusters sharing an etcd need their own).
    #[serde(default = "default_discovery_prefix")]
    pub prefix: Spanned<String>,
    /// A member is gone this long after its last lease renewal (renewed every third of it).
    #[serde(default = "default_discovery_ttl_ms")]
    pub lease_ttl_ms: Spanned<u64>,
}

fn default_discovery_prefix() -> Spanned<String> {
    Spanned::new(0..0, "/tandem/default".into())
}

fn default_discovery_ttl_ms() -> Spanned<u64> {
    Spanned::new(0..0, 3000)
}

/// `[[models]]`: another model's cluster file, relative to this one.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoreModel {
    /// Its cluster.toml.
    pub config: Spanned<PathBuf>,
}

/// `[model]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A .gguf file or HF directory; empty: the cached default model.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Tokens per KV block.
    #[serde(default = "default_block_size")]
    pub block_size: Spanned<u32>,
}

fn default_block_size() -> Spanned<u32> {
    Spanned::new(0..0, 16)
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            path: None,
            block_size: default_block_size(),
        }
    }
}

/// `[router]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterSection {
    /// HTTP listen address.
    #[serde(default = "default_listen")]
    pub listen: Spanned<String>,
    /// gRPC control-plane listen address (workers join here).
    #[serde(default = "default_control")]
    pub control: Spanned<String>,
    /// The operator endpoints' listen address — `/metrics`, `/status`, `/status.json`,
    /// `/prometheus/targets`, `/debug/workers` — with no API key: loopback unless the operator
    /// opens it (e.g. to Prometheus in a pod network, behind a NetworkPolicy).
    #[serde(default = "default_operator")]
    pub operator: Spanned<String>,
    /// A prompt whose uncached rest on its decode worker is at most this many tokens is
    /// prefilled there instead of on the prefill pool (0: only prompts of one token).
    #[serde(default)]
    pub local_prefill_max_tokens: u32,
    /// A prompt whose uncached rest on its decode worker is at most this many tokens is also
    /// prefilled there when that takes less time than the prefill pool's predicted wait (the
    /// tokens queued on its least-queued worker); 0: never.
    #[serde(default)]
    pub local_prefill_busy_max_tokens: u32,
    /// How workers are picked: `kv` (cache-aware), `least-loaded` or `round-robin`.
    #[serde(default)]
    pub policy: Policy,
    /// `kv`: a prefill worker caching more of the prompt is preferred while its estimated time
    /// to first token is within this many milliseconds of the best worker's.
    #[serde(default = "default_prefill_slack_ms")]
    pub prefill_slack_ms: u64,
    /// `kv`: what a prompt block held in a worker's host-memory tier and in its disk tier — and,
    /// a third value, one only the cluster store holds — counts for against one in its KV
    /// pool (1), each in 0..=1. Unset (or the store's left out): derived per worker from its
    /// measured load time against the prefill rate; `[0.0, 0.0]` routes blind to the tiers.
    #[serde(default)]
    pub tier_weights: Option<Spanned<Vec<f64>>>,
    /// How many times a request may move to another decode worker when its own dies, freezes
    /// or stalls mid-stream (0: never; the client gets an error event).
    #[serde(default = "default_migration_limit")]
    pub migration_limit: u32,
    /// Rebalance the decode pool's KV by live moves: when its fullest worker holds at least
    /// this many times the pool's mean (KV blocks in use), it sheds sequences to the others
    /// (0: off; otherwise above 1).
    #[serde(default = "default_kv_rebalance")]
    pub kv_rebalance: Spanned<f64>,
    /// A worker holding work whose engine runs no step for this long — or a stream that gets no
    /// token for this long — is stalled: its requests migrate, and it is not routed to until
    /// its engine moves again.
    #[serde(default = "default_stall_timeout_ms")]
    pub stall_timeout_ms: Spanned<u64>,
    /// A worker whose heartbeats stop for this long is dropped (and its requests migrate).
    #[serde(default = "default_heartbeat_timeout_ms")]
    pub heartbeat_timeout_ms: Spanned<u64>,
    /// A request that has not finished this long after it arrived ends with a 504 (or, once
    /// streaming, an error event), its workers told to release it.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: Spanned<u64>,
    /// The largest request body accepted (413 beyond).
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: Spanned<u64>,
    /// The largest request headers accepted, names and values together (431 beyond).
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: Spanned<u64>,
    /// HTTP connections served at once (the next waits in the kernel's backlog).
    #[serde(default = "default_max_connections")]
    pub max_connections: Spanned<u64>,
    /// HTTP connections one client address may hold at once (more are closed at once), so one
    /// client cannot fill `max_connections`. Behind a proxy every client shares its address:
    /// raise it to `max_connections` there.
    #[serde(default = "default_max_connections_per_address")]
    pub max_connections_per_address: Spanned<u64>,
    /// A file of API keys, one per line: requests must carry one (`Authorization: Bearer
    /// KEY`), or get a 401. Unset: no key needed.
    #[serde(default)]
    pub api_keys_file: Option<Spanned<PathBuf>>,
    /// Serve an address other than loopback with no `api_keys_file`: anyone who reaches it may
    /// use the cluster. Without it such a router refuses to start.
    #[serde(default)]
    pub allow_no_keys: bool,
    /// Other models' routers this one answers for, by model name (`{ "name" = "host:port" }`):
    /// a request naming one is passed to it; `/v1/models` lists them. Each is a cluster of
    /// its own (its cluster.toml: model, pools, SLOs).
    #[serde(default)]
    pub models: std::collections::BTreeMap<String, Spanned<String>>,
}

fn default_request_timeout_ms() -> Spanned<u64> {
    Spanned::new(0..0, 600_000)
}

fn default_max_body_bytes() -> Spanned<u64> {
    Spanned::new(0..0, 8 << 20)
}

fn default_max_header_bytes() -> Spanned<u64> {
    Spanned::new(0..0, 32 << 10)
}

fn default_max_connections() -> Spanned<u64> {
    Spanned::new(0..0, 1024)
}

fn default_max_connections_per_address() -> Spanned<u64> {
    Spanned::new(0..0, 256)
}

fn default_migration_limit() -> u32 {
    1
}

fn default_kv_rebalance() -> Spanned<f64> {
    Spanned::new(0..0, 0.0)
}

fn default_stall_timeout_ms() -> Spanned<u64> {
    Spanned::new(0..0, 10_000)
}

fn default_heartbeat_timeout_ms() -> Spanned<u64> {
    Spanned::new(0..0, 2_000)
}

fn default_prefill_slack_ms() -> u64 {
    100
}

fn default_listen() -> Spanned<String> {
    Spanned::new(0..0, "127.0.0.1:8000".into())
}
fn default_control() -> Spanned<String> {
    Spanned::new(0..0, "127.0.0.1:8001".into())
}
fn default_operator() -> Spanned<String> {
    Spanned::new(0..0, "127.0.0.1:8002".into())
}

impl Default for RouterSection {
    fn default() -> Self {
        RouterSection {
            listen: default_listen(),
            control: default_control(),
            operator: default_operator(),
            local_prefill_max_tokens: 0,
            local_prefill_busy_max_tokens: 0,
            policy: Policy::default(),
            prefill_slack_ms: default_prefill_slack_ms(),
            tier_weights: None,
            migration_limit: default_migration_limit(),
            kv_rebalance: default_kv_rebalance(),
            stall_timeout_ms: default_stall_timeout_ms(),
            heartbeat_timeout_ms: default_heartbeat_timeout_ms(),
            request_timeout_ms: default_request_timeout_ms(),
            max_body_bytes: default_max_body_bytes(),
            max_header_bytes: default_max_header_bytes(),
            max_connections_per_address: default_max_connections_per_address(),
            max_connections: default_max_connections(),
            api_keys_file: None,
            allow_no_keys: false,
            models: Default::default(),
        }
    }
}

/// `[prefill]` or `[decode]`: one worker pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSection {
    /// Workers started by `tandem up`.
    #[serde(default = "one")]
    pub replicas: Spanned<u32>,
    /// Kernel threads per worker.
    #[serde(default = "one")]
    pub threads: Spanned<u32>,
    /// KV blocks per worker.
    #[serde(default = "default_blocks")]
    pub kv_blocks: Spanned<u32>,
    /// Most tokens per forward step.
    #[serde(default = "default_batch_tokens")]
    pub max_batch_tokens: Spanned<u32>,
    /// Most sequences in one worker's running batch.
    #[serde(default = "default_max_running")]
    pub max_running: Spanned<u32>,
    /// Keep computed KV blocks as a prefix cache that later requests share.
    #[serde(default = "default_true")]
    pub prefix_cache: bool,
    /// What admitting a request reserves: `"reserve"` (prompt plus `max_tokens`; never
    /// preempts) or `"optimistic"` (the prompt; preempts the newest sequence when decoding
    /// outgrows the pool, swapping its KV to `[<pool>.kv_tiers]`'s host memory where set).
    #[serde(default)]
    pub admission: Option<Spanned<Admission>>,
    /// Host workers bind their services to.
    #[serde(default = "default_host")]
    pub host: String,
    /// Latency targets (used by the autoscaler).
    #[serde(default)]
    pub slo: SloSection,
    /// Where the real engine's forward pass runs: `"cpu"` or `"cuda:N"`.
    #[serde(default = "default_device")]
    pub device: Spanned<String>,
    /// `"cpu"` (the real engine) or `"mock"` (no model runs; a timing model, see `[<pool>.mock]`).
    #[serde(default = "default_engine")]
    pub engine: Spanned<EngineKind>,
    /// The mock engine's timing model.
    #[serde(default)]
    pub mock: MockSection,
    /// Autoscaling of this pool on its own latency target; absent: a fixed pool.
    pub autoscale: Option<AutoscaleSection>,
    /// KV below each worker's pool (host memory, local disk); absent: none.
    pub kv_tiers: Option<KvTiersSection>,
    /// Sent `SIGTERM` (a Kubernetes pod deleted), how long a worker lets the requests it holds
    /// finish, admitting none, before it exits (under the pod's termination grace period).
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: Spanned<u64>,
    /// Decode workers: most drafts a step verifies for a sequence (prompt-lookup speculative
    /// decoding, adaptive: only where the measured step costs say it pays; 0: off; at most 16).
    /// A request's `speculation` overrides it. Never changes a token.
    #[serde(default = "default_speculation")]
    pub speculation: Spanned<u32>,
}

/// `[<pool>.kv_tiers]`: where a worker's prefix cache keeps the blocks its pool evicts — host
/// memory (G2), then local disk (G3, kept across restarts).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvTiersSection {
    /// Bytes of host memory per worker (0: no host tier).
    #[serde(default)]
    pub host_bytes: u64,
    /// The disk tier's directory, relative to this file; each worker uses a directory of its
    /// own under it, named after the worker.
    pub disk_path: Option<Spanned<String>>,
    /// Bytes of block files per worker at most (needs `disk_path`).
    pub disk_bytes: Option<Spanned<u64>>,
    /// Which evicted blocks are written down: `"evicted"` (all) or `"hit-twice"` (only those
    /// shared from the cache at least twice).
    #[serde(default)]
    pub write_policy: Option<Spanned<WritePolicy>>,
}

fn default_device() -> Spanned<String> {
    Spanned::new(0..0, "cpu".into())
}

fn default_engine() -> Spanned<EngineKind> {
    Spanned::new(0..0, EngineKind::Cpu)
}

/// `[<pool>.mock]`: the mock engine's step time, `step_us + prefill_token_us × prompt tokens +
/// decode_token_us × decoding sequences + kv_token_ns × KV tokens read`. A `preset`
/// (`"cpu-smollm2"`, fitted to this engine; `"h200-llama8b"`, estimated) fills the fields not set.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MockSection {
    /// Starting point for the fields not given.
    pub preset: Option<Spanned<MockPreset>>,
    /// Fixed cost of a step, µs.
    pub step_us: Option<f64>,
    /// Per prompt token in a step, µs.
    pub prefill_token_us: Option<f64>,
    /// Per decoding sequence in a step, µs.
    pub decode_token_us: Option<f64>,
    /// Per KV token attended, ns.
    pub kv_token_ns: Option<f64>,
}

/// `[<pool>.autoscale]`: the planner's bounds and pace for one pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoscaleSection {
    /// Fewest replicas.
    #[serde(default = "one")]
    pub min: Spanned<u32>,
    /// Most replicas.
    pub max: Spanned<u32>,
    /// How often the planner decides, ms.
    #[serde(default = "default_tick")]
    pub tick_ms: Spanned<u64>,
    /// Least time between two scale-downs (and after a scale-up before one), ms.
    #[serde(default = "default_cooldown")]
    pub cooldown_ms: Spanned<u64>,
    /// Latency window the planner reads percentiles over, ms.
    #[serde(default = "default_window")]
    pub window_ms: Spanned<u64>,
    /// `"local"` (the router starts and drains worker processes), `"command"` or
    /// `"kubernetes"` (the pool's Deployment is scaled through the API server).
    #[serde(default = "default_actuator")]
    pub actuator: Spanned<Actuator>,
    /// For `actuator = "command"`: run as `<command> <pool> <replicas>` on every change.
    pub command: Option<Spanned<String>>,
    /// For `actuator = "kubernetes"`: the Deployment whose scale is the pool's replicas.
    pub deployment: Option<Spanned<String>>,
    /// For `actuator = "kubernetes"`: its namespace (default: the router's own, from its
    /// service account).
    pub namespace: Option<Spanned<String>>,
}

fn default_tick() -> Spanned<u64> {
    Spanned::new(0..0, 1000)
}
fn default_cooldown() -> Spanned<u64> {
    Spanned::new(0..0, 5000)
}
fn default_window() -> Spanned<u64> {
    Spanned::new(0..0, 5000)
}
fn default_actuator() -> Spanned<Actuator> {
    Spanned::new(0..0, Actuator::Local)
}

fn one() -> Spanned<u32> {
    Spanned::new(0..0, 1)
}
fn default_blocks() -> Spanned<u32> {
    Spanned::new(0..0, 1024)
}
fn default_true() -> bool {
    true
}

fn default_max_running() -> Spanned<u32> {
    Spanned::new(0..0, 64)
}

fn default_speculation() -> Spanned<u32> {
    Spanned::new(0..0, 0)
}

fn default_drain_timeout_ms() -> Spanned<u64> {
    Spanned::new(0..0, 25_000)
}

fn default_batch_tokens() -> Spanned<u32> {
    Spanned::new(0..0, 512)
}
fn default_host() -> String {
    "127.0.0.1".into()
}

/// `[<pool>.slo]`.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SloSection {
    /// Target p90 time to first token (prefill pool).
    pub ttft_p90_ms: Option<u64>,
    /// Target p90 inter-token latency (decode pool).
    pub itl_p90_ms: Option<u64>,
    /// The p90 wait for room a decode pool's autoscaling allows a request (decode pool; part
    /// of its time to first token). Default: a quarter of `[prefill.slo] ttft_p90_ms`, or the
    /// ITL target without one.
    pub admission_p90_ms: Option<Spanned<u64>>,
}

/// `[kv_transfer]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvTransferSection {
    /// Transports in order of preference ("rdma", "quic", "tcp"); each pair of workers uses the
    /// first that both sides have, and says which.
    #[serde(default = "default_prefer")]
    pub prefer: Spanned<Vec<Transport>>,
    /// Accept only this transport: a pair that cannot use it fails instead of falling back.
    #[serde(default)]
    pub require: Option<Spanned<Transport>>,
    /// Stream each layer's KV as soon as the prefill computes it (default), overlapping the
    /// transfer with the remaining layers; `false` sends all layers once the prompt is done.
    #[serde(default = "yes")]
    pub layerwise: bool,
    /// A file holding the cluster secret: KV senders must prove it (HMAC-SHA256 over a fresh
    /// nonce) before a decode worker reads any KV. `TANDEM_KV_SECRET` overrides it.
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// Connect and handshake deadline.
    #[serde(default = "default_connect_ms")]
    pub connect_timeout_ms: Spanned<u64>,
    /// Deadline for one request's whole KV transfer.
    #[serde(default = "default_transfer_ms")]
    pub transfer_timeout_ms: Spanned<u64>,
    /// Blocks a decode worker reserves for a remote prefill are held this long unless the
    /// sender renews them (it does every second while the prompt waits or computes): a dead
    /// or frozen prefill worker's reservations are free this soon.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: Spanned<u64>,
    /// Peer fetch: decode workers serve the KV blocks they hold to prefill workers, which
    /// fetch the prompt's blocks the decode worker holds and they lack instead of computing
    /// them (needs a host tier in `[prefill.kv_tiers]` to stage them in).
    #[serde(default = "default_off")]
    pub peer_fetch: Spanned<bool>,
}

fn default_off() -> Spanned<bool> {
    Spanned::new(0..0, false)
}

fn default_lease_ms() -> Spanned<u64> {
    Spanned::new(0..0, 3000)
}

fn yes() -> bool {
    true
}

fn default_prefer() -> Spanned<Vec<Transport>> {
    // QUIC encrypts but moves KV 4-7x slower than TCP here (BENCHMARKS.md): it is opt-in.
    Spanned::new(0..0, vec![Transport::Rdma, Transport::Tcp, Transport::Quic])
}
fn default_connect_ms() -> Spanned<u64> {
    Spanned::new(0..0, 2000)
}
fn default_transfer_ms() -> Spanned<u64> {
    Spanned::new(0..0, 10000)
}

impl Default for KvTransferSection {
    fn default() -> Self {
        KvTransferSection {
            prefer: default_prefer(),
            require: None,
            secret_file: None,
            layerwise: true,
            connect_timeout_ms: default_connect_ms(),
            transfer_timeout_ms: default_transfer_ms(),
            lease_ms: default_lease_ms(),
            peer_fetch: default_off(),
        }
    }
}

impl PoolSection {
    /// Whether its workers have a host tier (G2): where fetched blocks are staged.
    pub fn has_host_tier(&self) -> bool {
        self.kv_tiers.as_ref().is_some_and(|t| t.host_bytes > 0)
    }
}

impl ClusterConfig {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<ClusterConfig, ConfigError> {
        let src = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        ClusterConfig::parse(path, &src)
    }

    /// Parses and validates `src`, naming `file` in errors.
    pub fn parse(file: &Path, src: &str) -> Result<ClusterConfig, ConfigError> {
        let ctx = Ctx { file, src };
        let cfg: ClusterConfig = toml::from_str(src).map_err(|e| ctx.toml(&e))?;
        ctx.positive(&cfg.model.block_size, "model.block_size")?;
        ctx.router(&cfg.router)?;
        for (name, pool) in [
            ("prefill", cfg.prefill.as_ref()),
            ("decode", Some(&cfg.decode)),
        ] {
            if let Some(pool) = pool {
                ctx.pool(name, pool)?;
            }
        }
        ctx.kv_transfer(&cfg.kv_transfer)?;
        ctx.store(&cfg.store)?;
        if let Some((span, key)) = cfg.store.used_span() {
            for (name, pool) in [
                ("prefill", cfg.prefill.as_ref()),
                ("decode", Some(&cfg.decode)),
            ] {
                if pool.is_some_and(|p| !p.has_host_tier()) {
                    let m = format!(
                        "the {name} workers stage blocks fetched from the store in host memory: \
                         set [{name}.kv_tiers] host_bytes"
                    );
                    return ctx.err(span.clone(), key, m);
                }
            }
        }
        let peer = &cfg.kv_transfer.peer_fetch;
        if *peer.get_ref() && cfg.prefill.as_ref().is_some_and(|p| !p.has_host_tier()) {
            let m = "the prefill workers stage blocks fetched from decode workers in host memory: \
                     set [prefill.kv_tiers] host_bytes";
            return ctx.err(peer.span(), "kv_transfer.peer_fetch", m);
        }
        if let Some(d) = &cfg.discovery {
            ctx.discovery(d)?;
        }
        let discover = &cfg.store.discover;
        if *discover.get_ref() && cfg.discovery.is_none() {
            let m = "store nodes are found through etcd: set [discovery]";
            return ctx.err(discover.span(), "store.discover", m);
        }
        Ok(cfg)
    }

    /// Whether `tandem up` starts a store node of its own (see [`StoreSection::embedded`]):
    /// no node set, embedding not turned off, and every pool has a host tier.
    pub fn embedded_store(&self) -> bool {
        self.store.used_span().is_none()
            && self.store.embedded
            && self.decode.has_host_tier()
            && self.prefill.as_ref().is_none_or(PoolSection::has_host_tier)
    }

    /// Whether requests go through a separate prefill pool.
    pub fn disaggregated(&self) -> bool {
        self.prefill.is_some()
    }
}

#[cfg(test)]
mod tests;
