//! A completion's response, whole or streamed as server-sent events: the tokens of its `n`
//! choices turned into text (incremental detokenisation, stop strings, log-probabilities) and
//! put into the OpenAI chat or completions format.
//!
//! An `n > 1` request runs one engine request a choice: the first is routed as any request
//! (its prompt's KV through the prefill pool, when there is one); once its first token is out,
//! the others start on the same decode worker, whose prefix cache holds the prompt's blocks by
//! then, so they compute only the prompt's last partial block. Choice `i` draws with `seed + i`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::text::{StopStrings, StreamDecoder};
use engine::FinishReason;
use futures::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::http::Prepared;
use crate::logprobs::LogprobsOut;
use crate::openai::{ApiError, Usage};
use crate::request::{self, Token, TokenResult};
use crate::State;

/// Which API the response answers.
#[derive(Clone, Copy, PartialEq)]
pub enum Kind {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Text,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        }
    }
}

/// Turns one choice's tokens into text pieces: incremental detokenisation, end-of-turn tokens
/// dropped, stop strings applied.
struct Texter {
    state: Arc<State>,
    index: usize,
    dec: StreamDecoder,
    stops: StopStrings,
    tokens: usize,
    /// When the request arrived, and when the previous token did (for TTFT, ITL, end to end).
    start: Instant,
    last: Option<Instant>,
    /// The tokens' log-probabilities, when the request asked for them.
    lp: Option<LogprobsOut>,
    /// The prompt's text and tokens, until the first token's text starts with them (`echo`).
    echo: Option<(String, Vec<u32>)>,
}

impl Texter {
    fn new(state: &Arc<State>, p: &Prepared, kind: Kind, index: usize, start: Instant) -> Texter {
        Texter {
            state: state.clone(),
            index,
            dec: StreamDecoder::default(),
            stops: StopStrings::new(&p.stops),
            tokens: 0,
            start,
            last: None,
            lp: p
                .report_logprobs
                .then(|| LogprobsOut::new(kind == Kind::Chat)),
            echo: p.echo.clone(),
        }
    }

    /// The text this token adds, and the finish reason if generation ends here; records the
    /// request's latency metrics.
    fn push(&mut self, t: &Token) -> (String, Option<&'static str>) {
        let (tok, finish) = (t.id, t.finish);
        let now = Instant::now();
        match self.last {
            None => {
                metrics::histogram!("tandem_router_ttft_seconds").record(now - self.start);
                let mut w = self.state.signals.ttft.lock().expect("window lock");
                w.record(now, now - self.start);
            }
            Some(prev) => metrics::histogram!("tandem_router_itl_seconds").record(now - prev),
        }
        if t.sent_unix_us > 0 {
            // Another machine's clock may run ahead: a token cannot arrive before it was sent.
            let delay = proto::unix_us(std::time::SystemTime::now()).saturating_sub(t.sent_unix_us);
            metrics::histogram!("tandem_router_token_delay_seconds").record(delay as f64 / 1e6);
        }
        self.last = Some(now);
        let echoed = self.echo.take().map_or_else(String::new, |(text, ids)| {
            if let Some(out) = &mut self.lp {
                out.prompt(&ids, &t.prompt_logprobs, &text, &self.state.tokenizer);
            }
            text
        });
        // One entry a token of the text (an end-of-sequence token that ends it has none).
        let eos =
            finish == Some(FinishReason::Stop) && self.state.tokenizer.stop_ids().contains(&tok);
        if let (Some(out), Some(lp), false) = (&mut self.lp, &t.logprobs, eos) {
            out.push(tok, lp.clone());
        }
        let (text, reason) = self.push_text(tok, finish);
        if let Some(out) = &mut self.lp {
            out.emitted(&text);
        }
        if reason.is_some() {
            metrics::histogram!("tandem_router_e2e_seconds").record(now - self.start);
            metrics::counter!("tandem_router_requests_total", "outcome" => "ok").increment(1);
        }
        (echoed + &text, reason)
    }

    /// The log-probabilities of the tokens pushed since the last call, in the response's
    /// format.
    fn take_logprobs(&mut self) -> Option<Value> {
        let tok = &self.state.tokenizer;
        self.lp.as_mut().and_then(|out| out.take(tok))
    }

