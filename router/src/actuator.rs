//! Actuators: what turns the planner's desired replica counts into workers, behind one trait.
//!
//! - [`Local`]: the router starts worker processes itself (`tandem prefill|decode` with the
//!   cluster's config, dying with the router) and drains stopped ones: no new requests are
//!   routed to it, it is told to `Drain` (stop admitting), and it is terminated only once the
//!   router has no request in flight on it — so no request fails because of a scale-down.
//!   A worker process that exits on its own is noticed, dropped from routing, and replaced on
//!   the next tick because the desired count still wants it.
//! - [`Command`]: runs `<command> <pool> <replicas>` whenever the desired count changes, for
//!   Kubernetes, systemd or anything else; new workers join the router like any other.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::{Child, Command as Process, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use types::WorkerId;

use crate::planner::Pool;
use crate::registry::Registry;
use proto::grpc::{worker_client::WorkerClient, DrainRequest};

/// Replicas an actuator has started that have not joined yet, per pool.
pub type Starting = u32;

/// Brings a pool towards a desired number of replicas; called every planner tick.
pub trait Actuator: Send {
    /// One reconciliation step for `pool`; returns the replicas started and not yet joined.
    fn reconcile<'a>(
        &'a mut self,
        pool: Pool,
        desired: u32,
        registry: &'a Arc<Registry>,
    ) -> Pin<Box<dyn Future<Output = Starting> + Send + 'a>>;
}

enum Phase {
    Starting,
    Serving(WorkerId),
    Draining(WorkerId, Instant),
}

struct Owned {
    pool: Pool,
    name: String,
    process: Child,
    phase: Phase,
}

/// Starts and drains worker processes on this machine.
pub struct Local {
    exe: PathBuf,
    config: PathBuf,
    control: String,
    security: pki::Security,
    owned: Vec<Owned>,
    started: u32,
}

impl Local {
    /// Workers run as `exe <pool> --config <config> --router <control>`; the router drains
    /// them with `security`.
    pub fn new(exe: PathBuf, config: PathBuf, control: String, security: pki::Security) -> Local {
        Local {
            exe,
            config,
            control,
            security,
            owned: Vec::new(),
            started: 0,
        }
    }

