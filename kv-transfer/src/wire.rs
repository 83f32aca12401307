//! The transfer protocol over any ordered byte stream (a TCP connection, a QUIC stream).

use std::time::{Duration, Instant};

use proto::ModelIdentity;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use types::RequestId;

use crate::core::{Client, ClientEvent, Received, Server, ServerEvent, Timeouts};
use crate::frame::{Frame, HEADER};
use crate::TransferError;

/// Largest frame read before a peer has passed the handshake, and the largest non-`Layer`
/// frame at any time: a stranger cannot make a worker allocate more than this.
pub const MAX_CONTROL_FRAME: u32 = 1 << 20;

/// Reads one control frame, checking its CRC.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Frame, TransferError> {
    read_frame_limited(r, None, MAX_CONTROL_FRAME).await
}

/// Layer buffers handed back once their KV is in the cache, reused for the next transfers so
/// that big layers do not land in freshly mapped (page-faulting) memory every time.
#[derive(Debug, Clone, Default)]
pub struct BufferPool(std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>);

impl BufferPool {
    /// Most bytes kept: a burst of transfers (a decode worker thawed with many on its sockets)
    /// must not leave the worker holding its peak in buffers for ever.
    const KEEP_BYTES: usize = 32 << 20;

    /// An empty buffer with room for `n` bytes: the smallest kept one that fits, else a new one
    /// (its bytes are written by the socket read, never zeroed first).
    fn take(&self, n: usize) -> Vec<u8> {
        let mut pool = self.0.lock().expect("pool lock");
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= n)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        let mut buf = match best {
            Some(i) => pool.swap_remove(i),
            None => Vec::with_capacity(n),
        };
        buf.clear();
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        let mut pool = self.0.lock().expect("pool lock");
        let kept: usize = pool.iter().map(Vec::capacity).sum();
        if kept + buf.capacity() <= Self::KEEP_BYTES {
            pool.push(buf);
        }
    }
}

/// Reads one frame of at most `limit` payload bytes, checking its CRC; `Layer` payloads go
/// straight into a buffer from `pool`.
pub async fn read_frame_limited<R: AsyncRead + Unpin>(
    r: &mut R,
    pool: Option<&BufferPool>,
    limit: u32,
) -> Result<Frame, TransferError> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).await?;
    let (kind, len, crc) = Frame::header(&h)?;
    let limit = if kind == 5 {
        limit
    } else {
        limit.min(MAX_CONTROL_FRAME)
    };
    if len > limit {
        return Err(crate::frame::FrameError(format!(
            "a frame of kind {kind} with {len} bytes, more than the {limit} allowed here"
        ))
        .into());
    }
    if kind == 5 && len >= 12 {
        // A layer: read its bytes straight into the buffer the frame keeps (no second copy).
        let mut head = [0u8; 12];
        r.read_exact(&mut head).await?;
        let n = len as usize - 12;
        let mut data = match pool {
            Some(p) => p.take(n),
            None => Vec::with_capacity(n),
        };
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&head);
        // Straight from the socket into the buffer's spare room, checksumming each piece while
        // it is still in cache.
        while data.len() < n {
            let at = data.len();
            let room = bytes::BufMut::limit(&mut data, n - at);
            let mut room = room;
            if r.read_buf(&mut room).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            hasher.update(&data[at..]);
        }
        let got = hasher.finalize();
        if got != crc {
            return Err(crate::frame::FrameError(format!(
                "checksum mismatch (frame says {crc:08x}, payload has {got:08x})"
            ))
            .into());
        }
        let request_id = u64::from_le_bytes(head[..8].try_into().expect("8"));
        let layer = u32::from_le_bytes(head[8..].try_into().expect("4"));
        return Ok(Frame::Layer {
            request_id,
            layer,
            data,
        });
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).await?;
    Ok(Frame::decode(kind, crc, &payload)?)
}

