//! The `kubernetes` actuator: each pool is a Deployment, and the planner's desired replicas
//! are written to its `scale` subresource through the API server (a JSON merge patch of
//! `spec.replicas`), with the pod's service-account token (read again for every call: tokens
//! rotate) and, over HTTPS, the cluster's CA. New pods register in etcd and join like any worker.
//! A scale-down picks the pods that go: the pool's least busy workers (a worker is named after
//! its pod), annotated with the lowest `pod-deletion-cost`, so the ReplicaSet removes those;
//! each, sent SIGTERM, admits nothing more (its heartbeats tell the router), finishes what it
//! holds and exits (`worker::serve`) within the pod's grace period. (Not marked draining here:
//! a scale-down the planner takes back before Kubernetes acts would leave them so.)
//!
//! Unit-tested against recorded API requests (an in-process fake API server); not run against a
//! live API server here.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::actuator::{Actuator, Starting};
use crate::planner::Pool;
use crate::registry::Registry;

/// Where the in-cluster credentials are.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The deadline of one API call.
const CALL: Duration = Duration::from_secs(5);

/// The annotation by which a ReplicaSet scaling down picks its pods, the lowest cost first.
pub const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// How the actuator reaches the API server.
#[derive(Debug, Clone)]
pub struct KubeApi {
    /// `https://host:port` (or `http://…` in tests).
    pub base: String,
    /// A file holding the bearer token.
    pub token_file: PathBuf,
    /// The CA the API server's certificate is checked against (PEM), for HTTPS.
    pub ca_pem: Option<Vec<u8>>,
    /// The namespace of Deployments named without one.
    pub namespace: String,
}

impl KubeApi {
    /// The API server as a pod sees it: `KUBERNETES_SERVICE_HOST`/`_PORT` and the mounted
    /// service account; `None` outside a cluster.
    pub fn in_cluster() -> Option<KubeApi> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let dir = PathBuf::from(SERVICE_ACCOUNT);
        let namespace = std::fs::read_to_string(dir.join("namespace"))
            .ok()
            .or_else(|| std::env::var("POD_NAMESPACE").ok())?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        Some(KubeApi {
            base: format!("https://{host}:{port}"),
            token_file: dir.join("token"),
            ca_pem: std::fs::read(dir.join("ca.crt")).ok(),
            namespace: namespace.trim().to_string(),
        })
    }
}

/// A pool's Deployment.
#[derive(Debug, Clone)]
pub struct Target {
    /// The Deployment's name.
    pub deployment: String,
    /// Its namespace (`None`: the API's default).
    pub namespace: Option<String>,
}

/// Scales Deployments through the API server.
pub struct Kubernetes {
    api: KubeApi,
    targets: HashMap<Pool, Target>,
    /// TLS towards the API server (with its CA), for `https://` bases.
    tls: Option<tokio_rustls::TlsConnector>,
    /// The replicas last written per pool (written again only when the planner changes them).
    applied: HashMap<Pool, u32>,
    /// Scale-downs so far: each marks its pods one lower than the last, so pods marked before
    /// and kept (a scale-down taken back) never tie with those chosen now.
    downs: u32,
}

impl Kubernetes {
    /// An actuator for the pools in `targets`.
    pub fn new(api: KubeApi, targets: HashMap<Pool, Target>) -> Result<Kubernetes, String> {
        let tls = match &api.ca_pem {
            Some(pem) => Some(tls(pem)?),
            None if api.base.starts_with("https://") => {
                return Err("an https API server needs its CA".into())
            }
            None => None,
        };
        Ok(Kubernetes {
            api,
            targets,
            tls,
            applied: HashMap::new(),
            downs: 0,
        })
    }

    /// `PATCH …/deployments/<name>/scale` with `{"spec":{"replicas":n}}`.
    async fn scale(&self, t: &Target, n: u32) -> Result<(), String> {
        let ns = t.namespace.as_deref().unwrap_or(&self.api.namespace);
        let path = format!(
            "/apis/apps/v1/namespaces/{ns}/deployments/{}/scale",
            t.deployment
        );
        self.merge(&path, serde_json::json!({"spec": {"replicas": n}}))
            .await
    }

