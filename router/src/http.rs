//! The HTTP endpoints: `/v1/chat/completions`, `/v1/completions` (requests validated here,
//! answered by [`crate::response`]), `/v1/models`, `/health`,
//! and `/debug/workers` (live per-worker KV and queue figures).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State as AxState;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::sampler::Constraint;
use engine::{ChatMessage, SamplingParams};
use proto::grpc;
use proto::Pool;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::guard;
use crate::openai::{self, ApiError, ChatRequest, Common, CompletionRequest, Prompt, Stop};
use crate::response::{self, Kind};
use crate::State;

/// Default `max_tokens` when a request gives none (bounded by the context).
const DEFAULT_MAX_TOKENS: usize = 1024;

pub(crate) fn parse<T: DeserializeOwned>(headers: &HeaderMap, body: &Bytes) -> Result<T, ApiError> {
    let ct = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !ct.starts_with("application/json") {
        return Err(ApiError::UnsupportedMediaType(format!(
            "expected Content-Type: application/json, got {ct:?}"
        )));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
}

/// What a request asks for once validated and tokenised.
pub(crate) struct Prepared {
    pub(crate) prompt: Vec<u32>,
    pub(crate) params: SamplingParams,
    pub(crate) stops: Vec<String>,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// The prompt's text and tokens, when the response starts with them (`echo`).
    pub(crate) echo: Option<(String, Vec<u32>)>,
    /// Choices to return.
    pub(crate) n: usize,
    /// Choices to generate (at least `n`): the `n` likeliest are returned.
    pub(crate) best_of: usize,
    /// Whether the client asked for log-probabilities (`best_of` needs them either way).
    pub(crate) report_logprobs: bool,
}

/// Most choices one request may ask for (`n`).
const MAX_N: i64 = 16;

fn prepare(
    state: &State,
    c: &Common,
    prompt: Vec<u32>,
    logprobs: Option<usize>,
) -> Result<Prepared, ApiError> {
    if let Some(m) = c.model.as_ref().filter(|m| **m != state.model_id) {
        return Err(state.unknown_model(m));
    }
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::BadRequest(format!(
            "n must be between 1 and {MAX_N}, got {n}"
        )));
    }
    let max_tokens = max_tokens(c, &prompt, state.context_len)?;
    let stops = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) if v.len() <= 4 => v.clone(),
        Some(Stop::Many(_)) => return Err(ApiError::BadRequest("at most 4 stop sequences".into())),
    };
    let params = sampling(state, c, max_tokens, logprobs)?;
    params
        .validate()
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    Ok(Prepared {
        prompt,
        params,
        stops,
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        echo: None,
        n: n as usize,
        best_of: n as usize,
        report_logprobs: logprobs.is_some(),
    })
}

/// The tokens a request may generate: its `max_tokens` (or `max_completion_tokens`) within
/// what the context leaves after the prompt, or as many as the default allows.
fn max_tokens(c: &Common, prompt: &[u32], ctx: usize) -> Result<usize, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::BadRequest("the prompt is empty".into()));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::BadRequest(format!(
            "the prompt has {} tokens; the model's context is {ctx} tokens",
            prompt.len()
        )));
    }
    let room = ctx - prompt.len();
    match c.max_completion_tokens.or(c.max_tokens) {
        None => Ok(DEFAULT_MAX_TOKENS.min(room)),
        Some(m) if m < 1 => Err(ApiError::BadRequest(format!("max_tokens must be at least 1, got {m}"))),
        Some(m) if m as u64 > room as u64 => Err(ApiError::BadRequest(format!(
            "max_tokens is {m}, but the prompt has {} tokens and the context is {ctx}: at most {room} can be generated",
            prompt.len()
        ))),
        Some(m) => Ok(m as usize),
    }
}

