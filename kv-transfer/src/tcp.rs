//! The TCP transport: one connection per (prefill, decode) pair, transfers one after another.

use std::time::{Duration, Instant};

use crate::wire::Local;
use tokio::io::BufReader;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::wire::{self, IncomingKv};
use crate::{TransferError, TransferStats, Transport};

/// The sending side of a connection to one decode worker.
pub struct TcpKvSender {
    stream: TcpStream,
    peer: String,
}

impl TcpKvSender {
    /// Connects to `addr` and completes the handshake within `timeout`.
    pub async fn connect(
        addr: &str,
        local: &Local,
        timeout: Duration,
    ) -> Result<TcpKvSender, TransferError> {
        wire::deadline(
            timeout,
            || format!("connecting to {addr} over TCP"),
            async {
                let mut stream = TcpStream::connect(addr).await?;
                stream.set_nodelay(true)?;
                let (mut r, mut w) = stream.split();
                wire::hello(&mut r, &mut w, local).await?;
                Ok(TcpKvSender {
                    stream,
                    peer: addr.to_string(),
                })
            },
        )
        .await
    }

    /// Sends one request's KV and waits for the receiver to admit it, within `timeout`.
    pub async fn send(
        &mut self,
        request_id: u64,
        n_tokens: u32,
        width: u32,
        layers: crate::wire::Layers<'_>,
        timeout: Duration,
    ) -> Result<TransferStats, TransferError> {
        let t0 = Instant::now();
        let peer = self.peer.clone();
        let (mut r, w) = self.stream.split();
        // Small frames (headers, small layers) leave in few writes; big layers bypass the buffer.
        let mut w = tokio::io::BufWriter::with_capacity(256 << 10, w);
        let bytes = wire::deadline(
            timeout,
            || format!("KV of request {request_id} to {peer} over TCP"),
            wire::transfer(&mut r, &mut w, request_id, n_tokens, width, layers),
        )
        .await?;
        Ok(TransferStats {
            bytes,
            elapsed: t0.elapsed(),
            transport: Transport::Tcp,
        })
    }
}

/// Accepts KV connections on `listener` forever, handing complete transfers to `tx`.
pub async fn serve(listener: TcpListener, local: Local, tx: mpsc::Sender<IncomingKv>) {
    let pool = wire::BufferPool::default();
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let (local, tx, pool) = (local.clone(), tx.clone(), pool.clone());
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let (r, mut w) = stream.into_split();
            let mut r = BufReader::with_capacity(1 << 20, r);
            if let Err(e) =
                wire::serve_stream(&mut r, &mut w, &local, Transport::Tcp, &tx, &pool).await
            {
                tracing::warn!(%peer, "KV connection (tcp) closed: {e}");
            }
        });
    }
}
