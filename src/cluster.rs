//! The cluster commands: each role on its own (`router`, `prefill`, `decode`) and `up`, which
//! starts them all from cluster.toml as separate OS processes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use engine::tiers::{TierConfig, WritePolicy};
use engine::EngineConfig;
use proto::config::{ClusterConfig, PoolSection};
use std::io::Write;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::supervise;

/// Arguments shared by the role commands.
#[derive(Args, Debug, Clone)]
pub struct RoleArgs {
    /// The cluster description.
    #[arg(long, default_value = "cluster.toml")]
    pub config: PathBuf,
    /// The router's control endpoint (workers), overriding `router.control`.
    #[arg(long)]
    pub router: Option<String>,
    /// HTTP listen address (router), overriding `router.listen`; a store node's gRPC address,
    /// overriding `store.listen`.
    #[arg(long)]
    pub listen: Option<String>,
    /// Control listen address (router), overriding `router.control`.
    #[arg(long)]
    pub control: Option<String>,
    /// Operator endpoints' listen address (router), overriding `router.operator`.
    #[arg(long)]
    pub operator: Option<String>,
    /// Worker name for logs.
    #[arg(long)]
    pub name: Option<String>,
    /// Workers: the address to bind and register, overriding the pool's `host` (e.g. a pod's
    /// IP under Kubernetes).
    #[arg(long)]
    pub host: Option<String>,
    /// Decode workers: the TCP KV endpoint to advertise instead of the bound one (NAT, proxies).
    #[arg(long)]
    pub kv_advertise: Option<String>,
    /// Router: once listening, write `{"http": ADDR, "control": ADDR, "operator": ADDR}` as one
    /// line to this inherited file descriptor and close it (how `tandem up` learns the
    /// addresses); a store node writes `{"store": ADDR}`.
    #[arg(long)]
    pub ready_fd: Option<i32>,
    /// Workers: once serving (joined, or registered in etcd), write this file (a readiness
    /// probe can test for it, e.g. under Kubernetes).
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
    /// Router: another model's router it answers for, `NAME=HOST:PORT` (beside `[router]
    /// models`; `tandem up` passes those of the config's `[[models]]`).
    #[arg(long = "peer")]
    pub peers: Vec<String>,
    /// Workers and the router: the cluster KV store's nodes (`http://HOST:PORT`, several
    /// comma-separated), overriding `store.node` / `store.nodes`.
    #[arg(long)]
    pub store: Option<String>,
}

