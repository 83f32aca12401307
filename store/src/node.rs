//! A store node's gRPC service over [`Objects`]: workers offer and put blocks and get
//! prefixes; the router watches what the node holds, pins, and reads its load.
//!
//! Every call is checked against the caller's certificate (mutual TLS, as every internal hop):
//! only workers put and get, only the router pins. A put belongs to the certificate that
//! started it; a put stream that ends (or breaks) leaves its unended puts abandoned, never
//! visible. What one call can make the node hold is capped: the objects one offer or get
//! names, a chunk's bytes (tonic's message limit), and [`Objects`]' own limits. A get's sends
//! wait at most until its lease runs out.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pki::{Role, Security};
use proto::grpc::store_server::{Store, StoreServer};
use proto::grpc::{
    self, GetChunk, GetRequest, KvEvents, PinKind, PinReply, PinRequest, PutChunk, PutGrant,
    PutOutcome, PutReply, PutStartReply, PutStartRequest, StoreLoad, StoreStatsRequest,
    WatchRequest,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use types::BlockHash;

use crate::{Change, Got, Limits, ObjectKey, Objects, Pin as Kept, PutId, PutStart};

/// Most objects one offer or get names.
pub const MAX_KEYS: usize = 4096;
/// Bytes of one get chunk (under tonic's 4 MiB message limit).
pub const CHUNK: usize = 1 << 20;
/// Changes a watcher may fall behind by before it is dropped (it watches again, and gets a
/// snapshot).
const WATCH_BACKLOG: usize = 256;
/// HTTP/2 flow-control window of a store connection's streams, both ways (its default, 64 KiB,
/// holds a 1 MiB object to a round trip every 64 KiB).
pub const WINDOW: u32 = 8 << 20;
/// Largest HTTP/2 frame a store connection's peer may send (its default, 16 KiB, cuts a 1 MiB
/// object in 64).
pub const FRAME: u32 = 1 << 20;
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
type Owner = Option<[u8; 32]>;

struct Watcher {
    model: u64,
    next: u64,
    tx: mpsc::Sender<Result<KvEvents, Status>>,
}

struct Inner {
    objects: Objects,
    owners: HashMap<PutId, Owner>,
    watchers: Vec<Watcher>,
}

impl Inner {
    /// Sends the objects' changes to the watchers of their model; one that has fallen behind
    /// is dropped.
    fn publish(&mut self) {
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
        };
        Node {
            inner: Arc::new(Mutex::new(inner)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("store node lock")
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

    async fn put(&self, req: Request<Streaming<PutChunk>>) -> Result<Response<PutReply>, Status> {
        let owner = caller(&req, WORKERS, "put")?;
        let mut stream = req.into_inner();
        let mut open = HashSet::new();
        let mut reply = PutReply::default();
        let end = loop {
            let chunk = match stream.message().await {
                Ok(Some(c)) => c,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            };
            let id = PutId(chunk.put_id);
            let mut n = self.lock();
            if n.owners.get(&id) != Some(&owner) {
                reply
                    .failed
                    .push(format!("put {id} is not one this caller started"));
                continue;
            }
            open.insert(id);
            let done =
                n.objects
                    .put_write(id, chunk.offset, &chunk.data)
                    .and_then(|()| match chunk.end {
                        true => n.objects.put_end(id).map(|()| true),
                        false => Ok(false),
                    });
            match done {
                Ok(false) => continue,
                Ok(true) => reply.published += 1,
                Err(e) => {
                    n.objects.put_abort(id);
                    reply.failed.push(e.to_string());
                }
            }
            open.remove(&id);
            n.owners.remove(&id);
            n.publish();
        };
        let mut n = self.lock();
        for id in open {
            n.objects.abandon(id);
            n.owners.remove(&id);
        }
        drop(n);
        end.map(|()| Response::new(reply))
    }

    type GetStream = Boxed<GetChunk>;

    async fn get(&self, req: Request<GetRequest>) -> Result<Response<Self::GetStream>, Status> {
        caller(&req, WORKERS, "get")?;
        let keys = req.into_inner().keys;
        capped(&keys, "objects asked for")?;
        let keys = keys
            .into_iter()
            .map(|k| key(Some(k)))
            .collect::<Result<Vec<_>, _>>()?;
        let (tx, rx) = mpsc::channel(4);
        let node = self.clone();
        tokio::spawn(async move {
            for (index, k) in keys.into_iter().enumerate() {
                let got = node.lock().objects.get(k, Instant::now());
                let got = match got {
                    Ok(Some(g)) => g,
                    Ok(None) => break,
                    Err(e) => {
                        let _ = tx
                            .send(Err(Status::resource_exhausted(e.to_string())))
                            .await;
                        break;
                    }
                };
                let sent = send(&tx, index as u32, &got).await;
                node.lock().objects.release(got.lease);
                if !sent {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
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

/// Sends object `index` in [`CHUNK`]s, each send waiting at most until the lease runs out;
/// `false` when the caller went away or fell that far behind.
async fn send(tx: &mpsc::Sender<Result<GetChunk, Status>>, index: u32, got: &Got) -> bool {
    let deadline = tokio::time::Instant::from_std(got.expires);
    let size = got.data.len() as u64;
    let mut parts = got.data.chunks(CHUNK).peekable();
    let mut offset = 0u64;
    // An empty object is one empty chunk.
    let first: &[u8] = &[];
    let mut next = parts.next().or(Some(first));
    while let Some(part) = next {
        let chunk = GetChunk {
            index,
            size,
            sum: got.sum,
            offset,
            data: part.to_vec(),
        };
        match tokio::time::timeout_at(deadline, tx.send(Ok(chunk))).await {
            Ok(Ok(())) => {}
            _ => return false,
        }
        offset += part.len() as u64;
        next = parts.next();
    }
    true
}

/// Serves a store node on `listener` until the process ends: workers and the router may
/// connect (mutual TLS under `security`), no one else.
pub async fn serve(
    listener: tokio::net::TcpListener,
    security: &Security,
    node: Node,
) -> Result<(), String> {
    let allowed = [Role::Prefill, Role::Decode, Role::Router];
    let incoming = proto::secure::incoming(listener, security, &allowed, "store")
        .map_err(|e| e.to_string())?;
    tokio::spawn(node.clone().tick());
    tonic::transport::Server::builder()
        .initial_stream_window_size(WINDOW)
        .initial_connection_window_size(WINDOW * 2)
        .max_frame_size(FRAME)
        .add_service(node.service())
        .serve_with_incoming(incoming)
        .await
        .map_err(|e| proto::secure::explain(&e))
}
