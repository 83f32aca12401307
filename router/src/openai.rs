//! OpenAI-compatible request and response bodies, and the one place errors become HTTP.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Every way a request can fail, mapped to an HTTP status and an OpenAI error body in
/// [`ApiError::status`] and nowhere else.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// Malformed or invalid request (400).
    #[error("{0}")]
    BadRequest(String),
    /// No API key, or one this router does not know (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The body is larger than `[router] max_body_bytes` (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// The client did not send its request body in time (408).
    #[error("{0}")]
    RequestTimeout(String),
    /// The headers are larger than `[router] max_header_bytes` (431).
    #[error("{0}")]
    HeadersTooLarge(String),
    /// The request body is not JSON (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// No such endpoint (404).
    #[error("{0}")]
    NotFound(String),
    /// The endpoint exists, not for this method (405).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The named model is not served here (404).
    #[error("{0}")]
    ModelNotFound(String),
    /// No worker can take the request now (503).
    #[error("{0}")]
    Unavailable(String),
    /// A worker failed mid-request (502).
    #[error("{0}")]
    Upstream(String),
    /// The request ran past `[router] request_timeout_ms` (504).
    #[error("{0}")]
    Timeout(String),
    /// A bug or an unexpected failure (500).
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// HTTP status, OpenAI error type and code.
    pub fn status(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            ApiError::BadRequest(_) => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_request",
            ),
            ApiError::Unauthorized(_) => (
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
            ),
            ApiError::PayloadTooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "payload_too_large",
            ),
            ApiError::RequestTimeout(_) => (
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "request_timeout",
            ),
            ApiError::HeadersTooLarge(_) => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "invalid_request_error",
                "headers_too_large",
            ),
            ApiError::UnsupportedMediaType(_) => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                "unsupported_media_type",
            ),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "invalid_request_error", "not_found"),
            ApiError::MethodNotAllowed(_) => (
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "method_not_allowed",
            ),
            ApiError::ModelNotFound(_) => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
            ),
            ApiError::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "unavailable",
            ),
            ApiError::Upstream(_) => (StatusCode::BAD_GATEWAY, "server_error", "upstream_error"),
            ApiError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "server_error", "timeout"),
            ApiError::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal_error",
            ),
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> serde_json::Value {
        let (_, ty, code) = self.status();
        json!({ "error": { "message": self.to_string(), "type": ty, "param": null, "code": code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, _, _) = self.status();
        let outcome = if status.is_client_error() {
            "client_error"
        } else {
            "server_error"
        };
        metrics::counter!("tandem_router_requests_total", "outcome" => outcome).increment(1);
        (status, axum::Json(self.body())).into_response()
    }
}

/// Text content: a string or a list of `{"type": "text", "text": ...}` parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts (only text parts are accepted).
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// Must be "text".
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: String,
}

impl Content {
    /// The text, or why it is not acceptable.
    pub fn text(&self) -> Result<String, ApiError> {
        match self {
            Content::Text(s) => Ok(s.clone()),
            Content::Parts(ps) => ps
                .iter()
                .map(|p| {
                    if p.kind == "text" {
                        Ok(p.text.as_str())
                    } else {
                        Err(ApiError::BadRequest(format!(
                            "content part type {:?} is not supported (only \"text\")",
                            p.kind
                        )))
                    }
                })
                .collect(),
        }
    }
}

/// A chat message in a request.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// "system", "user", "assistant" ("developer" is read as "system").
    pub role: String,
    /// The content.
    pub content: Content,
}

