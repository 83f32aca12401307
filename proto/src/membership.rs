//! The worker side of the control protocol: join the router, then heartbeat.

use std::time::Duration;

use pki::{Role, Security};

use crate::grpc::control_client::ControlClient;
use crate::grpc::{Heartbeat, JoinRequest};

/// How often a worker heartbeats (its load, its prefix-cache events): what the router knows of
/// it is at most this old.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_millis(250);

/// Why a worker could not join.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The router refused the worker (protocol version or model identity mismatch).
    #[error("the router refused this worker: {0}")]
    Refused(String),
    /// The router could not be reached in time.
    #[error("cannot reach the router at {0}: {1}")]
    Unreachable(String, String),
}

/// Joins the router at `router` (e.g. `http://127.0.0.1:8001`), retrying while it is not up
/// yet for up to `wait`, then heartbeats every `period` with what `beat(resync)` builds (the
/// router asked for a KV snapshot when `resync`), re-joining if the router forgets the worker.
/// Returns once joined; heartbeats continue in the background.
pub async fn join(
    router: String,
    security: Security,
    request: JoinRequest,
    wait: Duration,
    period: Duration,
    beat: impl FnMut(bool) -> Heartbeat + Send + 'static,
) -> Result<u64, JoinError> {
    let deadline = tokio::time::Instant::now() + wait;
    let (client, id) = loop {
        let attempt = async {
            let mut c = connect(&security, &router).await?;
            match c.join(request.clone()).await {
                Ok(r) => Ok(Ok((c, r.into_inner().worker_id))),
                Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                    Ok(Err(s.message().to_string()))
                }
                Err(s) => Err(s.to_string()),
            }
        };
        match attempt.await {
            Ok(Ok(joined)) => break joined,
            Ok(Err(refused)) => return Err(JoinError::Refused(refused)),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(JoinError::Unreachable(router, e))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    tokio::spawn(heartbeats(client, id, request, period, beat));
    Ok(id)
}

/// Heartbeats to one router every `period` until the process ends, re-joining when the router
/// forgets the worker (`NOT_FOUND`).
async fn heartbeats(
    mut client: ControlClient<tonic::transport::Channel>,
    id: u64,
    request: JoinRequest,
    period: Duration,
    mut beat: impl FnMut(bool) -> Heartbeat + Send + 'static,
) {
    let (mut id, mut resync) = (id, false);
    // A call's deadline: long enough for TCP to recover from loss on a bad link (a beat that
    // gives up early is resent as a whole KV snapshot, which a lossy link loses more often).
    let deadline = Duration::from_secs(10).max(period * 4);
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let b = Heartbeat {
            worker_id: id,
            ..beat(resync)
        };
        match tokio::time::timeout(deadline, client.beat(b)).await {
            Ok(Ok(r)) => resync = r.into_inner().resync,
            Ok(Err(s)) if s.code() == tonic::Code::NotFound => {
                if let Ok(Ok(r)) =
                    tokio::time::timeout(deadline, client.join(request.clone())).await
                {
                    id = r.into_inner().worker_id;
                }
                // A new membership: the router knows nothing of this worker's cache.
                resync = true;
            }
            _ => resync = true,
        }
    }
}

/// Follows one router found through etcd for as long as the task runs (abort it when the
/// router's registration goes): joins it, retrying every second while it cannot be reached,
/// then heartbeats as [`join`] does. A router that refuses the worker is logged and left.
pub async fn follow(
    router: String,
    security: Security,
    request: JoinRequest,
    period: Duration,
    beat: impl FnMut(bool) -> Heartbeat + Send + 'static,
) {
    let (client, id) = loop {
        let attempt = async {
            let mut c = connect(&security, &router).await.ok()?;
            Some(
                c.join(request.clone())
                    .await
                    .map(|r| (c, r.into_inner().worker_id)),
            )
        };
        match tokio::time::timeout(period * 8, attempt).await {
            Ok(Some(Ok(joined))) => break joined,
            Ok(Some(Err(s))) if s.code() == tonic::Code::FailedPrecondition => {
                return tracing::error!(%router, "the router refused this worker: {}", s.message());
            }
            _ => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    };
    tracing::info!(%router, worker_id = id, "joined a router found through etcd");
    heartbeats(client, id, request, period, beat).await
}

/// A client of the router's `Control` service at `router`, which must hold a router's
/// certificate under mutual TLS.
async fn connect(
    security: &Security,
    router: &str,
) -> Result<ControlClient<tonic::transport::Channel>, String> {
    let channel = crate::secure::endpoint(security, router, Role::Router.dns())
        .map_err(|e| crate::secure::explain(&e))?
        .connect()
        .await
        .map_err(|e| crate::secure::explain(&e))?;
    Ok(ControlClient::new(channel))
}
