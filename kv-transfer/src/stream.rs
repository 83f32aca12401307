//! The byte streams under the TCP transport and the RDMA side channel: under mutual TLS (the
//! default) a connection is a TLS 1.3 session between a prefill worker's certificate and a
//! decode worker's, both checked before any frame; plain TCP only where the cluster says
//! `insecure = true`. A listener holds at most [`MAX_CONNECTIONS`] authenticated connections
//! at once; handshakes in progress are capped per address
//! ([`pki::accept::MAX_HANDSHAKES_PER_ADDRESS`]), so strangers cannot take the slots of
//! prefill workers.

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

/// Authenticated KV connections one listener holds at once; more are refused (and counted).
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
    handshaking: pki::PerAddress,
    name: &'static str,
}

impl Gate {
    /// Under mutual TLS only prefill workers get in.
    pub fn new(local: &Local, name: &'static str) -> Result<Gate, TransferError> {
        let acceptor = match &local.security {
            Security::Insecure => None,
            Security::Mutual(c) => Some(
                Acceptor::new(c, pki::ALPN_KV, &crate::KV_SENDERS, name)
                    .map_err(|e| TransferError::Refused(e.to_string()))?,
            ),
        };
        Ok(Gate {
            acceptor,
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            handshaking: pki::PerAddress::default(),
            name,
        })
    }

    /// The halves of a connection from `peer` once it is authenticated, with its slot among
    /// [`MAX_CONNECTIONS`]; `None` (counted) when its address has too many handshakes in
    /// progress, it is refused, or every slot is taken.
    pub async fn open(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
    ) -> Option<(ReadHalf, WriteHalf, OwnedSemaphorePermit)> {
        let _ = tcp.set_nodelay(true);
        let (r, w): (ReadHalf, WriteHalf) = match &self.acceptor {
            None => {
                let (r, w) = tcp.into_split();
                (Box::new(r), Box::new(w))
            }
            Some(a) => {
                let held = a.admit(&self.handshaking, peer)?;
                let (tls, _) = a.accept(tcp, Some(peer)).await.ok()?;
                drop(held);
                let (r, w) = tokio::io::split(tls);
                (Box::new(r), Box::new(w))
            }
        };
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            metrics::counter!("tandem_auth_refused_total", "listener" => self.name, "reason" => "too_many_connections")
                .increment(1);
            tracing::warn!(%peer, listener = self.name, "refused: {MAX_CONNECTIONS} KV connections open");
            return None;
        };
        Some((r, w, slot))
    }
}
