//! `tandem bench load`: an open-loop load generator against any OpenAI-compatible endpoint.
//!
//! Requests arrive on a schedule — Poisson at a fixed rate, or replayed from a trace in the
//! Mooncake JSONL format (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
//! 512-token blocks; requests sharing hash ids get identical prompt prefixes) with time and
//! length scaling — whether or not earlier ones have finished. Each streams a completion of
//! token-id prompts with `ignore_eos`, so lengths are exact. Reports TTFT, ITL and end-to-end
//! percentiles, throughput and goodput (requests meeting both SLOs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use types::sum::{fnv1a, FNV_OFFSET};

/// Arguments of `tandem bench load`.
#[derive(Args, Debug)]
pub struct LoadArgs {
    /// The router's address (host:port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: String,
    /// The router's operator address (host:port; `router.operator`), where the workers' prompt
    /// tokens and prefix-cache hits are read before and after the run.
    #[arg(long, default_value = "127.0.0.1:8002")]
    operator: String,
    /// Model name to send.
    #[arg(long, default_value = "SmolLM2-135M-Instruct.Q4_1")]
    model: String,
    #[command(flatten)]
    work: Workload,
}

/// The load and its targets: what `tandem bench load` sends and `tandem simulate` replays.
#[derive(Args, Debug, Clone)]
pub struct Workload {
    /// Poisson arrival rate (requests/s) when no trace is given.
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Requests to send (the first N of a trace).
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Prompt tokens per request (without a trace).
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Output tokens per request (without a trace).
    #[arg(long, default_value_t = 32)]
    output_tokens: usize,
    /// Replay this Mooncake-format trace instead.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Start at this request of the trace (its time becomes 0).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Multiply trace timestamps by this (e.g. 0.1 to replay 10x faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Multiply trace lengths by this (to fit a small cluster).
    #[arg(long, default_value_t = 1.0)]
    length_scale: f64,
    /// TTFT target for goodput (a request meets it with its TTFT at most this; `tandem plan`
    /// takes it as --ttft-p90-ms: 90% of requests within it).
    #[arg(long, visible_alias = "ttft-p90-ms", default_value_t = 1000)]
    pub(crate) ttft_slo_ms: u64,
    /// ITL target for goodput (the p90 of a request's gaps at most this).
    #[arg(long, visible_alias = "itl-p90-ms", default_value_t = 100)]
    pub(crate) itl_slo_ms: u64,
    /// Random seed for arrivals and prompts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Modulate the arrival rate over the run: `day` (a 0.3x night, a ramp to a 1.5x peak, a
    /// 3x burst, a 0.6x evening) or `X:MULTIPLIER,...` over the schedule's span (X from 0 to
    /// 1, linear between); every request keeps its prompt and its place in the order.
    #[arg(long, value_name = "PROFILE")]
    rate_profile: Option<crate::profile::RateProfile>,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Also draw the run here (SVG): TTFT and ITL CDFs, throughput and SLO attainment over
    /// time (and a simulation's replicas and planner p90 per pool).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// This run's name in the plot's legends.
    #[arg(long, default_value = "this run")]
    label: String,
    /// Draw an earlier run over this one: LABEL=REPORT.json (its --json; repeatable).
    #[arg(long = "plot-with", value_name = "LABEL=REPORT.json")]
    plot_with: Vec<String>,
}

/// What one request saw (one type for the load generator and the simulator).
pub use sim::Outcome;
/// One request of the load (the simulator's request type: the same schedule either way).
pub use sim::SimRequest as Planned;

/// splitmix64: deterministic prompts and arrivals from the seed.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn token(key: u64, i: u64) -> u32 {
    // Ordinary vocabulary ids (skips the 17 control tokens at the start of SmolLM2's vocabulary).
    100 + (mix(key.wrapping_mul(1_000_003).wrapping_add(i)) % 40_000) as u32
}

