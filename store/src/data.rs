//! A store node's data connections: the bytes of puts and gets on a stream of their own,
//! beside the node's gRPC service, which keeps the control (offers, pins, watches, load).
//! HTTP/2 held the bytes to a fraction of the link (flow-control windows, frames, a copy at
//! each layer); here an object crosses as one frame, read straight into the buffer the node
//! publishes and written straight from the buffer it holds.
//!
//! A connection is TCP, under mutual TLS as every internal hop (ALPN [`pki::ALPN_STORE`],
//! workers' certificates only), plain where the cluster says `insecure = true`. The client
//! opens with [`MAGIC`]; then requests follow one after another (little-endian):
//!
//! ```text
//! client → node                                     node → client
//! PUT  'P' put_id u64, len u64, bytes[len]          (nothing until END)
//! END  'E'                                          DONE 'D' published u32, failed u32,
//!                                                        failed × (len u32, text)
//! GET  'G' n u32, n × (model u64, block u64)        OBJ  'O' size u64, sum u64, bytes[size]
//!                                                        … one per key held, in order, up to
//!                                                        the first not held; then END 'E'
//!                                                   REFUSED 'X' len u32, text: the connection
//!                                                        closes
//! ```
//!
//! A put's bytes are taken only for a put this connection's certificate started, of exactly
//! its granted size (checked before anything is allocated); a put whose frame breaks off is
//! abandoned, never visible. A get's object is sent under its read lease, within the lease.
//! The node holds at most [`MAX_CONNECTIONS`] connections; one idle for [`IDLE`] is closed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pki::{Role, Security};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufStream};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::timeout_at;
use types::BlockHash;

use crate::node::{Node, Owner, MAX_KEYS};
use crate::{ObjectKey, PutId};

/// A data connection's preamble.
pub const MAGIC: [u8; 4] = *b"TSD1";
/// Data connections one node holds at once; more are refused.
pub const MAX_CONNECTIONS: usize = 256;
/// Peer-fetch connections one worker serves at once ([`serve_gets`]): each get holds up to the
/// blocks its `export` copies out (64 of them, ~23 MB of SmolLM2's KV), so a peer can make the
/// worker hold at most this many of those.
pub const MAX_PEER_CONNECTIONS: usize = 16;
/// How long a node keeps a connection that sends nothing (a client drops its idle ones
/// sooner).
pub const IDLE: Duration = Duration::from_secs(60);
/// Longest the node waits for the rest of a request once it has begun, or for a reply to be
/// taken (beyond a get's lease).
const FRAME_DEADLINE: Duration = Duration::from_secs(10);
/// Largest object a client takes from a node ([`crate::Limits`]' default `max_object`).
pub const MAX_OBJECT: u64 = 64 << 20;
/// Longest failure text either side sends.
const MAX_TEXT: usize = 1024;

const PUT: u8 = b'P';
const END: u8 = b'E';
const GET: u8 = b'G';
const DONE: u8 = b'D';
const OBJECT: u8 = b'O';
const REFUSED: u8 = b'X';

/// A connection's byte stream (TCP or TLS), both ways.
trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// A connection, buffered both ways: headers leave and arrive in few system calls, an
/// object's bytes bypass the buffers. (One stream, not split halves: a connection either
/// reads or writes at a time.)
type Stream = BufStream<Box<dyn Io>>;

/// A data connection failed.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The connection broke.
    #[error("the store's data connection: {0}")]
    Io(#[from] std::io::Error),
    /// The node refused the request (and closed the connection).
    #[error("the store node refused: {0}")]
    Refused(String),
    /// The node's answer does not follow the protocol.
    #[error("the store node's answer is malformed: {0}")]
    Malformed(String),
    /// No answer by the deadline.
    #[error("no answer from the store's data connection within its deadline")]
    Timeout,
}

fn buffered<S: Io + 'static>(s: S) -> Stream {
    let s: Box<dyn Io> = Box::new(s);
    BufStream::with_capacity(64 << 10, 64 << 10, s)
}

/// Serves data connections on `listener` for as long as the process lives: the cluster's
/// workers only (mutual TLS under `security`), at most [`MAX_CONNECTIONS`] at once.
pub async fn serve(listener: TcpListener, security: &Security, node: Node) -> Result<(), String> {
    accept(
        (listener, MAX_CONNECTIONS),
        security,
        "store_data",
        move |s, owner| connection(node.clone(), s, owner),
    )
    .await
}

