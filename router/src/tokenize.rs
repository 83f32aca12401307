//! The tokenizer endpoints vLLM serves, which evaluation harnesses use to count tokens with the
//! served model's own tokenizer (lm-evaluation-harness's `remote` tokenizer backend):
//! `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State as AxState;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use crate::guard;
use crate::http::parse;
use crate::openai::ApiError;
use crate::State;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    prompt: String,
    #[serde(default)]
    model: Option<String>,
    /// Add the model's beginning-of-sequence token, where it has one (default: yes).
    #[serde(default = "yes")]
    add_special_tokens: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
    #[serde(default)]
    model: Option<String>,
}

/// The request body, within the size limit and for the served model.
fn read<T: serde::de::DeserializeOwned>(
    state: &State,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    model: impl Fn(&T) -> Option<&str>,
) -> Result<T, ApiError> {
    let body = guard::body(body, state.limits.max_body_bytes)?;
    let req: T = parse(headers, &body)?;
    match model(&req) {
        Some(m) if m != state.model_id => Err(state.unknown_model(m)),
        _ => Ok(req),
    }
}

/// `POST /tokenize`: `{"prompt": text}` → `{"tokens": [...], "count": n, "max_model_len": ctx}`.
pub async fn tokenize(
    AxState(state): AxState<Arc<State>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || {
        let req = read(&state, &headers, body, |r: &TokenizeRequest| {
            r.model.as_deref()
        })?;
        let ids = state
            .tokenizer
            .encode_with(&req.prompt, req.add_special_tokens)
            .map_err(|e| ApiError::BadRequest(e.to_string()))?;
        Ok::<_, ApiError>(Json(
            json!({"tokens": ids, "count": ids.len(), "max_model_len": state.context_len}),
        ))
    };
    run().map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `POST /detokenize`: `{"tokens": [...]}` → `{"prompt": text}`.
pub async fn detokenize(
    AxState(state): AxState<Arc<State>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = || {
        let req = read(&state, &headers, body, |r: &DetokenizeRequest| {
            r.model.as_deref()
        })?;
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= state.vocab_size) {
            return Err(ApiError::BadRequest(format!(
                "token id {bad} is outside the vocabulary of {}",
                state.vocab_size
            )));
        }
        let text = state
            .tokenizer
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::BadRequest(e.to_string()))?;
        Ok(Json(json!({ "prompt": text })))
    };
    run().map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `GET /tokenizer_info`: the special tokens, the chat template and the context length.
pub async fn tokenizer_info(AxState(state): AxState<Arc<State>>) -> Json<serde_json::Value> {
    let (bos, eos) = state.tokenizer.special_tokens();
    Json(json!({
        "tokenizer_class": "tandem",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": null,
        "chat_template": state.tokenizer.chat_template(),
        "model_max_length": state.context_len,
    }))
}
