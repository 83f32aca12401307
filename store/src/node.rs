//! A store node's gRPC service over [`Objects`]: workers offer blocks (their bytes, and gets,
//! go on the node's data connections, [`crate::data`]); the router watches what the node holds,
//! pins, and reads its load.
//!
//! Every call is checked against the caller's certificate (mutual TLS, as every internal hop):
//! only workers put and get, only the router pins. A put belongs to the certificate that
//! started it. What one call can make the node hold is capped: the objects one offer or get
//! names, and [`Objects`]' own limits.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pki::{Role, Security};
use proto::grpc::store_server::{Store, StoreServer};
use proto::grpc::{
    self, KvEvents, PinKind, PinReply, PinRequest, PutGrant, PutOutcome, PutStartReply,
    PutStartRequest, StoreLoad, StoreStatsRequest, WatchRequest,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use types::BlockHash;

use crate::{Change, Limits, ObjectKey, Objects, Pin as Kept, PutId, PutStart};

/// Most objects one offer or get names.
pub const MAX_KEYS: usize = 4096;
/// Changes a watcher may fall behind by before it is dropped (it watches again, and gets a
/// snapshot).
const WATCH_BACKLOG: usize = 256;
/// How often puts and leases past their time are freed.
const TICK: Duration = Duration::from_millis(100);

/// The node's gauges on its `/metrics` (its load, each [`TICK`]): name and help.
pub const CATALOGUE: [(&str, &str); 14] = [
    ("tandem_store_objects", "KV blocks the store node holds."),
    ("tandem_store_bytes", "Bytes of the blocks the store node holds."),
    ("tandem_store_pending_bytes", "Bytes taken by puts under way on the store node."),
    ("tandem_store_capacity_bytes", "The store node's capacity in bytes ([store] capacity_bytes)."),
    ("tandem_store_hits", "Gets that found their block on the store node, since it started."),
    ("tandem_store_misses", "Gets that did not find their block on the store node, since it started."),
    ("tandem_store_puts", "Blocks published on the store node, since it started."),
    ("tandem_store_puts_refused", "Puts the store node refused (full, busy, too large), since it started."),
    ("tandem_store_puts_corrupt", "Puts whose bytes failed their checksum on the store node, since it started."),
    ("tandem_store_puts_abandoned", "Puts never published within their deadline or left by their stream, since the store node started."),
    ("tandem_store_evictions", "Blocks the store node evicted, since it started."),
    ("tandem_store_leases", "Read leases the store node holds now."),
    ("tandem_store_soft_pins", "Blocks softly pinned on the store node now."),
    ("tandem_store_hard_pins", "Blocks hard-pinned on the store node now."),
];

/// Who a put belongs to: its certificate's SHA-256 (`None` on a plain connection).
pub(crate) type Owner = Option<[u8; 32]>;

struct Watcher {
    model: u64,
    next: u64,
    tx: mpsc::Sender<Result<KvEvents, Status>>,
}

pub(crate) struct Inner {
    pub(crate) objects: Objects,
    pub(crate) owners: HashMap<PutId, Owner>,
    watchers: Vec<Watcher>,
    /// The port of the node's data connections (0 until they are served).
    data_port: u16,
    /// Fault injection for tests and chaos runs: every object sent has a bit flipped (its
    /// checksum left as it was), as a node whose memory went bad would send it.
    pub(crate) corrupting: bool,
}

impl Inner {
    /// Put `id` given up: its writer went away before it was whole.
    pub(crate) fn abandon(&mut self, id: PutId) {
        self.objects.abandon(id);
        self.owners.remove(&id);
    }

    /// Sends the objects' changes to the watchers of their model; one that has fallen behind
    /// is dropped.
    pub(crate) fn publish(&mut self) {
        let changes = self.objects.take_changes();
        if changes.is_empty() {
            return;
        }
        self.watchers.retain_mut(|w| {
            let events = watch_events(&changes, w.model, w.next);
            if events.hashes.is_empty() {
                return !w.tx.is_closed();
            }
            w.next = events.next;
            w.tx.try_send(Ok(events)).is_ok()
        });
    }
}

/// `changes` to model `model`'s objects as a watch sends them, numbered from `first`.
pub fn watch_events(changes: &[Change], model: u64, first: u64) -> KvEvents {
    let (hashes, stored): (Vec<u64>, Vec<bool>) = changes
        .iter()
        .filter_map(|c| match *c {
            Change::Stored(k) if k.model == model => Some((k.block.0, true)),
            Change::Removed(k) if k.model == model => Some((k.block.0, false)),
            _ => None,
        })
        .unzip();
    KvEvents {
        first,
        next: first + hashes.len() as u64,
        hashes,
        stored,
        snapshot: false,
        tiers: Vec::new(),
    }
}

/// One store node: its objects and who watches them.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Mutex<Inner>>,
}