/// The store's nodes a role uses: `--store`'s, else the file's.
fn store_nodes(cfg: &ClusterConfig, a: &RoleArgs) -> Vec<String> {
    match &a.store {
        Some(list) => list.split(',').map(|s| s.trim().to_string()).collect(),
        None => cfg.store.node_uris(),
    }
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub(crate) fn load(path: &Path) -> Result<(ClusterConfig, PathBuf)> {
    let cfg = ClusterConfig::load(path)?;
    let model = match &cfg.model.path {
        Some(p) => p.clone(),
        None => engine::fetch::ensure_default_model_with(&crate::download::download)?,
    };
    Ok((cfg, model))
}

/// The cluster secret: `TANDEM_KV_SECRET`, else the contents of `kv_transfer.secret_file`.
fn secret(cfg: &ClusterConfig) -> Result<Option<std::sync::Arc<Vec<u8>>>> {
    if let Ok(s) = std::env::var("TANDEM_KV_SECRET") {
        return Ok(Some(std::sync::Arc::new(s.into_bytes())));
    }
    match &cfg.kv_transfer.secret_file {
        Some(p) => {
            let s = std::fs::read_to_string(p)
                .with_context(|| format!("reading kv_transfer.secret_file {}", p.display()))?;
            if s.trim().is_empty() {
                bail!("kv_transfer.secret_file {} is empty", p.display());
            }
            Ok(Some(std::sync::Arc::new(s.trim().as_bytes().to_vec())))
        }
        None => Ok(None),
    }
}

/// This process's security: mutual TLS with credentials for `role` from the cluster's
/// certificate directory (made with a new CA when empty), or plain under `insecure = true`,
/// said loudly.
pub(crate) fn security(
    cfg: &ClusterConfig,
    config: &Path,
    role: pki::Role,
    name: &str,
) -> Result<pki::Security> {
    if cfg.security.insecure {
        let s = pki::Security::Insecure;
        s.warn_if_insecure(&format!("the {role} {name}"));
        return Ok(s);
    }
    let dir = cfg.pki_dir(config);
    let creds = pki::Store::at(&dir)
        .credentials(role, name)
        .with_context(|| {
            format!(
                "the cluster's certificates ([security] dir = {})",
                dir.display()
            )
        })?;
    Ok(pki::Security::Mutual(std::sync::Arc::new(creds)))
}

/// A `--listen` beyond loopback needs API keys or `allow_no_keys`, as `router.listen` does
/// (checked with the config file).
fn open_listen(cfg: &ClusterConfig, a: &RoleArgs) -> Result<()> {
    let Some(l) = &a.listen else {
        return Ok(());
    };
    let loopback = l.parse::<SocketAddr>().is_ok_and(|a| a.ip().is_loopback());
    if !loopback && cfg.router.api_keys_file.is_none() && !cfg.router.allow_no_keys {
        bail!(
            "--listen {l} is reachable from other machines and {} has no router.api_keys_file: \
             set one, or router.allow_no_keys = true to serve anyone who reaches it",
            a.config.display()
        );
    }
    Ok(())
}

/// Makes the cluster CA before `tandem up` starts anything (unless `insecure = true`) and
/// says how the internal hops are secured.
fn up_security(cfg: &ClusterConfig, config: &Path) -> Result<()> {
    if cfg.security.insecure {
        pki::Security::Insecure.warn_if_insecure("this cluster");
        return Ok(());
    }
    let dir = cfg.pki_dir(config);
    pki::Store::at(&dir)
        .init()
        .with_context(|| format!("making the cluster CA in {}", dir.display()))?;
    eprintln!(
        "tandem up: internal hops are mutual TLS under the cluster CA in {}",
        dir.display()
    );
    Ok(())
}

/// The router's HTTP limits, with its API keys read.
fn limits(cfg: &ClusterConfig) -> Result<router::guard::Limits> {
    let r = &cfg.router;
    let api_keys = match &r.api_keys_file {
        Some(p) => {
            let p = p.get_ref();
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading router.api_keys_file {}", p.display()))?;
            Some(std::sync::Arc::new(router::guard::read_api_keys(&text)))
        }
        None => None,
    };
    Ok(router::guard::Limits {
        max_body_bytes: *r.max_body_bytes.get_ref() as usize,
        max_header_bytes: *r.max_header_bytes.get_ref() as usize,
        max_connections: *r.max_connections.get_ref() as usize,
        max_connections_per_address: *r.max_connections_per_address.get_ref() as usize,
        api_keys,
    })
}

/// What every worker of `pool` is configured with.
fn worker_settings(
    cfg: &ClusterConfig,
    pool: &PoolSection,
    model: PathBuf,
    a: &RoleArgs,
    role: pki::Role,
) -> Result<worker::Settings> {
    let name = a.name.clone().unwrap_or_else(|| role.name().into());
    let security = security(cfg, &a.config, role, &name)?;
    Ok(worker::Settings {
        discovery: discovery(cfg, &security),
        security,
        model,
        device: pool.device.get_ref().clone(),
        mock: mock_timing(pool),
        threads: *pool.threads.get_ref() as usize,
        engine: EngineConfig {
            tiers: tier_config(pool, &a.config, &name),
            ..engine_config(cfg, pool)
        },
        host: a.host.clone().unwrap_or_else(|| pool.host.clone()),
        router: control_endpoint(cfg, a),
        name,
        require: cfg.kv_transfer.require.as_ref().map(|r| *r.get_ref()),
        secret: secret(cfg)?,
        ready_file: a.ready_file.clone(),
        store: store_nodes(cfg, a),
        store_discover: *cfg.store.discover.get_ref(),
        store_fetch_timeout: Duration::from_millis(*cfg.store.fetch_timeout_ms.get_ref()),
        store_replicas: *cfg.store.replicas.get_ref() as usize,
        drain_timeout: Duration::from_millis(*pool.drain_timeout_ms.get_ref()),
        peer_fetch: *cfg.kv_transfer.peer_fetch.get_ref(),
    })
}

/// The engine of every worker of `pool`.
pub(crate) fn engine_config(cfg: &ClusterConfig, pool: &PoolSection) -> EngineConfig {
    EngineConfig {
        block_size: *cfg.model.block_size.get_ref() as usize,
        num_blocks: *pool.kv_blocks.get_ref() as usize,
        max_batch_tokens: *pool.max_batch_tokens.get_ref() as usize,
        max_running: *pool.max_running.get_ref() as usize,
        prefix_cache: pool.prefix_cache,
        // Blocks reserved for KV that never comes go when their sender stops renewing
        // them, even if the router is gone too (it cancels abandoned requests itself).
        kv_lease: Some(Duration::from_millis(*cfg.kv_transfer.lease_ms.get_ref())),
        tiers: TierConfig::default(),
        admission: match pool.admission.as_ref().map(|a| *a.get_ref()) {
            None | Some(proto::config::Admission::Reserve) => engine::Admission::Reserve,
            Some(proto::config::Admission::Optimistic) => engine::Admission::Optimistic,
        },
        speculation: *pool.speculation.get_ref() as usize,
    }
}

/// The KV tiers of worker `name` of `pool` (`[<pool>.kv_tiers]`; none when absent): the
/// disk tier in a directory of the worker's own under `disk_path`, relative to the config
/// file `config`.
pub(crate) fn tier_config(pool: &PoolSection, config: &Path, name: &str) -> TierConfig {
    use proto::config::WritePolicy as P;
    let Some(t) = &pool.kv_tiers else {
        return TierConfig::default();
    };
    let beside = config.parent().unwrap_or(Path::new("."));
    TierConfig {
        host_bytes: t.host_bytes,
        disk_path: t
            .disk_path
            .as_ref()
            .map(|p| beside.join(p.get_ref()).join(name)),
        disk_bytes: t.disk_bytes.as_ref().map_or(0, |b| *b.get_ref()),
        write_policy: match t.write_policy.as_ref().map(|p| *p.get_ref()) {
            None | Some(P::Evicted) => WritePolicy::Evicted,
            Some(P::HitTwice) => WritePolicy::HitTwice,
        },
        disk_queue: None,
    }
}

/// The router's routing policy from `[router]`.
pub(crate) fn routing(cfg: &ClusterConfig) -> router::routing::Routing {
    router::routing::Routing {
        policy: cfg.router.policy,
        prefill_slack: std::time::Duration::from_millis(cfg.router.prefill_slack_ms),
        tier_weights: cfg.router.tier_weights.as_ref().map(|w| {
            let w = w.get_ref();
            ([w[0], w[1]], w.get(2).copied())
        }),
    }
}

/// `[discovery]` as a member with `security` uses it (its credentials for `https://` etcd).
pub(crate) fn discovery(
    cfg: &ClusterConfig,
    security: &pki::Security,
) -> Option<discovery::Config> {
    let d = cfg.discovery.as_ref()?;
    let tls = security.credentials().map(|c| {
        let (cert, key, ca) = c.pems();
        discovery::Tls {
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
        }
    });
    Some(discovery::Config {
        endpoints: d.etcd.get_ref().clone(),
        prefix: d.prefix.get_ref().clone(),
        ttl: Duration::from_millis(*d.lease_ttl_ms.get_ref()),
        tls,
    })
}

/// The mock engine's timing for a pool with `engine = "mock"` (a preset, then the fields set).
pub(crate) fn mock_timing(pool: &PoolSection) -> Option<engine::MockTiming> {
    use proto::config::{EngineKind, MockPreset};
    if *pool.engine.get_ref() != EngineKind::Mock {
        return None;
    }
    let m = &pool.mock;
    let mut t = match m.preset.as_ref().map(|p| *p.get_ref()) {
        None | Some(MockPreset::CpuSmollm2) => engine::MockTiming::CPU_SMOLLM2,
        Some(MockPreset::H200Llama8b) => engine::MockTiming::H200_LLAMA8B,
    };
    t.step_us = m.step_us.unwrap_or(t.step_us);
    t.prefill_token_us = m.prefill_token_us.unwrap_or(t.prefill_token_us);
    t.decode_token_us = m.decode_token_us.unwrap_or(t.decode_token_us);
    t.kv_token_ns = m.kv_token_ns.unwrap_or(t.kv_token_ns);
    Some(t)
}

/// What the router's planner scales: each pool with an `[<pool>.autoscale]` section.
pub(crate) fn scaling(cfg: &ClusterConfig) -> Vec<router::planner::Scaling> {
    use router::planner::{Pool, Scaling};
    let pools = [
        (Pool::Prefill, cfg.prefill.as_ref()),
        (Pool::Decode, Some(&cfg.decode)),
    ];
    pools
        .into_iter()
        .filter_map(|(pool, section)| {
            let s = section?;
            let a = s.autoscale.as_ref()?;
            let target = match pool {
                Pool::Prefill => s.slo.ttft_p90_ms,
                Pool::Decode => s.slo.itl_p90_ms,
            }?;
            // The decode pool's wait for room: its own, else a quarter of the TTFT target.
            let ttft = cfg.prefill.as_ref().and_then(|p| p.slo.ttft_p90_ms);
            let own = s.slo.admission_p90_ms.as_ref().map(|w| *w.get_ref());
            let wait_target = match pool {
                Pool::Prefill => None,
                Pool::Decode => own.or(ttft.map(|t| t / 4)),
            };
            Some(Scaling {
                pool,
                target: Duration::from_millis(target),
                wait_target: wait_target.map(Duration::from_millis),
                min: *a.min.get_ref(),
                max: *a.max.get_ref(),
                initial: *s.replicas.get_ref(),
                tick: Duration::from_millis(*a.tick_ms.get_ref()),
                cooldown: Duration::from_millis(*a.cooldown_ms.get_ref()),
                window: Duration::from_millis(*a.window_ms.get_ref()),
            })
        })
        .collect()
}

/// Whether `tandem up` leaves a pool's workers to the router's local actuator.
fn router_starts(pool: &PoolSection) -> bool {
    pool.autoscale
        .as_ref()
        .is_some_and(|a| *a.actuator.get_ref() == proto::config::Actuator::Local)
}

fn control_endpoint(cfg: &ClusterConfig, a: &RoleArgs) -> String {
    a.router
        .clone()
        .unwrap_or_else(|| format!("http://{}", cfg.router.control.get_ref()))
}

/// The other models' routers: `[router] models`, then the `--peer NAME=ADDR` flags.
fn peers(cfg: &ClusterConfig, flags: &[String]) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = cfg
        .router
        .models
        .iter()
        .map(|(n, a)| (n.clone(), a.get_ref().clone()))
        .collect();
    for f in flags {
        let (n, a) = f
            .split_once('=')
            .ok_or_else(|| anyhow!("--peer {f:?}: expected NAME=HOST:PORT"))?;
        out.push((n.to_string(), a.to_string()));
    }
    Ok(out)
}