/// One layer's KV in the wire layout (keys then values, f16), with the CRC32 of its bytes
/// computed where it was produced, while they were in cache: sending never reads them twice,
/// and the checksum covers the staging copy too.
#[derive(Debug, Clone)]
pub struct Layer {
    /// The bytes.
    pub bytes: Vec<u8>,
    /// CRC32 of `bytes`.
    pub crc: u32,
}

impl Layer {
    /// Checksums `bytes`.
    pub fn new(bytes: Vec<u8>) -> Layer {
        let crc = crc32fast::hash(&bytes);
        Layer { bytes, crc }
    }
}

/// Writes a `Layer` frame without copying the layer into a frame buffer; the frame's CRC is
/// the layer's own combined with its 12-byte head's.
pub async fn write_layer<W: AsyncWrite + Unpin>(
    w: &mut W,
    request_id: u64,
    layer: u32,
    kv: &Layer,
) -> Result<(), TransferError> {
    let data = &kv.bytes;
    let mut head = Vec::with_capacity(12);
    head.extend(request_id.to_le_bytes());
    head.extend(layer.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head);
    crc.combine(&crc32fast::Hasher::new_with_initial_len(
        kv.crc,
        data.len() as u64,
    ));
    let mut h = Vec::with_capacity(HEADER + 12);
    h.push(5);
    h.extend(((12 + data.len()) as u32).to_le_bytes());
    h.extend(crc.finalize().to_le_bytes());
    h.extend(head);
    w.write_all(&h).await?;
    w.write_all(data).await?;
    Ok(())
}

/// What one end of a KV link is: its model identity and, if the cluster has one, the shared
/// secret that proves membership.
#[derive(Debug, Clone)]
pub struct Local {
    /// The KV layout this end computes with.
    pub identity: ModelIdentity,
    /// The cluster secret (HMAC-SHA256 key); `None` when the cluster runs without one.
    pub secret: Option<std::sync::Arc<Vec<u8>>>,
    /// This end's credentials (mutual TLS on every KV stream), or `insecure`.
    pub security: pki::Security,
    /// A receiver refuses a transfer of more tokens than this (its whole cache) before it
    /// reads any of it.
    pub max_kv_tokens: u32,
    /// A receiver's transfer tickets: with them, a transfer begins only into a reservation
    /// made here, with its ticket (a decode worker's always); `None` (a sender's, or a test of
    /// the protocol) checks none.
    pub tickets: Option<crate::Tickets>,
}

impl Local {
    /// An end without a cluster secret or credentials: plain streams (for tests of the
    /// protocol above the stream, and `insecure = true`).
    pub fn open(identity: ModelIdentity) -> Local {
        Local {
            identity,
            secret: None,
            security: pki::Security::Insecure,
            max_kv_tokens: u32::MAX,
            tickets: None,
        }
    }
}

