//! The workers the router knows: who joined, their endpoints and load, and the `Control`
//! service they join through. A worker whose model identity cannot exchange KV with the
//! router's model is refused at join time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::grpc::control_server::Control;
use proto::grpc::{self, Heartbeat, HeartbeatReply, JoinReply, JoinRequest, Role};
use proto::ModelIdentity;
use serde::Serialize;
use tonic::{Request, Response, Status};

/// One joined worker.
#[derive(Debug, Clone, Serialize)]
pub struct Worker {
    /// Router-assigned id.
    pub id: u64,
    /// "prefill" or "decode".
    pub role: &'static str,
    /// Name it gave.
    pub name: String,
    /// gRPC endpoint.
    pub endpoint: String,
    /// KV-transfer offers (decode workers): transport and endpoint.
    pub kv_offers: Vec<(String, String)>,
    /// KV transfers this worker made, by transport (prefill workers).
    pub kv_transfers: std::collections::BTreeMap<String, u64>,
    /// The last prefill's queue + compute time and exposed KV wait, µs (prefill workers).
    pub last_prefill_us: (u64, u64),
    #[serde(skip)]
    pub(crate) offers: Vec<grpc::KvOffer>,
    /// Where the worker serves Prometheus metrics (`host:port`).
    pub metrics_endpoint: String,
    /// Being drained by the planner: takes no new requests.
    pub draining: bool,
    /// Prefill: measured prompt tokens per second of engine time.
    pub prompt_tokens_per_s: f32,
    /// Last reported load.
    pub running: u32,
    /// Last reported queue.
    pub waiting: u32,
    /// Last reported free KV blocks.
    pub kv_blocks_free: u32,
    /// Last reported blocks reserved for KV still arriving (decode workers).
    pub kv_blocks_reserved: u32,
    /// Last reported transfers in flight (prefill workers).
    pub transfers_in_flight: u32,
    /// Ledger (decode workers): blocks whose KV is on the wire.
    pub kv_blocks_in_flight: u32,
    /// Ledger (decode workers): blocks of remotely prefilled requests that run.
    pub kv_blocks_committed: u32,
    /// Ledger (decode workers): requests freed since the worker started.
    pub kv_requests_freed: u64,
    /// KV blocks in all.
    pub kv_blocks_total: u32,
    /// Requests the router has in flight on it.
    pub in_flight: usize,
    #[serde(skip)]
    last_beat: Instant,
    #[serde(skip)]
    pub(crate) inflight: Arc<AtomicUsize>,
}

/// Counts a request against a worker's load while alive.
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
    /// A worker that misses heartbeats this long is dropped.
    pub timeout: Duration,
}

impl Registry {
    /// A registry that admits workers compatible with `identity`.
    pub fn new(identity: ModelIdentity) -> Arc<Registry> {
        Arc::new(Registry {
            identity,
            next_id: AtomicU64::new(1),
            workers: Mutex::new(HashMap::new()),
            timeout: Duration::from_secs(2),
        })
    }

    /// Snapshot of the live workers.
    pub fn workers(&self) -> Vec<Worker> {
        self.prune();
        let mut w: Vec<Worker> = self
            .workers
            .lock()
            .expect("registry lock")
            .values()
            .cloned()
            .collect();
        for x in &mut w {
            x.in_flight = x.inflight.load(Ordering::SeqCst);
        }
        w.sort_by_key(|x| x.id);
        w
    }

    /// Number of live workers of a role.
    pub fn count(&self, role: &str) -> usize {
        self.workers()
            .iter()
            .filter(|w| w.role == role && !w.draining)
            .count()
    }

    /// The least-loaded live worker of `role`, counted as in flight until the guard drops.
    pub fn pick(&self, role: &str, exclude: &[u64]) -> Option<(Worker, InFlight)> {
        self.prune();
        let ws = self.workers.lock().expect("registry lock");
        let w = ws
            .values()
            .filter(|w| w.role == role && !w.draining && !exclude.contains(&w.id))
            .min_by_key(|w| (w.inflight.load(Ordering::SeqCst) + w.waiting as usize, w.id))?;
        w.inflight.fetch_add(1, Ordering::SeqCst);
        Some((w.clone(), InFlight(w.inflight.clone())))
    }

    /// Counts a KV transfer made by worker `id` and keeps its timings.
    pub fn record_transfer(&self, id: u64, reply: &grpc::PrefillReply) {
        if let Some(w) = self.workers.lock().expect("registry lock").get_mut(&id) {
            *w.kv_transfers.entry(reply.transport.clone()).or_default() += 1;
            w.last_prefill_us = (reply.compute_us, reply.transfer_us);
        }
    }