/// `tandem router`.
pub fn router(a: RoleArgs) -> Result<()> {
    let (cfg, model) = load(&a.config)?;
    open_listen(&cfg, &a)?;
    let security = security(&cfg, &a.config, pki::Role::Router, "router")?;
    let rc = router::RouterConfig {
        discovery: discovery(&cfg, &security),
        store: store_nodes(&cfg, &a),
        store_discover: *cfg.store.discover.get_ref(),
        security,
        listen: a
            .listen
            .clone()
            .unwrap_or_else(|| cfg.router.listen.get_ref().clone()),
        control: a
            .control
            .clone()
            .unwrap_or_else(|| cfg.router.control.get_ref().clone()),
        operator: a
            .operator
            .clone()
            .unwrap_or_else(|| cfg.router.operator.get_ref().clone()),
        model,
        block_size: *cfg.model.block_size.get_ref() as usize,
        disaggregated: cfg.disaggregated(),
        local_prefill_max_tokens: cfg.router.local_prefill_max_tokens,
        local_prefill_busy_max_tokens: cfg.router.local_prefill_busy_max_tokens,
        routing: routing(&cfg),
        liveness: router::registry::Liveness {
            heartbeat: std::time::Duration::from_millis(*cfg.router.heartbeat_timeout_ms.get_ref()),
            stall: std::time::Duration::from_millis(*cfg.router.stall_timeout_ms.get_ref()),
        },
        migration_limit: cfg.router.migration_limit,
        kv_rebalance: Some(*cfg.router.kv_rebalance.get_ref()).filter(|&r| r > 0.0),
        limits: limits(&cfg)?,
        request_timeout: Duration::from_millis(*cfg.router.request_timeout_ms.get_ref()),
        scaling: scaling(&cfg),
        slo: router::status::Targets {
            ttft_p90: cfg
                .prefill
                .as_ref()
                .and_then(|p| p.slo.ttft_p90_ms)
                .or(cfg.decode.slo.ttft_p90_ms)
                .map(Duration::from_millis),
            itl_p90: cfg.decode.slo.itl_p90_ms.map(Duration::from_millis),
        },
        peers: peers(&cfg, &a.peers)?,
        actuator: {
            // One actuator for the cluster: Kubernetes if any pool names it, else a command if
            // any pool names one, else local.
            let kube: std::collections::HashMap<_, _> = [
                (proto::Pool::Prefill, cfg.prefill.as_ref()),
                (proto::Pool::Decode, Some(&cfg.decode)),
            ]
            .into_iter()
            .filter_map(|(pool, p)| {
                let a = p?.autoscale.as_ref()?;
                (*a.actuator.get_ref() == proto::config::Actuator::Kubernetes).then(|| {
                    let target = router::kubernetes::Target {
                        deployment: a.deployment.as_ref()?.get_ref().clone(),
                        namespace: a.namespace.as_ref().map(|n| n.get_ref().clone()),
                    };
                    Some((pool, target))
                })?
            })
            .collect();
            let command = [cfg.prefill.as_ref(), Some(&cfg.decode)]
                .into_iter()
                .flatten()
                .filter_map(|p| p.autoscale.as_ref()?.command.as_ref())
                .map(|c| c.get_ref().clone())
                .next();
            match command {
                _ if !kube.is_empty() => router::ActuatorConfig::Kubernetes(kube),
                Some(c) => router::ActuatorConfig::Command(c),
                None => router::ActuatorConfig::Local {
                    exe: std::env::current_exe().context("locating the tandem binary")?,
                    config: std::fs::canonicalize(&a.config).unwrap_or(a.config.clone()),
                },
            }
        },
    };
    let ready_fd = a.ready_fd;
    runtime()?.block_on(router::run(rc, move |at| {
        let (http, control, operator) = (at.http, at.control, at.operator);
        eprintln!("tandem router: listening on http://{http} (control http://{control}, operator http://{operator})");
        let line = serde_json::json!({"http": http, "control": control, "operator": operator});
        report_ready(ready_fd, &line, "router");
    }))?;
    Ok(())
}

