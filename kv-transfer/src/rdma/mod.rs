//! The RDMA transport (cargo feature `rdma`): one-sided RDMA WRITEs straight into the decode
//! worker's paged KV pool.
//!
//! The decode worker listens on a TCP side channel. A prefill worker connects, passes the
//! protocol handshake (version, layout, ticket-checked `Begin`s, cluster secret), then both
//! exchange queue-pair endpoints (`Setup`) and connect a reliable-connected queue pair. Per
//! transfer the receiver grants the request's block ids and registers those blocks alone — one
//! memory region per run of consecutive blocks, per layer, per keys/values pool — sending their
//! addresses and keys with the grant (`grant.rs`); the regions are deregistered when the
//! transfer is over, so no peer ever holds a key to the rest of the pool. For each layer the
//! sender copies the layer into a registered
//! staging buffer, posts one WRITE per block for keys and one for values (the last carrying the
//! layer index as immediate data), waits for their completion, and sends `Written` with the
//! layer's CRC32. The receiver waits for the immediates, checks every CRC against its cache and
//! only then admits the request. Layout, deadlines and acks are the protocol core's, as for
//! TCP and QUIC.

mod grant;
mod verbs;

use std::collections::HashMap;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{BufReader, BufWriter};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::core::Timeouts;
use crate::stream::{Gate, ReadHalf, WriteHalf};
use crate::wire::{self, Conn, InPlaceSide, KvEvent, Layer, Layers, Local};
use crate::{KvRegions, TransferError, TransferStats, Transport};
use verbs::{Context, Cq, Endpoint, Mr, Pd, PreparedQp, Qp, Write};

/// Receives posted per connection for the senders' immediates.
const RECV_DEPTH: u32 = 1024;
/// Most WRITEs posted before waiting for their completion.
const SEND_DEPTH: u32 = 1024;

/// RDMA devices here, or why none can be used.
pub fn probe() -> Result<Vec<String>, String> {
    match ibverbs::devices() {
        Ok(list) => {
            let names: Vec<String> = list
                .iter()
                .filter_map(|d| d.name().map(|n| n.to_string_lossy().into_owned()))
                .collect();
            if names.is_empty() {
                Err("no RDMA device on this machine".into())
            } else {
                Ok(names)
            }
        }
        // ENOSYS: the kernel has no RDMA support at all, which also means no devices.
        Err(e) if e.raw_os_error() == Some(38) => {
            Err("no RDMA device on this machine (the kernel has no RDMA support)".into())
        }
        Err(e) => Err(format!("listing RDMA devices failed: {e}")),
    }
}

fn io(e: std::io::Error) -> TransferError {
    TransferError::Io(e)
}

fn put_endpoint(b: &mut Vec<u8>, e: &Endpoint) {
    b.extend(e.qpn.to_le_bytes());
    b.extend(e.lid.to_le_bytes());
    b.push(e.gid.is_some() as u8);
    b.extend(e.gid.unwrap_or_default());
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], TransferError> {
        if self.0.len() < N {
            return Err(TransferError::Protocol("truncated RDMA setup".into()));
        }
        let (a, b) = self.0.split_at(N);
        self.0 = b;
        Ok(a.try_into().expect("N bytes"))
    }
    fn endpoint(&mut self) -> Result<Endpoint, TransferError> {
        let qpn = u32::from_le_bytes(self.take()?);
        let lid = u16::from_le_bytes(self.take()?);
        let has_gid = self.take::<1>()?[0] != 0;
        let gid = self.take::<16>()?;
        Ok(Endpoint {
            qpn,
            lid,
            gid: has_gid.then_some(gid),
        })
    }
    fn u64(&mut self) -> Result<u64, TransferError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, TransferError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
}

