//! The transfer protocol over any ordered byte stream (a TCP connection, a QUIC stream).

use std::time::Duration;

use proto::ModelIdentity;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use crate::frame::{Frame, HEADER};
use crate::TransferError;

/// Reads one frame, checking its CRC.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Frame, TransferError> {
    read_frame_with(r, None).await
}

/// Layer buffers handed back once their KV is in the cache, reused for the next transfers so
/// that big layers do not land in freshly mapped (page-faulting) memory every time.
#[derive(Debug, Clone, Default)]
pub struct BufferPool(std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>);

impl BufferPool {
    /// Most buffers kept.
    const KEEP: usize = 256;

    fn take(&self, n: usize) -> Vec<u8> {
        let mut pool = self.0.lock().expect("pool lock");
        let mut buf = match pool.iter().position(|b| b.capacity() >= n) {
            Some(i) => pool.swap_remove(i),
            None => Vec::with_capacity(n),
        };
        buf.clear();
        buf.resize(n, 0);
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        let mut pool = self.0.lock().expect("pool lock");
        if pool.len() < Self::KEEP {
            pool.push(buf);
        }
    }
}

/// [`read_frame`], taking layer buffers from `pool`.
pub async fn read_frame_with<R: AsyncRead + Unpin>(
    r: &mut R,
    pool: Option<&BufferPool>,
) -> Result<Frame, TransferError> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).await?;
    let (kind, len, crc) = Frame::header(&h)?;
    if kind == 5 && len >= 12 {
        // A layer: read its bytes straight into the buffer the frame keeps (no second copy).
        let mut head = [0u8; 12];
        r.read_exact(&mut head).await?;
        let mut data = match pool {
            Some(p) => p.take(len as usize - 12),
            None => vec![0u8; len as usize - 12],
        };
        r.read_exact(&mut data).await?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&head);
        hasher.update(&data);
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

/// Writes a `Layer` frame without copying `data` into a frame buffer.
pub async fn write_layer<W: AsyncWrite + Unpin>(
    w: &mut W,
    request_id: u64,
    layer: u32,
    data: &[u8],
) -> Result<(), TransferError> {
    let mut head = Vec::with_capacity(12);
    head.extend(request_id.to_le_bytes());
    head.extend(layer.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head);
    crc.update(data);
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
}

impl Local {
    /// An end without a cluster secret.
    pub fn open(identity: ModelIdentity) -> Local {
        Local {
            identity,
            secret: None,
        }
    }
}

const PROOF_CONTEXT: &[u8] = b"tandem-kv-v1";

fn proof_message(nonce: &[u8; 16], identity: &ModelIdentity) -> Vec<u8> {
    let mut m = PROOF_CONTEXT.to_vec();
    m.extend(nonce);
    // The identity is bound into the proof, so a proof cannot be replayed for another layout.
    m.extend(
        Frame::Hello {
            version: proto::PROTOCOL_VERSION,
            identity: identity.clone(),
        }
        .encode(),
    );
    m
}

/// The client side of the handshake: Hello, then (if the server challenges) a proof of the
/// cluster secret.
pub async fn hello<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    r: &mut R,
    w: &mut W,
    local: &Local,
) -> Result<(), TransferError> {
    let hello = Frame::Hello {
        version: proto::PROTOCOL_VERSION,
        identity: local.identity.clone(),
    };
    w.write_all(&hello.encode()).await?;
    w.flush().await?;
    let mut reply = read_frame(r).await?;
    if let Frame::Challenge(nonce) = reply {
        let secret = local.secret.as_ref().ok_or_else(|| {
            TransferError::Refused(
                "the peer requires the cluster secret and none is configured here".into(),
            )
        })?;
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
        let tag = ring::hmac::sign(&key, &proof_message(&nonce, &local.identity));
        w.write_all(&Frame::Proof(tag.as_ref().to_vec()).encode())
            .await?;
        w.flush().await?;
        reply = read_frame(r).await?;
    }
    match reply {
        Frame::HelloOk => Ok(()),
        Frame::Refuse(why) => Err(TransferError::Refused(why)),
        other => Err(TransferError::Protocol(format!(
            "expected HelloOk, got {other:?}"
        ))),
    }
}

/// Sends one request's KV and waits for its ack.
pub async fn transfer<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    r: &mut R,
    w: &mut W,
    request_id: u64,
    n_tokens: u32,
    width: u32,
    layers: Layers<'_>,
) -> Result<u64, TransferError> {
    let n_layers = match &layers {
        Layers::Ready(l) => l.len() as u32,
        Layers::Stream { n_layers, .. } => *n_layers,
    };
    let begin = Frame::Begin {
        request_id,
        n_tokens,
        n_layers,
        width,
    };
    w.write_all(&begin.encode()).await?;
    let mut bytes = 0u64;
    match layers {
        Layers::Ready(all) => {
            for (l, data) in all.iter().enumerate() {
                write_layer(w, request_id, l as u32, data).await?;
                bytes += data.len() as u64;
            }
        }
        Layers::Stream { n_layers, rx } => {
            for l in 0..n_layers {
                let data = rx.recv().await.ok_or_else(|| {
                    TransferError::Protocol(format!(
                        "request {request_id}: the KV source ended after {l} of {n_layers} layers"
                    ))
                })?;
                write_layer(w, request_id, l, &data).await?;
                // Out now: the next layer is still being computed.
                w.flush().await?;
                bytes += data.len() as u64;
            }
        }
    }
    w.flush().await?;
    match read_frame(r).await? {
        Frame::Ack {
            request_id: id,
            ok: true,
            ..
        } if id == request_id => Ok(()),
        Frame::Ack {
            request_id: id,
            ok: false,
            message,
        } if id == request_id => Err(TransferError::Refused(message)),
        other => Err(TransferError::Protocol(format!(
            "expected the ack of request {request_id}, got {other:?}"
        ))),
    }
    .map(|()| bytes)
}

