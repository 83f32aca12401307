//! The byte streams under the TCP transport and the RDMA side channel: under mutual TLS (the
//! default) a connection is a TLS 1.3 session between a prefill worker's certificate and a
//! decode worker's, both checked before any frame; plain TCP only where the cluster says
//! `insecure = true`. A listener holds at most [`MAX_CONNECTIONS`] connections at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pki::{Acceptor, Role, Security};
use tokio::io::{AsyncRead, AsyncWrite, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::wire::{self, Local};
use crate::TransferError;

/// A stream's reading half.
pub type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
/// A stream's writing half.
pub type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;
/// The client side's buffered halves.
pub type Buffered = (BufReader<ReadHalf>, BufWriter<WriteHalf>);

/// KV connections one listener holds at once; more are refused at accept (and counted).
pub const MAX_CONNECTIONS: usize = 256;

/// Dials a decode worker's KV listener at `addr` within `timeout` (`what` names it in errors):
/// TCP, then under mutual TLS a session with a decode worker's certificate.
pub async fn dial(
    addr: &str,
    local: &Local,
    timeout: Duration,
    what: &str,
) -> Result<Buffered, TransferError> {
    let connect = async {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let halves: (ReadHalf, WriteHalf) = match &local.security {
            Security::Insecure => {
                let (r, w) = tcp.into_split();
                (Box::new(r), Box::new(w))
            }
            Security::Mutual(c) => {
                let tls = pki::accept::connect(c, pki::ALPN_KV, Role::Decode, tcp).await?;
                let (r, w) = tokio::io::split(tls);
                (Box::new(r), Box::new(w))
            }
        };
        Ok(halves)
    };
    let (r, w) = wire::deadline(
        timeout,
        || format!("connecting to {addr} ({what})"),
        connect,
    )
    .await?;
    // Small frames (headers, small layers) leave in few writes; big layers bypass the buffer.
    Ok((
        BufReader::with_capacity(64 << 10, r),
        BufWriter::with_capacity(256 << 10, w),
    ))
}

/// The server side of a KV listener (named `name` in metrics): who may connect, and how many
/// at once.
#[derive(Clone)]
pub struct Gate {
    acceptor: Option<Acceptor>,
    slots: Arc<Semaphore>,
    name: &'static str,
}

impl Gate {
    /// Under mutual TLS only prefill workers get in.
    pub fn new(local: &Local, name: &'static str) -> Result<Gate, TransferError> {
        let acceptor = match &local.security {
            Security::Insecure => None,
            Security::Mutual(c) => Some(
                Acceptor::new(c, pki::ALPN_KV, &[Role::Prefill], name)
                    .map_err(|e| TransferError::Refused(e.to_string()))?,
            ),
        };
        Ok(Gate {
            acceptor,
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            name,
        })
    }

    /// A slot for a new connection from `peer`, or `None` (counted) when all are taken.
    pub fn admit(&self, peer: SocketAddr) -> Option<OwnedSemaphorePermit> {
        let slot = self.slots.clone().try_acquire_owned().ok();
        if slot.is_none() {
            metrics::counter!("tandem_auth_refused_total", "listener" => self.name, "reason" => "too_many_connections")
                .increment(1);
            tracing::warn!(%peer, listener = self.name, "refused: {MAX_CONNECTIONS} KV connections open");
        }
        slot
    }

    /// The halves of an accepted connection once its peer is authenticated; `None` (counted
    /// by the acceptor) when it is refused.
    pub async fn open(&self, tcp: TcpStream, peer: SocketAddr) -> Option<(ReadHalf, WriteHalf)> {
        let _ = tcp.set_nodelay(true);
        match &self.acceptor {
            None => {
                let (r, w) = tcp.into_split();
                Some((Box::new(r), Box::new(w)))
            }
            Some(a) => {
                let (tls, _) = a.accept(tcp, Some(peer)).await.ok()?;
                let (r, w) = tokio::io::split(tls);
                Some((Box::new(r), Box::new(w)))
            }
        }
    }
}