/// Writes `line` to the inherited descriptor `--ready-fd` names, if one does, and closes it
/// (how `tandem up` learns where a process it started listens).
pub(crate) fn report_ready(fd: Option<i32>, line: &serde_json::Value, who: &str) {
    let Some(fd) = fd else {
        return;
    };
    // SAFETY: `fd` was handed to this process for this one line (`--ready-fd`); nothing else
    // in it uses that descriptor, and the File owns and closes it here.
    let mut f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    if let Err(e) = writeln!(f, "{line}") {
        eprintln!("tandem {who}: cannot report readiness on fd {fd}: {e}");
    }
}

/// `tandem prefill`.
pub fn prefill(a: RoleArgs) -> Result<()> {
    let (cfg, model) = load(&a.config)?;
    let pool = cfg
        .prefill
        .as_ref()
        .ok_or_else(|| anyhow!("{}: has no [prefill] section", a.config.display()))?;
    let worker = worker_settings(&cfg, pool, model, &a, pki::Role::Prefill)?;
    let pc = prefill_worker::PrefillConfig {
        send: send_config(&cfg, &worker),
        worker,
        layerwise: cfg.kv_transfer.layerwise,
    };
    runtime()?.block_on(prefill_worker::run(pc))?;
    Ok(())
}

/// How a worker sends KV (a prefill's prompts, a decode worker's handoffs).
fn send_config(cfg: &ClusterConfig, w: &worker::Settings) -> worker::kv_send::SendConfig {
    let t = &cfg.kv_transfer;
    worker::kv_send::SendConfig {
        connect_timeout: Duration::from_millis(*t.connect_timeout_ms.get_ref()),
        transfer_timeout: Duration::from_millis(*t.transfer_timeout_ms.get_ref()),
        prefer: t.prefer.get_ref().clone(),
        require: w.require,
    }
}