/// Where a worker serves the KV blocks it holds to other workers (peer fetch): the protocol's
/// gets, answered by `export` (the objects of the keys it is given, in order up to the first
/// it lacks); puts are refused. The cluster's workers only, as [`serve`], at most
/// [`MAX_PEER_CONNECTIONS`] at once.
pub async fn serve_gets<F, Fut>(
    listener: TcpListener,
    security: &Security,
    export: F,
) -> Result<(), String>
where
    F: Fn(Vec<ObjectKey>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Vec<Fetched>> + Send + 'static,
{
    accept(
        (listener, MAX_PEER_CONNECTIONS),
        security,
        "peer_data",
        move |s, _| gets_only(export.clone(), s),
    )
    .await
}

/// Accepts connections on `listener` (mutual TLS with workers' certificates under
/// `security`; `label` names the listener in refusal metrics), at most `max` at once, each
/// handed to `handle` with its peer's certificate fingerprint.
async fn accept<H, Fut>(
    (listener, max): (TcpListener, usize),
    security: &Security,
    label: &'static str,
    handle: H,
) -> Result<(), String>
where
    H: Fn(Stream, Owner) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(max));
    let refuse = || {
        metrics::counter!("tandem_auth_refused_total", "listener" => label, "reason" => "too_many_connections")
            .increment(1);
    };
    match security {
        Security::Insecure => loop {
            let Ok((tcp, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                refuse();
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let served = handle(buffered(tcp), None);
            tokio::spawn(async move {
                let _slot = slot;
                served.await
            });
        },
        Security::Mutual(creds) => {
            let workers = [Role::Prefill, Role::Decode];
            let acceptor = pki::accept::Acceptor::new(creds, pki::ALPN_STORE, &workers, label)
                .map_err(|e| e.to_string())?;
            let mut incoming = acceptor.incoming(listener);
            while let Some((tls, peer)) = incoming.recv().await {
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    refuse();
                    continue;
                };
                let served = handle(buffered(tls), Some(peer.fingerprint));
                tokio::spawn(async move {
                    let _slot = slot;
                    served.await
                });
            }
            Ok(())
        }
    }
}

/// A peer-fetch connection: gets after gets, each answered by `export`, until it closes,
/// idles or breaks (anything else is refused and ends it).
async fn gets_only<F, Fut>(export: F, mut s: Stream)
where
    F: Fn(Vec<ObjectKey>) -> Fut,
    Fut: std::future::Future<Output = Vec<Fetched>>,
{
    let mut magic = [0u8; 4];
    let by = tokio::time::Instant::now() + FRAME_DEADLINE;
    if !matches!(timeout_at(by, s.read_exact(&mut magic)).await, Ok(Ok(_))) || magic != MAGIC {
        return;
    }
    loop {
        let idle = tokio::time::Instant::now() + IDLE;
        let Ok(Ok(kind)) = timeout_at(idle, s.read_u8()).await else {
            return;
        };
        let by = tokio::time::Instant::now() + FRAME_DEADLINE;
        let why = match kind {
            GET => match timeout_at(by, get_keys(&mut s)).await {
                Ok(Ok(keys)) => {
                    let objects = export(keys).await;
                    match timeout_at(by, send_objects(&mut s, &objects)).await {
                        Ok(Ok(())) => continue,
                        _ => return,
                    }
                }
                Ok(Err(Serve::Refuse(why))) => why,
                Ok(Err(Serve::Broken)) => return,
                Err(_) => "a get's keys did not come within the deadline".into(),
            },
            other => format!("a request {other:#04x} where only gets are served"),
        };
        let _ = timeout_at(by, refused(&mut s, &why)).await;
        return;
    }
}

/// Objects, each as an OBJ frame, then END.
async fn send_objects(w: &mut Stream, objects: &[Fetched]) -> std::io::Result<()> {
    for o in objects {
        w.write_u8(OBJECT).await?;
        w.write_u64_le(o.data.len() as u64).await?;
        w.write_u64_le(o.sum).await?;
        w.write_all(&o.data).await?;
    }
    w.write_u8(END).await?;
    w.flush().await
}

