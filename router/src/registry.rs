//! The workers the router knows, shared by its tasks: the request core's [`Table`] behind a
//! lock, the change channels requests wait on, and the `Control` service workers join and
//! heartbeat through. A worker whose model identity cannot exchange KV with the router's model
//! is refused at join time. Every change (a join, a heartbeat, a worker gone) is announced on
//! a watch channel, which requests waiting for room wait on; a worker removed or stalled is
//! announced on a second one, which requests on it wait on ([`Registry::lost`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use proto::grpc::control_server::Control;
use proto::grpc::{self, Heartbeat, HeartbeatReply, JoinReply, JoinRequest};
use proto::{ModelIdentity, Pool};
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use types::WorkerId;

pub use crate::core::{InFlight, Liveness, Picked, Route, Worker};
use crate::core::{JoinRefused, MoveWhy, Shed, Table};
use crate::routing::{Policy, Routing};

/// All joined workers.
pub struct Registry {
    table: Mutex<Table>,
    changed: watch::Sender<u64>,
    /// Bumped when a worker is removed or marked stalled: what [`Registry::lost`] wakes on.
    gone: watch::Sender<u64>,
    /// Bumped when a worker starts to drain: the requests on it may move off.
    drains: watch::Sender<u64>,
    /// When a worker is given up on.
    pub liveness: Liveness,
    /// The cluster store's nodes as last seen (by node number; the status page's).
    store_nodes: Mutex<std::collections::BTreeMap<usize, crate::store_watch::NodeView>>,
}

impl Registry {
    /// A registry that admits workers compatible with `identity` and drops those silent for
    /// 2 s.
    pub fn new(identity: ModelIdentity) -> Arc<Registry> {
        Registry::with_timeout(identity, Duration::from_secs(2))
    }

    /// [`Registry::new`] dropping workers silent for `timeout`.
    pub fn with_timeout(identity: ModelIdentity, timeout: Duration) -> Arc<Registry> {
        let liveness = Liveness {
            heartbeat: timeout,
            ..Liveness::default()
        };
        Registry::configured(identity, liveness, Routing::default())
    }