/// `tandem decode`.
pub fn decode(a: RoleArgs) -> Result<()> {
    let (cfg, model) = load(&a.config)?;
    let worker = worker_settings(&cfg, &cfg.decode, model, &a, pki::Role::Decode)?;
    let dc = decode_worker::DecodeConfig {
        send: send_config(&cfg, &worker),
        worker,
        kv_advertise: a.kv_advertise.clone(),
        transfer_timeout: Duration::from_millis(*cfg.kv_transfer.transfer_timeout_ms.get_ref()),
    };
    runtime()?.block_on(decode_worker::run(dc))?;
    Ok(())
}

/// The router's `/health` answer, when it answers 200 within 2 s.
async fn health(http: &reqwest::Client, addr: SocketAddr) -> Option<serde_json::Value> {
    let r = http
        .get(format!("http://{addr}/health"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    if r.status() != reqwest::StatusCode::OK {
        return None;
    }
    r.json().await.ok()
}

/// Starts `exe args` with this process' stderr; `ready` (a pipe's write end) becomes the
/// child's descriptor 3.
fn spawn(exe: &Path, args: &[&str], ready: Option<i32>) -> Result<Child> {
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null()).kill_on_drop(true);
    // SAFETY: prctl, dup2 and fcntl are async-signal-safe; they ask the kernel to signal this
    // child when the parent (`tandem up`) dies, so no worker outlives it, and put the readiness
    // pipe at descriptor 3 without close-on-exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            if let Some(fd) = ready {
                let r = if fd == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0)
                } else {
                    libc::dup2(fd, 3)
                };
                if r < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd.spawn()
        .with_context(|| format!("starting {} {}", exe.display(), args.join(" ")))
}

