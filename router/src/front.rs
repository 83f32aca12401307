//! The HTTP front: the router's own accept loop over hyper's HTTP/1.1 server, so that no client
//! can hold what others need. Each connection has deadlines — its request headers within
//! [`HEADER_TIMEOUT`] of the connection opening or the last response (hyper closes one that
//! sends nothing, trickles its headers, or sits idle between requests as long), its body within
//! [`BODY_TIMEOUT`] ([`crate::guard::check`]) — and
//! counts against two caps: the listener's (`[router] max_connections`; more wait in the
//! kernel's backlog) and its address's (`max_connections_per_address`; more are closed at once
//! and counted in `tandem_router_connections_refused_total`), so one greedy or slow client
//! cannot fill the listener and lock out `/health` and everyone else.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower::ServiceExt;

/// How long a client has to send a request's headers (and how long a connection may sit idle
/// between requests).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client has to send a request's body once its headers are in.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// The caps of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Connections served at once.
    pub total: usize,
    /// Connections from one address at once.
    pub per_address: usize,
}

/// Serves `app` on `listener` until the process ends.
pub async fn serve(listener: TcpListener, app: axum::Router, caps: Caps) -> std::io::Result<()> {
    let total = Arc::new(Semaphore::new(caps.total.clamp(1, Semaphore::MAX_PERMITS)));
    let open = pki::PerAddress::default();
    loop {
        let permit = total
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (tcp, addr) = match listener.accept().await {
            Ok(c) => c,
            // As axum's own loop does: a failed accept (e.g. out of descriptors) is logged and
            // retried after a pause, never fatal.
            Err(e) => {
                tracing::warn!("accepting an HTTP connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(held) = open.take(addr.ip(), caps.per_address) else {
            metrics::counter!("tandem_router_connections_refused_total", "reason" => "per_address")
                .increment(1);
            continue;
        };
        let app = app.clone();
        tokio::spawn(async move {
            let _counted = (permit, held);
            connection(tcp, app).await;
        });
    }
}

/// One HTTP/1.1 connection with the header deadline. (Not HTTP/2: hyper's HTTP/2 server has no
/// deadline for a peer that keeps a connection open and answers its pings.)
async fn connection(tcp: TcpStream, app: axum::Router) {
    let _ = tcp.set_nodelay(true);
    let service =
        hyper::service::service_fn(move |req: axum::http::Request<hyper::body::Incoming>| {
            let app = app.clone();
            async move {
                let resp = app.oneshot(req.map(axum::body::Body::new)).await;
                Ok::<_, Infallible>(resp.unwrap_or_else(|never| match never {}))
            }
        });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(tcp), service)
        .with_upgrades();
    if let Err(e) = served.await {
        tracing::debug!("HTTP connection ended: {e}");
    }
}