    /// Before `pool` goes down to `n` replicas: the workers beyond `n` to go — draining ones
    /// first, then the fewest requests held — their pods annotated with the lowest deletion
    /// cost (the ReplicaSet removes those).
    async fn choose_leaving(
        &mut self,
        t: &Target,
        pool: Pool,
        n: u32,
        registry: &Registry,
    ) -> Result<(), String> {
        let leaving: Vec<String> = registry.with(|table| {
            let mut ws: Vec<_> = table
                .pool(pool)
                .map(|w| {
                    let l = &w.load;
                    let held = l.running + l.waiting + l.pending_transfers + l.transfers_in_flight;
                    ((!w.draining, held), w.name.clone())
                })
                .collect();
            ws.sort();
            let excess = ws.len().saturating_sub(n as usize);
            ws.into_iter().take(excess).map(|(_, name)| name).collect()
        });
        self.downs += 1;
        let cost = format!("-{}", 1000 + self.downs);
        let ns = t.namespace.as_deref().unwrap_or(&self.api.namespace);
        let mut failed = Vec::new();
        for pod in leaving {
            let path = format!("/api/v1/namespaces/{ns}/pods/{pod}");
            let body = serde_json::json!({"metadata": {"annotations": {DELETION_COST: cost}}});
            match self.merge(&path, body).await {
                Ok(()) => tracing::info!(pod, cost, "planner: {pool} pod chosen to go"),
                Err(e) => failed.push(e),
            }
        }
        match failed.is_empty() {
            true => Ok(()),
            false => Err(failed.join("; ")),
        }
    }

    /// A JSON merge patch of `path`, with the token read now.
    async fn merge(&self, path: &str, body: serde_json::Value) -> Result<(), String> {
        let token = std::fs::read_to_string(&self.api.token_file)
            .map_err(|e| format!("reading the token {}: {e}", self.api.token_file.display()))?;
        let call = self.patch(path, token.trim(), body.to_string());
        let (status, text) = tokio::time::timeout(CALL, call)
            .await
            .map_err(|_| format!("PATCH {path}: no answer within {CALL:?}"))??;
        if (200..300).contains(&status) {
            return Ok(());
        }
        Err(format!(
            "PATCH {path}: {status}: {}",
            text.chars().take(300).collect::<String>()
        ))
    }

    /// One request on a fresh connection; the status and the body.
    async fn patch(&self, path: &str, token: &str, body: String) -> Result<(u16, String), String> {
        let authority = self
            .api
            .base
            .split_once("://")
            .map_or(self.api.base.as_str(), |(_, a)| a)
            .trim_end_matches('/');
        let req = hyper::Request::patch(path)
            .header(hyper::header::HOST, authority)
            .header(hyper::header::AUTHORIZATION, format!("Bearer {token}"))
            .header(hyper::header::CONTENT_TYPE, "application/merge-patch+json")
            .header(hyper::header::ACCEPT, "application/json")
            .body(http_body_util::Full::new(axum::body::Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let tcp = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| format!("connecting to {authority}: {e}"))?;
        match &self.tls {
            None => send(tcp, req).await,
            Some(tls) => {
                let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let name = rustls::pki_types::ServerName::try_from(host.to_string())
                    .map_err(|e| format!("{host}: {e}"))?;
                let stream = tls
                    .connect(name, tcp)
                    .await
                    .map_err(|e| format!("TLS with {authority}: {e}"))?;
                send(stream, req).await
            }
        }
    }
}

/// A TLS client trusting only the cluster's CA, with ring (the provider QUIC uses).
fn tls(ca_pem: &[u8]) -> Result<tokio_rustls::TlsConnector, String> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| format!("the CA: {e}"))?;
        roots.add(cert).map_err(|e| format!("the CA: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
}

/// Sends `req` over `io` (HTTP/1.1) and reads the whole answer.
async fn send<S>(
    io: S,
    req: hyper::Request<http_body_util::Full<axum::body::Bytes>>,
) -> Result<(u16, String), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::BodyExt;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let r = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = r.status().as_u16();
    let body = r
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    conn.abort();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

impl Actuator for Kubernetes {
    fn reconcile<'a>(
        &'a mut self,
        pool: Pool,
        desired: u32,
        registry: &'a Arc<Registry>,
    ) -> Pin<Box<dyn Future<Output = Starting> + Send + 'a>> {
        Box::pin(async move {
            let Some(t) = self.targets.get(&pool).cloned() else {
                return 0;
            };
            if self.applied.get(&pool) != Some(&desired) {
                let down = desired < registry.count(pool) as u32;
                let chosen = match down {
                    true => self.choose_leaving(&t, pool, desired, registry).await,
                    false => Ok(()),
                };
                if let Err(e) = chosen {
                    // Kubernetes picks the pods itself (they drain on SIGTERM all the same).
                    tracing::warn!("planner: choosing the {pool} pods to go: {e}");
                }
                match self.scale(&t, desired).await {
                    Ok(()) => {
                        tracing::info!(deployment = %t.deployment, "planner: scaled {pool} to {desired}");
                        self.applied.insert(pool, desired);
                    }
                    // Tried again next tick.
                    Err(e) => tracing::warn!("planner: scaling {pool} to {desired}: {e}"),
                }
            }
            // Pods asked for and not joined yet (pending, pulling, loading the model).
            match self.applied.get(&pool) {
                Some(&n) => n.saturating_sub(registry.count(pool) as u32),
                None => 0,
            }
        })
    }
}
