//! The server side of an internal hop: a TLS handshake under a deadline that requires a
//! certificate from the cluster CA, then the peer's role checked against those the listener
//! serves. Every refusal is counted in `tandem_auth_refused_total{listener, reason}` and
//! logged with the peer's address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

use crate::{fingerprint, Credentials, PkiError, Role};

/// How long a peer has to finish its handshake.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// Handshakes in progress at once on one listener; more connections wait to be accepted.
pub const MAX_HANDSHAKES: usize = 256;
/// Handshakes in progress at once from one address; more are closed at once (and counted).
pub const MAX_HANDSHAKES_PER_ADDRESS: usize = 16;

/// Who is on the other end of an accepted connection.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Its address.
    pub addr: Option<SocketAddr>,
    /// The role its certificate names.
    pub role: Role,
    /// Its certificate's SHA-256.
    pub fingerprint: [u8; 32],
}

/// Why a connection was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Refusal {
    /// It did not speak TLS.
    #[error("not TLS: {0}")]
    NotTls(String),
    /// It presented no certificate.
    #[error("no client certificate")]
    NoCertificate,
    /// Its certificate is not from the cluster CA (or expired, or malformed).
    #[error("untrusted certificate: {0}")]
    Untrusted(String),
    /// Its certificate names a role this listener does not serve.
    #[error("the role {0} may not connect here")]
    WrongRole(String),
    /// The handshake failed otherwise.
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The handshake did not finish within [`HANDSHAKE_DEADLINE`].
    #[error("handshake not finished within {HANDSHAKE_DEADLINE:?}")]
    Timeout,
}

impl Refusal {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::NotTls(_) => "not_tls",
            Refusal::NoCertificate => "no_certificate",
            Refusal::Untrusted(_) => "untrusted_certificate",
            Refusal::WrongRole(_) => "wrong_role",
            Refusal::Handshake(_) => "handshake",
            Refusal::Timeout => "handshake_timeout",
        }
    }

    fn of(e: &std::io::Error) -> Refusal {
        let tls = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
        match tls {
            Some(rustls::Error::NoCertificatesPresented) => Refusal::NoCertificate,
            Some(rustls::Error::InvalidCertificate(c)) => Refusal::Untrusted(format!("{c:?}")),
            Some(
                t @ (rustls::Error::InvalidMessage(_)
                | rustls::Error::InappropriateMessage { .. }
                | rustls::Error::InappropriateHandshakeMessage { .. }),
            ) => Refusal::NotTls(t.to_string()),
            Some(t) => Refusal::Handshake(t.to_string()),
            None => Refusal::Handshake(e.to_string()),
        }
    }
}

/// Accepts the connections of one listener (named `listener` in metrics and logs) from the
/// roles it serves.
#[derive(Clone)]
pub struct Acceptor {
    tls: tokio_rustls::TlsAcceptor,
    allowed: Vec<Role>,
    listener: &'static str,
}

impl Acceptor {
    /// An acceptor for `allowed` peers, speaking `alpn`.
    pub fn new(
        creds: &Credentials,
        alpn: &[u8],
        allowed: &[Role],
        listener: &'static str,
    ) -> Result<Acceptor, PkiError> {
        Ok(Acceptor {
            tls: tokio_rustls::TlsAcceptor::from(creds.server_config(alpn)?),
            allowed: allowed.to_vec(),
            listener,
        })
    }

    /// The handshake on `io`, from `addr`, and the peer's role checked; a refusal is counted.
    pub async fn accept<IO: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: IO,
        addr: Option<SocketAddr>,
    ) -> Result<(TlsStream<IO>, Peer), Refusal> {
        let out = self.handshake(io, addr).await;
        if let Err(r) = &out {
            metrics::counter!("tandem_auth_refused_total", "listener" => self.listener, "reason" => r.reason())
                .increment(1);
            tracing::warn!(listener = self.listener, peer = ?addr, "refused: {r}");
        }
        out
    }

    async fn handshake<IO: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: IO,
        addr: Option<SocketAddr>,
    ) -> Result<(TlsStream<IO>, Peer), Refusal> {
        let s = tokio::time::timeout(HANDSHAKE_DEADLINE, self.tls.accept(io))
            .await
            .map_err(|_| Refusal::Timeout)?
            .map_err(|e| Refusal::of(&e))?;
        let cert = s
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .ok_or(Refusal::NoCertificate)?;
        let role = Role::of(cert).ok_or_else(|| Refusal::WrongRole("none".into()))?;
        if !self.allowed.contains(&role) {
            return Err(Refusal::WrongRole(role.to_string()));
        }
        let fingerprint = fingerprint(cert);
        Ok((
            s,
            Peer {
                addr,
                role,
                fingerprint,
            },
        ))
    }

    /// A handshake slot for `addr` among `open`'s, or `None` (counted) when it has
    /// [`MAX_HANDSHAKES_PER_ADDRESS`] in progress already.
    pub fn admit(&self, open: &crate::PerAddress, addr: SocketAddr) -> Option<crate::Held> {
        let held = open.take(addr.ip(), MAX_HANDSHAKES_PER_ADDRESS);
        if held.is_none() {
            metrics::counter!("tandem_auth_refused_total", "listener" => self.listener, "reason" => "too_many_handshakes")
                .increment(1);
        }
        held
    }

    /// Accepts on `listener` for as long as the receiver lives: each connection's handshake on
    /// a task of its own (at most [`MAX_HANDSHAKES`] at once), the authenticated ones sent on.
    pub fn incoming(
        self,
        listener: TcpListener,
    ) -> tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, Peer)> {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let per_address = crate::PerAddress::default();
        let me = Arc::new(self);
        tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, addr) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(listener = me.listener, "accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let Some(held) = me.admit(&per_address, addr) else {
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let (me, tx) = (me.clone(), tx.clone());
                tokio::spawn(async move {
                    let accepted = me.accept(tcp, Some(addr)).await;
                    drop((slot, held));
                    if let Ok(c) = accepted {
                        let _ = tx.send(c).await;
                    }
                });
            }
        });
        rx
    }
}

/// The client side: `io` wrapped in TLS to a peer that must hold a certificate of `role`.
pub async fn connect<IO: AsyncRead + AsyncWrite + Unpin>(
    creds: &Credentials,
    alpn: &[u8],
    role: Role,
    io: IO,
) -> Result<tokio_rustls::client::TlsStream<IO>, std::io::Error> {
    let config = creds
        .client_config(alpn)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let name = rustls::pki_types::ServerName::try_from(role.dns())
        .expect("a valid DNS name")
        .to_owned();
    tokio_rustls::TlsConnector::from(config)
        .connect(name, io)
        .await
}
