//! One request's path through the pools: reserve on a decode worker, prefill on a prefill worker
//! (KV goes straight from one to the other), then the decode worker's token stream.
//!
//! The returned channel yields tokens until one carries a finish reason, or an error. Dropping
//! the receiver (the client went away) drops the decode stream and the prefill call, which makes
//! both workers abort the request and free its blocks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::grpc::decode_client::DecodeClient;
use proto::grpc::prefill_client::PrefillClient;
use proto::grpc::{self, generate_event, Finish, GenerateRequest, PrefillRequest};
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::openai::ApiError;
use crate::State;

/// A generated token and, on the last one, why generation ended.
pub type TokenResult = Result<(u32, Finish), ApiError>;

/// How long a request may wait for a decode worker with room before it is refused.
const ADMISSION_WAIT: Duration = Duration::from_secs(30);

fn channel(state: &State, endpoint: &str) -> Result<Channel, ApiError> {
    let mut cache = state.channels.lock().expect("channel cache lock");
    if let Some(c) = cache.get(endpoint) {
        return Ok(c.clone());
    }
    let c = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| ApiError::Internal(format!("bad worker endpoint {endpoint}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy();
    cache.insert(endpoint.to_string(), c.clone());
    Ok(c)
}

/// Whether a gRPC failure means the worker itself is gone or broken.
fn worker_failed(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled | Code::Aborted
    )
}

/// Starts generation of `prompt`; returns the token channel once the first token (or the first
/// error) is known, so that errors before any output can still become an HTTP status.
pub async fn start(
    state: &Arc<State>,
    prompt: Vec<u32>,
    params: grpc::SamplingParams,
) -> Result<(TokenResult, mpsc::Receiver<TokenResult>), ApiError> {
    let id = state.next_request_id();
    let remote = prompt.len() >= 2 && state.registry.count("prefill") > 0;
    let arrived = Instant::now();
    let deadline = arrived + ADMISSION_WAIT;
    let mut full: Vec<u64> = Vec::new();
    // Counted as waiting for a decode worker with room from the first refusal on.
    let mut waiting: Option<WaitingForRoom> = None;
    // A decode worker that accepts the request (and, for a remote prefill, has reserved blocks).
    let (dw, dguard, mut stream) = loop {
        let Some((w, guard)) = state.registry.pick("decode", &full) else {
            if Instant::now() >= deadline {
                return Err(ApiError::Unavailable(
                    if state.registry.count("decode") == 0 {
                        "no decode worker has joined the cluster".into()
                    } else {
                        format!(
                            "no decode worker had room for the request within {ADMISSION_WAIT:?}"
                        )
                    },
                ));
            }
            full.clear();
            waiting.get_or_insert_with(|| WaitingForRoom::new(&state.signals));
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let req = GenerateRequest {
            request_id: id,
            prompt: prompt.clone(),
            params: Some(params.clone()),
            remote_prefill: remote,
        };
        let mut client = DecodeClient::new(channel(state, &w.endpoint)?);
        let opened = match client.generate(req).await {
            Ok(r) => {
                let mut s = r.into_inner();
                if remote {
                    match s.message().await {
                        Ok(Some(grpc::GenerateEvent {
                            event: Some(generate_event::Event::Reserved(_)),
                            ..
                        })) => Ok(s),
                        Ok(other) => Err(Status::internal(format!(
                            "expected a reservation, got {other:?}"
                        ))),
                        Err(e) => Err(e),
                    }
                } else {
                    Ok(s)
                }
            }
            Err(e) => Err(e),
        };
        match opened {
            Ok(s) => break (w, guard, s),
            Err(s) if s.code() == Code::ResourceExhausted => full.push(w.id),
            Err(s) if s.code() == Code::InvalidArgument => {
                return Err(ApiError::BadRequest(s.message().to_string()))
            }
            Err(s) if worker_failed(&s) => {
                tracing::warn!(worker = w.id, "decode worker failed: {s}");
                state.registry.remove(w.id);
            }
            Err(s) => {
                return Err(ApiError::Upstream(format!(
                    "decode worker {}: {}",
                    w.name,
                    s.message()
                )))
            }
        }
    };
    drop(waiting);
    let reserved = Instant::now();
    state
        .signals
        .admission
        .lock()
        .expect("window lock")
        .record(reserved, reserved - arrived);
    // The prefill, sent to the least-loaded prefill worker; its KV goes to `dw` directly.
    let prefill = if remote {
        let (pw, pguard) = state.registry.pick("prefill", &[]).ok_or_else(|| {
            ApiError::Unavailable("no prefill worker has joined the cluster".into())
        })?;
        let mut client = PrefillClient::new(channel(state, &pw.endpoint)?);
        let req = PrefillRequest {
            request_id: id,
            tokens: prompt[..prompt.len() - 1].to_vec(),
            offers: dw.offers.clone(),
        };
        let registry = state.registry.clone();
        let pending = state.signals.prefill_started(req.tokens.len() as u64);
        // Its own task, so that it completes (and is counted) even when the decode stream
        // finishes first; aborted only when the client goes away.
        Some(tokio::spawn(async move {
            let _guard = pguard;
            let _pending = pending;
            let reply = client.prefill(req).await.map(|r| r.into_inner());
            if let Ok(r) = &reply {
                registry.record_transfer(pw.id, r);
                metrics::counter!("tandem_kv_transfers_total", "transport" => r.transport.clone())
                    .increment(1);
                // The negotiation's reason as a label: a fallback from a preferred transport is
                // visible in metrics, not only in a worker's log.
                metrics::counter!("tandem_kv_transport_chosen_total", "transport" => r.transport.clone(), "why" => r.transport_reason.clone())
                    .increment(1);
                metrics::counter!("tandem_kv_transfer_bytes_total", "transport" => r.transport.clone()).increment(r.kv_bytes);
                metrics::histogram!("tandem_kv_exposed_wait_seconds", "transport" => r.transport.clone()).record(r.transfer_us as f64 / 1e6);
            }
            reply.map_err(|s| {
                if worker_failed(&s) && s.message().contains("transport") {
                    registry.remove(pw.id);
                }
                ApiError::Upstream(format!(
                    "prefill on worker {} failed: {}",
                    pw.name,
                    s.message()
                ))
            })
        }))
    } else {
        None
    };
    let (tx, mut rx) = mpsc::channel::<TokenResult>(64);
    let registry = state.registry.clone();
    let dname = dw.name.clone();
    let state2 = state.clone();
    tokio::spawn(async move {
        let _dguard = dguard;
        let mut prefill = prefill;
        let mut started = false;
        let mut last_token: Option<Instant> = None;
        loop {
            let next = tokio::select! {
                _ = tx.closed() => {
                    if let Some(p) = prefill.take() {
                        p.abort();
                    }
                    break;
                }
                r = async { prefill.as_mut().expect("guarded").await }, if prefill.is_some() => {
                    prefill = None;
                    let r = r.unwrap_or_else(|e| Err(ApiError::Internal(format!("prefill task failed: {e}"))));
                    match r {
                        Ok(reply) => {
                            tracing::debug!(request = id, kv_bytes = reply.kv_bytes, compute_us = reply.compute_us, transfer_us = reply.transfer_us, transport = %reply.transport, "prefill done");
                            continue;
                        }
                        Err(e) => {
                            // No token can have been produced without the KV: recompute the
                            // prompt on the decode worker itself instead of failing.
                            match recompute(&state2, &dw, &prompt, &params, &e).await {
                                Ok(s) => {
                                    stream = s;
                                    continue;
                                }
                                Err(e) => Err(e),
                            }
                        }
                    }
                }
                m = stream.message() => match m {
                    Ok(Some(grpc::GenerateEvent { event: Some(generate_event::Event::Token(t)), finish })) => {
                        Ok((t, Finish::try_from(finish).unwrap_or(Finish::None)))
                    }
                    Ok(Some(other)) => Err(ApiError::Upstream(format!("unexpected event from decode worker {dname}: {other:?}"))),
                    Ok(None) => Err(ApiError::Upstream(format!("decode worker {dname} ended the stream before the request finished"))),
                    Err(s) if s.code() == Code::Aborted && remote && !started => {
                        // The decode worker gave up on the KV (the transfer broke or its lease
                        // ran out) before any token: recompute there, whatever the prefill says.
                        if let Some(p) = prefill.take() {
                            p.abort();
                        }
                        let e = ApiError::Upstream(s.message().to_string());
                        match recompute(&state2, &dw, &prompt, &params, &e).await {
                            Ok(s) => {
                                stream = s;
                                continue;
                            }
                            Err(e) => Err(e),
                        }
                    }
                    Err(s) => {
                        if worker_failed(&s) {
                            registry.remove(dw.id);
                        }
                        Err(match s.code() {
                            Code::InvalidArgument => ApiError::BadRequest(s.message().to_string()),
                            _ => ApiError::Upstream(format!("decode worker {dname} failed: {}", s.message())),
                        })
                    }
                },
            };
            let last = !matches!(next, Ok((_, Finish::None)));
            if next.is_ok() {
                // The planner's signals: the prefill pool's share of TTFT, and token gaps.
                let now = Instant::now();
                match last_token {
                    None if remote => state2
                        .signals
                        .prefill_ttft
                        .lock()
                        .expect("window lock")
                        .record(now, now - reserved),
                    None => {}
                    Some(prev) => state2
                        .signals
                        .itl
                        .lock()
                        .expect("window lock")
                        .record(now, now - prev),
                }
                last_token = Some(now);
            }
            started = true;
            if tx.send(next).await.is_err() || last {
                break;
            }
        }
    });
    let first = rx.recv().await.unwrap_or_else(|| {
        Err(ApiError::Internal(
            "the request ended without output".into(),
        ))
    });
    Ok((first, rx))
}

/// Runs a request's whole prompt on its decode worker after the remote prefill or the KV
/// transfer failed (`why`), returning the new token stream.
async fn recompute(
    state: &State,
    dw: &crate::registry::Worker,
    prompt: &[u32],
    params: &grpc::SamplingParams,
    why: &ApiError,
) -> Result<tonic::Streaming<grpc::GenerateEvent>, ApiError> {
    tracing::warn!("{why}; recomputing the prompt on decode worker {}", dw.name);
    metrics::counter!("tandem_kv_transfer_failures_total").increment(1);
    let req = GenerateRequest {
        request_id: state.next_request_id(),
        prompt: prompt.to_vec(),
        params: Some(params.clone()),
        remote_prefill: false,
    };
    let mut client = DecodeClient::new(channel(state, &dw.endpoint)?);
    match client.generate(req).await {
        Ok(r) => Ok(r.into_inner()),
        Err(s) => Err(ApiError::Upstream(format!(
            "{why}; recomputing on decode worker {} failed too: {}",
            dw.name,
            s.message()
        ))),
    }
}

/// A request waiting for a decode worker with room, counted for the planner while it lives.
struct WaitingForRoom(Arc<crate::planner::Signals>);

impl WaitingForRoom {
    fn new(signals: &Arc<crate::planner::Signals>) -> WaitingForRoom {
        signals
            .decode_waiting
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        WaitingForRoom(signals.clone())
    }
}

impl Drop for WaitingForRoom {
    fn drop(&mut self) {
        self.0
            .decode_waiting
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}