impl Message {
    /// The role the chat template sees, or why the role is refused.
    pub fn template_role(&self) -> Result<&'static str, ApiError> {
        match self.role.as_str() {
            "system" | "developer" => Ok("system"),
            "user" => Ok("user"),
            "assistant" => Ok("assistant"),
            other => Err(ApiError::BadRequest(format!(
                "message role {other:?} is not supported (system, user, assistant, developer)"
            ))),
        }
    }
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct StreamOptions {
    /// Send a last chunk with token usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and length fields shared by both endpoints.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct Common {
    /// Model name.
    pub model: Option<String>,
    /// Stream as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Same, newer name.
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// Top-k (extension).
    pub top_k: Option<i64>,
    /// Seed.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Number of choices (only 1).
    pub n: Option<i64>,
    /// Keep going past end-of-sequence (extension).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Penalty on tokens the output holds, -2..=2.
    pub presence_penalty: Option<f64>,
    /// Penalty per occurrence in the output, -2..=2.
    pub frequency_penalty: Option<f64>,
    /// Divides the logits of tokens seen in the prompt or output (extension, > 0).
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string, as OpenAI's clients send it) to a bias of -100..=100.
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// Drop tokens less likely than this times the likeliest (extension, 0..=1).
    pub min_p: Option<f64>,
    /// Tokens generated before a stop or end-of-sequence token may end the output (extension).
    pub min_tokens: Option<i64>,
    /// Token ids that end the output, besides the model's (extension).
    pub stop_token_ids: Option<Vec<u32>>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}`.
    pub response_format: Option<serde_json::Value>,
    /// Extension (vLLM's name): output valid against this JSON schema.
    pub guided_json: Option<serde_json::Value>,
    /// Extension: output matching this regular expression.
    pub guided_regex: Option<String>,
    /// Extension: output exactly one of these texts.
    pub guided_choice: Option<Vec<String>>,
    /// vLLM's `cache_salt`: the prompt's cached KV is shared only with requests of the same
    /// salt (one per tenant), in the workers' prefix caches and the router's KV index.
    pub cache_salt: Option<String>,
    /// Extension: most drafts a decode step verifies for this request (prompt-lookup
    /// speculative decoding, 0..=16; 0: off; unset: the decode pool's default). Never changes
    /// a token.
    pub speculation: Option<i64>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Report each token's log-probability.
    pub logprobs: Option<bool>,
    /// And those of this many likeliest tokens (0..=20; needs `logprobs`).
    pub top_logprobs: Option<i64>,
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
    /// Every other field, refused unless harmless ([`refuse_unsupported`]).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// `prompt`: a string, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// One text in a list.
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Token ids, one prompt in a list (as evaluation harnesses send them).
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Report each token's log-probability and those of this many likeliest tokens (0..=5).
    pub logprobs: Option<i64>,
    /// Start the text with the prompt (and, with `logprobs`, the log-probabilities with the
    /// prompt's tokens).
    #[serde(default)]
    pub echo: Option<bool>,
    /// Generate this many choices and return the `n` likeliest (highest mean token
    /// log-probability); not streamed.
    pub best_of: Option<i64>,
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
    /// Every other field, refused unless harmless ([`refuse_unsupported`]).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// OpenAI parameters this server does not implement, with the value each may take that asks
/// for nothing (a client sending its default is served; any other value is a 400, never
/// silently ignored).
const UNSUPPORTED: &[(&str, fn(&serde_json::Value) -> bool)] = &[
    ("suffix", |v| v == &json!("")),
    ("tools", |v| v.as_array().is_some_and(|a| a.is_empty())),
    ("tool_choice", |v| v == &json!("none")),
    ("parallel_tool_calls", |_| true),
    ("functions", |v| v.as_array().is_some_and(|a| a.is_empty())),
    ("function_call", |v| v == &json!("none")),
];

/// Fields that carry no instruction to the model: accepted and not used.
const METADATA: &[&str] = &["user", "metadata", "store", "service_tier"];

/// Refuses a request with a parameter this server does not implement (unless it asks for
/// nothing, or is null) or does not know.
pub fn refuse_unsupported(
    extra: &serde_json::Map<String, serde_json::Value>,
) -> Result<(), ApiError> {
    for (key, value) in extra {
        if value.is_null() || METADATA.contains(&key.as_str()) {
            continue;
        }
        match UNSUPPORTED.iter().find(|(k, _)| k == key) {
            Some((_, neutral)) if neutral(value) => {}
            Some(_) => {
                return Err(ApiError::BadRequest(format!(
                    "the parameter {key:?} is not supported by this server (value {value})"
                )))
            }
            None => return Err(ApiError::BadRequest(format!("unknown parameter {key:?}"))),
        }
    }
    Ok(())
}

/// Token counts.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Both.
    pub total_tokens: usize,
}
