//! The QUIC transport (quinn + rustls/ring): one connection per peer, one bidirectional stream
//! per transfer (handshake frame included, so streams are independent). Under mutual TLS (the
//! default) both ends present their cluster certificates: the prefill worker checks it reached
//! a decode worker, the decode worker that a prefill worker connected. Under `insecure = true`
//! the decode worker generates a self-signed certificate at start and advertises it in its
//! offer; the prefill worker trusts exactly that certificate (encrypted, not authenticated).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::wire::Local;
use pki::{Role, Security};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::sync::mpsc;

use crate::core::Timeouts;
use crate::wire::{self, Conn, KvEvent};
use crate::{TransferError, TransferStats, Transport};

/// The name in the generated certificate.
const SERVER_NAME: &str = "tandem-kv";

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls(e: impl std::fmt::Display) -> TransferError {
    TransferError::Protocol(format!("QUIC/TLS setup: {e}"))
}

/// A bound QUIC endpoint accepting KV, and the certificate peers must pin.
pub struct QuicKvReceiver {
    endpoint: quinn::Endpoint,
    /// DER of the self-signed certificate.
    pub cert_der: Vec<u8>,
}

impl QuicKvReceiver {
    /// Binds a QUIC endpoint on `addr`: with this worker's cluster certificate (client
    /// certificates required) under mutual TLS, else a fresh self-signed one.
    pub fn bind(addr: SocketAddr, security: &Security) -> Result<QuicKvReceiver, TransferError> {
        let (crypto, cert_der) = match security {
            Security::Mutual(c) => (
                c.server_config(pki::ALPN_KV).map_err(tls)?,
                c.cert().clone(),
            ),
            Security::Insecure => self_signed()?,
        };
        let mut config = quinn::ServerConfig::with_crypto(Arc::new(
            QuicServerConfig::try_from(crypto).map_err(tls)?,
        ));
        config.transport_config(Arc::new(transport_config()));
        let endpoint = quinn::Endpoint::server(config, addr)?;
        Ok(QuicKvReceiver {
            endpoint,
            cert_der: cert_der.to_vec(),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, TransferError> {
        Ok(self.endpoint.local_addr()?)
    }

    /// Accepts connections and their streams forever, handing complete transfers to `tx`.
    pub async fn serve(self, local: Local, tx: mpsc::Sender<KvEvent>, timeouts: Timeouts) {
        let receiving = wire::Receiving {
            local,
            transport: Transport::Quic,
            tx,
            pool: wire::BufferPool::default(),
            timeouts,
        };
        let mutual = matches!(receiving.local.security, Security::Mutual(_));
        while let Some(incoming) = self.endpoint.accept().await {
            let receiving = receiving.clone();
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                let peer = conn.remote_address();
                if mutual && !from_kv_sender(&conn) {
                    metrics::counter!("tandem_auth_refused_total", "listener" => "kv_quic", "reason" => "wrong_role")
                        .increment(1);
                    tracing::warn!(%peer, "refused a QUIC KV connection: not a prefill or decode worker");
                    return conn.close(1u32.into(), b"not a KV sender");
                }
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let receiving = receiving.clone();
                    tokio::spawn(async move {
                        let served = wire::serve_stream(&mut recv, &mut send, &receiving, None);
                        if let Err(e) = served.await {
                            tracing::warn!(%peer, "KV stream (quic) closed: {e}");
                        }
                        let _ = send.finish();
                    });
                }
            });
        }
    }
}

/// A self-signed certificate's server configuration and the certificate (`insecure`).
fn self_signed() -> Result<(Arc<rustls::ServerConfig>, CertificateDer<'static>), TransferError> {
    let cert = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()]).map_err(tls)?;
    let cert_der = cert.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.signing_key.serialize_der()));
    let crypto = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_no_client_auth()
        .with_single_cert(vec![cert_der.clone()], key)
        .map_err(tls)?;
    Ok((Arc::new(crypto), cert_der))
}

