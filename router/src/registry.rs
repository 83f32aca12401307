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
    /// Being drained by the planner: takes no new requests.
    pub draining: bool,
    /// Its last heartbeat's load.
    pub load: WorkerLoad,
    /// Requests the router has in flight on it.
    #[serde(serialize_with = "count")]
    pub in_flight: Arc<AtomicUsize>,
    #[serde(skip)]
    last_beat: Instant,
}

fn offers<S: Serializer>(o: &[KvOffer], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(o.iter().map(|o| (&o.transport, &o.endpoint)))
}

fn count<S: Serializer>(n: &Arc<AtomicUsize>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(n.load(Ordering::SeqCst) as u64)
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
}

/// Counts a request against a worker's load while alive. (Its end wakes nobody: room on a
/// worker is what its next heartbeat reports, and a refused request dropping its own guard
/// must not wake itself.)
pub struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// All joined workers.
pub struct Registry {
    identity: ModelIdentity,
    next_id: AtomicU64,
    workers: Mutex<HashMap<u64, Worker>>,
    changed: watch::Sender<u64>,
    /// A worker that misses heartbeats this long is dropped.
    pub timeout: Duration,
}

impl Registry {
    /// A registry that admits workers compatible with `identity` and drops those silent for
    /// 2 s.
    pub fn new(identity: ModelIdentity) -> Arc<Registry> {
        Registry::with_timeout(identity, Duration::from_secs(2))
    }

    /// [`Registry::new`] dropping workers silent for `timeout`.
    pub fn with_timeout(identity: ModelIdentity, timeout: Duration) -> Arc<Registry> {
        Arc::new(Registry {
            identity,
            next_id: AtomicU64::new(1),
            workers: Mutex::new(HashMap::new()),
            changed: watch::Sender::new(0),
            timeout,
        })
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
        ws.values()
            .filter(|w| w.pool == pool && !w.draining)
            .count()
    }

    /// The least-loaded live worker of `pool` not in `exclude`, counted as in flight until the
    /// guard drops.
    pub fn pick(&self, pool: Pool, exclude: &[u64]) -> Option<(Worker, InFlight)> {
        self.prune();
        let ws = self.lock();
        let w = ws
            .values()
            .filter(|w| w.pool == pool && !w.draining && !exclude.contains(&w.id))
            .min_by_key(|w| {
                let queued = w.load.waiting + w.load.pending_transfers;
                (w.in_flight() + queued as usize, w.id)
            })?;
        w.in_flight.fetch_add(1, Ordering::SeqCst);
        Some((w.clone(), InFlight(w.in_flight.clone())))
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

    /// Forgets a worker at once (e.g. its connection broke).
    pub fn remove(&self, id: u64) {
        if self.lock().remove(&id).is_some() {
            tracing::warn!(worker = id, "worker removed");
            self.touch();
        }
    }

    fn prune(&self) {
        let mut ws = self.lock();
        let timeout = self.timeout;
        let before = ws.len();
        ws.retain(|id, w| {
            let alive = w.last_beat.elapsed() < timeout;
            if !alive {
                tracing::warn!(worker = id, name = %w.name, "worker missed its heartbeats; dropped");
            }
            alive
        });
        if ws.len() != before {
            drop(ws);
            self.touch();
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
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let w = Worker {
            id,
            pool,
            name: j.name,
            endpoint: j.endpoint,
            offers: j.kv_offers,
            kv_transfers: BTreeMap::new(),
            last_prefill_us: (0, 0),
            metrics_endpoint: j.metrics_endpoint,
            draining: false,
            load: WorkerLoad {
                kv_blocks_free: j.kv_blocks_total,
                kv_blocks_total: j.kv_blocks_total,
                ..Default::default()
            },
            in_flight: Arc::new(AtomicUsize::new(0)),
            last_beat: Instant::now(),
        };
        tracing::info!(worker = id, %pool, name = %w.name, endpoint = %w.endpoint, "worker joined");
        self.lock().insert(id, w);
        self.touch();
        Ok(id)
    }

    /// Records a heartbeat; `NOT_FOUND` for a worker this router does not know (it joins again).
    pub fn beat(&self, b: Heartbeat) -> Result<(), Status> {
        let mut ws = self.lock();
        let w = ws
            .get_mut(&b.worker_id)
            .ok_or_else(|| Status::not_found("unknown worker; join again"))?;
        w.load = b.load.unwrap_or_default();
        w.last_beat = Instant::now();
        drop(ws);
        self.touch();
        Ok(())
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
        self.0.beat(req.into_inner())?;
        Ok(Response::new(HeartbeatReply {}))
    }
}