/// The requests of a workload: a trace replayed with its scales, or Poisson arrivals.
pub fn plan(a: &Workload) -> Result<Vec<Planned>> {
    // Earlier runs to plot are read now, so a bad one fails before the run, not after.
    for spec in &a.plot_with {
        crate::plot::earlier(spec)?;
    }
    let mut out = Vec::new();
    match &a.trace {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let block = ((512.0 * a.length_scale).round() as usize).max(1);
            let mut t0 = None;
            for (n, line) in text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .enumerate()
                .skip(a.skip)
                .take(a.requests)
            {
                let v: serde_json::Value = serde_json::from_str(line)
                    .with_context(|| format!("{}:{}: not JSON", path.display(), n + 1))?;
                let field = |k: &str| {
                    v[k].as_f64()
                        .ok_or_else(|| anyhow!("{}:{}: missing {k}", path.display(), n + 1))
                };
                let input = ((field("input_length")? * a.length_scale).round() as usize).max(1);
                let output = ((field("output_length")? * a.length_scale).round() as usize).max(1);
                // Shared hash ids give shared prefixes; the tail is unique to the request.
                let mut prompt = Vec::with_capacity(input);
                for h in v["hash_ids"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|h| h.as_u64())
                {
                    prompt.extend((0..block as u64).map(|i| token(h, i)));
                }
                prompt.truncate(input);
                let rest = input - prompt.len();
                prompt.extend((0..rest as u64).map(|i| token(u64::MAX - n as u64, i)));
                let ts = field("timestamp")?;
                let t0 = *t0.get_or_insert(ts);
                out.push(Planned {
                    at: Duration::from_secs_f64((ts - t0) / 1e3 * a.time_scale),
                    prompt,
                    output,
                });
            }
        }
        None => {
            if a.rate <= 0.0 {
                bail!("--rate must be positive");
            }
            let mut t = 0.0;
            for n in 0..a.requests {
                let u = (mix(a.seed ^ (n as u64) << 20) >> 11) as f64 / (1u64 << 53) as f64;
                t += -(1.0 - u).ln() / a.rate;
                let prompt = (0..a.prompt_tokens as u64)
                    .map(|i| token(a.seed.wrapping_add(n as u64), i))
                    .collect();
                out.push(Planned {
                    at: Duration::from_secs_f64(t),
                    prompt,
                    output: a.output_tokens,
                });
            }
        }
    }
    if let Some(profile) = &a.rate_profile {
        let mut at: Vec<Duration> = out.iter().map(|p| p.at).collect();
        profile.apply(&mut at);
        for (p, t) in out.iter_mut().zip(at) {
            p.at = t;
        }
    }
    Ok(out)
}

/// The lines of a streamed body, as they arrive.
struct Lines<S> {
    body: S,
    buf: Vec<u8>,
}

impl<S: futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin> Lines<S> {
    async fn next(&mut self) -> Result<Option<String>> {
        use futures::StreamExt;
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                let line = String::from_utf8_lossy(&line);
                return Ok(Some(line.trim_end_matches(['\r', '\n']).to_string()));
            }
            match self.body.next().await {
                Some(chunk) => self.buf.extend_from_slice(&chunk?),
                None if self.buf.is_empty() => return Ok(None),
                None => {
                    return Ok(Some(
                        String::from_utf8_lossy(&std::mem::take(&mut self.buf)).into(),
                    ))
                }
            }
        }
    }
}

