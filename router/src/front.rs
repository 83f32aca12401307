//! The HTTP front: the router's own accept loop over hyper, so that no client can hold what
//! others need. Each connection has deadlines — its request headers within
//! [`HEADER_TIMEOUT`] (hyper closes a connection that trickles them, and one that sits idle
//! between requests as long), its body within [`BODY_TIMEOUT`] ([`crate::guard::check`]) — and
//! counts against two caps: the listener's (`[router] max_connections`; more wait in the
//! kernel's backlog) and its address's (`max_connections_per_address`; more are closed at once
//! and counted in `tandem_router_connections_refused_total`), so one greedy or slow client
//! cannot fill the listener and lock out `/health` and everyone else.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower::ServiceExt;

/// How long a client has to send a request's headers (and how long a connection may sit idle
/// between requests).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client has to send a request's body once its headers are in.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections open per client address.
#[derive(Clone, Default)]
struct PerAddress(Arc<Mutex<HashMap<IpAddr, usize>>>);

/// One connection counted against its address until dropped.
struct Held(PerAddress, IpAddr);

impl PerAddress {
    fn take(&self, ip: IpAddr, max: usize) -> Option<Held> {
        let mut m = self.0.lock().expect("per-address lock");
        let n = m.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Held(self.clone(), ip))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut m = self.0 .0.lock().expect("per-address lock");
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

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
    let open = PerAddress::default();
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

/// One connection, HTTP/1.1 or HTTP/2, with the header deadline.
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
    let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    b.http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(HEADER_TIMEOUT))
        .keep_alive_timeout(HEADER_TIMEOUT);
    if let Err(e) = b
        .serve_connection_with_upgrades(TokioIo::new(tcp), service)
        .await
    {
        tracing::debug!("HTTP connection ended: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_holds_at_most_its_share_and_gives_it_back() {
        let open = PerAddress::default();
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.1".parse().unwrap();
        let held: Vec<_> = (0..3).map(|_| open.take(a, 3).unwrap()).collect();
        assert!(open.take(a, 3).is_none(), "a fourth from the same address");
        assert!(
            open.take(b, 3).is_some(),
            "another address is not held back"
        );
        drop(held);
        assert!(open.0.lock().unwrap().get(&a).is_none());
        assert!(open.take(a, 3).is_some());
    }
}