/// Starts `exe args` with `--ready-fd 3` and waits (up to 120 s) for its readiness line on a
/// pipe of its own (a JSON object); `who` names it in errors.
async fn spawn_ready(exe: &Path, args: &[&str], who: &str) -> Result<(Child, serde_json::Value)> {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error()).context("creating the readiness pipe");
    }
    // SAFETY: pipe2 just created these descriptors; each is owned by one File from here on.
    let (read, write) = unsafe {
        use std::os::fd::FromRawFd;
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    let mut args = args.to_vec();
    args.extend(["--ready-fd", "3"]);
    let child = spawn(exe, &args, Some(fds[1]))?;
    drop(write); // the child holds the only write end: EOF if it exits before it is ready
    let mut line = String::new();
    let mut reader = BufReader::new(tokio::net::unix::pipe::Receiver::from_file(read)?);
    tokio::time::timeout(Duration::from_secs(120), reader.read_line(&mut line))
        .await
        .map_err(|_| anyhow!("the {who} was not ready within 120 s"))??;
    if line.is_empty() {
        bail!("the {who} exited before it was ready");
    }
    let v = serde_json::from_str(&line)
        .with_context(|| format!("the {who}'s readiness line {line:?}"))?;
    Ok((child, v))
}

/// Starts the router and waits for it to say where it listens: its HTTP address and its
/// control endpoint.
async fn start_router(
    exe: &Path,
    config: &str,
    extra: &[String],
) -> Result<(Child, router::Bound)> {
    let mut args = vec!["router", "--config", config];
    args.extend(extra.iter().map(String::as_str));
    let (router, v) = spawn_ready(exe, &args, "router").await?;
    let addr = |k: &str| {
        let a = v[k].as_str().unwrap_or_default();
        a.parse::<SocketAddr>()
            .with_context(|| format!("the router's {k} address {a:?}"))
    };
    let at = router::Bound {
        http: addr("http")?,
        control: addr("control")?,
        operator: addr("operator")?,
    };
    Ok((router, at))
}