/// The client end of a connection over a byte stream, driving a [`Client`]: every await is
/// bounded by the core's next deadline, and every outcome comes from the core.
pub struct Conn<R, W> {
    r: R,
    w: W,
    core: Client,
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Conn<R, W> {
    /// Runs the handshake (Hello, and the proof of the cluster secret if challenged) for
    /// inline transfers.
    pub async fn open(
        r: R,
        w: W,
        local: &Local,
        timeouts: Timeouts,
    ) -> Result<Conn<R, W>, TransferError> {
        Conn::open_with(r, w, local, timeouts, false).await
    }

    /// [`Conn::open`] for inline or in-place (RDMA) transfers.
    pub async fn open_with(
        r: R,
        w: W,
        local: &Local,
        timeouts: Timeouts,
        in_place: bool,
    ) -> Result<Conn<R, W>, TransferError> {
        let core = Client::new(local, timeouts, in_place, Instant::now());
        let mut conn = Conn { r, w, core };
        match conn.next_event().await {
            ClientEvent::Connected => Ok(conn),
            ClientEvent::Closed(e) => Err(e),
            other => Err(TransferError::Protocol(format!(
                "unexpected {other:?} during the handshake"
            ))),
        }
    }

    /// Whether the connection can carry more transfers.
    pub fn is_open(&self) -> bool {
        self.core.is_open()
    }

    /// The reader and writer back.
    pub fn into_parts(self) -> (R, W) {
        (self.r, self.w)
    }

    /// Writes the frames the core queued.
    async fn transmit(&mut self) {
        while let Some(f) = self.core.poll_transmit() {
            if let Err(e) = self.w.write_all(&f.encode()).await {
                return self.core.handle_error(e.into());
            }
        }
        if let Err(e) = self.w.flush().await {
            self.core.handle_error(e.into());
        }
    }

    /// Awaits `fut` (the next layer from the engine) until a deadline of the core fires;
    /// renewals due meanwhile are sent.
    async fn bounded<T>(
        &mut self,
        fut: impl std::future::Future<Output = Result<T, TransferError>>,
    ) -> Option<T> {
        tokio::pin!(fut);
        let out = loop {
            let Some(d) = self.core.poll_timeout() else {
                break fut.await;
            };
            match tokio::time::timeout_at(d.into(), &mut fut).await {
                Ok(r) => break r,
                Err(_) => {
                    self.core.handle_timeout(Instant::now());
                    self.transmit().await;
                    if self.core.is_closed() {
                        return None;
                    }
                }
            }
        };
        match out {
            Ok(v) => Some(v),
            Err(e) => {
                self.core.handle_error(e);
                None
            }
        }
    }

    /// Reads frames (and fires deadlines) until the core has something to say.
    async fn next_event(&mut self) -> ClientEvent {
        loop {
            if let Some(e) = self.core.poll_event() {
                return e;
            }
            self.transmit().await;
            if self.core.is_closed() {
                continue;
            }
            if let Some(f) = self.bounded_read().await {
                self.core.handle(Instant::now(), f);
            }
        }
    }

    async fn bounded_read(&mut self) -> Option<Frame> {
        let deadline = self.core.poll_deadline();
        let read = read_frame_limited(&mut self.r, None, MAX_CONTROL_FRAME);
        let out = match deadline {
            Some(d) => match tokio::time::timeout_at(d.into(), read).await {
                Ok(r) => r,
                Err(_) => {
                    self.core.handle_timeout(Instant::now());
                    return None;
                }
            },
            None => read.await,
        };
        out.map_err(|e| self.core.handle_error(e)).ok()
    }

    /// Sends one request's KV and waits for the receiver's verdict, within `timeout` from now.
    pub async fn send(
        &mut self,
        (request_id, ticket): (u64, types::TransferTicket),
        n_tokens: u32,
        width: u32,
        layers: Layers<'_>,
        timeout: Duration,
    ) -> Result<u64, TransferError> {
        self.core.set_transfer_timeout(timeout);
        self.core
            .begin(Instant::now(), (request_id, ticket), n_tokens, width)?;
        self.transmit().await;
        let n_layers = match &layers {
            Layers::Ready(l) => l.len() as u32,
            Layers::Stream { n_layers, .. } => *n_layers,
        };
        let mut stream = match layers {
            Layers::Ready(all) => Ok(all.iter()),
            Layers::Stream { rx, .. } => Err(rx),
        };
        for l in 0..n_layers {
            if self.core.is_closed() {
                break;
            }
            let data: std::borrow::Cow<'_, Layer> = match &mut stream {
                Ok(all) => std::borrow::Cow::Borrowed(all.next().expect("counted")),
                Err(rx) => {
                    let next = async {
                        rx.recv().await.ok_or_else(|| {
                            TransferError::Protocol(format!(
                                "request {request_id}: the KV source ended after {l} of {n_layers} layers"
                            ))
                        })
                    };
                    match self.bounded(next).await {
                        Some(d) => std::borrow::Cow::Owned(d),
                        None => break,
                    }
                }
            };
            self.core.layer(request_id, l, data.bytes.len() as u64)?;
            let streaming = stream.is_err();
            let write = async {
                write_layer(&mut self.w, request_id, l, &data).await?;
                if streaming {
                    // Out now: the next layer is still being computed.
                    self.w.flush().await?;
                }
                Ok(())
            };
            // Bounded by the transfer's deadline, not by its next renewal: a write cut short
            // loses the stream's framing, and a receiver behind for a renewal period (its
            // engine busy) only slows the transfer. (Cut at the renewal, such transfers failed
            // a second in.) A renewal due meanwhile goes out when the next layer is waited for.
            let deadline = self.core.poll_deadline();
            let written = match deadline {
                Some(d) => tokio::time::timeout_at(d.into(), write)
                    .await
                    .unwrap_or_else(|_| {
                        Err(TransferError::Timeout(format!(
                            "writing the KV of request {request_id}: not done within the transfer's {timeout:?}"
                        )))
                    }),
                None => write.await,
            };
            if let Err(e) = written {
                self.core.handle_error(e);
            }
        }
        self.transmit().await;
        self.outcome(request_id).await
    }