/// Whether the peer of an accepted connection presented a KV sender's certificate — a prefill
/// worker's, or a decode worker's handing a sequence off (the chain was verified in the
/// handshake; what it may send is still bound to a reservation's ticket).
fn from_kv_sender(conn: &quinn::Connection) -> bool {
    let certs = conn
        .peer_identity()
        .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok());
    certs
        .and_then(|c| c.first().and_then(Role::of))
        .is_some_and(|r| crate::KV_SENDERS.contains(&r))
}

/// The client's configuration: the cluster certificate under mutual TLS (the server must
/// hold a decode worker's), else trust in exactly the offer's certificate; and the name to
/// connect to.
fn client_crypto(
    security: &Security,
    cert_der: &[u8],
) -> Result<(Arc<rustls::ClientConfig>, &'static str), TransferError> {
    if let Security::Mutual(c) = security {
        return Ok((
            c.client_config(pki::ALPN_KV).map_err(tls)?,
            Role::Decode.dns(),
        ));
    }
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(cert_der.to_vec()))
        .map_err(tls)?;
    let crypto = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok((Arc::new(crypto), SERVER_NAME))
}

/// Large windows: KV transfers are bulk data on fast links.
fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window((64u32 << 20).into());
    t.receive_window((256u32 << 20).into());
    t.send_window(256 << 20);
    t.max_idle_timeout(Some(Duration::from_secs(30).try_into().expect("in range")));
    t.keep_alive_interval(Some(Duration::from_secs(5)));
    t
}

/// The sending side of a QUIC connection to one decode worker.
pub struct QuicKvSender {
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    local: Local,
    peer: String,
}

impl QuicKvSender {
    /// Connects to `addr`, trusting only `cert_der`, within `timeout`.
    pub async fn connect(
        addr: &str,
        cert_der: &[u8],
        local: &Local,
        timeout: Duration,
    ) -> Result<QuicKvSender, TransferError> {
        let sock: SocketAddr = addr
            .parse()
            .map_err(|_| TransferError::Protocol(format!("{addr:?} is not a socket address")))?;
        let (crypto, server_name) = client_crypto(&local.security, cert_der)?;
        let mut config =
            quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(crypto).map_err(tls)?));
        config.transport_config(Arc::new(transport_config()));
        let bind: SocketAddr = if sock.is_ipv6() {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        }
        .parse()
        .expect("valid");
        let mut endpoint = quinn::Endpoint::client(bind)?;
        endpoint.set_default_client_config(config);
        let conn = wire::deadline(
            timeout,
            || format!("connecting to {addr} over QUIC"),
            async {
                endpoint
                    .connect(sock, server_name)
                    .map_err(|e| TransferError::Protocol(format!("QUIC connect: {e}")))?
                    .await
                    .map_err(|e| TransferError::Protocol(format!("QUIC connect: {e}")))
            },
        )
        .await?;
        Ok(QuicKvSender {
            _endpoint: endpoint,
            conn,
            local: local.clone(),
            peer: addr.to_string(),
        })
    }

    /// Sends one request's KV on a new stream and waits for the receiver to admit it.
    pub async fn send(
        &mut self,
        (request_id, ticket): (u64, types::TransferTicket),
        n_tokens: u32,
        width: u32,
        layers: crate::wire::Layers<'_>,
        timeout: Duration,
    ) -> Result<TransferStats, TransferError> {
        let t0 = Instant::now();
        let peer = self.peer.clone();
        let sent = wire::deadline(
            timeout,
            || format!("KV of request {request_id} to {peer} over QUIC"),
            async {
                let (send, recv) = self
                    .conn
                    .open_bi()
                    .await
                    .map_err(|e| TransferError::Protocol(format!("QUIC stream: {e}")))?;
                let send = tokio::io::BufWriter::with_capacity(256 << 10, send);
                let timeouts = Timeouts {
                    handshake: timeout,
                    transfer: timeout,
                    ..Timeouts::default()
                };
                let mut stream = Conn::open(recv, send, &self.local, timeouts).await?;
                let bytes = stream
                    .send((request_id, ticket), n_tokens, width, layers, timeout)
                    .await?;
                let (_, send) = stream.into_parts();
                let _ = send.into_inner().finish();
                Ok(bytes)
            },
        )
        .await?;
        Ok(TransferStats {
            bytes: sent,
            elapsed: t0.elapsed(),
            transport: Transport::Quic,
        })
    }
}