/// One model's processes under `tandem up`: its router and workers.
struct Stack {
    cfg: ClusterConfig,
    http: SocketAddr,
    operator: SocketAddr,
}

/// Starts the store node `tandem up` embeds (`[store] embedded`), adding it to `procs` and
/// `children`; returns where it serves (`http://HOST:PORT`).
async fn start_store(
    exe: &Path,
    config: &Path,
    procs: &mut Vec<supervise::Process>,
    children: &mut Vec<Child>,
) -> Result<String> {
    let cfg_s = config.to_string_lossy().to_string();
    let (node, v) = spawn_ready(exe, &["store", "--config", &cfg_s], "store node").await?;
    let at = v["store"].as_str().unwrap_or_default().to_string();
    // Started again on the same address, so that the workers and the router find it.
    let args = ["store", "--config", &cfg_s, "--listen", &at].map(String::from);
    procs.push(supervise::Process {
        name: "store".into(),
        args: args.to_vec(),
    });
    children.push(node);
    Ok(format!("http://{at}"))
}

/// Starts the router of `config` (with `extra` arguments) and the workers it does not start
/// itself (each with `worker_extra`), adding them to `procs` and `children`; their names
/// start with `prefix`.
async fn start_stack(
    exe: &Path,
    config: &Path,
    (extra, worker_extra): (&[String], &[String]),
    prefix: &str,
    procs: &mut Vec<supervise::Process>,
    children: &mut Vec<Child>,
) -> Result<Stack> {
    let cfg = load(config)?.0;
    let cfg_s = config.to_string_lossy().to_string();
    let (router, at) = start_router(exe, &cfg_s, extra).await?;
    let control = format!("http://{}", at.control);
    // Started again on the same addresses, so that its workers find it.
    let mut args = [
        "router",
        "--config",
        &cfg_s,
        "--listen",
        &at.http.to_string(),
        "--control",
        &at.control.to_string(),
        "--operator",
        &at.operator.to_string(),
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().cloned());
    procs.push(supervise::Process {
        name: format!("{prefix}router"),
        args,
    });
    children.push(router);
    let pools = [
        ("prefill", cfg.prefill.as_ref()),
        ("decode", Some(&cfg.decode)),
    ];
    for (role, pool) in pools {
        let Some(pool) = pool else { continue };
        if router_starts(pool) {
            // The router's planner starts (and later scales) this pool itself.
            continue;
        }
        for i in 0..*pool.replicas.get_ref() {
            let name = format!("{prefix}{role}-{i}");
            let mut args = [
                role, "--config", &cfg_s, "--router", &control, "--name", &name,
            ]
            .map(String::from)
            .to_vec();
            args.extend(worker_extra.iter().cloned());
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            children.push(spawn(exe, &refs, None)?);
            procs.push(supervise::Process { name, args });
        }
    }
    Ok(Stack {
        cfg,
        http: at.http,
        operator: at.operator,
    })
}