/// One remote pool (a layer's keys or values): where, how long, which key.
/// The device side of a decode worker: its KV pools, registered per grant.
struct Registered {
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    /// Per layer: the keys' and the values' pool, (address, bytes).
    pools: Vec<[(usize, usize); 2]>,
    block_bytes: u64,
    /// Keep the pools allocated while any grant's registration lives (every `ServerSide`
    /// holds this `Registered`, and drops its grants' regions first).
    _owners: Vec<Arc<dyn Send + Sync>>,
}

/// The decode side: a TCP side channel plus the KV pool, opened to writes grant by grant.
pub struct RdmaKvReceiver {
    listener: TcpListener,
    dev: Arc<Registered>,
}

impl RdmaKvReceiver {
    /// Opens the first RDMA device for the KV pool described by `regions` and takes the side
    /// channel's `listener`. Nothing is registered until a transfer is granted.
    ///
    /// # Safety
    /// Every region must lie inside memory that `regions.owners` keep allocated and unmoved
    /// (the receiver holds them as long as any registration lives): peers write into the
    /// granted blocks of it.
    pub unsafe fn bind(
        listener: TcpListener,
        regions: &KvRegions,
    ) -> Result<RdmaKvReceiver, TransferError> {
        let ctx = Context::open().map_err(io)?;
        let pd = Pd::new(&ctx).map_err(io)?;
        tracing::info!(
            device = ctx.name(),
            layers = regions.layers.len(),
            "KV pool open to RDMA writes, registered grant by grant"
        );
        Ok(RdmaKvReceiver {
            listener,
            dev: Arc::new(Registered {
                ctx,
                pd,
                pools: regions.layers.clone(),
                block_bytes: regions.block_bytes as u64,
                _owners: regions.owners.clone(),
            }),
        })
    }

    /// The side channel's address.
    pub fn local_addr(&self) -> Result<SocketAddr, TransferError> {
        Ok(self.listener.local_addr()?)
    }

    /// Accepts side-channel connections forever, each with its own queue pair.
    pub async fn serve(self, local: Local, tx: mpsc::Sender<KvEvent>, timeouts: Timeouts) {
        let receiving = wire::Receiving {
            local,
            transport: Transport::Rdma,
            tx,
            pool: wire::BufferPool::default(),
            timeouts,
        };
        let gate = match Gate::new(&receiving.local, "kv_rdma") {
            Ok(g) => g,
            Err(e) => return tracing::error!("KV listener (rdma) not served: {e}"),
        };
        loop {
            let Ok((tcp, peer)) = self.listener.accept().await else {
                continue;
            };
            let (receiving, dev, gate) = (receiving.clone(), self.dev.clone(), gate.clone());
            tokio::spawn(async move {
                let Some((r, mut w, _slot)) = gate.open(tcp, peer).await else {
                    return;
                };
                let mut r = BufReader::with_capacity(64 << 10, r);
                let mut side = ServerSide {
                    grants: HashMap::new(),
                    dev,
                    qp: None,
                    imms: Vec::new(),
                };
                let served = wire::serve_stream(&mut r, &mut w, &receiving, Some(&mut side));
                if let Err(e) = served.await {
                    tracing::warn!(%peer, "KV connection (rdma) closed: {e}");
                }
            });
        }
    }
}

/// The decode side of one connection's data path.
struct ServerSide {
    /// Each granted transfer's registered regions. Declared before `dev`: deregistered before
    /// the pool's owners may go.
    grants: HashMap<u64, Vec<Mr>>,
    dev: Arc<Registered>,
    qp: Option<Qp>,
    /// Immediates (layer indices) seen and not yet consumed by a transfer.
    imms: Vec<u32>,
}