    fn push_text(
        &mut self,
        tok: u32,
        finish: Option<FinishReason>,
    ) -> (String, Option<&'static str>) {
        self.tokens += 1;
        let tokenizer = &self.state.tokenizer;
        let stop = Some(FinishReason::Stop);
        let eos = finish == stop && tokenizer.stop_ids().contains(&tok);
        let mut piece = match eos {
            true => String::new(),
            false => self.dec.push(tokenizer, tok).unwrap_or_default(),
        };
        if finish.is_some() {
            piece.push_str(&self.dec.finish(tokenizer).unwrap_or_default());
        }
        let (mut text, stopped) = self.stops.push(&piece);
        if stopped {
            return (text, Some("stop"));
        }
        let f = finish.map(FinishReason::as_str);
        if f.is_some() {
            text.push_str(&self.stops.flush());
        }
        (text, f)
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One choice under way: its text maker, its first token and the rest.
struct Choice {
    texter: Texter,
    first: Token,
    rest: mpsc::Receiver<TokenResult>,
}

/// Runs the request's `n` choices (see the module doc) and answers, whole or streamed.
pub(crate) async fn respond(
    state: Arc<State>,
    p: Prepared,
    kind: Kind,
    start: Instant,
) -> Result<Response, ApiError> {
    let first = request::start(&state, p.prompt.clone(), &p.params).await;
    let pin = first.decode_worker;
    let mut choices = vec![Choice {
        texter: Texter::new(&state, &p, kind, 0, start),
        first: first.first?,
        rest: first.rest,
    }];
    let others = (1..p.best_of).map(|i| {
        let mut params = p.params.clone();
        params.seed = params.seed.wrapping_add(i as u64);
        let (state, prompt) = (state.clone(), p.prompt.clone());
        async move { request::start_on(&state, prompt, &params, pin).await }
    });
    for (i, s) in futures::future::join_all(others)
        .await
        .into_iter()
        .enumerate()
    {
        choices.push(Choice {
            texter: Texter::new(&state, &p, kind, i + 1, start),
            first: s.first?,
            rest: s.rest,
        });
    }
    let chunks = Chunks {
        id: format!("{}-{}", kind.id_prefix(), uuidish()),
        kind,
        created: now(),
        model: state.model_id.clone(),
        prompt_tokens: p.prompt.len(),
    };
    if !p.stream {
        let body = whole(chunks, choices, p.n).await?;
        return Ok(Json(body).into_response());
    }
    Ok(Sse::new(sse(chunks, choices, p.include_usage)).into_response())
}

/// A choice once it has ended.
struct Ended {
    text: String,
    reason: &'static str,
    logprobs: Value,
    tokens: usize,
    /// The mean log-probability of its tokens (0 without them).
    mean_logprob: f64,
}

/// Runs one choice to its end.
async fn finish(mut c: Choice) -> Result<Ended, ApiError> {
    let mut sum = 0.0;
    let lp = |t: &Token| t.logprobs.as_ref().map_or(0.0, |l| l.logprob as f64);
    sum += lp(&c.first);
    let (mut text, mut reason) = c.texter.push(&c.first);
    while reason.is_none() {
        let t = c
            .rest
            .recv()
            .await
            .unwrap_or_else(|| Err(ApiError::Internal("token stream ended early".into())))?;
        sum += lp(&t);
        let (piece, r) = c.texter.push(&t);
        text.push_str(&piece);
        reason = r;
    }
    let tokens = c.texter.tokens;
    Ok(Ended {
        text,
        reason: reason.unwrap_or("stop"),
        logprobs: c.texter.take_logprobs().unwrap_or(Value::Null),
        tokens,
        mean_logprob: sum / tokens.max(1) as f64,
    })
}

/// A non-streamed response: every choice's tokens, then one body with the `n` likeliest
/// (all of them unless `best_of` asked for more).
async fn whole(c: Chunks, choices: Vec<Choice>, n: usize) -> Result<Value, ApiError> {
    let done = futures::future::join_all(choices.into_iter().map(finish)).await;
    let mut ended = done.into_iter().collect::<Result<Vec<Ended>, ApiError>>()?;
    // Every generated token is billed, as OpenAI does for best_of.
    let tokens = ended.iter().map(|e| e.tokens).sum();
    if ended.len() > n {
        ended.sort_by(|a, b| b.mean_logprob.total_cmp(&a.mean_logprob));
        ended.truncate(n);
    }
    let mut out = Vec::new();
    for (index, e) in ended.into_iter().enumerate() {
        let (text, reason, lp) = (e.text, e.reason, e.logprobs);
        out.push(match c.kind {
            Kind::Chat => {
                json!({"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": lp})
            }
            Kind::Text => {
                json!({"index": index, "text": text, "finish_reason": reason, "logprobs": lp})
            }
        });
    }
    let object = match c.kind {
        Kind::Chat => "chat.completion",
        Kind::Text => "text_completion",
    };
    Ok(
        json!({"id": c.id, "object": object, "created": c.created, "model": c.model, "choices": out, "usage": c.usage(tokens)}),
    )
}

fn uuidish() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{:x}{:04x}",
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        N.fetch_add(1, Ordering::Relaxed) & 0xffff
    )
}

