//! The TCP transport: connections per (prefill, decode) pair, transfers one after another on
//! each; the prefill side keeps several when transfers overlap.

use std::time::{Duration, Instant};

use tokio::io::{BufReader, BufWriter};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::core::Timeouts;
use crate::stream::{self, Gate, ReadHalf, WriteHalf};
use crate::wire::{self, Conn, KvEvent, Local};
use crate::{TransferError, TransferStats, Transport};

/// The sending side of a connection to one decode worker.
pub struct TcpKvSender {
    conn: Conn<BufReader<ReadHalf>, BufWriter<WriteHalf>>,
}

impl TcpKvSender {
    /// Connects to `addr` (TLS under mutual TLS) and completes the handshake within
    /// `timeout`.
    pub async fn connect(
        addr: &str,
        local: &Local,
        timeout: Duration,
    ) -> Result<TcpKvSender, TransferError> {
        let (r, w) = stream::dial(addr, local, timeout, "TCP").await?;
        let timeouts = Timeouts {
            handshake: timeout,
            ..Timeouts::default()
        };
        Ok(TcpKvSender {
            conn: Conn::open(r, w, local, timeouts).await?,
        })
    }

    /// Whether the connection can carry another transfer.
    pub fn is_open(&self) -> bool {
        self.conn.is_open()
    }

    /// Sends one request's KV and waits for the receiver to admit it, within `timeout`.
    pub async fn send(
        &mut self,
        (request_id, ticket): (u64, types::TransferTicket),
        n_tokens: u32,
        width: u32,
        layers: crate::wire::Layers<'_>,
        timeout: Duration,
    ) -> Result<TransferStats, TransferError> {
        let t0 = Instant::now();
        let bytes = self
            .conn
            .send((request_id, ticket), n_tokens, width, layers, timeout)
            .await?;
        Ok(TransferStats {
            bytes,
            elapsed: t0.elapsed(),
            transport: Transport::Tcp,
        })
    }
}

/// Accepts KV connections on `listener` forever (from prefill workers' certificates under
/// mutual TLS, at most [`stream::MAX_CONNECTIONS`] at once), handing what arrives to `tx`.
pub async fn serve(
    listener: TcpListener,
    local: Local,
    tx: mpsc::Sender<KvEvent>,
    timeouts: Timeouts,
) {
    let gate = match Gate::new(&local, "kv_tcp") {
        Ok(g) => g,
        Err(e) => return tracing::error!("KV listener (tcp) not served: {e}"),
    };
    let receiving = wire::Receiving {
        local,
        transport: Transport::Tcp,
        tx,
        pool: wire::BufferPool::default(),
        timeouts,
    };
    loop {
        let Ok((tcp, peer)) = listener.accept().await else {
            continue;
        };
        let (receiving, gate) = (receiving.clone(), gate.clone());
        tokio::spawn(async move {
            let Some((r, mut w, _slot)) = gate.open(tcp, peer).await else {
                return;
            };
            // Small: control frames are buffered, but a layer larger than this is read straight
            // from the socket into its pooled buffer instead of through a second copy.
            let mut r = BufReader::with_capacity(64 << 10, r);
            let served = wire::serve_stream(&mut r, &mut w, &receiving, None);
            if let Err(e) = served.await {
                tracing::warn!(%peer, "KV connection (tcp) closed: {e}");
            }
        });
    }
}