async fn one(
    http: &reqwest::Client,
    addr: SocketAddr,
    model: &str,
    p: &Planned,
    sent: Instant,
) -> Outcome {
    let mut o = Outcome::default();
    let body = serde_json::json!({"model": model, "prompt": p.prompt, "max_tokens": p.output, "ignore_eos": true,
                                  "temperature": 0, "stream": true});
    let run = async {
        let url = format!("http://{addr}/v1/completions");
        let r = http.post(url).json(&body).send().await?;
        let status = r.status();
        if status != reqwest::StatusCode::OK {
            return Err(anyhow!("{status} {}", r.text().await.unwrap_or_default()));
        }
        let mut lines = Lines {
            body: Box::pin(r.bytes_stream()),
            buf: Vec::new(),
        };
        let mut last = None::<Instant>;
        let mut answer = FNV_OFFSET;
        while let Some(l) = lines.next().await? {
            if l.starts_with("event: error") {
                let data = lines.next().await?.unwrap_or_default();
                return Err(anyhow!("error event: {data}"));
            }
            let Some(data) = l.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                break;
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            let text = v["choices"][0]["text"].as_str().unwrap_or_default();
            answer = text.bytes().fold(answer, |h, b| fnv1a(h, b as u64));
            if !text.is_empty() {
                let now = Instant::now();
                match last {
                    None => o.ttft = Some(now - sent),
                    Some(prev) => o.gaps.push(now - prev),
                }
                last = Some(now);
            }
            if let Some(u) = v.get("usage") {
                o.tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
            }
        }
        Ok::<_, anyhow::Error>(answer)
    };
    match run.await {
        Ok(answer) => o.answer = Some(answer),
        Err(e) => o.error = Some(e.to_string()),
    }
    o.e2e = sent.elapsed();
    if o.tokens == 0 {
        o.tokens = o.gaps.len() + o.ttft.is_some() as usize;
    }
    o
}

/// What the engines' prefix caches did: prompt tokens admitted, of those found cached (in the
/// pool or loaded from a tier below it), and blocks loaded from each tier (host memory, disk).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounts {
    /// Prompt tokens the engines admitted.
    pub prompt: u64,
    /// Of those, found cached.
    pub hit: u64,
    /// Blocks loaded back from host memory and from disk.
    pub tier_hits: [u64; 2],
}

impl CacheCounts {
    /// The counts from `before` to `self`.
    fn since(self, before: CacheCounts) -> CacheCounts {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        CacheCounts {
            prompt: d(self.prompt, before.prompt),
            hit: d(self.hit, before.hit),
            tier_hits: [
                d(self.tier_hits[0], before.tier_hits[0]),
                d(self.tier_hits[1], before.tier_hits[1]),
            ],
        }
    }
}