impl Node {
    /// An empty node under `limits`.
    pub fn new(limits: Limits) -> Node {
        let inner = Inner {
            objects: Objects::new(limits),
            owners: HashMap::new(),
            watchers: Vec::new(),
            data_port: 0,
            corrupting: false,
        };
        Node {
            inner: Arc::new(Mutex::new(inner)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("store node lock")
    }

    /// Fault injection: from now on every object this node sends has a bit flipped (readers
    /// must find it by its checksum). For tests and chaos runs only.
    pub fn corrupt_what_it_sends(&self) {
        self.with(|n| n.corrupting = true);
    }

    /// `f` on the node's state, under its lock.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.lock())
    }

    /// The node's counters and levels.
    pub fn load(&self) -> StoreLoad {
        let n = self.lock();
        let s = n.objects.stats();
        StoreLoad {
            objects: s.objects,
            bytes: s.bytes,
            pending_bytes: s.pending_bytes,
            capacity: n.objects.capacity(),
            hits: s.hits,
            misses: s.misses,
            puts: s.puts,
            puts_refused: s.puts_refused,
            puts_corrupt: s.puts_corrupt,
            puts_abandoned: s.puts_abandoned,
            evictions: s.evictions,
            leases: s.leases,
            soft_pins: s.soft_pins,
            hard_pins: s.hard_pins,
            data_port: n.data_port.into(),
        }
    }

    /// Sets the node's gauges (see [`CATALOGUE`]) to its load now.
    fn export(&self) {
        let l = self.load();
        let gauges = [
            ("tandem_store_objects", l.objects),
            ("tandem_store_bytes", l.bytes),
            ("tandem_store_pending_bytes", l.pending_bytes),
            ("tandem_store_capacity_bytes", l.capacity),
            ("tandem_store_hits", l.hits),
            ("tandem_store_misses", l.misses),
            ("tandem_store_puts", l.puts),
            ("tandem_store_puts_refused", l.puts_refused),
            ("tandem_store_puts_corrupt", l.puts_corrupt),
            ("tandem_store_puts_abandoned", l.puts_abandoned),
            ("tandem_store_evictions", l.evictions),
            ("tandem_store_leases", l.leases),
            ("tandem_store_soft_pins", l.soft_pins),
            ("tandem_store_hard_pins", l.hard_pins),
        ];
        for (name, v) in gauges {
            metrics::gauge!(name).set(v as f64);
        }
    }

    /// Frees puts and leases past their time, every [`TICK`], for as long as the node lives.
    pub async fn tick(self) {
        let mut every = tokio::time::interval(TICK);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let mut n = self.lock();
            n.objects.tick(Instant::now());
            let owners: Vec<PutId> = n.owners.keys().copied().collect();
            for id in owners {
                if !n.objects.put_under_way(id) {
                    n.owners.remove(&id);
                }
            }
            n.publish();
            drop(n);
            self.export();
        }
    }

    /// The gRPC service.
    pub fn service(&self) -> StoreServer<Node> {
        StoreServer::new(self.clone())
    }
}

/// The caller's certificate, when its role is one of `allowed` (`None` on a plain
/// connection: `insecure = true` believes everyone).
fn caller<T>(req: &Request<T>, allowed: &[Role], what: &str) -> Result<Owner, Status> {
    match proto::secure::peer(req) {
        None => Ok(None),
        Some(p) if allowed.contains(&p.role) => Ok(Some(p.fingerprint)),
        Some(p) => Err(Status::permission_denied(format!(
            "a {} certificate may not {what} on a store node",
            p.role
        ))),
    }
}

const WORKERS: &[Role] = &[Role::Prefill, Role::Decode];

fn key(k: Option<grpc::ObjectKey>) -> Result<ObjectKey, Status> {
    let k = k.ok_or_else(|| Status::invalid_argument("an object without its key"))?;
    Ok(ObjectKey {
        model: k.model,
        block: BlockHash(k.block),
    })
}

