//! What an operator sees: `GET /status` (one embedded HTML page, no build step, no CDN) and
//! `GET /status.json`, the picture it draws — pools and workers from their heartbeats, the
//! prefix-hit ratio, TTFT and ITL against each pool's target with their recent history, the
//! planner's recent decisions with their inputs, and transfers by transport.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State as AxState;
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use proto::Pool;
use serde::Serialize;
use serde_json::{json, Value};

use crate::planner::{Decision, Inputs, Window};
use crate::State;

/// The page itself (HTML, CSS and JS in one file; charts are inline SVG).
const PAGE: &str = include_str!("status.html");

/// How many planner decisions (other than holds) the page lists.
const DECISIONS_KEPT: usize = 40;
/// How often the history takes a sample, and how many it keeps (ten minutes).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
const SAMPLES_KEPT: usize = 300;

/// Each pool's latency target (`[prefill.slo] ttft_p90_ms`, `[decode.slo] itl_p90_ms`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Targets {
    /// p90 time to first token.
    pub ttft_p90: Option<Duration>,
    /// p90 inter-token latency.
    pub itl_p90: Option<Duration>,
}

/// One planner decision as the page lists it: when, for which pool, what it saw and decided.
#[derive(Debug, Clone)]
pub struct DecisionRecord {
    /// Seconds since the router started.
    pub at_s: f64,
    /// "prefill" or "decode".
    pub pool: &'static str,
    /// What the planner saw.
    pub inputs: Inputs,
    /// What it decided.
    pub decision: Decision,
}

impl Serialize for DecisionRecord {
    /// Flat, in milliseconds: what the page reads.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (i, d) = (&self.inputs, &self.decision);
        json!({
            "at_s": self.at_s, "pool": self.pool,
            "action": d.action.label(), "desired": d.desired, "why": d.why,
            "live": i.live, "starting": i.starting, "queued": i.queued,
            "p90_ms": ms(i.p90), "predicted_ms": ms(i.predicted), "needed": i.needed, "needed_censored": i.censored, "room_needed": i.room_needed,
            "growth_per_s": i.growth, "needed_ahead": d.needed_ahead,
        })
        .serialize(s)
    }
}

/// One sample of the history the page charts.
#[derive(Debug, Clone, Serialize)]
struct Sample {
    at_s: f64,
    ttft_p50_ms: Option<f64>,
    ttft_p90_ms: Option<f64>,
    itl_p50_ms: Option<f64>,
    itl_p90_ms: Option<f64>,
    prefill_workers: usize,
    decode_workers: usize,
}

/// What the status page keeps beside the router's state: the targets, the planner's last
/// decisions and the sampled history.
pub struct Board {
    started: Instant,
    targets: Targets,
    decisions: Mutex<VecDeque<DecisionRecord>>,
    last_decision: Mutex<BTreeMap<&'static str, DecisionRecord>>,
    history: Mutex<VecDeque<Sample>>,
}

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64() * 1e3)
}

impl Board {
    /// A board for a router started now, judging latency against `targets`.
    pub fn new(targets: Targets) -> Board {
        Board {
            started: Instant::now(),
            targets,
            decisions: Mutex::new(VecDeque::new()),
            last_decision: Mutex::new(BTreeMap::new()),
            history: Mutex::new(VecDeque::new()),
        }
    }

    fn since_start(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.started).as_secs_f64()
    }

    /// Records a planner decision (holds only as the pool's latest).
    pub fn decided(&self, now: Instant, pool: Pool, inputs: &Inputs, d: &Decision) {
        let r = DecisionRecord {
            at_s: self.since_start(now),
            pool: pool.name(),
            inputs: *inputs,
            decision: d.clone(),
        };
        let mut last = self.last_decision.lock().expect("board lock");
        last.insert(r.pool, r.clone());
        if d.action != crate::planner::Action::Hold {
            let mut all = self.decisions.lock().expect("board lock");
            all.push_back(r);
            while all.len() > DECISIONS_KEPT {
                all.pop_front();
            }
        }
    }

    /// Takes one sample of the router's latency windows and pool sizes.
    pub fn sample(&self, state: &State) {
        let now = Instant::now();
        let (ttft, itl) = latencies(state, now);
        let workers = state.registry.workers();
        let count = |p: Pool| workers.iter().filter(|w| w.pool == p).count();
        let s = Sample {
            at_s: self.since_start(now),
            ttft_p50_ms: ttft.0,
            ttft_p90_ms: ttft.1,
            itl_p50_ms: itl.0,
            itl_p90_ms: itl.1,
            prefill_workers: count(Pool::Prefill),
            decode_workers: count(Pool::Decode),
        };
        let mut h = self.history.lock().expect("board lock");
        h.push_back(s);
        while h.len() > SAMPLES_KEPT {
            h.pop_front();
        }
    }
}