/// The cluster's engines' [`CacheCounts`], summed over the workers (`/debug/workers`); `None`
/// from an endpoint that is not a tandem router.
async fn cache_counts(http: &reqwest::Client, addr: SocketAddr) -> Option<CacheCounts> {
    let url = format!("http://{addr}/debug/workers");
    let v: serde_json::Value = http.get(url).send().await.ok()?.json().await.ok()?;
    let ws = v["workers"].as_array()?;
    let sum = |k: &str| {
        ws.iter()
            .map(|w| w["stats"][k].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    Some(CacheCounts {
        prompt: sum("prompt_tokens"),
        hit: sum("prefix_hit_tokens"),
        tier_hits: [sum("kv_host_hits"), sum("kv_disk_hits")],
    })
}

/// How often the engines' prompt and hit tokens are sampled during a run.
const SAMPLE: Duration = Duration::from_secs(1);

/// The engines' prompt tokens and prefix hits admitted in one sampling interval, summed over
/// the workers, at `t` seconds into the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheSample {
    /// When (seconds since the run started).
    pub t: f64,
    /// Prompt tokens admitted since the previous sample.
    pub prompt: u64,
    /// Of those, found cached.
    pub hit: u64,
}

/// Each worker's (prompt, hit) counters by its id (a restarted worker joins under a new id and
/// counts from zero).
async fn worker_counts(http: &reqwest::Client, addr: SocketAddr) -> Option<Counts> {
    let url = format!("http://{addr}/debug/workers");
    let v: serde_json::Value = http.get(url).send().await.ok()?.json().await.ok()?;
    let ws = v["workers"].as_array()?;
    let count = |w: &serde_json::Value, k: &str| w["stats"][k].as_u64().unwrap_or(0);
    let by_id = ws.iter().filter_map(|w| {
        let c = (count(w, "prompt_tokens"), count(w, "prefix_hit_tokens"));
        Some((w["id"].as_u64()?, c))
    });
    Some(by_id.collect())
}

type Counts = std::collections::HashMap<u64, (u64, u64)>;

/// The (prompt, hit) tokens admitted from `last` to `now` (by worker id): a worker new in
/// `now` counts from zero, one gone from it counts nothing.
fn admitted(last: &Counts, now: &Counts) -> (u64, u64) {
    let (mut prompt, mut hit) = (0, 0);
    for (id, (p, h)) in now {
        let (p0, h0) = last.get(id).copied().unwrap_or_default();
        prompt += p.saturating_sub(p0);
        hit += h.saturating_sub(h0);
    }
    (prompt, hit)
}

/// Samples the engines' counters every [`SAMPLE`] from `t0` until `done`: what each interval
/// admitted (a worker seen first counts from its first sample, or from zero once the run is
/// under way — it joined, or rejoined after a restart, during the run).
async fn sample_cache(
    http: reqwest::Client,
    addr: SocketAddr,
    t0: Instant,
    done: std::sync::Arc<tokio::sync::Notify>,
) -> Vec<CacheSample> {
    let Some(mut last) = worker_counts(&http, addr).await else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut every = tokio::time::interval(SAMPLE);
    every.tick().await;
    loop {
        let stop = tokio::select! {
            _ = every.tick() => false,
            _ = done.notified() => true,
        };
        if let Some(now) = worker_counts(&http, addr).await {
            let (prompt, hit) = admitted(&last, &now);
            out.push(CacheSample {
                t: t0.elapsed().as_secs_f64(),
                prompt,
                hit,
            });
            last = now;
        }
        if stop {
            return out;
        }
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs the load and prints the report.
pub fn run(a: LoadArgs) -> Result<()> {
    let addr: SocketAddr = a
        .addr
        .parse()
        .with_context(|| format!("--addr {:?} is not host:port", a.addr))?;
    let operator: SocketAddr = a
        .operator
        .parse()
        .with_context(|| format!("--operator {:?} is not host:port", a.operator))?;
    let planned = plan(&a.work)?;
    if planned.is_empty() {
        bail!("no requests to send");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let sent_prompt: usize = planned.iter().map(|p| p.prompt.len()).sum();
    let at: Vec<Duration> = planned.iter().map(|p| p.at).collect();
    let http = reqwest::Client::new();
    let before = rt.block_on(cache_counts(&http, operator));
    let (outcomes, elapsed, samples) = rt.block_on(async {
        let t0 = Instant::now();
        let done = std::sync::Arc::new(tokio::sync::Notify::new());
        let sampler = tokio::spawn(sample_cache(http.clone(), operator, t0, done.clone()));
        let mut tasks = Vec::new();
        for p in planned {
            let (model, http) = (a.model.clone(), http.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until((t0 + p.at).into()).await;
                one(&http, addr, &model, &p, Instant::now()).await
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap_or_default());
        }
        let elapsed = t0.elapsed();
        done.notify_one();
        (out, elapsed, sampler.await.unwrap_or_default())
    });
    let after = rt.block_on(cache_counts(&http, operator));
    // The engines' prompt tokens and prefix-cache hits over the run (a tandem router only).
    let cache = before.zip(after).map(|(b, a)| a.since(b));
    let run = Run {
        at: &at,
        outcomes: &outcomes,
        secs: elapsed.as_secs_f64(),
        samples: &samples,
    };
    let report = report(&a.work, &run, sent_prompt, cache);
    finish(&a.work, &report)
}

/// Whether a finished request met both targets: its TTFT, and the p90 of its gaps.
fn meets(a: &Workload, o: &Outcome) -> bool {
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let mut g: Vec<f64> = o.gaps.iter().map(ms).collect();
    o.error.is_none()
        && o.ttft.is_some_and(|t| ms(&t) <= a.ttft_slo_ms as f64)
        && (g.is_empty() || pct(&mut g, 0.9) <= a.itl_slo_ms as f64)
}

/// The distribution at every percent, 0 to 100 (what `--plot` draws as a CDF).
fn cdf(v: &mut [f64]) -> Vec<f64> {
    (0..=100).map(|p| pct(v, p as f64 / 100.0)).collect()
}

/// A finished run: the requests sent at `at` and their outcomes, over `secs`, with the
/// engines' counters sampled during it (none from a simulation or a router that is not
/// tandem's).
pub struct Run<'a> {
    pub at: &'a [Duration],
    pub outcomes: &'a [Outcome],
    pub secs: f64,
    pub samples: &'a [CacheSample],
}

/// The run over time in about 60 bins (at least a second each): output tokens per second by
/// when they arrived, the share of the requests arriving in each bin that met both targets,
/// and the share of the prompt tokens the engines admitted in each bin that were cached.
fn timeline(a: &Workload, r: &Run) -> serde_json::Value {
    let bin = (r.secs / 60.0).max(1.0);
    let n = ((r.secs / bin).ceil() as usize).max(1);
    let index = |t: f64| ((t / bin) as usize).min(n - 1);
    let (mut tokens, mut arrived, mut good) = (vec![0u64; n], vec![0u64; n], vec![0u64; n]);
    for (&t, o) in r.at.iter().zip(r.outcomes) {
        arrived[index(t.as_secs_f64())] += 1;
        good[index(t.as_secs_f64())] += meets(a, o) as u64;
        if let (Some(first), None) = (o.ttft, &o.error) {
            let mut tt = t + first;
            tokens[index(tt.as_secs_f64())] += 1;
            for g in &o.gaps {
                tt += *g;
                tokens[index(tt.as_secs_f64())] += 1;
            }
        }
    }
    let attainment: Vec<Option<f64>> = good
        .iter()
        .zip(&arrived)
        .map(|(&g, &n)| (n > 0).then(|| g as f64 / n as f64))
        .collect();
    let (mut prompt, mut hit) = (vec![0u64; n], vec![0u64; n]);
    for s in r.samples {
        prompt[index(s.t)] += s.prompt;
        hit[index(s.t)] += s.hit;
    }
    let hits: Vec<Option<f64>> = hit
        .iter()
        .zip(&prompt)
        .map(|(&h, &p)| (p > 0).then(|| h as f64 / p as f64))
        .collect();
    serde_json::json!({
        "bin_s": bin,
        "output_tokens_per_s": tokens.iter().map(|&t| t as f64 / bin).collect::<Vec<_>>(),
        "arrived": arrived,
        "slo_attainment": attainment,
        "prefix_hit_ratio": (!r.samples.is_empty()).then_some(hits),
    })
}

/// The report of a run (`tandem-bench-load/3`, documented in README.md): `run`, the prompt
/// tokens sent and the engines' (admitted, cached) prompt tokens.
pub fn report(
    a: &Workload,
    run: &Run,
    sent_prompt: usize,
    cache: Option<CacheCounts>,
) -> serde_json::Value {
    let (outcomes, secs) = (run.outcomes, run.secs);
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let mut ttft: Vec<f64> = ok.iter().filter_map(|o| o.ttft.as_ref().map(ms)).collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|o| o.gaps.iter().map(ms)).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|o| ms(&o.e2e)).collect();
    let good = outcomes.iter().filter(|o| meets(a, o)).count();
    let tokens: usize = ok.iter().map(|o| o.tokens).sum();
    serde_json::json!({
        "format": "tandem-bench-load/3",
        "requests": outcomes.len(), "completed": ok.len(), "errors": outcomes.len() - ok.len(),
        "duration_s": secs, "output_tokens_per_s": tokens as f64 / secs, "requests_per_s": ok.len() as f64 / secs,
        "goodput_requests_per_s": good as f64 / secs,
        "slo_attainment": if outcomes.is_empty() { 0.0 } else { good as f64 / outcomes.len() as f64 },
        "slo": {"ttft_ms": a.ttft_slo_ms, "itl_p90_ms": a.itl_slo_ms},
        "ttft_ms": {"p50": pct(&mut ttft, 0.5), "p90": pct(&mut ttft, 0.9), "p99": pct(&mut ttft, 0.99)},
        "itl_ms": {"p50": pct(&mut itl, 0.5), "p90": pct(&mut itl, 0.9), "p99": pct(&mut itl, 0.99)},
        "e2e_ms": {"p50": pct(&mut e2e, 0.5), "p90": pct(&mut e2e, 0.9), "p99": pct(&mut e2e, 0.99)},
        "ttft_cdf_ms": cdf(&mut ttft), "itl_cdf_ms": cdf(&mut itl),
        "timeline": timeline(a, run),
        "first_error": outcomes.iter().find_map(|o| o.error.clone()),
        "answers": outcomes.iter().map(|o| o.answer.map(|h| format!("{h:016x}"))).collect::<Vec<_>>(),
        "prompt_tokens_sent": sent_prompt,
        "prompt_tokens_admitted": cache.map(|c| c.prompt),
        "prefix_hit_ratio": cache.map(|c| if c.prompt == 0 { 0.0 } else { c.hit as f64 / c.prompt as f64 }),
        "computed_prompt_ratio": cache.map(|c| (c.prompt - c.hit) as f64 / sent_prompt.max(1) as f64),
        "tier_hit_blocks": cache.map(|c| serde_json::json!({"host": c.tier_hits[0], "disk": c.tier_hits[1]})),
    })
}

/// Prints `report` and writes it as JSON where the workload asks.
pub fn finish(a: &Workload, report: &serde_json::Value) -> Result<()> {
    let f = |k: &str| report[k].as_f64().unwrap_or(f64::NAN);
    let n = |k: &str| report[k].as_u64().unwrap_or(0);
    println!(
        "requests {} completed {} errors {} in {:.1} s",
        n("requests"),
        n("completed"),
        n("errors"),
        f("duration_s")
    );
    println!(
        "throughput {:.1} output tokens/s, {:.2} requests/s, goodput {:.2} requests/s (TTFT <= {} ms, ITL p90 <= {} ms)",
        f("output_tokens_per_s"), f("requests_per_s"), f("goodput_requests_per_s"), a.ttft_slo_ms, a.itl_slo_ms
    );
    println!("| metric | p50 | p90 | p99 |\n|---|---:|---:|---:|");
    for k in ["ttft_ms", "itl_ms", "e2e_ms"] {
        let r = &report[k];
        println!(
            "| {k} | {:.1} | {:.1} | {:.1} |",
            r["p50"].as_f64().unwrap_or(f64::NAN),
            r["p90"].as_f64().unwrap_or(f64::NAN),
            r["p99"].as_f64().unwrap_or(f64::NAN)
        );
    }
    if let Some(p) = report["prompt_tokens_admitted"].as_u64() {
        let sent = n("prompt_tokens_sent");
        let h = (f("prefix_hit_ratio") * p as f64).round() as u64;
        println!(
            "prefix cache: {h} of {p} prompt tokens the engines admitted were cached ({:.1}%); \
             they computed {} of the {sent} sent ({:.1}%)",
            100.0 * h as f64 / p.max(1) as f64,
            p - h,
            100.0 * (p - h) as f64 / sent.max(1) as f64
        );
        let tiers = &report["tier_hit_blocks"];
        let (host, disk) = (tiers["host"].as_u64(), tiers["disk"].as_u64());
        if host.unwrap_or(0) + disk.unwrap_or(0) > 0 {
            println!(
                "tier hits: {} blocks loaded from host memory, {} from disk",
                host.unwrap_or(0),
                disk.unwrap_or(0)
            );
        }
    }
    if let Some(e) = report["first_error"].as_str() {
        eprintln!("first error: {e}");
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.plot {
        let mut runs = vec![(a.label.clone(), report.clone())];
        for spec in &a.plot_with {
            runs.push(crate::plot::earlier(spec)?);
        }
        crate::plot::write(p, &runs).with_context(|| format!("writing {}", p.display()))?;
        println!("plot: {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{admitted, Counts};

    #[test]
    fn a_worker_restarted_during_the_run_counts_from_zero() {
        let last: Counts = [(1, (100, 40)), (2, (50, 10))].into();
        // Worker 2 was killed and rejoined as 3; worker 1 admitted 20 more, 15 of them cached.
        let now: Counts = [(1, (120, 55)), (3, (30, 0))].into();
        assert_eq!(admitted(&last, &now), (50, 15));
        assert_eq!(admitted(&now, &now), (0, 0));
    }
}
