//! gRPC over the cluster's identity: the connections a server accepts (mutual TLS with the
//! peer's role checked, or plain under `insecure = true`), who a request came from, and the
//! channel a client dials.

use std::pin::Pin;
use std::task::{Context, Poll};

use pki::{Acceptor, Peer, Role, Security};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// One accepted connection of a gRPC server.
pub enum Conn {
    /// Plain TCP (`insecure = true`).
    Plain(TcpStream),
    /// Mutual TLS, with who is on the other end.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>, Peer),
}

/// What a request's extensions carry about its connection.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// The TCP addresses.
    pub tcp: TcpConnectInfo,
    /// The authenticated peer (`None` on a plain connection).
    pub peer: Option<Peer>,
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        match self {
            Conn::Plain(s) => ConnInfo {
                tcp: s.connect_info(),
                peer: None,
            },
            Conn::Tls(s, p) => ConnInfo {
                tcp: s.get_ref().0.connect_info(),
                peer: Some(p.clone()),
            },
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s, _) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s, _) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s, _) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s, _) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// The connections of a gRPC server on `listener` (named `name` in metrics) that only the
/// `allowed` roles may open: under mutual TLS, the others are refused at the handshake and
/// counted in `tandem_auth_refused_total`; plain under `insecure`. Every connection has Nagle's
/// algorithm off ([`crate::grpc_incoming`] says why).
pub fn incoming(
    listener: TcpListener,
    security: &Security,
    allowed: &[Role],
    name: &'static str,
) -> Result<Pin<Box<dyn Stream<Item = std::io::Result<Conn>> + Send>>, pki::PkiError> {
    Ok(match security {
        Security::Insecure => Box::pin(crate::grpc_incoming(listener).map(|s| s.map(Conn::Plain))),
        Security::Mutual(creds) => {
            let rx = Acceptor::new(creds, pki::ALPN_GRPC, allowed, name)?.incoming(listener);
            Box::pin(
                tokio_stream::wrappers::ReceiverStream::new(rx)
                    .map(|(s, p)| Ok(Conn::Tls(Box::new(s), p))),
            )
        }
    })
}

/// An error with its causes (tonic's transport errors say only "transport error"; the cause
/// says which: a refused connection, a certificate the peer does not trust, …).
pub fn explain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// The authenticated peer a request came from (`None` on a plain connection).
pub fn peer<T>(req: &tonic::Request<T>) -> Option<&Peer> {
    req.extensions().get::<ConnInfo>()?.peer.as_ref()
}

/// The gRPC endpoint to dial `uri` (`http://host:port`), whose server must hold a certificate
/// valid for `server_name` (a role's [`Role::dns`], or [`Role::WORKER_DNS`]).
pub fn endpoint(
    security: &Security,
    uri: &str,
    server_name: &str,
) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    let e = tonic::transport::Endpoint::from_shared(security.endpoint(uri))?;
    match security.credentials() {
        None => Ok(e),
        Some(c) => {
            let (cert, key, ca) = c.pems();
            let tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca))
                .identity(tonic::transport::Identity::from_pem(cert, key))
                .domain_name(server_name);
            e.tls_config(tls)
        }
    }
}
