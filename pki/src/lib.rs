//! tandem's cluster identity: who may talk to whom behind the router.
//!
//! - [`Role`]: what a process is (router, prefill worker, decode worker); a certificate names
//!   its role as a DNS name (`router.tandem`, …) that the peer checks.
//! - [`store`]: the cluster CA and the certificates on disk — a CA made once (by `tandem up`,
//!   or `tandem pki`), then a fresh certificate for each process where the CA key is at hand,
//!   or a role's certificate made ahead for a deployment (Kubernetes Secrets).
//! - [`Credentials`]: one process's certificate, key and the CA, as rustls configurations for
//!   mutually authenticated TLS 1.3 (every internal hop: gRPC and the KV transports).
//! - [`accept`]: the server side of a hop — the handshake under a deadline, the peer's role
//!   checked against those the listener serves, every refusal counted by reason in
//!   `tandem_auth_refused_total`.
//! - [`Security`]: mutual TLS (the default), or plain only where a cluster says
//!   `insecure = true`.

pub mod accept;
pub mod per_address;
pub mod store;

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

pub use accept::{Acceptor, Peer, Refusal};
pub use per_address::{Held, PerAddress};
pub use store::Store;

/// What a process is in the cluster: the role its certificate names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The router: the only caller of the workers' gRPC services.
    Router,
    /// A prefill worker: joins the router, sends KV to decode workers.
    Prefill,
    /// A decode worker: joins the router, receives KV.
    Decode,
    /// etcd, under `[discovery]` with `https://` endpoints: the certificate it serves with
    /// (`tandem pki issue --role etcd`); it connects to nothing of tandem's.
    Etcd,
    /// A node of the cluster KV store: workers put and get KV blocks, the router watches what
    /// it holds and pins.
    Store,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 5] = [
        Role::Router,
        Role::Prefill,
        Role::Decode,
        Role::Etcd,
        Role::Store,
    ];

    /// The role's name (file names, logs, metric labels).
    pub fn name(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Etcd => "etcd",
            Role::Store => "store",
        }
    }

    /// The DNS name a certificate of this role carries, and the one a client checks.
    pub fn dns(self) -> &'static str {
        match self {
            Role::Router => "router.tandem",
            Role::Prefill => "prefill.tandem",
            Role::Decode => "decode.tandem",
            Role::Etcd => "etcd.tandem",
            Role::Store => "store.tandem",
        }
    }

    /// The name every worker's certificate carries beside its role's: what the router checks
    /// when it calls a worker whose pool its channel does not know.
    pub const WORKER_DNS: &'static str = "worker.tandem";

    /// The role of a certificate the handshake has verified: the first role whose name it is
    /// valid for.
    pub fn of(cert: &CertificateDer<'_>) -> Option<Role> {
        let ee = webpki::EndEntityCert::try_from(cert).ok()?;
        Role::ALL.into_iter().find(|r| {
            let name = ServerName::try_from(r.dns()).expect("a valid DNS name");
            ee.verify_is_valid_for_subject_name(&name).is_ok()
        })
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why credentials could not be had.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// A file could not be read or written.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        error: std::io::Error,
    },
    /// A certificate or key was malformed, or could not be made.
    #[error("{0}")]
    Invalid(String),
}

/// One process's identity: its certificate (naming its role), its key, and the cluster CA it
/// trusts.
pub struct Credentials {
    role: Role,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
    ca: CertificateDer<'static>,
    /// PEM forms, for tonic's TLS configuration.
    cert_pem: String,
    key_pem: String,
    ca_pem: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// The TLS protocol name of gRPC (HTTP/2).
pub const ALPN_GRPC: &[u8] = b"h2";
/// The TLS protocol name of tandem's KV stream (TCP, and the RDMA side channel).
pub const ALPN_KV: &[u8] = b"tandem-kv/1";
/// ALPN of a store node's data connections (store/src/data.rs).
pub const ALPN_STORE: &[u8] = b"tandem-store/1";

impl Credentials {
    /// The role this process's certificate names.
    pub fn role(&self) -> Role {
        self.role
    }

    /// This process's certificate (DER).
    pub fn cert(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// The certificate, its key and the CA, PEM-encoded.
    pub fn pems(&self) -> (&str, &str, &str) {
        (&self.cert_pem, &self.key_pem, &self.ca_pem)
    }

    fn roots(&self) -> Arc<rustls::RootCertStore> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone()).expect("the CA was parsed");
        Arc::new(roots)
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// A server configuration that requires a client certificate from the cluster CA, speaking
    /// `alpn`, TLS 1.3 only. Which roles may connect is the [`Acceptor`]'s check.
    pub fn server_config(&self, alpn: &[u8]) -> Result<Arc<rustls::ServerConfig>, PkiError> {
        let provider = Credentials::provider();
        let bad = |e: rustls::Error| PkiError::Invalid(e.to_string());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            self.roots(),
            provider.clone(),
        )
        .build()
        .map_err(|e| PkiError::Invalid(e.to_string()))?;
        let mut c = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(bad)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain(), self.key.clone_key())
            .map_err(bad)?;
        c.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(c))
    }

    /// A client configuration presenting this process's certificate and trusting only the
    /// cluster CA, speaking `alpn`, TLS 1.3 only. The server's role is checked by the name the
    /// caller connects to ([`Role::dns`]).
    pub fn client_config(&self, alpn: &[u8]) -> Result<Arc<rustls::ClientConfig>, PkiError> {
        let bad = |e: rustls::Error| PkiError::Invalid(e.to_string());
        let mut c = rustls::ClientConfig::builder_with_provider(Credentials::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(bad)?
            .with_root_certificates(self.roots())
            .with_client_auth_cert(self.chain(), self.key.clone_key())
            .map_err(bad)?;
        c.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(c))
    }

    fn chain(&self) -> Vec<CertificateDer<'static>> {
        vec![self.cert.clone(), self.ca.clone()]
    }
}

/// How a process's internal hops are secured.
#[derive(Debug, Clone)]
pub enum Security {
    /// Mutually authenticated TLS 1.3 with these credentials: the default.
    Mutual(Arc<Credentials>),
    /// Plain TCP, anyone who reaches a listener is believed: only behind `insecure = true`
    /// (and in tests of the layers above, which say so).
    Insecure,
}

impl Security {
    /// The credentials, when mutual.
    pub fn credentials(&self) -> Option<&Arc<Credentials>> {
        match self {
            Security::Mutual(c) => Some(c),
            Security::Insecure => None,
        }
    }

    /// `endpoint` (`http://host:port`) as a client must dial it: `https://` under mutual TLS.
    pub fn endpoint(&self, endpoint: &str) -> String {
        match (self, endpoint.strip_prefix("http://")) {
            (Security::Mutual(_), Some(rest)) => format!("https://{rest}"),
            _ => endpoint.to_string(),
        }
    }

    /// Says loudly, once at start, that this process runs without authentication.
    pub fn warn_if_insecure(&self, what: &str) {
        if let Security::Insecure = self {
            let line = format!(
                "WARNING: {what} runs with `insecure = true`: its internal listeners accept anyone \
                 who reaches them, unauthenticated and unencrypted"
            );
            tracing::warn!("{line}");
            eprintln!("{line}");
        }
    }
}

/// SHA-256 of a certificate: what ties a worker's heartbeats to the certificate it joined with.
pub fn fingerprint(cert: &CertificateDer<'_>) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    d.as_ref().try_into().expect("SHA-256 is 32 bytes")
}

#[cfg(test)]
mod tests;