    /// Waits for the receiver's verdict on `request_id`: the bytes delivered, or why not.
    pub async fn outcome(&mut self, request_id: u64) -> Result<u64, TransferError> {
        self.until(request_id, |e| match e {
            ClientEvent::Delivered {
                request_id: id,
                bytes,
            } if id == request_id => Some(bytes),
            _ => None,
        })
        .await
    }

    /// Reads until `pick` accepts an event, or `request_id` fails, or the connection closes.
    async fn until<T>(
        &mut self,
        request_id: u64,
        pick: impl Fn(ClientEvent) -> Option<T>,
    ) -> Result<T, TransferError> {
        loop {
            match self.next_event().await {
                ClientEvent::Failed {
                    request_id: id,
                    error,
                } if id == request_id => return Err(error),
                ClientEvent::Closed(e) => return Err(e),
                other => {
                    if let Some(t) = pick(other) {
                        return Ok(t);
                    }
                }
            }
        }
    }

    /// Exchanges transport setup blobs with the receiver (after the handshake, before any
    /// transfer), within the handshake timeout.
    pub async fn setup(
        &mut self,
        ours: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, TransferError> {
        let exchange = async {
            self.w.write_all(&Frame::Setup(ours).encode()).await?;
            self.w.flush().await?;
            match read_frame(&mut self.r).await? {
                Frame::Setup(theirs) => Ok(theirs),
                other => Err(TransferError::Protocol(format!(
                    "expected the receiver's setup, got {}",
                    other.name()
                ))),
            }
        };
        deadline(timeout, || "transport setup".to_string(), exchange).await
    }

    /// In-place transfers: begins `request_id` and waits for the receiver's blocks and the
    /// transport's access to them.
    pub async fn begin_granted(
        &mut self,
        (request_id, ticket): (u64, types::TransferTicket),
        n_tokens: u32,
        width: u32,
        timeout: Duration,
    ) -> Result<(Vec<u32>, Vec<u8>), TransferError> {
        self.core.set_transfer_timeout(timeout);
        self.core
            .begin(Instant::now(), (request_id, ticket), n_tokens, width)?;
        self.transmit().await;
        self.until(request_id, |e| match e {
            ClientEvent::Granted {
                request_id: id,
                blocks,
                access,
            } if id == request_id => Some((blocks, access)),
            _ => None,
        })
        .await
    }

    /// In-place transfers: layer `layer` is in the receiver's memory; tells it with its CRC.
    pub async fn written(
        &mut self,
        request_id: u64,
        layer: u32,
        crc: u32,
    ) -> Result<(), TransferError> {
        self.core.written(request_id, layer, crc)?;
        self.transmit().await;
        Ok(())
    }
}

/// A request's KV to send: all layers at hand, or layers arriving one by one as the prefill
/// computes them (layer-wise streaming).
pub enum Layers<'a> {
    /// Every layer, in order.
    Ready(&'a [Layer]),
    /// `n_layers` layers, in order, from a channel.
    Stream {
        /// How many layers will come.
        n_layers: u32,
        /// Where they come from.
        rx: &'a mut mpsc::UnboundedReceiver<Layer>,
    },
}

/// Runs `fut` within `timeout`, naming `what` if it does not finish.
pub async fn deadline<T>(
    timeout: Duration,
    what: impl FnOnce() -> String,
    fut: impl std::future::Future<Output = Result<T, TransferError>>,
) -> Result<T, TransferError> {
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| TransferError::Timeout(what()))?
}