/// A request's KV to send: all layers at hand, or layers arriving one by one as the prefill
/// computes them (layer-wise streaming).
pub enum Layers<'a> {
    /// Every layer, in order.
    Ready(&'a [Vec<u8>]),
    /// `n_layers` layers, in order, from a channel.
    Stream {
        /// How many layers will come.
        n_layers: u32,
        /// Where they come from.
        rx: &'a mut mpsc::UnboundedReceiver<Vec<u8>>,
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
    pub request_id: u64,
    /// Tokens covered.
    pub n_tokens: u32,
    /// One buffer per layer: keys then values.
    pub layers: Vec<Vec<u8>>,
    /// Which transport brought it.
    pub transport: crate::Transport,
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

/// The server side of one stream: the handshake, then transfers until the peer closes it.
/// Peers with another protocol version or an incompatible model identity are refused before
/// any KV is read.
pub async fn serve_stream<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    r: &mut R,
    w: &mut W,
    local: &Local,
    transport: crate::Transport,
    tx: &mpsc::Sender<IncomingKv>,
    pool: &BufferPool,
) -> Result<(), TransferError> {
    let identity = &local.identity;
    match read_frame(r).await? {
        Frame::Hello {
            version,
            identity: theirs,
        } => {
            let why = if version != proto::PROTOCOL_VERSION {
                Some(format!(
                    "protocol version {version}, this worker speaks {}",
                    proto::PROTOCOL_VERSION
                ))
            } else {
                identity
                    .incompatibility(&theirs)
                    .map(|d| format!("incompatible KV layout: {d}"))
            };
            let why = match (why, &local.secret) {
                (Some(why), _) => Some(why),
                (None, None) => None,
                (None, Some(secret)) => {
                    let mut nonce = [0u8; 16];
                    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce)
                        .map_err(|_| TransferError::Protocol("no system randomness".into()))?;
                    w.write_all(&Frame::Challenge(nonce).encode()).await?;
                    w.flush().await?;
                    match read_frame(r).await? {
                        Frame::Proof(tag) => {
                            let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
                            ring::hmac::verify(&key, &proof_message(&nonce, &theirs), &tag)
                                .err()
                                .map(|_| "authentication failed: wrong cluster secret".to_string())
                        }
                        other => Some(format!(
                            "authentication failed: expected a proof, got {}",
                            other.name()
                        )),
                    }
                }
            };
            if let Some(why) = why {
                w.write_all(&Frame::Refuse(why.clone()).encode()).await?;
                w.flush().await?;
                return Err(TransferError::Refused(why));
            }
            w.write_all(&Frame::HelloOk.encode()).await?;
            w.flush().await?;
        }
        other => {
            return Err(TransferError::Protocol(format!(
                "expected Hello, got {other:?}"
            )))
        }
    }
    let width = (identity.n_kv_heads * identity.head_dim) as usize;
    loop {
        let (request_id, n_tokens, n_layers) = match read_frame(r).await {
            Ok(Frame::Begin {
                request_id,
                n_tokens,
                n_layers,
                width: w2,
            }) if w2 as usize == width && n_layers == identity.n_layers => {
                (request_id, n_tokens, n_layers)
            }
            Ok(other) => {
                return Err(TransferError::Protocol(format!(
                    "expected a Begin matching the handshake, got {other:?}"
                )))
            }
            Err(TransferError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(())
            }
            Err(e) => return Err(e),
        };
        let expect = 4 * n_tokens as usize * width;
        let mut layers = Vec::with_capacity(n_layers as usize);
        for l in 0..n_layers {
            match read_frame_with(r, Some(pool)).await? {
                Frame::Layer { request_id: rid, layer, data } if rid == request_id && layer == l && data.len() == expect => layers.push(data),
                Frame::Layer { request_id: rid, layer, data } => {
                    return Err(TransferError::Protocol(format!(
                        "request {request_id} layer {l}: got request {rid} layer {layer} with {} bytes (expected {expect})",
                        data.len()
                    )))
                }
                other => return Err(TransferError::Protocol(format!("expected a Layer, got {other:?}"))),
            }
        }
        let (reply, verdict) = oneshot::channel();
        let incoming = IncomingKv {
            request_id,
            n_tokens,
            layers,
            transport,
            reply: Some(reply),
            pool: pool.clone(),
        };
        let result = match tx.send(incoming).await {
            Ok(()) => verdict
                .await
                .unwrap_or_else(|_| Err("the worker dropped the transfer".into())),
            Err(_) => Err("the worker is shutting down".into()),
        };
        let ack = Frame::Ack {
            request_id,
            ok: result.is_ok(),
            message: result.err().unwrap_or_default(),
        };
        w.write_all(&ack.encode()).await?;
        w.flush().await?;
    }
}