impl InPlaceSide for ServerSide {
    fn setup(&mut self, theirs: &[u8]) -> Result<Vec<u8>, TransferError> {
        let peer = Cursor(theirs).endpoint()?;
        let cq = Cq::new(&self.dev.ctx, (RECV_DEPTH + 16) as i32).map_err(io)?;
        let prepared = PreparedQp::new(&self.dev.pd, &cq, 16, RECV_DEPTH).map_err(io)?;
        let mut ours = Vec::new();
        put_endpoint(&mut ours, &prepared.endpoint());
        let mut qp = prepared.connect(peer).map_err(io)?;
        for i in 0..RECV_DEPTH {
            // SAFETY: an empty receive references no memory.
            unsafe { qp.post_empty_recv(i as u64) }.map_err(io)?;
        }
        self.qp = Some(qp);
        ours.extend(self.dev.block_bytes.to_le_bytes());
        ours.extend((self.dev.pools.len() as u32).to_le_bytes());
        Ok(ours)
    }

    fn grant(&mut self, request_id: u64, blocks: &[u32]) -> Result<Vec<u8>, TransferError> {
        let runs = grant::runs(blocks);
        let bb = self.dev.block_bytes as usize;
        let mut mrs = Vec::with_capacity(self.dev.pools.len() * 2 * runs.len());
        let mut regions = Vec::with_capacity(self.dev.pools.len());
        for pair in &self.dev.pools {
            let mut two: [Vec<grant::Region>; 2] = Default::default();
            for (&(base, len), out) in pair.iter().zip(&mut two) {
                for &(first, n) in &runs {
                    let (off, bytes) = (first as usize * bb, n as usize * bb);
                    if off.saturating_add(bytes) > len {
                        return Err(TransferError::Protocol(format!(
                            "request {request_id}: granted block {} lies outside the KV pool",
                            first as u64 + n as u64 - 1
                        )));
                    }
                    // SAFETY: the range lies inside a pool (checked just above) that the
                    // pool's owners keep allocated and unmoved (`bind`'s contract; `dev` holds
                    // them), and this region is deregistered before `dev` is dropped.
                    let mr = unsafe { Mr::register(&self.dev.pd, (base + off) as *mut u8, bytes) }
                        .map_err(io)?;
                    out.push(grant::Region {
                        addr: mr.addr(),
                        rkey: mr.rkey(),
                    });
                    mrs.push(mr);
                }
            }
            regions.push(two);
        }
        self.grants.insert(request_id, mrs);
        Ok(grant::Access { runs, regions }.encode())
    }

    fn release(&mut self, request_id: u64) {
        self.grants.remove(&request_id);
    }

    fn try_writes(&mut self, request_id: u64, n_layers: u32) -> Result<bool, TransferError> {
        let qp = self
            .qp
            .as_mut()
            .ok_or_else(|| TransferError::Protocol("RDMA transfer before setup".into()))?;
        let mut wcs = [ibverbs_sys::ibv_wc::default(); 32];
        let cq = qp.cq().clone();
        let n = cq.poll(&mut wcs).map_err(io)?;
        for wc in &wcs[..n] {
            if let Some((status, vendor)) = wc.error() {
                return Err(TransferError::Protocol(format!(
                    "request {request_id}: RDMA receive failed (status {status}, vendor {vendor})"
                )));
            }
            if let Some(imm) = wc.imm_data() {
                self.imms.push(u32::from_be(imm));
            }
            // SAFETY: an empty receive references no memory.
            unsafe { qp.post_empty_recv(wc.wr_id()) }.map_err(io)?;
        }
        if self.imms.len() < n_layers as usize {
            return Ok(false);
        }
        let got: Vec<u32> = self.imms.drain(..n_layers as usize).collect();
        if got.iter().copied().ne(0..n_layers) {
            return Err(TransferError::Protocol(format!(
                "request {request_id}: RDMA layer completions out of order: {got:?}"
            )));
        }
        Ok(true)
    }
}

/// The prefill side: a side-channel connection and a connected queue pair to one decode
/// worker, with a registered staging buffer.
pub struct RdmaKvSender {
    conn: Conn<BufReader<ReadHalf>, BufWriter<WriteHalf>>,
    qp: Qp,
    pd: Arc<Pd>,
    staging: Mr,
    block_bytes: u64,
    block_size: usize,
    /// The model's layers (an access has regions for each).
    n_layers: usize,
    wr_id: u64,
}