/// One connection from `owner`, request after request until it closes, idles or breaks.
async fn connection(node: Node, mut s: Stream, owner: Owner) {
    let mut magic = [0u8; 4];
    let by = tokio::time::Instant::now() + FRAME_DEADLINE;
    if !matches!(timeout_at(by, s.read_exact(&mut magic)).await, Ok(Ok(_))) || magic != MAGIC {
        return;
    }
    let mut batch = Batch::default();
    loop {
        let idle = tokio::time::Instant::now() + IDLE;
        let Ok(Ok(kind)) = timeout_at(idle, s.read_u8()).await else {
            return;
        };
        let by = tokio::time::Instant::now() + FRAME_DEADLINE;
        let served = match kind {
            PUT => timeout_at(by, put(&node, &mut s, owner, &mut batch)).await,
            END => timeout_at(by, done(&mut s, std::mem::take(&mut batch))).await,
            // A get's objects each go within their lease (its keys within the deadline).
            GET => Ok(get(&node, &mut s, by).await),
            other => Ok(Err(Serve::Refuse(format!(
                "an unknown request {other:#04x}"
            )))),
        };
        let why = match served {
            Ok(Ok(())) => continue,
            Ok(Err(Serve::Refuse(why))) => why,
            Ok(Err(Serve::Broken)) => return,
            Err(_) => "the request was not completed within its deadline".into(),
        };
        let _ = timeout_at(by, refused(&mut s, &why)).await;
        return;
    }
}

/// Why a request ended the connection.
enum Serve {
    /// Refused, with the reason sent back.
    Refuse(String),
    /// The connection broke.
    Broken,
}

impl From<std::io::Error> for Serve {
    fn from(_: std::io::Error) -> Serve {
        Serve::Broken
    }
}

/// The puts of a batch so far (until its END).
#[derive(Default)]
struct Batch {
    published: u32,
    failed: Vec<String>,
}

/// A PUT frame: the object's bytes read straight into the buffer that is published.
async fn put(node: &Node, r: &mut Stream, owner: Owner, batch: &mut Batch) -> Result<(), Serve> {
    let id = PutId(r.read_u64_le().await?);
    let len = r.read_u64_le().await?;
    let fits = node.with(|n| {
        let mine = n.owners.get(&id) == Some(&owner);
        mine && n.objects.put_unwritten(id) == Some(len)
    });
    if !fits {
        return Err(Serve::Refuse(format!(
            "put {id} of {len} bytes: not a put this certificate started, under way and of that size"
        )));
    }
    let buffer = node.with(|n| n.objects.buffer(len as usize));
    let mut summer = types::sum::Summer::default();
    let data = match read_summed(r, buffer, len as usize, &mut summer).await {
        Ok(d) => d,
        Err(e) => {
            node.with(|n| n.abandon(id));
            return Err(e.into());
        }
    };
    let published = node.with(|n| {
        n.owners.remove(&id);
        let out = n.objects.put_whole_summed(id, data, summer.finish());
        if out.is_err() {
            n.objects.put_abort(id);
        }
        n.publish();
        out
    });
    match published {
        Ok(()) => batch.published += 1,
        Err(e) => batch.failed.push(e.to_string()),
    }
    Ok(())
}

/// An END: the batch's outcome.
async fn done(w: &mut Stream, batch: Batch) -> Result<(), Serve> {
    w.write_u8(DONE).await?;
    w.write_u32_le(batch.published).await?;
    w.write_u32_le(batch.failed.len() as u32).await?;
    for f in &batch.failed {
        text(w, f).await?;
    }
    w.flush().await?;
    Ok(())
}

/// The next `len` bytes, read into a buffer of that size that is never zeroed first (the
/// allocator's reused memory would be written twice).
async fn read_bytes(r: &mut Stream, len: usize) -> std::io::Result<Vec<u8>> {
    read_into(r, Vec::with_capacity(len), len).await
}

/// [`read_bytes`] into `data` (empty, with room for `len`).
async fn read_into(r: &mut Stream, data: Vec<u8>, len: usize) -> std::io::Result<Vec<u8>> {
    read_pieces(r, data, len, |_| {}).await
}

