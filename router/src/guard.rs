//! The HTTP surface's limits, each failing as an OpenAI error body: API keys (`[router]
//! api_keys_file`), header and body sizes, and the number of connections served at once.

use std::collections::HashSet;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State as AxState};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::openai::ApiError;
use crate::State;

/// The HTTP limits of a router.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Largest sum of header names and values.
    pub max_header_bytes: usize,
    /// Connections served at once (more wait to be accepted).
    pub max_connections: usize,
    /// The API keys a request must carry one of (`Authorization: Bearer KEY`); none: open.
    pub api_keys: Option<Arc<HashSet<String>>>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 8 << 20,
            max_header_bytes: 32 << 10,
            max_connections: 1024,
            api_keys: None,
        }
    }
}

/// Reads an API keys file: one key per line; blank lines and `#` comments skipped.
pub fn read_api_keys(text: &str) -> HashSet<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

/// A request body, or why there is none: too large is a 413, anything else a 400.
pub fn body(b: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    b.map_err(|r| match r.status() {
        StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::PayloadTooLarge(format!("the request body exceeds {limit} bytes"))
        }
        _ => ApiError::BadRequest(format!("the request body could not be read: {r}")),
    })
}

/// Whether `given` is one of `keys`: the SHA-256 of each key compared with the given one's,
/// every byte of every key (no early exit, and no length compared, that would time it).
fn known_key(keys: &HashSet<String>, given: &str) -> bool {
    let sha = |s: &str| ring::digest::digest(&ring::digest::SHA256, s.as_bytes());
    let given = sha(given);
    keys.iter().fold(false, |found, k| {
        let k = sha(k);
        let diff = k
            .as_ref()
            .iter()
            .zip(given.as_ref())
            .fold(0u8, |d, (a, b)| d | (a ^ b));
        found | (diff == 0)
    })
}

/// The key of an `Authorization: Bearer KEY` header (the scheme in any case).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, key) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(key)
}

/// Middleware: headers within `max_header_bytes`, and, where the router has API keys, a known
/// `Authorization: Bearer` key on everything but `/health`, `/metrics` (and its workers'
/// discovery, `/prometheus/targets`) and the status page (`/`, `/status`, `/status.json`: what
/// an operator reads, like the metrics).
pub async fn check(AxState(state): AxState<Arc<State>>, req: Request, next: Next) -> Response {
    let limits = &state.limits;
    let size: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if size > limits.max_header_bytes {
        let max = limits.max_header_bytes;
        return ApiError::HeadersTooLarge(format!("the request's headers exceed {max} bytes"))
            .into_response();
    }
    let open = matches!(
        req.uri().path(),
        "/health" | "/metrics" | "/prometheus/targets" | "/" | "/status" | "/status.json"
    );
    if let (Some(keys), false) = (&limits.api_keys, open) {
        let given = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(bearer);
        match given {
            None => {
                let m = "an API key is required (Authorization: Bearer KEY)";
                return ApiError::Unauthorized(m.into()).into_response();
            }
            Some(k) if !known_key(keys, k.trim()) => {
                return ApiError::Unauthorized("the API key is not valid".into()).into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

/// A TCP listener that serves at most `max` connections at once: the next is accepted only
/// when one closes (the kernel's backlog holds the rest).
pub struct Limited {
    inner: TcpListener,
    permits: Arc<Semaphore>,
}

impl Limited {
    /// Wraps `inner`.
    pub fn new(inner: TcpListener, max: usize) -> Limited {
        Limited {
            inner,
            permits: Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))),
        }
    }
}

/// A connection counted against its listener's limit until dropped.
pub struct Counted {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl axum::serve::Listener for Limited {
    type Io = Counted;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Counted, std::net::SocketAddr) {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    return (
                        Counted {
                            stream,
                            _permit: permit,
                        },
                        addr,
                    );
                }
                // As axum's own listener does: a failed accept (e.g. out of descriptors) is
                // logged and retried after a pause, never fatal.
                Err(e) => {
                    tracing::warn!("accepting an HTTP connection failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_keys_are_read_a_line_each_and_compared_whole() {
        let keys = read_api_keys("# team a\nsk-one\n\n  sk-two  \n");
        assert_eq!(keys.len(), 2);
        assert!(known_key(&keys, "sk-one") && known_key(&keys, "sk-two"));
        assert!(!known_key(&keys, "sk-on") && !known_key(&keys, "sk-one2"));
        assert!(!known_key(&keys, ""));
    }

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        assert_eq!(bearer("Bearer sk-one"), Some("sk-one"));
        assert_eq!(bearer("bearer sk-one"), Some("sk-one"));
        assert_eq!(bearer("BEARER sk-one"), Some("sk-one"));
        assert_eq!(bearer("Basic sk-one"), None);
        assert_eq!(bearer("sk-one"), None);
    }
}