impl RdmaKvSender {
    /// Connects the side channel to `addr`, runs the handshake, exchanges setup and connects
    /// a queue pair, within `timeout`.
    pub async fn connect(
        addr: &str,
        local: &Local,
        timeout: Duration,
    ) -> Result<RdmaKvSender, TransferError> {
        let ctx = Context::open().map_err(io)?;
        let pd = Pd::new(&ctx).map_err(io)?;
        let cq = Cq::new(&ctx, (SEND_DEPTH + 16) as i32).map_err(io)?;
        let prepared = PreparedQp::new(&pd, &cq, SEND_DEPTH, 16).map_err(io)?;
        let (r, w) = crate::stream::dial(addr, local, timeout, "RDMA side channel").await?;
        let timeouts = Timeouts {
            handshake: timeout,
            ..Timeouts::default()
        };
        let mut conn = Conn::open_with(r, w, local, timeouts, true).await?;
        let mut ours = Vec::new();
        put_endpoint(&mut ours, &prepared.endpoint());
        let theirs = conn.setup(ours, timeout).await?;
        let mut c = Cursor(&theirs);
        let peer = c.endpoint()?;
        let block_bytes = c.u64()?;
        let n_layers = c.u32()?;
        if n_layers != local.identity.n_layers {
            return Err(TransferError::Protocol(format!(
                "the receiver has {n_layers} layers, this model has {}",
                local.identity.n_layers
            )));
        }
        let qp = prepared.connect(peer).map_err(io)?;
        let staging = Mr::alloc(&pd, 1 << 20).map_err(io)?;
        Ok(RdmaKvSender {
            conn,
            qp,
            pd,
            staging,
            block_bytes,
            block_size: local.identity.block_size as usize,
            n_layers: n_layers as usize,
            wr_id: 0,
        })
    }

    /// Writes one layer into the granted blocks (through the regions the grant opened) and
    /// waits for the writes' completion.
    async fn write_layer(
        &mut self,
        layer: u32,
        data: &[u8],
        n_tokens: usize,
        (blocks, access): (&[u32], &grant::Access),
        until: Instant,
    ) -> Result<(), TransferError> {
        if self.staging.len() < data.len() {
            self.staging = Mr::alloc(&self.pd, data.len().next_power_of_two()).map_err(io)?;
        }
        self.staging.bytes_mut()[..data.len()].copy_from_slice(data);
        let per_token = data.len() / (2 * n_tokens);
        let mut writes = Vec::with_capacity(2 * blocks.len());
        for half in 0..2 {
            for (j, &b) in blocks.iter().enumerate() {
                let t0 = j * self.block_size;
                let t1 = (t0 + self.block_size).min(n_tokens);
                let len = ((t1 - t0) * per_token) as u64;
                let place = access.place((layer as usize, half), j, self.block_bytes);
                let Some((remote, rkey)) = place.filter(|_| len <= self.block_bytes) else {
                    return Err(TransferError::Protocol(format!(
                        "granted block {b} of layer {layer} is not in the grant's regions"
                    )));
                };
                let local = half * n_tokens * per_token + t0 * per_token;
                writes.push(Write {
                    local: self.staging.addr() + local as u64,
                    lkey: self.staging.lkey(),
                    len: len as u32,
                    remote,
                    rkey,
                });
            }
        }
        for (i, chunk) in writes.chunks(SEND_DEPTH as usize).enumerate() {
            let last = (i + 1) * SEND_DEPTH as usize >= writes.len();
            self.wr_id += 1;
            let id = self.wr_id;
            // The layer index travels as the immediate of the layer's last write only; earlier
            // chunks carry an index the receiver never expects, so they are sent plain.
            // SAFETY: local bytes are in the staging region, which is neither touched nor freed
            // until this completion is polled below; remote ranges lie in the regions the
            // receiver registered for this grant (a write outside them fails at its NIC).
            unsafe {
                if last {
                    self.qp.post_writes(chunk, layer, id)
                } else {
                    self.qp.post_writes_plain(chunk, id)
                }
            }
            .map_err(io)?;
            self.await_completion(id, until).await?;
        }
        Ok(())
    }

