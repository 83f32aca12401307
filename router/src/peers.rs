//! Other models' routers this one answers for (`[router] models` in cluster.toml): a request
//! that names one of those models is passed to its router as it came — path, body, content
//! type, API key — and the answer comes back as it goes, streams included. One HTTP address
//! serves every model; each model keeps its own router, pools, planner and SLOs (its own
//! cluster.toml).

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use crate::openai::ApiError;

/// The other models' routers, by model name.
#[derive(Default)]
pub struct Peers {
    by_name: BTreeMap<String, String>,
    client: reqwest::Client,
}

impl Peers {
    /// Routers at `host:port` by model name; a proxied read waits at most `read_timeout` for
    /// the peer's next bytes.
    pub fn new(models: &[(String, String)], read_timeout: Duration) -> Peers {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(read_timeout)
            .build()
            .expect("an HTTP client");
        Peers {
            by_name: models.iter().cloned().collect(),
            client,
        }
    }

    /// The other models' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// The router of the model a JSON body names, when it is one of the others.
    pub fn for_body(&self, body: &[u8]) -> Option<(&str, &str)> {
        // Without other models, no request body is read twice.
        if self.by_name.is_empty() {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        let name = v.get("model")?.as_str()?;
        self.by_name
            .get_key_value(name)
            .map(|(n, a)| (n.as_str(), a.as_str()))
    }

    /// Passes a request for `model` on to its router at `addr`; its answer is the peer's, the
    /// body streamed through. A peer that cannot be reached is a 502.
    pub async fn forward(
        &self,
        (model, addr): (&str, &str),
        path: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Response {
        let mut req = self.client.post(format!("http://{addr}{path}")).body(body);
        for name in ["content-type", "authorization", "accept"] {
            if let Some(v) = headers.get(name) {
                req = req.header(name, v.as_bytes());
            }
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                let m = format!("the router of model {model:?} at {addr} did not answer: {e}");
                return ApiError::Upstream(m).into_response();
            }
        };
        metrics::counter!("tandem_router_forwarded_total", "model" => model.to_string())
            .increment(1);
        let status =
            StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let content_type = resp.headers().get("content-type").cloned();
        let stream = resp
            .bytes_stream()
            .map(|r| r.map_err(std::io::Error::other));
        let mut out = Response::new(Body::from_stream(stream));
        *out.status_mut() = status;
        if let Some(ct) = content_type.and_then(|v| v.to_str().ok().map(String::from)) {
            if let Ok(v) = ct.parse() {
                out.headers_mut().insert("content-type", v);
            }
        }
        out
    }
}
