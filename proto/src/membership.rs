//! The worker side of the control protocol: join the router, then heartbeat.

use std::time::Duration;

use crate::grpc::control_client::ControlClient;
use crate::grpc::{Heartbeat, JoinRequest, WorkerLoad};

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
/// yet for up to `wait`, then heartbeats every `period` with what `stats` reports, re-joining if
/// the router forgets the worker. Returns once joined; heartbeats continue in the background.
pub async fn join(
    router: String,
    request: JoinRequest,
    wait: Duration,
    period: Duration,
    load: impl Fn() -> WorkerLoad + Send + 'static,
) -> Result<u64, JoinError> {
    let deadline = tokio::time::Instant::now() + wait;
    let (mut client, id) = loop {
        let attempt = async {
            let mut c = ControlClient::connect(router.clone())
                .await
                .map_err(|e| e.to_string())?;
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
    tokio::spawn(async move {
        let mut id = id;
        loop {
            tokio::time::sleep(period).await;
            let beat = Heartbeat {
                worker_id: id,
                load: Some(load()),
            };
            match client.beat(beat).await {
                Ok(_) => {}
                Err(s) if s.code() == tonic::Code::NotFound => {
                    if let Ok(r) = client.join(request.clone()).await {
                        id = r.into_inner().worker_id;
                    }
                }
                Err(_) => {}
            }
        }
    });
    Ok(id)
}