/// A whole request's KV, received and checksummed, waiting for the decode engine's verdict.
/// Its layer buffers go back to the receiver's pool when it is dropped.
#[derive(Debug)]
pub struct IncomingKv {
    /// The request.
    pub request_id: RequestId,
    /// Tokens covered.
    pub n_tokens: u32,
    /// One buffer per layer: keys then values.
    pub layers: Vec<Vec<u8>>,
    /// Which transport brought it.
    pub transport: crate::Transport,
    /// In-place transfers: the KV is already in the granted blocks (`layers` is empty); one
    /// CRC32 per layer to check it by before admitting.
    pub in_place: Option<Vec<u32>>,
    /// When its last byte was here (the worker's engine thread takes it between steps).
    pub landed: std::time::Instant,
    reply: Option<oneshot::Sender<Result<(), String>>>,
    pool: BufferPool,
}

impl IncomingKv {
    /// Answers the sender: `Ok` once the KV is in the cache, or the reason it was not taken.
    pub fn answer(mut self, verdict: Result<(), String>) {
        if let Some(r) = self.reply.take() {
            let _ = r.send(verdict);
        }
    }
}

impl Drop for IncomingKv {
    fn drop(&mut self) {
        for l in self.layers.drain(..) {
            self.pool.give(l);
        }
    }
}

/// What a decode worker hears from its KV listeners.
#[derive(Debug)]
pub enum KvEvent {
    /// A request's KV started to arrive.
    Arriving(RequestId),
    /// The sender of a request's KV is alive and still at it: extend the lease on its blocks.
    Renewed(RequestId),
    /// A request's KV is here whole; answer it.
    Complete(IncomingKv),
    /// In-place transfers: the blocks the request's KV of `n_tokens` tokens is to be written
    /// into, or why there are none.
    Grant {
        /// The request.
        request_id: RequestId,
        /// Tokens to be written.
        n_tokens: u32,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<u32>, String>>,
    },
    /// A request's KV will not come (the transfer broke); free what it holds.
    Abandoned {
        /// The request.
        request_id: RequestId,
        /// Why.
        error: String,
    },
}

/// What the connections of one KV listener share: this end's identity, the transport's name,
/// where arriving KV goes, the buffer pool and the deadlines.
#[derive(Debug, Clone)]
pub struct Receiving {
    /// This end.
    pub local: Local,
    /// The listener's transport (reported with each transfer).
    pub transport: crate::Transport,
    /// The decode worker's inbox.
    pub tx: mpsc::Sender<KvEvent>,
    /// Layer buffers.
    pub pool: BufferPool,
    /// Handshake and transfer deadlines.
    pub timeouts: Timeouts,
}

/// What an in-place (RDMA) transport adds to the server side of its side channel.
pub trait InPlaceSide: Send {
    /// Sets the data path up from the sender's setup blob (after the handshake); returns this
    /// side's blob.
    fn setup(&mut self, theirs: &[u8]) -> Result<Vec<u8>, TransferError>;
    /// Whether the writes of all `n_layers` layers of `request_id` have landed (their
    /// completions have been seen); never blocks.
    fn try_writes(&mut self, request_id: u64, n_layers: u32) -> Result<bool, TransferError>;
    /// Opens `blocks` (and nothing else) to the sender's writes for `request_id`; returns the
    /// access to send with the grant.
    fn grant(&mut self, request_id: u64, blocks: &[u32]) -> Result<Vec<u8>, TransferError>;
    /// Closes what [`InPlaceSide::grant`] opened for `request_id` (its transfer is over).
    fn release(&mut self, request_id: u64);
}