/// The request's sampling parameters, each checked against its range.
fn sampling(
    state: &State,
    c: &Common,
    max_tokens: usize,
    logprobs: Option<usize>,
) -> Result<SamplingParams, ApiError> {
    let bad = |m: String| Err(ApiError::BadRequest(m));
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return bad(format!(
            "temperature must be between 0 and 2, got {temperature}"
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad(format!("top_p must be in (0, 1], got {top_p}"));
    }
    let top_k = c.top_k.unwrap_or(0);
    if top_k < 0 {
        return bad(format!("top_k must be non-negative, got {top_k}"));
    }
    let min_tokens = c.min_tokens.unwrap_or(0);
    if min_tokens < 0 {
        return bad(format!("min_tokens must be non-negative, got {min_tokens}"));
    }
    Ok(SamplingParams {
        max_tokens: Some(max_tokens),
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k: top_k as usize,
        seed: c.seed.unwrap_or(0) as u64,
        stop_token_ids: stop_token_ids(c, state.vocab_size)?,
        ignore_eos: c.ignore_eos,
        presence_penalty: c.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0) as f32,
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0) as f32,
        logit_bias: logit_bias(c, state.vocab_size)?,
        min_p: c.min_p.unwrap_or(0.0) as f32,
        min_tokens: min_tokens as usize,
        generated: 0,
        logprobs,
        prompt_logprobs: None,
        constraint: constraint(c)?,
        cache_salt: cache_salt(c)?,
        speculation: speculation(c)?,
    })
}

/// `speculation`: 0..=[`engine::sampler::MAX_SPECULATION`] drafts a step.
fn speculation(c: &Common) -> Result<Option<usize>, ApiError> {
    let max = engine::sampler::MAX_SPECULATION as i64;
    match c.speculation {
        Some(k) if !(0..=max).contains(&k) => Err(ApiError::BadRequest(format!(
            "speculation must be between 0 and {max} drafts, got {k}"
        ))),
        k => Ok(k.map(|k| k as usize)),
    }
}

/// The longest `cache_salt` accepted, in bytes.
const MAX_CACHE_SALT: usize = 256;

/// `cache_salt`: a non-empty string of at most [`MAX_CACHE_SALT`] bytes.
fn cache_salt(c: &Common) -> Result<Option<String>, ApiError> {
    match c.cache_salt.as_deref() {
        Some(s) if s.is_empty() || s.len() > MAX_CACHE_SALT => Err(ApiError::BadRequest(format!(
            "cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} bytes"
        ))),
        salt => Ok(salt.map(String::from)),
    }
}

/// The grammar the output must match: `response_format` or one of the `guided_*` extensions
/// (at most one). Whether it compiles is the decode worker's to say (a 400 from there).
fn constraint(c: &Common) -> Result<Option<Constraint>, ApiError> {
    let bad = |m: String| Err(ApiError::BadRequest(m));
    let format = match &c.response_format {
        None => None,
        Some(f) => match f["type"].as_str() {
            Some("text") => None,
            Some("json_object") => Some(Constraint::JsonSchema(json!({"type": "object"}))),
            Some("json_schema") => match f["json_schema"].get("schema") {
                Some(s) if s.is_object() => Some(Constraint::JsonSchema(s.clone())),
                _ => {
                    return bad(
                        "response_format json_schema needs json_schema.schema, an object".into(),
                    )
                }
            },
            _ => {
                return bad(format!(
                    "response_format type must be text, json_object or json_schema, got {}",
                    f["type"]
                ))
            }
        },
    };
    let all = [
        format,
        c.guided_json.clone().map(Constraint::JsonSchema),
        c.guided_regex.clone().map(Constraint::Regex),
        c.guided_choice.clone().map(Constraint::Choice),
    ];
    let mut given = all.into_iter().flatten();
    let first = given.next();
    if given.next().is_some() {
        return bad(
            "give at most one of response_format, guided_json, guided_regex and guided_choice"
                .into(),
        );
    }
    Ok(first)
}

/// The most `stop_token_ids` a request may carry.
const MAX_STOP_TOKEN_IDS: usize = 256;