    /// A registry giving up on workers by `liveness` and routing by `routing`.
    pub fn configured(
        identity: ModelIdentity,
        liveness: Liveness,
        routing: Routing,
    ) -> Arc<Registry> {
        Arc::new(Registry {
            table: Mutex::new(Table::new(identity, liveness, routing)),
            changed: watch::Sender::new(0),
            gone: watch::Sender::new(0),
            drains: watch::Sender::new(0),
            liveness,
            store_nodes: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().expect("registry lock")
    }

    /// Runs `f` on the table, with the workers silent past the heartbeat timeout dropped first
    /// (and announced).
    pub fn with<T>(&self, f: impl FnOnce(&mut Table) -> T) -> T {
        let mut t = self.lock();
        let gone = t.prune(Instant::now());
        let out = f(&mut t);
        drop(t);
        if !gone.is_empty() {
            self.announce_gone();
        }
        out
    }

    /// Tokens per KV block in this cluster.
    pub fn block_size(&self) -> usize {
        self.lock().block_size()
    }

    /// How this registry routes.
    pub fn policy(&self) -> Policy {
        self.lock().policy()
    }

    /// Block entries in the KV index (one per block per worker holding it).
    pub fn indexed_blocks(&self) -> usize {
        self.lock().indexed_blocks()
    }

    /// The KV index's entries by tier (see [`Table::indexed_by_tier`]).
    pub fn indexed_by_tier(&self) -> [usize; 3] {
        self.lock().indexed_by_tier()
    }

    /// Changes what is known of store node `node`.
    pub fn set_store_node(&self, node: usize, f: impl FnOnce(&mut crate::store_watch::NodeView)) {
        let mut nodes = self.store_nodes.lock().expect("store nodes lock");
        f(nodes.entry(node).or_default());
    }

    /// Forgets store node `node` (its registration went): nothing it held stays indexed.
    pub fn forget_store_node(&self, node: usize) {
        self.with(|t| t.index_mut().clear_store(node));
        self.store_nodes
            .lock()
            .expect("store nodes lock")
            .remove(&node);
    }

    /// The store's nodes as last seen.
    pub fn store_nodes(&self) -> Vec<crate::store_watch::NodeView> {
        let nodes = self.store_nodes.lock().expect("store nodes lock");
        nodes.values().cloned().collect()
    }

    /// Blocks of the cluster store's in the KV index.
    pub fn indexed_store_blocks(&self) -> usize {
        self.lock().index_mut().store_blocks()
    }

    /// A receiver that sees every change from now on (joins, heartbeats, removals): what a
    /// request waiting for room waits on.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn touch(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Wakes the requests on a worker that was removed or marked stalled, and those waiting
    /// for room.
    pub fn announce_gone(&self) {
        self.gone.send_modify(|v| *v += 1);
        self.touch();
    }

    /// Snapshot of the live workers, by id.
    pub fn workers(&self) -> Vec<Worker> {
        let mut all: Vec<Worker> = self.with(|t| t.iter().cloned().collect());
        all.sort_by_key(|w| w.id);
        all
    }

    /// Number of live workers of a pool, not draining nor stalled.
    pub fn count(&self, pool: Pool) -> usize {
        self.with(|t| t.count(pool))
    }

    /// The worker of `pool` not in `exclude` that the policy chooses for `route`, counted
    /// against it until the guard is dropped (see [`Table::pick`]).
    pub fn pick(&self, pool: Pool, exclude: &[WorkerId], route: &Route) -> Option<Picked> {
        self.with(|t| t.pick(pool, |w| !exclude.contains(&w.id), route))
    }

    /// The prefill pool's predicted wait and rate (see [`Table::prefill_wait`]).
    pub fn prefill_wait(&self) -> Option<(Duration, f64)> {
        self.with(|t| t.prefill_wait())
    }

    /// Counts a KV transfer made by worker `id` and keeps its timings.
    pub fn record_transfer(&self, id: WorkerId, reply: &grpc::PrefillReply) {
        self.lock().record_transfer(id, reply);
    }

    /// Stops routing new requests to worker `id` (it is being drained).
    pub fn set_draining(&self, id: WorkerId) {
        self.lock().set_draining(id);
        self.drains.send_modify(|v| *v += 1);
    }

    /// Resolves when a request decoding on worker `id` is to move off it, and why: the worker
    /// drains, or the rebalancer asked it to shed a sequence and this call took one up (never
    /// while neither, nor once it has left the table: [`Registry::lost`] says that). Wakes
    /// when any worker starts to drain or is asked to shed; never polls.
    pub async fn leaving(&self, id: WorkerId) -> MoveWhy {
        let mut drains = self.drains.subscribe();
        loop {
            let why = self.with(|t| {
                if t.get(id).is_some_and(|w| w.draining) {
                    Some(MoveWhy::Draining)
                } else {
                    t.claim_shed(id).then_some(MoveWhy::Rebalance)
                }
            });
            if let Some(why) = why {
                return why;
            }
            if drains.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// The rebalancer's decision at `now`, if any: the requests on the fullest decode worker
    /// are woken to take it up.
    pub fn rebalance(&self, r: &mut crate::core::Rebalancer, now: Instant) -> Option<Shed> {
        let shed = self.with(|t| r.decide(t, now));
        if shed.is_some() {
            self.drains.send_modify(|v| *v += 1);
        }
        shed
    }

    /// Forgets a worker at once (e.g. its connection broke), and its cache.
    pub fn remove(&self, id: WorkerId) {
        if self.lock().remove(id) {
            self.announce_gone();
        }
    }

    /// Marks worker `id` stalled: it is not routed to until its engine's steps move again.
    pub fn set_stalled(&self, id: WorkerId) {
        self.lock().set_stalled(id);
        self.announce_gone();
    }

    /// Resolves when worker `id` can no longer be counted on: removed, silent past the
    /// heartbeat timeout, or stalled. Sleeps to the moment its heartbeats would have to have
    /// come or to the next removal or stall, and looks again; never polls.
    pub async fn lost(&self, id: WorkerId) {
        let mut changes = self.gone.subscribe();
        loop {
            let Some(due) = self.lock().due(id) else {
                return;
            };
            if Instant::now() >= due {
                self.with(|_| ());
                return;
            }
            // Or sooner, when a worker is removed (its etcd lease expired, a call found it
            // unreachable) or marked stalled: looked at again then.
            tokio::select! {
                _ = tokio::time::sleep_until(due.into()) => {}
                r = changes.changed() => if r.is_err() {
                    tokio::time::sleep_until(due.into()).await;
                },
            }
        }
    }

    /// Admits a worker that asks to join, or says why not.
    pub fn join(&self, j: JoinRequest) -> Result<WorkerId, Status> {
        let id = self.lock().join(j, Instant::now()).map_err(|e| match e {
            JoinRefused::Role => Status::invalid_argument(e.to_string()),
            _ => Status::failed_precondition(e.to_string()),
        })?;
        self.touch();
        Ok(id)
    }

    /// Records a heartbeat and its KV events; `NOT_FOUND` for a worker this router does not
    /// know (it joins again). `true` when the KV index wants a snapshot of its cache.
    pub fn beat(&self, b: Heartbeat) -> Result<bool, Status> {
        let beaten = self
            .lock()
            .beat(b, Instant::now())
            .map_err(|e| Status::not_found(e.to_string()))?;
        match beaten.stalled {
            true => self.announce_gone(),
            false => self.touch(),
        }
        if beaten.draining {
            self.drains.send_modify(|v| *v += 1);
        }
        Ok(beaten.resync)
    }
}

/// The `Control` gRPC service over a registry. Under mutual TLS only workers reach it (the
/// listener checks the role); a worker joins only its certificate's pool, gets an id nobody can
/// guess, and only the certificate it joined with may heartbeat for that id.
pub struct ControlService {
    registry: Arc<Registry>,
    owners: Mutex<HashMap<WorkerId, [u8; 32]>>,
    /// Under mutual TLS: a call with no authenticated peer is refused (never waved through).
    mutual: bool,
}

impl ControlService {
    /// The service over `registry`; `mutual` when its listener is mutual TLS.
    pub fn new(registry: Arc<Registry>, mutual: bool) -> ControlService {
        ControlService {
            registry,
            owners: Mutex::new(HashMap::new()),
            mutual,
        }
    }

    /// The authenticated peer of `req`; under mutual TLS a call without one is refused.
    fn peer<T>(&self, req: &Request<T>) -> Result<Option<pki::Peer>, Status> {
        match proto::secure::peer(req) {
            Some(p) => Ok(Some(p.clone())),
            None if self.mutual => Err(refused("no_certificate", "no authenticated peer".into())),
            None => Ok(None),
        }
    }

    /// Whether the certificate of `peer` may speak for worker `id`: the one it joined (or, for
    /// a worker adopted from etcd, first heartbeat) with. An id nobody owns is taken by the
    /// peer when `take` (joining) or when the router knows the worker and it is of the peer's
    /// pool (adopted).
    fn own(&self, id: WorkerId, peer: &pki::Peer, take: bool) -> Result<(), Status> {
        let pool = || {
            self.registry
                .with(|t| t.iter().find(|w| w.id == id).map(|w| w.pool))
        };
        let mut owners = self.owners.lock().expect("owners lock");
        match owners.get(&id) {
            Some(f) if *f != peer.fingerprint => Err(refused(
                "not_owner",
                format!("worker {id} belongs to another certificate"),
            )),
            Some(_) => Ok(()),
            None if take => {
                owners.insert(id, peer.fingerprint);
                Ok(())
            }
            None => match pool() {
                Some(p) if pool_of(peer.role) != Some(p) => Err(refused(
                    "wrong_pool",
                    format!("worker {id} is not of the {} pool", peer.role),
                )),
                Some(_) => {
                    owners.insert(id, peer.fingerprint);
                    Ok(())
                }
                // Not a worker here: the heartbeat is refused as unknown.
                None => Ok(()),
            },
        }
    }
}

/// The pool a certificate's role may join.
fn pool_of(role: pki::Role) -> Option<Pool> {
    match role {
        pki::Role::Prefill => Some(Pool::Prefill),
        pki::Role::Decode => Some(Pool::Decode),
        pki::Role::Router | pki::Role::Etcd | pki::Role::Store => None,
    }
}

/// A control-plane refusal, counted by reason.
fn refused(reason: &'static str, why: String) -> Status {
    metrics::counter!("tandem_auth_refused_total", "listener" => "control", "reason" => reason)
        .increment(1);
    tracing::warn!("control plane refused a call: {why}");
    Status::permission_denied(why)
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let peer = self.peer(&req)?;
        let mut j = req.into_inner();
        if let Some(p) = &peer {
            let pool = pool_of(p.role).map_or(grpc::Role::Unspecified, grpc::Role::from);
            if j.role != pool as i32 {
                let why = format!("a {} certificate may not join another pool", p.role);
                return Err(refused("wrong_pool", why));
            }
        }
        if j.worker_id == 0 {
            // Not a counter: an id is what heartbeats name, so nobody may guess one.
            j.worker_id = pki::store::random_u64().max(1);
        }
        if let Some(p) = &peer {
            self.own(WorkerId(j.worker_id), p, true)?;
        }
        let worker_id = self.registry.join(j)?.0;
        let live = self.registry.workers();
        let mut owners = self.owners.lock().expect("owners lock");
        owners.retain(|id, _| live.iter().any(|w| w.id == *id));
        Ok(Response::new(JoinReply { worker_id }))
    }

    async fn beat(&self, req: Request<Heartbeat>) -> Result<Response<HeartbeatReply>, Status> {
        if let Some(p) = self.peer(&req)? {
            self.own(WorkerId(req.get_ref().worker_id), &p, false)?;
        }
        let resync = self.registry.beat(req.into_inner())?;
        Ok(Response::new(HeartbeatReply { resync }))
    }
}