fn capped<T>(items: &[T], what: &str) -> Result<(), Status> {
    match items.len() > MAX_KEYS {
        true => Err(Status::invalid_argument(format!(
            "{} {what} in one call: at most {MAX_KEYS}",
            items.len()
        ))),
        false => Ok(()),
    }
}

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Store for Node {
    async fn put_start(
        &self,
        req: Request<PutStartRequest>,
    ) -> Result<Response<PutStartReply>, Status> {
        let owner = caller(&req, WORKERS, "put")?;
        let objects = req.into_inner().objects;
        capped(&objects, "objects offered")?;
        let now = Instant::now();
        let mut n = self.lock();
        let mut grants = Vec::with_capacity(objects.len());
        for o in objects {
            let grant = match n.objects.put_start(key(o.key)?, o.size, o.sum, now) {
                Ok(PutStart::Write(id)) => {
                    n.owners.insert(id, owner);
                    (PutOutcome::PutWrite, id.0, String::new())
                }
                Ok(PutStart::Held) => (PutOutcome::PutHeld, 0, String::new()),
                Err(e) => (PutOutcome::PutRefused, 0, e.to_string()),
            };
            grants.push(PutGrant {
                outcome: grant.0 as i32,
                put_id: grant.1,
                why: grant.2,
            });
        }
        n.publish();
        Ok(Response::new(PutStartReply { grants }))
    }

    async fn pin(&self, req: Request<PinRequest>) -> Result<Response<PinReply>, Status> {
        caller(&req, &[Role::Router], "pin")?;
        let req = req.into_inner();
        capped(&req.keys, "objects to pin")?;
        let kind = match PinKind::try_from(req.pin) {
            Ok(PinKind::PinNone) => Kept::None,
            Ok(PinKind::PinSoft) => Kept::Soft,
            Ok(PinKind::PinHard) => Kept::Hard,
            Err(_) => return Err(Status::invalid_argument(format!("pin {}", req.pin))),
        };
        let mut n = self.lock();
        let mut reply = PinReply::default();
        for k in req.keys {
            match n.objects.pin(key(Some(k))?, kind) {
                Ok(()) => reply.pinned += 1,
                Err(e) => reply.failed.push(e.to_string()),
            }
        }
        Ok(Response::new(reply))
    }

    async fn stats(&self, req: Request<StoreStatsRequest>) -> Result<Response<StoreLoad>, Status> {
        caller(
            &req,
            &[Role::Router, Role::Prefill, Role::Decode],
            "read stats",
        )?;
        Ok(Response::new(self.load()))
    }

    type WatchStream = Boxed<KvEvents>;

    async fn watch(
        &self,
        req: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        caller(&req, &[Role::Router], "watch")?;
        let model = req.into_inner().model;
        let (tx, rx) = mpsc::channel(WATCH_BACKLOG);
        let mut n = self.lock();
        let hashes: Vec<u64> = n.objects.blocks(model).into_iter().map(|b| b.0).collect();
        let snapshot = KvEvents {
            first: 0,
            hashes,
            stored: Vec::new(),
            snapshot: true,
            next: 0,
            tiers: Vec::new(),
        };
        tx.try_send(Ok(snapshot)).expect("a new channel has room");
        n.watchers.push(Watcher { model, next: 0, tx });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves a store node until the process ends: its gRPC on `control`, its data connections
/// on `data`; workers and the router may connect (mutual TLS under `security`), no one else.
pub async fn serve(
    control: tokio::net::TcpListener,
    data: tokio::net::TcpListener,
    security: &Security,
    node: Node,
) -> Result<(), String> {
    let allowed = [Role::Prefill, Role::Decode, Role::Router];
    let incoming =
        proto::secure::incoming(control, security, &allowed, "store").map_err(|e| e.to_string())?;
    let port = data.local_addr().map_err(|e| e.to_string())?.port();
    node.with(|n| n.data_port = port);
    tokio::spawn(node.clone().tick());
    let (security_, node_) = (security.clone(), node.clone());
    let bytes = tokio::spawn(async move { crate::data::serve(data, &security_, node_).await });
    let grpc = tonic::transport::Server::builder()
        .add_service(node.service())
        .serve_with_incoming(incoming);
    tokio::select! {
        r = grpc => r.map_err(|e| proto::secure::explain(&e)),
        r = bytes => r.map_err(|e| e.to_string())?.map_err(|e| format!("data connections: {e}")),
    }
}