/// `stop_token_ids`, at most [`MAX_STOP_TOKEN_IDS`], checked against the vocabulary.
fn stop_token_ids(c: &Common, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let ids = c.stop_token_ids.clone().unwrap_or_default();
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::BadRequest(format!(
            "stop_token_ids: {} ids, at most {MAX_STOP_TOKEN_IDS} allowed",
            ids.len()
        )));
    }
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(bad) => Err(ApiError::BadRequest(format!(
            "stop_token_ids: token id {bad} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(ids),
    }
}

/// `logit_bias`'s token ids (strings, as OpenAI's clients send them) read and checked against
/// the vocabulary.
fn logit_bias(c: &Common, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = &c.logit_bias else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(k, &b)| match k.parse::<u32>() {
            Ok(t) if (t as usize) < vocab => Ok((t, b as f32)),
            _ => Err(ApiError::BadRequest(format!(
                "logit_bias keys must be token ids below the vocabulary size {vocab}, got {k:?}"
            ))),
        })
        .collect()
}

/// A 400 for a text of `bytes` that cannot fit the model's context whatever its tokens (each
/// token is at most [`State::max_token_bytes`] long): refused before any time goes into
/// tokenising it.
fn fits(state: &State, bytes: usize) -> Result<(), ApiError> {
    let most = state.context_len.saturating_mul(state.max_token_bytes);
    if bytes > most {
        return Err(ApiError::BadRequest(format!(
            "the prompt is {bytes} bytes: more than the model's context of {} tokens can hold",
            state.context_len
        )));
    }
    Ok(())
}

