//! The TCP transport: one connection per (prefill, decode) pair, transfers one after another.

use std::time::{Duration, Instant};

use proto::ModelIdentity;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::frame::{Frame, HEADER};
use crate::TransferError;

async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> Result<Frame, TransferError> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).await?;
    let (kind, len, crc) = Frame::header(&h)?;
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).await?;
    Ok(Frame::decode(kind, crc, &payload)?)
}

/// Writes a `Layer` frame without copying `data` into a frame buffer.
async fn write_layer(
    w: &mut TcpStream,
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

/// The sending side of a connection to one decode worker.
pub struct TcpKvSender {
    stream: TcpStream,
    peer: String,
}

/// What one transfer cost.
#[derive(Debug, Clone, Copy)]
pub struct TransferStats {
    /// Payload bytes sent.
    pub bytes: u64,
    /// From the first byte written to the receiver's ack.
    pub elapsed: Duration,
}

impl TcpKvSender {
    /// Connects to `addr` and completes the handshake within `timeout`.
    pub async fn connect(
        addr: &str,
        identity: &ModelIdentity,
        timeout: Duration,
    ) -> Result<TcpKvSender, TransferError> {
        let fut = async {
            let mut stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let hello = Frame::Hello {
                version: proto::PROTOCOL_VERSION,
                identity: identity.clone(),
            };
            stream.write_all(&hello.encode()).await?;
            match read_frame(&mut stream).await? {
                Frame::HelloOk => Ok(TcpKvSender {
                    stream,
                    peer: addr.to_string(),
                }),
                Frame::Refuse(why) => Err(TransferError::Refused(why)),
                other => Err(TransferError::Protocol(format!(
                    "expected HelloOk, got {other:?}"
                ))),
            }
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| TransferError::Timeout(format!("connecting to {addr}")))?
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Sends one request's KV (`layers[l]` = keys then values of `n_tokens` tokens, f16) and
    /// waits for the receiver to admit it, all within `timeout`.
    pub async fn send(
        &mut self,
        request_id: u64,
        n_tokens: u32,
        width: u32,
        layers: &[Vec<u8>],
        timeout: Duration,
    ) -> Result<TransferStats, TransferError> {
        let t0 = Instant::now();
        let fut = async {
            let begin = Frame::Begin {
                request_id,
                n_tokens,
                n_layers: layers.len() as u32,
                width,
            };
            self.stream.write_all(&begin.encode()).await?;
            for (l, data) in layers.iter().enumerate() {
                write_layer(&mut self.stream, request_id, l as u32, data).await?;
            }
            match read_frame(&mut self.stream).await? {
                Frame::Ack {
                    request_id: r,
                    ok: true,
                    ..
                } if r == request_id => Ok(()),
                Frame::Ack {
                    request_id: r,
                    ok: false,
                    message,
                } if r == request_id => Err(TransferError::Refused(message)),
                other => Err(TransferError::Protocol(format!(
                    "expected the ack of request {request_id}, got {other:?}"
                ))),
            }
        };
        tokio::time::timeout(timeout, fut).await.map_err(|_| {
            TransferError::Timeout(format!("KV of request {request_id} to {}", self.peer))
        })??;
        Ok(TransferStats {
            bytes: layers.iter().map(|l| l.len() as u64).sum(),
            elapsed: t0.elapsed(),
        })
    }
}

/// A whole request's KV, received and checksummed, waiting for the decode engine's verdict.
#[derive(Debug)]
pub struct IncomingKv {
    /// The request.
    pub request_id: u64,
    /// Tokens covered.
    pub n_tokens: u32,
    /// One buffer per layer: keys then values.
    pub layers: Vec<Vec<u8>>,
    /// Send `Ok` once the KV is in the cache, or the reason it was not taken.
    pub reply: oneshot::Sender<Result<(), String>>,
}

/// Accepts KV connections on `listener` forever, handing complete transfers to `tx`.
///
/// Peers with another protocol version or an incompatible model identity are refused at the
/// handshake, before any KV is read.
pub async fn serve(listener: TcpListener, identity: ModelIdentity, tx: mpsc::Sender<IncomingKv>) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let (identity, tx) = (identity.clone(), tx.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(stream, &identity, tx).await {
                match e {
                    TransferError::Io(ref io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                    }
                    e => tracing::warn!(%peer, "KV connection closed: {e}"),
                }
            }
        });
    }
}

async fn connection(
    stream: TcpStream,
    identity: &ModelIdentity,
    tx: mpsc::Sender<IncomingKv>,
) -> Result<(), TransferError> {
    stream.set_nodelay(true)?;
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::with_capacity(1 << 20, r);
    match read_frame(&mut r).await? {
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
            if let Some(why) = why {
                w.write_all(&Frame::Refuse(why.clone()).encode()).await?;
                return Err(TransferError::Refused(why));
            }
            w.write_all(&Frame::HelloOk.encode()).await?;
        }
        other => {
            return Err(TransferError::Protocol(format!(
                "expected Hello, got {other:?}"
            )))
        }
    }
    let width = (identity.n_kv_heads * identity.head_dim) as usize;
    loop {
        let (request_id, n_tokens, n_layers) = match read_frame(&mut r).await? {
            Frame::Begin {
                request_id,
                n_tokens,
                n_layers,
                width: w2,
            } if w2 as usize == width && n_layers == identity.n_layers => {
                (request_id, n_tokens, n_layers)
            }
            other => {
                return Err(TransferError::Protocol(format!(
                    "expected a Begin matching the handshake, got {other:?}"
                )))
            }
        };
        let expect = 4 * n_tokens as usize * width;
        let mut layers = Vec::with_capacity(n_layers as usize);
        for l in 0..n_layers {
            match read_frame(&mut r).await? {
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
            reply,
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
    }
}