    /// Stops routing new requests to worker `id` (it is being drained).
    pub fn set_draining(&self, id: u64) {
        if let Some(w) = self.workers.lock().expect("registry lock").get_mut(&id) {
            w.draining = true;
        }
    }

    /// Forgets a worker at once (e.g. its connection broke).
    pub fn remove(&self, id: u64) {
        if self
            .workers
            .lock()
            .expect("registry lock")
            .remove(&id)
            .is_some()
        {
            tracing::warn!(worker = id, "worker removed");
        }
    }

    fn prune(&self) {
        let mut ws = self.workers.lock().expect("registry lock");
        let timeout = self.timeout;
        ws.retain(|id, w| {
            let alive = w.last_beat.elapsed() < timeout;
            if !alive {
                tracing::warn!(worker = id, name = %w.name, "worker missed its heartbeats; dropped");
            }
            alive
        });
    }
}

/// The `Control` gRPC service over a registry.
pub struct ControlService(pub Arc<Registry>);

#[tonic::async_trait]
impl Control for ControlService {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let j = req.into_inner();
        let reg = &self.0;
        if j.protocol_version != proto::PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "worker {} speaks protocol version {}, the router {}",
                j.name,
                j.protocol_version,
                proto::PROTOCOL_VERSION
            )));
        }
        let theirs: ModelIdentity = j.identity.clone().unwrap_or_default().into();
        if let Some(diff) = reg.identity.incompatibility(&theirs) {
            tracing::warn!(name = %j.name, "refused worker: {diff}");
            return Err(Status::failed_precondition(format!(
                "worker {} cannot exchange KV with this cluster's model ({diff}; router vs worker)",
                j.name
            )));
        }
        let role = match Role::try_from(j.role) {
            Ok(Role::Prefill) => "prefill",
            Ok(Role::Decode) => "decode",
            _ => return Err(Status::invalid_argument("role must be prefill or decode")),
        };
        let id = reg.next_id.fetch_add(1, Ordering::SeqCst);
        let w = Worker {
            id,
            role,
            name: j.name,
            endpoint: j.endpoint,
            kv_offers: j
                .kv_offers
                .iter()
                .map(|o| (o.transport.clone(), o.endpoint.clone()))
                .collect(),
            kv_transfers: Default::default(),
            last_prefill_us: (0, 0),
            offers: j.kv_offers,
            metrics_endpoint: j.metrics_endpoint.clone(),
            draining: false,
            prompt_tokens_per_s: 0.0,
            running: 0,
            waiting: 0,
            kv_blocks_free: j.kv_blocks_total,
            kv_blocks_reserved: 0,
            transfers_in_flight: 0,
            kv_blocks_in_flight: 0,
            kv_blocks_committed: 0,
            kv_requests_freed: 0,
            kv_blocks_total: j.kv_blocks_total,
            in_flight: 0,
            last_beat: Instant::now(),
            inflight: Arc::new(AtomicUsize::new(0)),
        };
        tracing::info!(worker = id, role, name = %w.name, endpoint = %w.endpoint, "worker joined");
        reg.workers.lock().expect("registry lock").insert(id, w);
        Ok(Response::new(JoinReply { worker_id: id }))
    }

    async fn beat(&self, req: Request<Heartbeat>) -> Result<Response<HeartbeatReply>, Status> {
        let b = req.into_inner();
        let mut ws = self.0.workers.lock().expect("registry lock");
        let w = ws
            .get_mut(&b.worker_id)
            .ok_or_else(|| Status::not_found("unknown worker; join again"))?;
        w.running = b.running;
        w.waiting = b.waiting;
        w.kv_blocks_free = b.kv_blocks_free;
        w.kv_blocks_total = b.kv_blocks_total;
        w.kv_blocks_reserved = b.kv_blocks_reserved;
        w.transfers_in_flight = b.transfers_in_flight;
        w.kv_blocks_in_flight = b.kv_blocks_in_flight;
        w.kv_blocks_committed = b.kv_blocks_committed;
        w.kv_requests_freed = b.kv_requests_freed;
        w.prompt_tokens_per_s = b.prompt_tokens_per_s;
        w.last_beat = Instant::now();
        Ok(Response::new(grpc::HeartbeatReply {}))
    }
}