/// The server side of one stream, driving a [`Server`]: the handshake, then transfers until
/// the peer closes it. Peers with another protocol version, an incompatible model identity or
/// without the cluster secret are refused before any KV is read; until then no frame larger
/// than [`MAX_CONTROL_FRAME`] is read.
pub async fn serve_stream<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    r: &mut R,
    w: &mut W,
    receiving: &Receiving,
    mut in_place: Option<&mut dyn InPlaceSide>,
) -> Result<(), TransferError> {
    let mut nonce = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce)
        .map_err(|_| TransferError::Protocol("no system randomness".into()))?;
    let (local, timeouts) = (&receiving.local, receiving.timeouts);
    let mut core = Server::new(local, timeouts, in_place.is_some(), nonce, Instant::now());
    let mut broke = false;
    loop {
        while let Some(f) = core.poll_transmit() {
            if let Err(e) = w.write_all(&f.encode()).await {
                core.handle_error(e.into());
            }
        }
        if let Err(e) = w.flush().await {
            core.handle_error(e.into());
        }
        // One event at a time: a verdict queues an Ack, which goes out before the next read.
        if let Some(event) = core.poll_event() {
            // Reborrowed for this event only (the object's lifetime shortened to it).
            let side = in_place
                .as_mut()
                .map(|s| -> &mut dyn InPlaceSide { &mut **s });
            match event {
                ServerEvent::Accepted { .. } => set_up(&mut core, r, w, side, timeouts).await,
                ServerEvent::GrantNeeded {
                    request_id,
                    n_tokens,
                } => grant(&mut core, &receiving.tx, side, (request_id, n_tokens)).await,
                ServerEvent::Begun { request_id, .. } => {
                    let _ = receiving
                        .tx
                        .send(KvEvent::Arriving(RequestId(request_id)))
                        .await;
                }
                ServerEvent::Renewed { request_id } => {
                    let _ = receiving
                        .tx
                        .send(KvEvent::Renewed(RequestId(request_id)))
                        .await;
                }
                ServerEvent::Received {
                    request_id,
                    n_tokens,
                    kv,
                } => received(&mut core, receiving, side, (request_id, n_tokens, kv)).await,
                ServerEvent::Abandoned { request_id, error } => {
                    broke = true;
                    if let Some(side) = side {
                        side.release(request_id);
                    }
                    let error = error.to_string();
                    let _ = receiving
                        .tx
                        .send(KvEvent::Abandoned {
                            request_id: RequestId(request_id),
                            error,
                        })
                        .await;
                }
                ServerEvent::Closed(TransferError::Io(e))
                    if e.kind() == std::io::ErrorKind::UnexpectedEof && !broke =>
                {
                    return Ok(())
                }
                ServerEvent::Closed(e) => return Err(e),
            }
            continue;
        }
        next_frame(&mut core, r, &receiving.pool).await;
    }
}

/// Reads the stream's next frame into `core`, within its deadline and its size limit
/// ([`Server::frame_limit`]: no bigger than a layer a begun transfer expects).
async fn next_frame<R: AsyncRead + Unpin>(core: &mut Server, r: &mut R, pool: &BufferPool) {
    let read = read_frame_limited(r, Some(pool), core.frame_limit());
    let frame = match core.poll_timeout() {
        Some(d) => match tokio::time::timeout_at(d.into(), read).await {
            Ok(f) => f,
            Err(_) => return core.handle_timeout(Instant::now()),
        },
        None => read.await,
    };
    match frame {
        Ok(f) => core.handle(Instant::now(), f),
        Err(e) => core.handle_error(e),
    }
}

/// An in-place transport's setup exchange after the handshake (the sender's, then ours).
async fn set_up<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    core: &mut Server,
    r: &mut R,
    w: &mut W,
    side: Option<&mut dyn InPlaceSide>,
    timeouts: Timeouts,
) {
    let Some(side) = side else { return };
    let set_up = async {
        let theirs = match read_frame(r).await? {
            Frame::Setup(b) => b,
            other => {
                return Err(TransferError::Protocol(format!(
                    "expected the sender's setup, got {}",
                    other.name()
                )))
            }
        };
        let ours = side.setup(&theirs)?;
        w.write_all(&Frame::Setup(ours).encode()).await?;
        Ok(())
    };
    let done = deadline(timeouts.handshake, || "transport setup".into(), set_up);
    if let Err(e) = done.await {
        core.handle_error(e);
    }
}