/// `tandem up`: the router and every worker of cluster.toml as child processes, kept running
/// (restarted when one exits) until Ctrl-C or SIGTERM. Each `[[models]]` entry's cluster file
/// is started first, the same way, and the main router answers for its model.
pub fn up(config: PathBuf) -> Result<()> {
    let (cfg, model) = load(&config)?;
    up_security(&cfg, &config)?;
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    runtime()?.block_on(async move {
        let (mut procs, mut children, mut stacks, mut peers) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let started = async {
            for m in &cfg.models {
                let path = config.parent().unwrap_or(Path::new(".")).join(m.config.get_ref());
                let id = router::model_id(&load(&path)?.1);
                let s = start_stack(&exe, &path, (&[], &[]), &format!("{id}-"), &mut procs, &mut children).await?;
                peers.extend(["--peer".to_string(), format!("{id}={}", s.http)]);
                stacks.push(s);
            }
            // The main model's workers and router share a store node of its own when it embeds one.
            let mut store = Vec::new();
            if cfg.embedded_store() {
                let at = start_store(&exe, &config, &mut procs, &mut children).await?;
                store = vec!["--store".to_string(), at];
            }
            let router_extra = [peers.clone(), store.clone()].concat();
            let main = start_stack(&exe, &config, (&router_extra, &store), "", &mut procs, &mut children).await?;
            stacks.push(main);
            for s in &stacks {
                wait_up(&s.cfg, s.http, &procs, &mut children).await?;
            }
            anyhow::Ok(())
        };
        if let Err(e) = started.await {
            children.iter().filter_map(Child::id).for_each(|pid| {
                // SAFETY: sending SIGTERM to our own child process.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            });
            return Err(e);
        }
        let main = stacks.last().expect("the main stack");
        let (http, operator) = (main.http, main.operator);
        let model_id = router::model_id(&model);
        let (p, d) = stacks.iter().map(|s| wanted(&s.cfg)).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let models = stacks.len();
        say(format_args!("tandem is up: {p} prefill + {d} decode workers ({models} model(s)) behind http://{http}"));
        if cfg.embedded_store() {
            say(format_args!("cluster KV store: one node of its own ([store] embedded; its workers put and fetch KV blocks there)"));
        }
        say(format_args!("status page: http://{operator}/status (or `tandem status --addr {operator} --watch`); metrics: http://{operator}/metrics"));
        // A base model (no chat template) is asked through /v1/completions.
        let chat = engine::inspect(&model).map_or(true, |(_, t)| t.chat_template().is_some());
        if chat {
            say(format_args!("try:\n  curl http://{http}/v1/chat/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{model_id}\", \"temperature\": 0, \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital city of Germany?\"}}]}}'"));
        } else {
            say(format_args!("try:\n  curl http://{http}/v1/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{model_id}\", \"temperature\": 0, \"max_tokens\": 16, \"prompt\": \"The capital of France is\"}}'"));
        }
        say(format_args!("Ctrl-C stops the cluster; a process that exits is started again."));
        supervise::run(&exe, procs, children, |exe, args| spawn(exe, args, None)).await
    })
}

/// The prefill and decode workers the cluster starts with (autoscaled pools at their
/// replicas, within their bounds).
fn wanted(cfg: &ClusterConfig) -> (u64, u64) {
    let want = |p: &PoolSection| {
        let r = *p.replicas.get_ref();
        p.autoscale
            .as_ref()
            .map_or(r, |a| r.clamp(*a.min.get_ref(), *a.max.get_ref())) as u64
    };
    (cfg.prefill.as_ref().map_or(0, want), want(&cfg.decode))
}

/// Waits (up to 300 s) until every worker has joined the router at `http`; a process that
/// exits before then is an error (a bad model or config would only exit again).
async fn wait_up(
    cfg: &ClusterConfig,
    http: SocketAddr,
    procs: &[supervise::Process],
    children: &mut [Child],
) -> Result<()> {
    let (want_p, want_d) = wanted(cfg);
    let client = reqwest::Client::new();
    let t0 = Instant::now();
    loop {
        for (p, c) in procs.iter().zip(children.iter_mut()) {
            if let Some(status) = c.try_wait().ok().flatten() {
                bail!("{} exited ({status}) before the cluster was up", p.name);
            }
        }
        if let Some(v) = health(&client, http).await {
            if v["prefill_workers"].as_u64() == Some(want_p)
                && v["decode_workers"].as_u64() == Some(want_d)
            {
                return Ok(());
            }
        }
        if t0.elapsed() > Duration::from_secs(300) {
            bail!("the workers did not all join within 300 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Prints a line to stdout, ignoring a closed pipe (`tandem up | head -1` must not stop the
/// cluster).
fn say(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(args);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}