/// [`read_into`], summing each piece read into `summer` while it is in the CPU's cache.
async fn read_summed(
    r: &mut Stream,
    data: Vec<u8>,
    len: usize,
    summer: &mut types::sum::Summer,
) -> std::io::Result<Vec<u8>> {
    read_pieces(r, data, len, |piece| summer.sum(piece)).await
}

/// [`read_into`], handing each piece to `seen` as it arrives.
async fn read_pieces(
    r: &mut Stream,
    mut data: Vec<u8>,
    len: usize,
    mut seen: impl FnMut(&[u8]),
) -> std::io::Result<Vec<u8>> {
    while data.len() < len {
        let (from, left) = (data.len(), (len - data.len()) as u64);
        if (&mut *r).take(left).read_buf(&mut data).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        seen(&data[from..]);
    }
    Ok(data)
}

async fn text(w: &mut Stream, t: &str) -> std::io::Result<()> {
    let t = &t.as_bytes()[..t.len().min(MAX_TEXT)];
    w.write_u32_le(t.len() as u32).await?;
    w.write_all(t).await
}

async fn refused(w: &mut Stream, why: &str) -> std::io::Result<()> {
    w.write_u8(REFUSED).await?;
    text(w, why).await?;
    w.flush().await
}

/// A GET: each object held, in order, under its lease, up to the first not held.
async fn get(node: &Node, w: &mut Stream, by: tokio::time::Instant) -> Result<(), Serve> {
    let keys = timeout_at(by, get_keys(w))
        .await
        .map_err(|_| Serve::Refuse("a get's keys did not come within the deadline".into()))??;
    for k in keys {
        let (got, corrupting) =
            match node.with(|n| (n.objects.get(k, Instant::now()), n.corrupting)) {
                (Ok(Some(g)), c) => (g, c),
                (Ok(None), _) => break,
                (Err(e), _) => return Err(Serve::Refuse(e.to_string())),
            };
        let bytes = match corrupting {
            false => std::borrow::Cow::Borrowed(&got.data[..]),
            true => std::borrow::Cow::Owned(flipped(&got.data)),
        };
        let lease = tokio::time::Instant::from_std(got.expires);
        let sent = timeout_at(lease, async {
            w.write_u8(OBJECT).await?;
            w.write_u64_le(bytes.len() as u64).await?;
            w.write_u64_le(got.sum).await?;
            w.write_all(&bytes).await
        })
        .await;
        node.with(|n| n.objects.release(got.lease));
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(Serve::Broken),
        }
    }
    timeout_at(tokio::time::Instant::now() + FRAME_DEADLINE, async {
        w.write_u8(END).await?;
        w.flush().await
    })
    .await
    .map_err(|_| Serve::Broken)??;
    Ok(())
}

/// `data` with one bit flipped (fault injection: [`Node::corrupt_what_it_sends`]).
fn flipped(data: &[u8]) -> Vec<u8> {
    let mut v = data.to_vec();
    if let Some(b) = v.get_mut(data.len() / 2) {
        *b ^= 0x10;
    }
    v
}

/// A GET's keys, at most [`MAX_KEYS`].
async fn get_keys(r: &mut Stream) -> Result<Vec<ObjectKey>, Serve> {
    let n = r.read_u32_le().await? as usize;
    if n > MAX_KEYS {
        return Err(Serve::Refuse(format!(
            "{n} objects asked for in one get: at most {MAX_KEYS}"
        )));
    }
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        let model = r.read_u64_le().await?;
        let block = BlockHash(r.read_u64_le().await?);
        keys.push(ObjectKey { model, block });
    }
    Ok(keys)
}

/// A worker's data connection to one node.
pub struct Client {
    s: Stream,
    /// When it was last used (a pool drops it well before the node's [`IDLE`]).
    pub used: Instant,
}

/// What a batch of puts came to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PutDone {
    /// Objects published.
    pub published: u32,
    /// Why each other failed (a bad checksum, an expired put).
    pub failed: Vec<String>,
}

/// An object a get returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// Its bytes.
    pub data: Vec<u8>,
    /// Their checksum as the node holds it (the reader checks it).
    pub sum: u64,
}

impl Client {
    /// Connects to the node's data port at `addr` by `deadline`: TCP, then under mutual TLS a
    /// session with a store certificate.
    pub async fn connect(
        addr: &str,
        security: &Security,
        deadline: tokio::time::Instant,
    ) -> Result<Client, DataError> {
        Client::connect_to(addr, security, Role::Store, deadline).await
    }