    fn spawn(&mut self, pool: Pool) {
        self.started += 1;
        let name = format!("{}-auto-{}", pool.name(), self.started);
        let mut cmd = Process::new(&self.exe);
        cmd.args([pool.name(), "--config"])
            .arg(&self.config)
            .args(["--router", &self.control, "--name", &name])
            .stdin(Stdio::null());
        // SAFETY: prctl is async-signal-safe; the worker is terminated when the router dies.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(process) => {
                tracing::info!(pool = pool.name(), %name, "planner: started a worker");
                eprintln!("tandem router: planner started {name}");
                self.owned.push(Owned {
                    pool,
                    name,
                    process,
                    phase: Phase::Starting,
                });
            }
            Err(e) => tracing::error!(pool = pool.name(), "planner: cannot start a worker: {e}"),
        }
    }

    async fn drain(security: &pki::Security, registry: &Registry, id: WorkerId) {
        registry.set_draining(id);
        let Some(w) = registry.workers().into_iter().find(|w| w.id == id) else {
            return;
        };
        let Ok(ch) = proto::secure::endpoint(security, &w.endpoint, pki::Role::WORKER_DNS) else {
            return;
        };
        let call = async {
            let ch = ch.connect_timeout(Duration::from_secs(2)).connect().await?;
            WorkerClient::new(ch)
                .drain(DrainRequest {})
                .await
                .map(|_| ())
                .map_err(|e| e.into())
        };
        let r: Result<(), Box<dyn std::error::Error + Send + Sync>> = call.await;
        if let Err(e) = r {
            tracing::warn!(
                worker = %id,
                "drain: {e} (no new requests are routed to it anyway)"
            );
        }
    }

    /// Forgets this router's processes of `pool` that ended: drained ones are done; others
    /// crashed and will be replaced.
    fn reap(&mut self, pool: Pool, registry: &Registry) {
        let mut i = 0;
        while i < self.owned.len() {
            let o = &mut self.owned[i];
            let status = match o.process.try_wait() {
                Ok(Some(status)) if o.pool == pool => status,
                _ => {
                    i += 1;
                    continue;
                }
            };
            let o = self.owned.swap_remove(i);
            match o.phase {
                Phase::Draining(id, _) => registry.remove(id),
                Phase::Serving(id) => {
                    tracing::warn!(name = %o.name, "planner: {} exited ({status}); it will be replaced", o.name);
                    eprintln!("tandem router: {} exited ({status}); replacing it", o.name);
                    registry.remove(id);
                }
                Phase::Starting => {
                    tracing::warn!(name = %o.name, "planner: {} exited before joining ({status})", o.name)
                }
            }
        }
    }

    /// Starting processes that joined now serve; drained ones with nothing in flight stop.
    fn advance(&mut self, pool: Pool, workers: &[crate::registry::Worker]) {
        for o in self.owned.iter_mut().filter(|o| o.pool == pool) {
            if let Phase::Starting = o.phase {
                if let Some(w) = workers.iter().find(|w| w.name == o.name) {
                    o.phase = Phase::Serving(w.id);
                }
            }
            // Drained and idle (nothing of the router's in flight on it): stop it.
            if let Phase::Draining(id, since) = o.phase {
                let idle = workers
                    .iter()
                    .find(|w| w.id == id)
                    .is_none_or(|w| w.in_flight() == 0 && w.load.running == 0);
                if idle || since.elapsed() > Duration::from_secs(600) {
                    // SAFETY: signalling our own child process.
                    unsafe { libc::kill(o.process.id() as i32, libc::SIGTERM) };
                }
            }
        }
    }

    async fn step(&mut self, pool: Pool, desired: u32, registry: &Arc<Registry>) -> Starting {
        self.reap(pool, registry);
        let workers = registry.workers();
        self.advance(pool, &workers);
        let live = workers
            .iter()
            .filter(|w| w.pool == pool && !w.draining)
            .count() as u32;
        let starting = self
            .owned
            .iter()
            .filter(|o| o.pool == pool && matches!(o.phase, Phase::Starting))
            .count() as u32;
        if live + starting < desired {
            for _ in 0..desired - live - starting {
                self.spawn(pool);
            }
        } else if live > desired {
            // Drain the newest of the workers this router started.
            let mut serving: Vec<(usize, WorkerId)> = self
                .owned
                .iter()
                .enumerate()
                .filter_map(|(i, o)| match o.phase {
                    Phase::Serving(id) if o.pool == pool => Some((i, id)),
                    _ => None,
                })
                .collect();
            serving.sort_by_key(|&(_, id)| std::cmp::Reverse(id));
            for (i, id) in serving.into_iter().take((live - desired) as usize) {
                tracing::info!(pool = pool.name(), name = %self.owned[i].name, "planner: draining a worker");
                eprintln!("tandem router: planner draining {}", self.owned[i].name);
                self.owned[i].phase = Phase::Draining(id, Instant::now());
                Local::drain(&self.security, registry, id).await;
            }
        }
        self.owned
            .iter()
            .filter(|o| o.pool == pool && matches!(o.phase, Phase::Starting))
            .count() as u32
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        for o in &mut self.owned {
            let _ = o.process.kill();
            let _ = o.process.wait();
        }
    }
}

impl Actuator for Local {
    fn reconcile<'a>(
        &'a mut self,
        pool: Pool,
        desired: u32,
        registry: &'a Arc<Registry>,
    ) -> Pin<Box<dyn Future<Output = Starting> + Send + 'a>> {
        Box::pin(self.step(pool, desired, registry))
    }
}

/// Runs a configured command with the pool and the desired count on every change.
pub struct Command {
    command: String,
    last: std::collections::HashMap<&'static str, u32>,
}

impl Command {
    /// Runs `command <pool> <replicas>` (through `sh -c`).
    pub fn new(command: String) -> Command {
        Command {
            command,
            last: Default::default(),
        }
    }
}

impl Actuator for Command {
    fn reconcile<'a>(
        &'a mut self,
        pool: Pool,
        desired: u32,
        _: &'a Arc<Registry>,
    ) -> Pin<Box<dyn Future<Output = Starting> + Send + 'a>> {
        Box::pin(async move {
            if self.last.insert(pool.name(), desired) != Some(desired) {
                let line = format!("{} {} {desired}", self.command, pool.name());
                match tokio::process::Command::new("sh")
                    .args(["-c", &line])
                    .status()
                    .await
                {
                    Ok(s) if s.success() => tracing::info!("planner: ran `{line}`"),
                    Ok(s) => tracing::warn!("planner: `{line}` exited {s}"),
                    Err(e) => tracing::warn!("planner: `{line}`: {e}"),
                }
            }
            0
        })
    }
}
