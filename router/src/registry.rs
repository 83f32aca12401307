//! The workers the router knows: who joined, their endpoints and load, and the `Control`
//! service they join through. A worker whose model identity cannot exchange KV with the
//! router's model is refused at join time. Every change (a join, a heartbeat, a worker gone, a
//! request done) is announced on a watch channel, which requests waiting for room wait on.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::grpc::control_server::Control;
use proto::grpc::{self, Heartbeat, HeartbeatReply, JoinReply, JoinRequest, KvOffer, WorkerLoad};
use proto::{ModelIdentity, Pool};
use serde::{Serialize, Serializer};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::kv_index::KvIndex;
use crate::routing::{self, Candidate, Policy, Routing};

/// One joined worker.
#[derive(Debug, Clone, Serialize)]
pub struct Worker {
    /// Router-assigned id.
    pub id: u64,
    /// Its pool.
    #[serde(rename = "role")]
    pub pool: Pool,
    /// Name it gave.
    pub name: String,
    /// gRPC endpoint.
    pub endpoint: String,
    /// Where prefill workers may send it KV (decode workers).
    #[serde(rename = "kv_offers", serialize_with = "offers")]
    pub offers: Vec<KvOffer>,
    /// KV transfers this worker made, by transport (prefill workers).
    pub kv_transfers: BTreeMap<String, u64>,
    /// The last prefill's queue + compute time and exposed KV wait, µs (prefill workers).
    pub last_prefill_us: (u64, u64),
    /// Where the worker serves Prometheus metrics (`host:port`).
    pub metrics_endpoint: String,
    /// What its engine computes on.
    pub device: String,
    /// Being drained by the planner: takes no new requests.
    pub draining: bool,
    /// Its last heartbeat's load.
    pub load: WorkerLoad,
    /// Requests the router has in flight on it.
    #[serde(serialize_with = "count")]
    pub in_flight: Arc<AtomicUsize>,
    /// Prefill: prompt tokens the router sent it that are not done yet.
    #[serde(serialize_with = "count64")]
    pub queued_tokens: Arc<AtomicU64>,
    /// Making no progress: it holds work but its engine's step count has stood still for the
    /// stall timeout (a wedged engine), or a request of it saw no token for that long. Not
    /// routed to until its steps move again.
    pub stalled: bool,
    #[serde(skip)]
    last_beat: Instant,
    /// Its engine's step count and when it last moved.
    #[serde(skip)]
    progress: (u64, Instant),
}

fn offers<S: Serializer>(o: &[KvOffer], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(o.iter().map(|o| (&o.transport, &o.endpoint)))
}

fn count<S: Serializer>(n: &Arc<AtomicUsize>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(n.load(Ordering::SeqCst) as u64)
}

fn count64<S: Serializer>(n: &Arc<AtomicU64>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(n.load(Ordering::SeqCst))
}

impl Worker {
    /// Requests in flight on it (the router's count).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// When its last heartbeat (or its join) arrived.
    pub fn last_beat(&self) -> Instant {
        self.last_beat
    }

    /// Whether it can take requests: not draining, not stalled.
    fn usable(&self) -> bool {
        !self.draining && !self.stalled
    }
}

/// When the registry gives up on a worker.
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    /// A worker silent this long (no heartbeat) is dropped.
    pub heartbeat: Duration,
    /// A worker holding work whose engine made no step this long is stalled.
    pub stall: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            heartbeat: Duration::from_secs(2),
            stall: Duration::from_secs(10),
        }
    }
}

/// Counts a request (and, on a prefill worker, its prompt tokens) against a worker's load while
/// alive. (Its end wakes nobody: room on a worker is what its next heartbeat reports, and a
/// refused request dropping its own guard must not wake itself.)
pub struct InFlight {
    n: Arc<AtomicUsize>,
    tokens: Arc<AtomicU64>,
    queued: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.n.fetch_sub(1, Ordering::SeqCst);
        self.tokens.fetch_sub(self.queued, Ordering::SeqCst);
    }
}