    /// [`Client::connect`] to a server of `role` (a decode worker serving its blocks: peer
    /// fetch).
    pub async fn connect_to(
        addr: &str,
        security: &Security,
        role: Role,
        deadline: tokio::time::Instant,
    ) -> Result<Client, DataError> {
        let dial = async {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let mut s = match security {
                Security::Insecure => buffered(tcp),
                Security::Mutual(c) => {
                    buffered(pki::accept::connect(c, pki::ALPN_STORE, role, tcp).await?)
                }
            };
            s.write_all(&MAGIC).await?;
            Ok::<_, std::io::Error>(s)
        };
        let s = timeout_at(deadline, dial)
            .await
            .map_err(|_| DataError::Timeout)??;
        Ok(Client {
            s,
            used: Instant::now(),
        })
    }

    /// Sends granted puts' bytes (`(put id, bytes)`) and waits for their outcome, by
    /// `deadline`.
    pub async fn put(
        &mut self,
        puts: &[(u64, &[u8])],
        deadline: tokio::time::Instant,
    ) -> Result<PutDone, DataError> {
        let exchange = async {
            for (id, bytes) in puts {
                self.s.write_u8(PUT).await?;
                self.s.write_u64_le(*id).await?;
                self.s.write_u64_le(bytes.len() as u64).await?;
                self.s.write_all(bytes).await?;
            }
            self.s.write_u8(END).await?;
            self.s.flush().await?;
            match self.s.read_u8().await? {
                DONE => {}
                other => return Err(self.unexpected(other).await),
            }
            let published = self.s.read_u32_le().await?;
            let n = self.s.read_u32_le().await?;
            if n as usize > puts.len() {
                let m = format!("{n} failures for {} puts", puts.len());
                return Err(DataError::Malformed(m));
            }
            let mut failed = Vec::with_capacity(n as usize);
            for _ in 0..n {
                failed.push(read_text(&mut self.s).await?);
            }
            Ok(PutDone { published, failed })
        };
        let out = timeout_at(deadline, exchange).await;
        self.used = Instant::now();
        out.map_err(|_| DataError::Timeout)?
    }

    /// The objects of `keys` (`(model, block)`) the node holds, in order up to the first it
    /// does not, by `deadline`.
    pub async fn get(
        &mut self,
        keys: &[(u64, u64)],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Fetched>, DataError> {
        let exchange = async {
            self.s.write_u8(GET).await?;
            self.s.write_u32_le(keys.len() as u32).await?;
            for (model, block) in keys {
                self.s.write_u64_le(*model).await?;
                self.s.write_u64_le(*block).await?;
            }
            self.s.flush().await?;
            let mut out = Vec::new();
            loop {
                match self.s.read_u8().await? {
                    OBJECT if out.len() < keys.len() => {}
                    END => return Ok(out),
                    other => return Err(self.unexpected(other).await),
                }
                let size = self.s.read_u64_le().await?;
                let sum = self.s.read_u64_le().await?;
                if size > MAX_OBJECT {
                    let m = format!("an object of {size} bytes (at most {MAX_OBJECT})");
                    return Err(DataError::Malformed(m));
                }
                let data = read_bytes(&mut self.s, size as usize).await?;
                out.push(Fetched { data, sum });
            }
        };
        let out = timeout_at(deadline, exchange).await;
        self.used = Instant::now();
        out.map_err(|_| DataError::Timeout)?
    }

    /// The error for answer `kind` where another was due: the node's refusal, or malformed.
    async fn unexpected(&mut self, kind: u8) -> DataError {
        match kind {
            REFUSED => match read_text(&mut self.s).await {
                Ok(why) => DataError::Refused(why),
                Err(e) => e,
            },
            other => DataError::Malformed(format!("answer {other:#04x}")),
        }
    }
}

async fn read_text(r: &mut Stream) -> Result<String, DataError> {
    let n = r.read_u32_le().await? as usize;
    if n > MAX_TEXT {
        return Err(DataError::Malformed(format!("a text of {n} bytes")));
    }
    let mut t = vec![0u8; n];
    r.read_exact(&mut t).await?;
    Ok(String::from_utf8_lossy(&t).into_owned())
}
