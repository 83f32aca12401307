//! The HTTP surface's limits, each failing as an OpenAI error body: API keys (`[router]
//! api_keys_file`), header and body sizes, the body's deadline; the connection caps are the
//! front's (`front.rs`).

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State as AxState};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

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
    /// Connections one client address may hold at once (more are closed).
    pub max_connections_per_address: usize,
    /// The API keys a request must carry one of (`Authorization: Bearer KEY`); none: open.
    pub api_keys: Option<Arc<HashSet<String>>>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 8 << 20,
            max_header_bytes: 32 << 10,
            max_connections: 1024,
            max_connections_per_address: 256,
            api_keys: None,
        }
    }
}

impl Limits {
    /// The connection caps of the HTTP front.
    pub fn caps(&self) -> crate::front::Caps {
        crate::front::Caps {
            total: self.max_connections,
            per_address: self.max_connections_per_address,
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

/// Middleware of the API's listener: headers within `max_header_bytes`, and, where the router
/// has API keys, a known `Authorization: Bearer` key on everything but `/health`. (What an
/// operator reads — metrics, the status page — is on the operator's own listener.)
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
    let open = req.uri().path() == "/health";
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
    match whole_body(req, limits.max_body_bytes).await {
        Ok(req) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// The request with its body read whole within [`BODY_TIMEOUT`](crate::front::BODY_TIMEOUT)
/// and `limit` bytes: a client trickling its body holds its connection no longer than that.
async fn whole_body(req: Request, limit: usize) -> Result<Request, ApiError> {
    let too_large = || ApiError::PayloadTooLarge(format!("the request body exceeds {limit} bytes"));
    let announced = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if announced.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let (parts, body) = req.into_parts();
    let read = axum::body::to_bytes(body, limit);
    let bytes = match tokio::time::timeout(crate::front::BODY_TIMEOUT, read).await {
        Err(_) => {
            let s = crate::front::BODY_TIMEOUT.as_secs();
            return Err(ApiError::RequestTimeout(format!(
                "the request body did not arrive within {s} s"
            )));
        }
        // Beyond the limit (a chunked body announces no length), or the client broke off.
        Ok(Err(e)) => {
            let e = e.into_inner();
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                return Err(too_large());
            }
            return Err(ApiError::BadRequest(format!(
                "the request body could not be read: {e}"
            )));
        }
        Ok(Ok(b)) => b,
    };
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
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