/// Samples the history every [`SAMPLE_EVERY`] for as long as the router runs.
pub async fn sampler(state: Arc<State>) {
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        state.board.sample(&state);
    }
}

type P50P90 = (Option<f64>, Option<f64>);

/// (p50, p90) of the client TTFT and of the ITL windows, ms.
fn latencies(state: &State, now: Instant) -> (P50P90, P50P90) {
    let q = |w: &Mutex<Window>| {
        let ([p50, p90], _) = w.lock().expect("window lock").quantiles(now, [0.5, 0.9]);
        (ms(p50), ms(p90))
    };
    (q(&state.signals.ttft), q(&state.signals.itl))
}

/// A worker's health as the router judges it.
fn health(w: &crate::registry::Worker) -> &'static str {
    match (w.draining, w.stalled) {
        (true, _) => "draining",
        (_, true) => "stalled",
        _ => "ok",
    }
}

/// One worker's row.
fn worker(w: &crate::registry::Worker, now: Instant) -> Value {
    let l = &w.load;
    let used = l.kv_blocks_total.saturating_sub(l.kv_blocks_free);
    let transports: Vec<&str> = w.offers.iter().map(|o| o.transport.as_str()).collect();
    json!({
        "id": w.id, "name": w.name, "role": w.pool.name(), "endpoint": w.endpoint,
        "device": w.device, "health": health(w),
        "heartbeat_age_ms": now.saturating_duration_since(w.last_beat()).as_millis() as u64,
        "running": l.running, "waiting": l.waiting, "in_flight": w.in_flight(),
        "kv_blocks": {
            "total": l.kv_blocks_total, "used": used, "cached": l.kv_blocks_cached,
            "free": l.kv_blocks_free.saturating_sub(l.kv_blocks_cached),
        },
        "kv_offers": transports, "kv_transfers": w.kv_transfers,
        "prompt_tokens_per_s": l.prompt_tokens_per_s,
        "prompt_tokens": l.prompt_tokens, "prefix_hit_tokens": l.prefix_hit_tokens,
        "kv_tiers": tiers(l),
        "preempted": {"swapped": l.preempted_swapped, "recomputed": l.preempted_recomputed},
        "speculation": {"proposed": l.spec_proposed, "accepted": l.spec_accepted,
            "verifies": l.spec_verifies, "declined": l.spec_declined},
    })
}

/// A worker's KV tiers below its pool (empty without any): per tier, blocks held, hits
/// (blocks loaded back), bytes loaded and stored, load seconds; writes skipped and corrupt
/// blocks found; and its use of the cluster store (blocks put, held there already, dropped;
/// fetched; failed fetches).
fn tiers(l: &proto::grpc::WorkerLoad) -> Value {
    let tier = |blocks, hits, loaded, stored, seconds| {
        json!({"blocks": blocks, "hits": hits, "bytes_loaded": loaded, "bytes_stored": stored,
               "load_seconds": seconds})
    };
    let host = tier(
        l.kv_host_blocks,
        l.kv_host_hits,
        l.kv_host_bytes_loaded,
        l.kv_host_bytes_stored,
        l.kv_host_load_seconds,
    );
    let disk = tier(
        l.kv_disk_blocks,
        l.kv_disk_hits,
        l.kv_disk_bytes_loaded,
        l.kv_disk_bytes_stored,
        l.kv_disk_load_seconds,
    );
    let store = json!({"puts": l.kv_store_puts, "held": l.kv_store_puts_held,
        "dropped": l.kv_store_puts_dropped, "hits": l.kv_store_hits,
        "bytes_loaded": l.kv_store_bytes_loaded, "load_seconds": l.kv_store_load_seconds,
        "fetch_failures": l.kv_store_fetch_failures});
    json!({"host": host, "disk": disk, "store": store,
           "writes_skipped": l.kv_disk_writes_skipped, "corrupt": l.kv_tier_corrupt})
}

