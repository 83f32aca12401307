//! Every process's Prometheus endpoint: the `metrics` crate's recorder for this process, and a
//! minimal HTTP/1.1 responder for `GET /metrics` (workers have no web framework of their own).

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Histogram buckets for latencies and step times: 100 µs to 60 s.
pub const LATENCY_BUCKETS: [f64; 17] = [
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
];

/// Buckets of the workers' step overheads (`tandem_*_step_overhead_seconds`: a mock step's
/// time beyond its timing model's) and of the router's token delays, fine enough for the
/// simulator to draw from: eight a decade, 10 µs to 1 s.
pub fn overhead_buckets() -> Vec<f64> {
    (0..=40)
        .map(|i| 1e-5 * 10f64.powf(i as f64 / 8.0))
        .collect()
}

/// What a metric is, for its `# TYPE` and `# HELP` lines.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution.
    Histogram,
}

/// Describes each `(name, kind, help)` to the installed recorder, so `/metrics` carries help
/// text for every family (Prometheus' linter requires it).
pub fn describe(catalogue: &[(&'static str, Kind, &'static str)]) {
    let every_process = [(
        "tandem_auth_refused_total",
        Kind::Counter,
        "Connections and calls refused on an internal listener, by listener and reason (no_certificate, untrusted_certificate, wrong_role, not_tls, handshake, handshake_timeout, too_many_connections, wrong_pool, not_owner; listener kv, reason ticket: a KV transfer without its reservation's ticket).",
    )];
    for &(name, kind, help) in catalogue.iter().chain(&every_process) {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
}

/// Installs this process's Prometheus recorder and keeps it maintained; `None` if another
/// recorder is already installed (metrics then go to that one).
pub fn install() -> Option<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets(&LATENCY_BUCKETS)
        .ok()?
        .set_buckets_for_metric(
            Matcher::Suffix("_step_overhead_seconds".into()),
            &overhead_buckets(),
        )
        .ok()?
        .set_buckets_for_metric(
            Matcher::Full("tandem_router_token_delay_seconds".into()),
            &overhead_buckets(),
        )
        .ok()?
        .install_recorder()
        .ok()?;
    let h = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            h.run_upkeep();
        }
    });
    Some(handle)
}

/// Serves `GET /metrics` (Prometheus text format 0.0.4) on `listener` forever; other paths get
/// 404.
pub async fn serve(listener: TcpListener, handle: PrometheusHandle) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            // The request line and headers; the body (if any) is ignored.
            while n < buf.len() {
                match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf[n..])).await {
                    Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                    Ok(Ok(k)) => n += k,
                }
                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = if path == "/metrics" {
                ("200 OK", handle.render())
            } else {
                ("404 Not Found", "not found\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

/// Installs the recorder and serves it on an ephemeral port of `host`; returns where (`None`
/// when another recorder was already installed in this process).
pub async fn start(host: &str) -> std::io::Result<Option<std::net::SocketAddr>> {
    let Some(handle) = install() else {
        return Ok(None);
    };
    let listener = TcpListener::bind((host, 0)).await?;
    let at = listener.local_addr()?;
    tokio::spawn(serve(listener, handle));
    Ok(Some(at))
}