/// `f` — rendering a template, tokenising a prompt: work that grows with the request — on the
/// blocking pool, at most [`crate::TOKENIZING`] at once, never on the runtime's threads, which
/// carry heartbeats and every stream's tokens.
async fn off_runtime<T: Send + 'static>(
    state: &Arc<State>,
    f: impl FnOnce(&State) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let _slot = state.tokenizing.acquire().await.expect("never closed");
    let st = state.clone();
    tokio::task::spawn_blocking(move || f(&st))
        .await
        .map_err(|e| ApiError::Internal(format!("tokenising: {e}")))?
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    AxState(state): AxState<Arc<State>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let start = Instant::now();
    let run = async {
        let body = guard::body(body, state.limits.max_body_bytes)?;
        if let Some(peer) = state.peers.for_body(&body) {
            let path = "/v1/chat/completions";
            return Ok(state.peers.forward(peer, path, &headers, body).await);
        }
        let req: ChatRequest = parse(&headers, &body)?;
        refuse_tools(&state, &req.extra)?;
        openai::refuse_unsupported(&req.extra)?;
        if req.messages.is_empty() {
            return Err(ApiError::BadRequest("messages must not be empty".into()));
        }
        let messages = req
            .messages
            .iter()
            .map(|m| {
                Ok(ChatMessage {
                    role: m.template_role()?.into(),
                    content: m.content.text()?,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        fits(&state, messages.iter().map(|m| m.content.len()).sum())?;
        let ids = off_runtime(&state, move |s| {
            let text = s
                .tokenizer
                .apply_chat_template(&messages, true)
                .map_err(|e| ApiError::BadRequest(e.to_string()))?;
            s.tokenizer
                .encode(&text)
                .map_err(|e| ApiError::Internal(e.to_string()))
        })
        .await?;
        let top = match (req.logprobs, req.top_logprobs) {
            (Some(true), k) if (0..=20).contains(&k.unwrap_or(0)) => Some(k.unwrap_or(0) as usize),
            (Some(true), Some(k)) => {
                return Err(ApiError::BadRequest(format!(
                    "top_logprobs must be between 0 and 20, got {k}"
                )))
            }
            (_, Some(k)) if k != 0 => {
                return Err(ApiError::BadRequest(
                    "top_logprobs needs logprobs: true".into(),
                ))
            }
            _ => None,
        };
        let p = prepare(&state, &req.common, ids, top)?;
        response::respond(state.clone(), p, Kind::Chat, start).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/completions`.
pub async fn completions(
    AxState(state): AxState<Arc<State>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let start = Instant::now();
    let run = async {
        let body = guard::body(body, state.limits.max_body_bytes)?;
        if let Some(peer) = state.peers.for_body(&body) {
            let path = "/v1/completions";
            return Ok(state.peers.forward(peer, path, &headers, body).await);
        }
        let req: CompletionRequest = parse(&headers, &body)?;
        openai::refuse_unsupported(&req.extra)?;
        if let Prompt::Text(t) = &req.prompt {
            fits(&state, t.len())?;
        }
        let asked = req.prompt.clone();
        let (text, ids) = off_runtime(&state, move |s| prompt(s, &asked)).await?;
        let top = match req.logprobs {
            None => None,
            Some(k) if (0..=5).contains(&k) => Some(k as usize),
            Some(k) => {
                return Err(ApiError::BadRequest(format!(
                    "logprobs must be between 0 and 5, got {k}"
                )))
            }
        };
        let mut p = prepare(&state, &req.common, ids, top)?;
        best_of(&mut p, req.best_of)?;
        if req.echo == Some(true) {
            // The prompt's log-probabilities come from the decode worker's own prefill.
            p.params.prompt_logprobs = top;
            let text = match text {
                Some(t) => t,
                None => state
                    .tokenizer
                    .decode(&p.prompt, false)
                    .map_err(|e| ApiError::BadRequest(e.to_string()))?,
            };
            p.echo = Some((text, p.prompt.clone()));
        }
        response::respond(state.clone(), p, Kind::Text, start).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// `tools` (or the older `functions`), when not empty: the model's chat template must render
/// them, or the request is a 400 that says so; parsing tool calls out of the output is not
/// built yet, so a template that renders them gets a 400 naming that instead.
fn refuse_tools(state: &State, extra: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    let asked = ["tools", "functions"].iter().find(|k| {
        extra
            .get(**k)
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
    });
    let Some(key) = asked else { return Ok(()) };
    let renders = state
        .tokenizer
        .chat_template()
        .is_some_and(|t| t.contains("tools"));
    Err(ApiError::BadRequest(match renders {
        false => format!(
            "{key:?}: the chat template of {} does not render tools, so this model cannot be given any",
            state.model_id
        ),
        true => format!("{key:?}: tool calling is not supported by this server yet"),
    }))
}

/// `best_of`: between `n` and [`MAX_N`], not streamed; the choices' log-probabilities are
/// computed (to rank them) even when the client did not ask for them.
fn best_of(p: &mut Prepared, best_of: Option<i64>) -> Result<(), ApiError> {
    let Some(b) = best_of else { return Ok(()) };
    if !(p.n as i64..=MAX_N).contains(&b) {
        return Err(ApiError::BadRequest(format!(
            "best_of must be between n ({}) and {MAX_N}, got {b}",
            p.n
        )));
    }
    if b > p.n as i64 && p.stream {
        return Err(ApiError::BadRequest(
            "best_of above n cannot be streamed".into(),
        ));
    }
    p.best_of = b as usize;
    p.params.logprobs.get_or_insert(0);
    Ok(())
}

/// A completion's prompt as tokens, with its text when it came as text.
fn prompt(state: &State, p: &Prompt) -> Result<(Option<String>, Vec<u32>), ApiError> {
    let encode = |t: &str| {
        let ids = state.tokenizer.encode(t);
        ids.map_err(|e| ApiError::Internal(e.to_string()))
    };
    let ids = |t: &[u32]| match t.iter().find(|&&x| x as usize >= state.vocab_size) {
        Some(bad) => Err(ApiError::BadRequest(format!(
            "token id {bad} is outside the vocabulary"
        ))),
        None => Ok(t.to_vec()),
    };
    let one = || ApiError::BadRequest("exactly one prompt per request".into());
    match p {
        Prompt::Text(t) => Ok((Some(t.clone()), encode(t)?)),
        Prompt::Texts(v) if v.len() == 1 => Ok((Some(v[0].clone()), encode(&v[0])?)),
        Prompt::Tokens(t) => Ok((None, ids(t)?)),
        Prompt::TokenLists(v) if v.len() == 1 => Ok((None, ids(&v[0])?)),
        Prompt::Texts(_) | Prompt::TokenLists(_) => Err(one()),
    }
}

/// `GET /v1/models`: this router's model and the others' it answers for.
pub async fn models(AxState(state): AxState<Arc<State>>) -> Json<Value> {
    let data: Vec<Value> = state
        .served_models()
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "tandem"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `GET /health`: 200 when at least one decode worker (and, when disaggregated, one prefill
/// worker) has joined.
pub async fn health(AxState(state): AxState<Arc<State>>) -> Response {
    let (p, d) = (
        state.registry.count(Pool::Prefill),
        state.registry.count(Pool::Decode),
    );
    let ok = d > 0 && (!state.core.disaggregated || p > 0);
    let code = if ok {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(json!({"status": if ok { "ok" } else { "waiting for workers" }, "prefill_workers": p, "decode_workers": d}))).into_response()
}

/// How long `/debug/workers` waits for one worker's live stats.
const STATS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// `GET /debug/workers`: every worker with its live load (asked now, not from heartbeats).
pub async fn workers(AxState(state): AxState<Arc<State>>) -> Json<Value> {
    let mut out = Vec::new();
    for w in state.registry.workers() {
        let live = async {
            let ch = state.channel(&w.endpoint).ok()?;
            let mut client = grpc::worker_client::WorkerClient::new(ch);
            let call = client.stats(grpc::StatsRequest {});
            let r = tokio::time::timeout(STATS_WAIT, call).await.ok()?;
            r.ok().map(|r| r.into_inner())
        }
        .await;
        let mut v = serde_json::to_value(&w).unwrap_or(Value::Null);
        if let Some(s) = live {
            v["stats"] = serde_json::to_value(s).unwrap_or(Value::Null);
        }
        out.push(v);
    }
    Json(json!({ "workers": out }))
}

/// Any other path.
pub async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::NotFound(format!("no endpoint {}", uri.path())).into_response()
}

/// A path served, with another method.
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let m = format!("{} does not take {method}", uri.path());
    ApiError::MethodNotAllowed(m).into_response()
}

/// `GET /metrics`: Prometheus text — the router's request histograms and counters, KV-transfer
/// counters by transport, and every joined worker's last reported load (one gauge per
/// `WorkerLoad` field).
pub async fn metrics(AxState(state): AxState<Arc<State>>) -> Response {
    metrics::gauge!("tandem_router_kv_index_blocks").set(state.registry.indexed_blocks() as f64);
    for (tier, n) in types::Tier::ALL
        .iter()
        .zip(state.registry.indexed_by_tier())
    {
        let labels = [("tier", tier.name())];
        metrics::gauge!("tandem_router_kv_index_tier_blocks", &labels).set(n as f64);
    }
    let store = state.registry.indexed_store_blocks() as f64;
    metrics::gauge!("tandem_router_kv_index_tier_blocks", "tier" => "store").set(store);
    let nodes = state.registry.store_nodes();
    for source in crate::store_watch::Source::ALL {
        let n = nodes.iter().filter(|n| n.source == source).count();
        metrics::gauge!("tandem_router_store_nodes", "source" => source.name()).set(n as f64);
    }
    for w in state.registry.workers() {
        let labels = [("worker", w.name.clone()), ("role", w.pool.to_string())];
        metrics::gauge!("tandem_worker_in_flight", &labels).set(w.in_flight() as f64);
        let load = serde_json::to_value(&w.load).unwrap_or(Value::Null);
        for &(field, metric, _) in grpc::LOAD_FIELDS {
            let v = load[field].as_f64();
            let v = v
                .or_else(|| load[field].as_bool().map(f64::from))
                .unwrap_or(0.0);
            metrics::gauge!(metric, &labels).set(v);
        }
    }
    match &state.metrics {
        Some(h) => ([("content-type", "text/plain; version=0.0.4")], h.render()).into_response(),
        None => {
            ApiError::Unavailable("metrics are not enabled in this process".into()).into_response()
        }
    }
}