/// The whole picture at `now`.
pub fn snapshot(state: &State, now: Instant) -> Value {
    let b = &state.board;
    let workers = state.registry.workers();
    let rows: Vec<Value> = workers.iter().map(|w| worker(w, now)).collect();
    let (prompt, hit) = workers.iter().fold((0u64, 0u64), |(p, h), w| {
        (p + w.load.prompt_tokens, h + w.load.prefix_hit_tokens)
    });
    let mut transfers: BTreeMap<String, u64> = BTreeMap::new();
    for w in &workers {
        for (t, n) in &w.kv_transfers {
            *transfers.entry(t.clone()).or_default() += n;
        }
    }
    let pool = |p: Pool, target: Option<Duration>, signal: &str| {
        let ws = workers.iter().filter(|w| w.pool == p);
        json!({
            "workers": ws.clone().count(),
            "healthy": ws.filter(|w| health(w) == "ok").count(),
            "target_p90_ms": ms(target), "signal": signal,
        })
    };
    let (ttft, itl) = latencies(state, now);
    let window = state.signals.itl.lock().expect("window lock").span();
    json!({
        "model": state.model_id, "disaggregated": state.core.disaggregated,
        "uptime_s": b.since_start(now),
        "pools": {
            "prefill": pool(Pool::Prefill, b.targets.ttft_p90, "ttft"),
            "decode": pool(Pool::Decode, b.targets.itl_p90, "itl"),
        },
        "workers": rows,
        "prefix": {
            "prompt_tokens": prompt, "hit_tokens": hit,
            "hit_ratio": if prompt == 0 { None } else { Some(hit as f64 / prompt as f64) },
        },
        "latency": {
            "window_s": window.as_secs_f64(),
            "ttft": {"p50_ms": ttft.0, "p90_ms": ttft.1, "target_p90_ms": ms(b.targets.ttft_p90)},
            "itl": {"p50_ms": itl.0, "p90_ms": itl.1, "target_p90_ms": ms(b.targets.itl_p90)},
        },
        "history": &*b.history.lock().expect("board lock"),
        "planner": {
            "decisions": &*b.decisions.lock().expect("board lock"),
            "latest": &*b.last_decision.lock().expect("board lock"),
        },
        "transfers": transfers,
        "store_nodes": store_nodes(state),
    })
}

/// The cluster store's nodes: each one's address, whether the router's watch on it holds, and
/// its figures when last asked (objects, bytes, capacity, hits, misses, puts — refused,
/// corrupt, abandoned —, evictions, leases, pins).
fn store_nodes(state: &State) -> Value {
    let nodes = state.registry.store_nodes();
    let row = |n: &crate::store_watch::NodeView| {
        let figures = n.load.as_ref().map(|l| {
            json!({"objects": l.objects, "bytes": l.bytes, "capacity": l.capacity,
                   "hits": l.hits, "misses": l.misses, "puts": l.puts,
                   "puts_refused": l.puts_refused, "puts_corrupt": l.puts_corrupt,
                   "puts_abandoned": l.puts_abandoned, "evictions": l.evictions,
                   "leases": l.leases, "soft_pins": l.soft_pins, "hard_pins": l.hard_pins})
        });
        json!({"uri": n.uri, "source": n.source.name(), "up": n.up, "load": figures})
    };
    nodes.iter().map(row).collect::<Vec<_>>().into()
}

/// `GET /status`: the page.
pub async fn page() -> Response {
    ([("cache-control", "no-store")], Html(PAGE)).into_response()
}

/// `GET /prometheus/targets`: every joined worker's metrics endpoint in Prometheus's HTTP
/// service-discovery format (`http_sd_configs`), labelled with its name and role — so a
/// Prometheus pointed at the router scrapes the workers as they come and go.
pub async fn prometheus_targets(AxState(state): AxState<Arc<State>>) -> Json<Value> {
    let groups: Vec<Value> = state
        .registry
        .workers()
        .iter()
        .filter(|w| !w.metrics_endpoint.is_empty())
        .map(|w| {
            json!({"targets": [w.metrics_endpoint],
                   "labels": {"tandem_worker": w.name, "tandem_role": w.pool.name()}})
        })
        .collect();
    Json(Value::Array(groups))
}

/// `GET /status.json`: what the page draws.
pub async fn status_json(AxState(state): AxState<Arc<State>>) -> Json<Value> {
    Json(snapshot(&state, Instant::now()))
}
