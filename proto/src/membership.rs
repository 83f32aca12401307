//! The worker side of the control protocol: join the router, then heartbeat.

use std::time::Duration;

use crate::grpc::control_client::ControlClient;
use crate::grpc::{Heartbeat, JoinRequest, WorkerStats};

/// A worker's load, written by its engine thread and read by its services and heartbeats.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Requests in the running batch.
    pub running: u32,
    /// Requests queued for admission.
    pub waiting: u32,
    /// Requests holding blocks while their KV arrives (decode workers).
    pub awaiting: u32,
    /// Blocks those requests hold.
    pub kv_blocks_reserved: u32,
    /// Free KV blocks.
    pub kv_blocks_free: u32,
    /// All KV blocks.
    pub kv_blocks_total: u32,
    /// Ledger: blocks whose KV is on the wire (decode workers).
    pub kv_blocks_in_flight: u32,
    /// Ledger: blocks of remotely prefilled requests committed to running sequences.
    pub kv_blocks_committed: u32,
    /// Ledger: requests whose blocks were freed, since start.
    pub kv_requests_freed: u64,
    /// Prefill: prompt tokens per second of engine time (moving average over busy steps).
    pub prompt_tokens_per_s: f32,
}

impl Load {
    /// The heartbeat reporting this load (`worker_id` is filled in by [`join`]).
    pub fn heartbeat(&self, transfers_in_flight: u32) -> Heartbeat {
        Heartbeat {
            worker_id: 0,
            running: self.running,
            waiting: self.waiting + self.awaiting,
            kv_blocks_free: self.kv_blocks_free,
            kv_blocks_total: self.kv_blocks_total,
            kv_blocks_reserved: self.kv_blocks_reserved,
            transfers_in_flight,
            kv_blocks_in_flight: self.kv_blocks_in_flight,
            kv_blocks_committed: self.kv_blocks_committed,
            kv_requests_freed: self.kv_requests_freed,
            prompt_tokens_per_s: self.prompt_tokens_per_s,
        }
    }

    /// The `Stats` answer for this load.
    pub fn stats(&self) -> WorkerStats {
        WorkerStats {
            running: self.running,
            waiting: self.waiting,
            kv_blocks_free: self.kv_blocks_free,
            kv_blocks_total: self.kv_blocks_total,
            pending_transfers: self.awaiting,
            kv_blocks_reserved: self.kv_blocks_reserved,
            kv_blocks_in_flight: self.kv_blocks_in_flight,
            kv_blocks_committed: self.kv_blocks_committed,
            kv_requests_freed: self.kv_requests_freed,
        }
    }
}

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
    stats: impl Fn() -> Heartbeat + Send + 'static,
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
                ..stats()
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