/// The pieces of one response: its id, kind and the chunks of a stream.
struct Chunks {
    id: String,
    kind: Kind,
    created: u64,
    model: String,
    prompt_tokens: usize,
}

/// What a choice's stream yields: chunks, or the end of the choice with its token count, or
/// the failure that ends the whole stream.
enum Piece {
    Chunk(Event),
    Done(usize),
    Failed(Event),
}

impl Chunks {
    fn usage(&self, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens + completion_tokens,
        }
    }

    /// The stream's object name: the same for every chunk, usage included.
    fn object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text => "text_completion",
        }
    }

    /// A chunk of choice `index` carrying `delta` (chat) or its text (completions), its tokens'
    /// log-probabilities, and the finish reason.
    fn chunk(&self, index: usize, delta: Value, lp: Option<Value>, reason: Option<&str>) -> Event {
        let lp = lp.unwrap_or(Value::Null);
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": index, "delta": delta, "finish_reason": reason, "logprobs": lp})
            }
            Kind::Text => {
                json!({"index": index, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": reason, "logprobs": lp})
            }
        };
        Event::default().data(json!({"id": self.id, "object": self.object(), "created": self.created, "model": self.model, "choices": [choice]}).to_string())
    }

    /// The last chunk before `[DONE]` when the client asked for usage.
    fn usage_chunk(&self, n: usize) -> Event {
        Event::default().data(json!({"id": self.id, "object": self.object(), "created": self.created, "model": self.model, "choices": [], "usage": self.usage(n)}).to_string())
    }

    /// What one token of a choice (or its stream's failure) becomes.
    fn pieces(&self, tx: &mut Texter, next: TokenResult) -> Vec<Piece> {
        let token = match next {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("stream failed: {e}");
                metrics::counter!("tandem_router_requests_total", "outcome" => "stream_error")
                    .increment(1);
                return vec![Piece::Failed(
                    Event::default().event("error").data(e.body().to_string()),
                )];
            }
        };
        let mut out = Vec::new();
        let (text, reason) = tx.push(&token);
        let lp = tx.take_logprobs();
        if !text.is_empty() || lp.is_some() {
            let delta = json!({ "content": text });
            out.push(Piece::Chunk(self.chunk(tx.index, delta, lp, None)));
        }
        if let Some(r) = reason {
            out.push(Piece::Chunk(self.chunk(tx.index, json!({}), None, Some(r))));
            out.push(Piece::Done(tx.tokens));
        }
        out
    }
}

/// One choice's pieces, in order: the chat's opening chunk, then a token at a time.
fn choice_stream(c: Arc<Chunks>, ch: Choice) -> impl Stream<Item = Piece> {
    let opening = (c.kind == Kind::Chat).then(|| {
        let delta = json!({"role": "assistant", "content": ""});
        Piece::Chunk(c.chunk(ch.texter.index, delta, None, None))
    });
    let body = stream::unfold(
        (Some(Ok(ch.first)), false, ch.texter, ch.rest),
        move |(first, done, mut tx, mut rest)| {
            let c = c.clone();
            async move {
                if done {
                    return None;
                }
                let next = match first {
                    Some(t) => t,
                    None => rest.recv().await.unwrap_or_else(|| {
                        Err(ApiError::Internal("token stream ended early".into()))
                    }),
                };
                let pieces = c.pieces(&mut tx, next);
                let done = pieces.iter().any(|p| !matches!(p, Piece::Chunk(_)));
                Some((stream::iter(pieces), (None, done, tx, rest)))
            }
        },
    )
    .flatten();
    stream::iter(opening).chain(body)
}

/// The choices' chunks as they come, then the usage chunk (when asked for) and `[DONE]` once
/// every choice has ended — or an error event and `[DONE]` at the first failure.
fn sse(
    c: Chunks,
    choices: Vec<Choice>,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let c = Arc::new(c);
    let n = choices.len();
    let merged = stream::select_all(
        choices
            .into_iter()
            .map(|ch| choice_stream(c.clone(), ch).boxed()),
    );
    let ended = (0usize, 0usize, false);
    merged
        .scan(ended, move |(finished, tokens, over), piece| {
            if *over {
                return futures::future::ready(None);
            }
            let events = match piece {
                Piece::Chunk(e) => vec![e],
                Piece::Failed(e) => {
                    *over = true;
                    vec![e, Event::default().data("[DONE]")]
                }
                Piece::Done(t) => {
                    (*finished, *tokens) = (*finished + 1, *tokens + t);
                    let mut last = Vec::new();
                    if *finished == n {
                        *over = true;
                        if include_usage {
                            last.push(c.usage_chunk(*tokens));
                        }
                        last.push(Event::default().data("[DONE]"));
                    }
                    last
                }
            };
            futures::future::ready(Some(stream::iter(events.into_iter().map(Ok))))
        })
        .flatten()
}