/// What routing a request needs to know of it.
#[derive(Debug, Clone, Default)]
pub struct Route {
    /// The names of the prompt's whole blocks ([`engine::block_hash::prompt_hashes`]) the
    /// worker could hold; empty when the policy does not look at caches.
    pub blocks: Vec<u64>,
    /// Prompt tokens a prefill worker would compute without its cache.
    pub prompt_tokens: usize,
}

/// A worker chosen for a request.
pub struct Picked {
    /// The worker.
    pub worker: Worker,
    /// Counts the request against it until dropped.
    pub guard: InFlight,
    /// Prompt tokens it holds in its cache, by the index.
    pub cached_tokens: usize,
}

/// All joined workers.
pub struct Registry {
    identity: ModelIdentity,
    next_id: AtomicU64,
    workers: Mutex<HashMap<u64, Worker>>,
    changed: watch::Sender<u64>,
    /// Bumped when a worker is removed or marked stalled: what [`Registry::lost`] wakes on.
    gone: watch::Sender<u64>,
    index: Mutex<KvIndex>,
    routing: Routing,
    /// Round-robin counters: prefill, decode.
    turns: [AtomicUsize; 2],
    /// When a worker is given up on.
    pub liveness: Liveness,
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
            identity,
            next_id: AtomicU64::new(1),
            workers: Mutex::new(HashMap::new()),
            changed: watch::Sender::new(0),
            gone: watch::Sender::new(0),
            index: Mutex::new(KvIndex::default()),
            routing,
            turns: Default::default(),
            liveness,
        })
    }

    /// Tokens per KV block in this cluster.
    pub fn block_size(&self) -> usize {
        self.identity.block_size as usize
    }

    /// How this registry routes.
    pub fn policy(&self) -> Policy {
        self.routing.policy
    }

    /// Block entries in the KV index (one per block per worker holding it).
    pub fn indexed_blocks(&self) -> usize {
        self.index.lock().expect("index lock").len()
    }

    /// A receiver that sees every change from now on (joins, heartbeats, removals): what a
    /// request waiting for room waits on.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn touch(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Snapshot of the live workers.
    pub fn workers(&self) -> Vec<Worker> {
        self.prune();
        let mut w: Vec<Worker> = self.lock().values().cloned().collect();
        w.sort_by_key(|x| x.id);
        w
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Worker>> {
        self.workers.lock().expect("registry lock")
    }

    /// Number of live workers of a pool, not draining.
    pub fn count(&self, pool: Pool) -> usize {
        self.prune();
        let ws = self.lock();
        ws.values().filter(|w| w.pool == pool && w.usable()).count()
    }

    /// The live workers of `pool` not in `exclude` (by id) and what the policy weighs of each
    /// for `route`.
    fn candidates(&self, pool: Pool, exclude: &[u64], route: &Route) -> (Vec<u64>, Vec<Candidate>) {
        self.prune();
        let bs = self.identity.block_size as usize;
        let ws = self.lock();
        let mut ws: Vec<&Worker> = ws
            .values()
            .filter(|w| w.pool == pool && w.usable() && !exclude.contains(&w.id))
            .collect();
        ws.sort_by_key(|w| w.id);
        // The candidates' cached prefixes only (the index lock after the workers', as in
        // `prune`).
        let overlap = if self.routing.policy == Policy::Kv {
            let ids: std::collections::HashSet<u64> = ws.iter().map(|w| w.id).collect();
            let index = self.index.lock().expect("index lock");
            index.overlap_in(&route.blocks, |w| ids.contains(&w))
        } else {
            HashMap::new()
        };
        let c = ws
            .iter()
            .map(|w| Candidate {
                load: w.in_flight() + (w.load.waiting + w.load.pending_transfers) as usize,
                cached: overlap.get(&w.id).copied().unwrap_or(0) * bs,
                queued_tokens: w.queued_tokens.load(Ordering::SeqCst),
                rate: w.load.prompt_tokens_per_s as f64,
            })
            .collect();
        (ws.iter().map(|w| w.id).collect(), c)
    }

    /// The live worker of `pool` not in `exclude` that the policy chooses for `route`,
    /// counted against it (in flight, and for a prefill its queued tokens) until the guard is
    /// dropped.
    pub fn pick(&self, pool: Pool, exclude: &[u64], route: &Route) -> Option<Picked> {
        let (ids, c) = self.candidates(pool, exclude, route);
        let turn = self.turns[(pool == Pool::Decode) as usize].fetch_add(1, Ordering::SeqCst);
        let i = match pool {
            Pool::Decode => routing::decode(self.routing.policy, &c, turn),
            Pool::Prefill => routing::prefill(&self.routing, &c, route.prompt_tokens, turn),
        }?;
        let w = self.lock().get(&ids[i])?.clone();
        let queued = match pool {
            Pool::Prefill => route.prompt_tokens.saturating_sub(c[i].cached) as u64,
            Pool::Decode => 0,
        };
        w.in_flight.fetch_add(1, Ordering::SeqCst);
        w.queued_tokens.fetch_add(queued, Ordering::SeqCst);
        let guard = InFlight {
            n: w.in_flight.clone(),
            tokens: w.queued_tokens.clone(),
            queued,
        };
        Some(Picked {
            worker: w,
            guard,
            cached_tokens: c[i].cached,
        })
    }

    /// The prefill pool's predicted wait: the least time any prefill worker needs for the
    /// tokens already queued on it, with that worker's rate (tokens/s); `None` without one.
    pub fn prefill_wait(&self) -> Option<(Duration, f64)> {
        let (_, mut c) = self.candidates(Pool::Prefill, &[], &Route::default());
        routing::fill_rates(&mut c);
        c.iter()
            .map(|x| (x.wait_s(), x.rate_or_default()))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(s, rate)| (Duration::from_secs_f64(s), rate))
    }

    /// Counts a KV transfer made by worker `id` and keeps its timings.
    pub fn record_transfer(&self, id: u64, reply: &grpc::PrefillReply) {
        if let Some(w) = self.lock().get_mut(&id) {
            *w.kv_transfers.entry(reply.transport.clone()).or_default() += 1;
            w.last_prefill_us = (reply.compute_us, reply.transfer_us);
        }
    }

    /// Stops routing new requests to worker `id` (it is being drained).
    pub fn set_draining(&self, id: u64) {
        if let Some(w) = self.lock().get_mut(&id) {
            w.draining = true;
        }
    }

    /// Forgets a worker at once (e.g. its connection broke), and its cache.
    pub fn remove(&self, id: u64) {
        if self.lock().remove(&id).is_some() {
            self.index.lock().expect("index lock").remove_worker(id);
            tracing::warn!(worker = id, "worker removed");
            self.gone.send_modify(|v| *v += 1);
            self.touch();
        }
    }

    fn prune(&self) {
        let mut ws = self.lock();
        let timeout = self.liveness.heartbeat;
        let before = ws.len();
        let mut gone = Vec::new();
        ws.retain(|id, w| {
            let alive = w.last_beat.elapsed() < timeout;
            if !alive {
                tracing::warn!(worker = id, name = %w.name, "worker missed its heartbeats; dropped");
                gone.push(*id);
            }
            alive
        });
        let mut index = self.index.lock().expect("index lock");
        gone.into_iter().for_each(|id| index.remove_worker(id));
        drop(index);
        if ws.len() != before {
            drop(ws);
            self.gone.send_modify(|v| *v += 1);
            self.touch();
        }
    }

    /// Whether `w`, whose heartbeat just arrived, is stalled: its engine's steps stood still for
    /// the stall timeout while it held work — or, marked stalled by a request, have not moved
    /// since.
    fn stalled(&self, w: &mut Worker) -> bool {
        let now = Instant::now();
        let busy = w.load.running + w.load.waiting > 0;
        if w.load.engine_steps != w.progress.0 || !busy {
            // Moving, or idle and answering (its load is fresh): the stall clock starts over.
            w.progress = (w.load.engine_steps, now);
            return false;
        }
        w.stalled || now - w.progress.1 >= self.liveness.stall
    }

    /// Marks worker `id` stalled (a request of it saw no token within the stall timeout): it is
    /// not routed to until its engine's steps move again.
    pub fn set_stalled(&self, id: u64) {
        if let Some(w) = self.lock().get_mut(&id) {
            tracing::warn!(worker = id, name = %w.name, "worker stalled: a request saw no progress");
            w.stalled = true;
        }
        self.gone.send_modify(|v| *v += 1);
        self.touch();
    }

    /// Resolves when worker `id` can no longer be counted on: removed, silent past the
    /// heartbeat timeout, or stalled. Sleeps to the moment its heartbeats would have to have
    /// come or to the next removal or stall, and looks again; never polls.
    pub async fn lost(&self, id: u64) {
        let mut changes = self.gone.subscribe();
        loop {
            let due = match self.lock().get(&id) {
                Some(w) if !w.stalled => w.last_beat + self.liveness.heartbeat,
                _ => return,
            };
            if Instant::now() >= due {
                self.prune();
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
    pub fn join(&self, j: JoinRequest) -> Result<u64, Status> {
        if j.protocol_version != proto::PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "worker {} speaks protocol version {}, the router {}",
                j.name,
                j.protocol_version,
                proto::PROTOCOL_VERSION
            )));
        }
        let theirs: ModelIdentity = j.identity.clone().unwrap_or_default().into();
        if let Some(diff) = self.identity.incompatibility(&theirs) {
            tracing::warn!(name = %j.name, "refused worker: {diff}");
            return Err(Status::failed_precondition(format!(
                "worker {} cannot exchange KV with this cluster's model ({diff}; router vs worker)",
                j.name
            )));
        }
        let pool = grpc::Role::try_from(j.role)
            .ok()
            .and_then(|r| Pool::try_from(r).ok())
            .ok_or_else(|| Status::invalid_argument("role must be prefill or decode"))?;
        // A worker registered in etcd brings its cluster-wide id; joining again (through the
        // watch and through this call, or after an outage) changes nothing.
        let id = match j.worker_id {
            0 => self.next_id.fetch_add(1, Ordering::SeqCst),
            id if self.lock().contains_key(&id) => return Ok(id),
            id => id,
        };
        let w = Worker {
            id,
            pool,
            name: j.name,
            endpoint: j.endpoint,
            offers: j.kv_offers,
            kv_transfers: BTreeMap::new(),
            last_prefill_us: (0, 0),
            metrics_endpoint: j.metrics_endpoint,
            device: j.device,
            draining: false,
            load: WorkerLoad {
                kv_blocks_free: j.kv_blocks_total,
                kv_blocks_total: j.kv_blocks_total,
                ..Default::default()
            },
            in_flight: Arc::new(AtomicUsize::new(0)),
            queued_tokens: Arc::new(AtomicU64::new(0)),
            stalled: false,
            last_beat: Instant::now(),
            progress: (0, Instant::now()),
        };
        tracing::info!(worker = id, %pool, name = %w.name, endpoint = %w.endpoint, "worker joined");
        self.lock().insert(id, w);
        self.touch();
        Ok(id)
    }

    /// Records a heartbeat and its KV events; `NOT_FOUND` for a worker this router does not
    /// know (it joins again). `true` when the KV index wants a snapshot of its cache.
    pub fn beat(&self, b: Heartbeat) -> Result<bool, Status> {
        let mut ws = self.lock();
        let w = ws
            .get_mut(&b.worker_id)
            .ok_or_else(|| Status::not_found("unknown worker; join again"))?;
        w.load = b.load.unwrap_or_default();
        w.last_beat = Instant::now();
        let was = w.stalled;
        w.stalled = self.stalled(w);
        if w.stalled != was {
            tracing::warn!(worker = w.id, name = %w.name, stalled = w.stalled, "worker progress");
        }
        drop(ws);
        let resync = match &b.kv {
            Some(kv) => self
                .index
                .lock()
                .expect("index lock")
                .apply(b.worker_id, kv),
            None => false,
        };
        self.touch();
        Ok(resync)
    }
}

/// The `Control` gRPC service over a registry.
pub struct ControlService(pub Arc<Registry>);

#[tonic::async_trait]
impl Control for ControlService {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let worker_id = self.0.join(req.into_inner())?;
        Ok(Response::new(JoinReply { worker_id }))
    }

    async fn beat(&self, req: Request<Heartbeat>) -> Result<Response<HeartbeatReply>, Status> {
        let resync = self.0.beat(req.into_inner())?;
        Ok(Response::new(HeartbeatReply { resync }))
    }
}