/// The worker's blocks for an in-place transfer of `n_tokens` of `request_id`, granted with
/// the transport's access to them alone.
async fn grant(
    core: &mut Server,
    tx: &mpsc::Sender<KvEvent>,
    side: Option<&mut dyn InPlaceSide>,
    (request_id, n_tokens): (u64, u32),
) {
    let (reply, answer) = oneshot::channel();
    let ask = KvEvent::Grant {
        request_id: RequestId(request_id),
        n_tokens,
        reply,
    };
    let blocks = match tx.send(ask).await {
        Ok(()) => answer
            .await
            .unwrap_or_else(|_| Err("the worker dropped the request".into())),
        Err(_) => Err("the worker is shutting down".into()),
    };
    let opened = |b: Vec<u32>| {
        let access = match side {
            Some(side) => side.grant(request_id, &b)?,
            None => Vec::new(),
        };
        Ok((b, access))
    };
    let granted = blocks
        .map_err(TransferError::Refused)
        .and_then(opened)
        .and_then(|(b, access)| core.grant(request_id, b, access));
    if let Err(e) = granted {
        core.handle_error(e);
    }
}

/// A transfer whose KV is all here (inline, or written in place and its writes landed): the
/// worker admits it, and its verdict goes back to the sender.
async fn received(
    core: &mut Server,
    receiving: &Receiving,
    side: Option<&mut dyn InPlaceSide>,
    (request_id, n_tokens, kv): (u64, u32, Received),
) {
    let (layers, crcs) = match kv {
        Received::Inline(layers) => (layers, None),
        Received::InPlace(crcs) => (Vec::new(), Some(crcs)),
    };
    if let (Some(side), Some(crcs)) = (side, &crcs) {
        let until = Instant::now() + receiving.timeouts.transfer;
        let landed = writes_landed(&mut *side, request_id, crcs.len() as u32, until).await;
        // Every write has landed (or never will be admitted): the sender's access ends here,
        // before the worker reads the blocks.
        side.release(request_id);
        if let Err(e) = landed {
            return core.handle_error(e);
        }
    }
    let (reply, verdict) = oneshot::channel();
    let incoming = IncomingKv {
        request_id: RequestId(request_id),
        n_tokens,
        layers,
        in_place: crcs,
        transport: receiving.transport,
        landed: std::time::Instant::now(),
        reply: Some(reply),
        pool: receiving.pool.clone(),
    };
    let result = match receiving.tx.send(KvEvent::Complete(incoming)).await {
        Ok(()) => verdict
            .await
            .unwrap_or_else(|_| Err("the worker dropped the transfer".into())),
        Err(_) => Err("the worker is shutting down".into()),
    };
    core.verdict(request_id, result);
}

/// Waits until the writes of all `n_layers` layers of `request_id` have completed, by `until`.
/// The `Written` frames came over the side channel; the writes' own completions (their
/// immediates) must be here too before admission. Polled, not awaited on a completion channel:
/// see `rdma::RdmaKvSender::await_completion` for why.
async fn writes_landed(
    side: &mut dyn InPlaceSide,
    request_id: u64,
    n_layers: u32,
    until: Instant,
) -> Result<(), TransferError> {
    loop {
        match side.try_writes(request_id, n_layers) {
            Ok(true) => return Ok(()),
            Ok(false) if Instant::now() < until => {
                tokio::time::sleep(Duration::from_micros(50)).await
            }
            Ok(false) => {
                return Err(TransferError::Timeout(format!(
                    "request {request_id}: the RDMA writes did not complete"
                )))
            }
            Err(e) => return Err(e),
        }
    }
}