    /// Waits for write `id`'s completion by polling the send CQ, yielding to the runtime between
    /// polls. Why polling, not a completion channel: one layer's writes complete in
    /// microseconds, and a channel (`ibv_req_notify_cq` + an event fd woken through the
    /// runtime) would add a syscall and a wake-up per layer on the transfer's critical path;
    /// the wait is bounded by `until`. The receiver's check of the immediates
    /// (`wire::serve_stream`, `try_writes`) polls for the same reason: they are almost always
    /// there when the `Written` frame arrives, since the sender sends it only after its own
    /// completion.
    async fn await_completion(&mut self, id: u64, until: Instant) -> Result<(), TransferError> {
        let mut wcs = [ibverbs_sys::ibv_wc::default(); 16];
        let cq = self.qp.cq().clone();
        loop {
            let n = cq.poll(&mut wcs).map_err(io)?;
            for wc in &wcs[..n] {
                if let Some((status, vendor)) = wc.error() {
                    return Err(TransferError::Protocol(format!(
                        "RDMA write failed (status {status}, vendor {vendor})"
                    )));
                }
                if wc.wr_id() == id {
                    return Ok(());
                }
            }
            if Instant::now() >= until {
                return Err(TransferError::Timeout(
                    "RDMA writes did not complete".into(),
                ));
            }
            tokio::task::yield_now().await;
        }
    }

    /// Sends one request's KV and waits for the receiver to admit it, within `timeout`.
    pub async fn send(
        &mut self,
        (request_id, ticket): (u64, types::TransferTicket),
        n_tokens: u32,
        width: u32,
        layers: Layers<'_>,
        timeout: Duration,
    ) -> Result<TransferStats, TransferError> {
        let t0 = Instant::now();
        let until = t0 + timeout;
        let (blocks, access) = self
            .conn
            .begin_granted((request_id, ticket), n_tokens, width, timeout)
            .await?;
        let access = grant::Access::decode(&access, &blocks, self.n_layers)?;
        let (n_layers, mut ready, mut rx) = match layers {
            Layers::Ready(all) => (all.len() as u32, Some(all.iter()), None),
            Layers::Stream { n_layers, rx } => (n_layers, None, Some(rx)),
        };
        let mut bytes = 0u64;
        for l in 0..n_layers {
            let owned: Layer;
            let data: &Layer = match (&mut ready, &mut rx) {
                (Some(all), _) => all.next().expect("counted"),
                (None, Some(rx)) => {
                    let left = until.saturating_duration_since(Instant::now());
                    owned = tokio::time::timeout(left, rx.recv())
                        .await
                        .map_err(|_| {
                            TransferError::Timeout(format!("layer {l} of request {request_id}"))
                        })?
                        .ok_or_else(|| {
                            TransferError::Protocol(format!(
                                "request {request_id}: the KV source ended after {l} layers"
                            ))
                        })?;
                    &owned
                }
                (None, None) => unreachable!("one source"),
            };
            let granted = (&blocks[..], &access);
            self.write_layer(l, &data.bytes, n_tokens as usize, granted, until)
                .await?;
            bytes += data.bytes.len() as u64;
            self.conn.written(request_id, l, data.crc).await?;
        }
        self.conn.outcome(request_id).await?;
        Ok(TransferStats {
            bytes,
            elapsed: t0.elapsed(),
            transport: Transport::Rdma,
        })
    }
}
