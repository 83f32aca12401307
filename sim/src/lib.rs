//! A whole tandem cluster on a virtual clock (`tandem simulate`).
//!
//! What runs is the cluster's own code, with no I/O and no sleeping: each worker is a real
//! [`engine::Engine`] — its scheduler, continuous batching, block accounting and prefix cache —
//! over the mock engine's timing model on a virtual clock ([`engine::Model::mock_virtual`]: a
//! step takes no time and says how long it would take); the router's routing policy
//! ([`router::routing`]) picks workers from the router's own KV index ([`router::KvIndex`]),
//! fed by the workers' prefix-cache events. What is modelled, not run: the HTTP and gRPC hops
//! (free), the KV transfer (its bytes over a link's bandwidth plus its latency), and the
//! router's request phases, which [`Sim::arrive`] and the event handlers follow step by step
//! (reserve on a decode worker, prefill here or on a prefill worker, the KV's arrival, tokens).
//!
//! Events are processed in time order (ties in the order they were scheduled), and the routing
//! policy breaks ties by the pick's turn, so a run is a function of its configuration and
//! requests: the same run twice gives the same report.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{Engine, EngineConfig, MockTiming, ModelConfig};
use proto::grpc::KvEvents;
use proto::Pool;
use router::kv_index::KvIndex;
use router::planner::{PoolPlan, Scaling};
use router::routing::{self, Candidate, Routing};

mod admission;
mod faults;
mod overhead;
mod planner;
pub use faults::{schedule as schedule_faults, Count, Fault, FaultKind, FaultSpec};
pub use overhead::{Overhead, OverheadError};
pub use planner::Sample;

/// One pool: how many workers, each engine's configuration and step timing.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    /// Workers in the pool.
    pub replicas: usize,
    /// Each worker's engine.
    pub engine: EngineConfig,
    /// Each worker's step time.
    pub timing: MockTiming,
    /// Added to every step, drawn per step: what a real worker spends beside the timing
    /// model's time (the engine's own work, the wake-ups of the mock's sleeps; measured, see
    /// [`Overhead`] and BENCHMARKS.md).
    pub step_overhead: Overhead,
}

/// The link a KV transfer crosses: `latency + bytes / bandwidth`.
#[derive(Debug, Clone, Copy)]
pub struct Link {
    /// Bytes per second.
    pub bandwidth: f64,
    /// Fixed cost of one transfer (connection, first byte).
    pub latency: Duration,
    /// The receiving decode engine's time to write arrived KV into its cache, ns a byte: its
    /// next step waits for it, as a real decode worker's engine thread does (measured, see
    /// `scripts/sim_fidelity.py`).
    pub write_ns_per_byte: f64,
}

/// A cluster to simulate.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The model's shape (KV bytes per token, the block names' seed, the vocabulary).
    pub model: ModelConfig,
    /// The prefill pool; without one, decode workers prefill their own requests (colocated).
    pub prefill: Option<PoolSpec>,
    /// The decode pool.
    pub decode: PoolSpec,
    /// The router's routing policy.
    pub routing: Routing,
    /// A decode worker prefills a request itself when this few of its prompt's tokens are
    /// uncached (`[router] local_prefill_max_tokens`).
    pub local_prefill_max_tokens: usize,
    /// Prefill to decode worker.
    pub link: Link,
    /// The pools the planner scales (`[<pool>.autoscale]`); none: a static fleet.
    pub scaling: Vec<Scaling>,
    /// From the planner's decision to a new replica serving.
    pub start_up: Duration,
    /// One call between the router and a worker (the reservation, the prefill's dispatch, a
    /// token's way out).
    pub hop: Duration,
    /// Added to each token's way out, drawn per token (a real router measures it:
    /// `tandem_router_token_delay_seconds`); tokens still reach their client in order.
    pub token_delay: Overhead,
    /// How the router notices failures and what it does about them.
    pub liveness: Liveness,
    /// What goes wrong, and when.
    pub faults: Vec<Fault>,
}

/// The router's failure handling (`[router]` and `[kv_transfer]` of cluster.toml) and where
/// the faults land.
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    /// A worker holding work with no step for this long is stalled (`stall_timeout_ms`).
    pub stall: Duration,
    /// A transfer that has not completed by then has failed (`transfer_timeout_ms`).
    pub transfer_timeout: Duration,
    /// How many times a request may move to another decode worker (`migration_limit`).
    pub migration_limit: u32,
    /// Racks the workers are spread over (worker `i` in rack `i % racks`), for link faults.
    pub racks: usize,
    /// Which workers a fault takes.
    pub fault_seed: u64,
}

impl Default for Liveness {
    fn default() -> Liveness {
        Liveness {
            stall: Duration::from_secs(10),
            transfer_timeout: Duration::from_secs(30),
            migration_limit: 1,
            racks: 1,
            fault_seed: 1,
        }
    }
}

/// One request of the load: when it arrives, its prompt, how many tokens it generates.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// Arrival, from the start of the run.
    pub at: Duration,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output tokens (generated to the end: the mock never stops early).
    pub output: usize,
}

/// What one request saw, as a client measures it.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Arrival to first token.
    pub ttft: Option<Duration>,
    /// Gaps between tokens.
    pub gaps: Vec<Duration>,
    /// Arrival to last token.
    pub e2e: Duration,
    /// Tokens received.
    pub tokens: usize,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// A run's results.
#[derive(Debug, Clone, Default)]
pub struct SimResult {
    /// Per request, in the order given.
    pub outcomes: Vec<Outcome>,
    /// Virtual time from the start to the last event.
    pub duration: Duration,
    /// Prompt tokens the engines admitted, and of those found in their prefix caches.
    pub prompt_tokens: u64,
    /// See `prompt_tokens`.
    pub prefix_hit_tokens: u64,
    /// KV bytes moved from prefill to decode workers.
    pub kv_bytes: u64,
    /// Where each request was prefilled, by the router's reason names.
    pub decisions: BTreeMap<&'static str, u64>,
    /// Worker-seconds per pool: each worker from joining to leaving (or the run's end).
    pub worker_seconds: BTreeMap<&'static str, f64>,
    /// Forward steps run, all workers.
    pub steps: u64,
    /// Per pool: steps run and their time (timing model plus overhead), seconds.
    pub step_time: BTreeMap<&'static str, (u64, f64)>,
    /// Each planner tick of each scaled pool.
    pub series: Vec<Sample>,
    /// Requests moved to another decode worker.
    pub migrations: u64,
    /// Decode workers held for the oldest request waiting for room.
    pub admission_holds: u64,
    /// Workers that died, and that the router found stalled.
    pub deaths: u64,
    /// See `deaths`.
    pub stalls: u64,
    /// Each fault as it struck: virtual seconds, what.
    pub faults: Vec<(f64, String)>,
    /// Where first tries' TTFT went, as the router's `tandem_router_ttft_phase_seconds`
    /// measures it: per phase (admission, prefill, first_token), requests and seconds.
    pub ttft_phases: BTreeMap<&'static str, (u64, f64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive(usize),
    StepDone(usize),
    KvArrived {
        req: usize,
        decode: usize,
        attempt: u32,
    },
    TransferFailed {
        req: usize,
        attempt: u32,
    },
    Dispatch {
        req: usize,
        decode: usize,
        cached: usize,
        attempt: u32,
    },
    Tick,
    WorkerUp(Pool),
    Fault(usize),
    StallCheck {
        worker: usize,
        serial: u64,
    },
    PrefillReturned {
        req: usize,
        attempt: u32,
    },
    Thaw(usize),
    LinkRestored(usize),
    Beat(usize),
}

struct Worker {
    pool: Pool,
    engine: Engine,
    overhead: Overhead,
    /// Steps it has run (which overhead each draws).
    stepped: u64,
    /// Engine time owed to KV writes since its last step (ns): its next step starts later.
    writes: u64,
    /// The step time the virtual mock left (ns).
    clock: Arc<AtomicU64>,
    /// A step is running (its results are delivered at its end), until this virtual time.
    busy: bool,
    busy_until: u64,
    /// Decode: requests the router sent while it stepped (and their attempts): its engine
    /// thread reserves them when the step ends.
    reserving: Vec<(usize, u32)>,
    /// The running step's tokens, delivered at its end.
    pending: Vec<engine::TokenEvent>,
    /// Requests the router has in flight on it.
    in_flight: usize,
    /// Prefill: prompt tokens sent and not yet done.
    queued_tokens: u64,
    /// Prefill: prompt tokens per second of engine time, a moving average over its steps (as
    /// a real prefill worker measures it), and what its last heartbeat told the router.
    capacity: f64,
    reported: f64,
    /// Heartbeats so far: a request it refused asks it again only after its next.
    beats: u64,
    /// Decode: its load as its last heartbeat said it (the planner reads its KV blocks).
    seen: proto::grpc::WorkerLoad,
    /// The next KV event number (what its heartbeats would carry).
    kv_next: u64,
    /// Let go by the planner: takes no new requests.
    draining: bool,
    /// When it joined and when it left — drained or dead (virtual ns).
    started: u64,
    stopped: Option<u64>,
    /// Frozen: no step ends until it thaws; the step that would have ended meanwhile ends then.
    frozen: bool,
    deferred: bool,
    /// Freezes so far (a stall check belongs to one).
    freezes: u64,
    /// The router found it stalled: no new requests until it thaws.
    stalled: bool,
}

impl Worker {
    /// It takes new requests.
    fn serving(&self) -> bool {
        !self.draining && self.stopped.is_none() && !self.stalled
    }

    /// Prefill: the prompt tokens per second its last heartbeat reported (0 before any).
    fn rate(&self) -> f64 {
        self.reported
    }

    /// Prefill: a step of `tokens` prompt tokens took `ns` (the real worker's moving average).
    fn measure(&mut self, tokens: usize, ns: u64) {
        if tokens > 0 && ns > 0 {
            let rate = tokens as f64 / (ns as f64 / 1e9);
            self.capacity = match self.capacity {
                c if c > 0.0 => 0.8 * c + 0.2 * rate,
                _ => rate,
            };
        }
    }
}

#[derive(Default)]
struct Req {
    at: u64,
    first: Option<u64>,
    last: u64,
    gaps: Vec<Duration>,
    tokens: usize,
    decode: Option<usize>,
    prefill_tokens: u64,
    /// Bytes of its KV transfer under way.
    kv_bytes: u64,
    /// When a decode worker reserved it, for a remote prefill (the prefill pool's TTFT runs
    /// from here).
    reserved: Option<u64>,
    /// When the router heard of its reservation on a decode worker, and when its prompt's KV
    /// was in that worker's cache (remote prefills): its TTFT phases.
    admitted: Option<u64>,
    kv_in: Option<u64>,
    /// Its prompt's block names (all but the last token), computed once.
    blocks: Option<Vec<u64>>,
    error: Option<String>,
    /// Its last token has been delivered.
    done: bool,
    /// The prefill worker computing its prompt.
    prefill_on: Option<usize>,
    /// The prefill worker the router counts it on (its in-flight and queued tokens): from the
    /// pick until the prefill call returns, after the transfer's answer.
    prefill_counted: Option<usize>,
    /// Its prompt as sent (a migrated request's prompt has its streamed tokens after it).
    prompt_len: usize,
    /// Its admission deadline counts from here (its arrival, or its last migration).
    admit_from: u64,
    /// The decode workers that refused it (no room), with their heartbeat count then: not
    /// asked again before their next heartbeat.
    refused_by: Vec<(usize, u64)>,
    /// It has found no decode worker with room on this attempt and not been reserved yet (the
    /// router counts it waiting for room).
    waiting: bool,
    /// Migrations so far; each migration or recomputation is a new attempt, and the events of
    /// an older one are ignored.
    migrations: u32,
    attempt: u32,
}

/// The simulation state.
pub struct Sim {
    cfg: SimConfig,
    seed: u64,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    workers: Vec<Worker>,
    index: KvIndex,
    requests: Vec<SimRequest>,
    reqs: Vec<Req>,
    /// Requests waiting for a decode worker with room, and how many requests the router counts
    /// waiting (those and the ones asking again after a heartbeat).
    admission: VecDeque<usize>,
    waiting: u64,
    /// The router's line of those waiting (the oldest holds a worker after a while).
    line: router::admission::Line,
    rr: usize,
    result: SimResult,
    /// The virtual clock's zero as an instant.
    base: Instant,
    /// The planner's period (its shortest pool tick).
    tick_every: Duration,
    plans: Vec<PoolPlan>,
    signals: planner::Signals,
    /// Replicas asked for and not joined yet.
    starting: Vec<Pool>,
    series: Vec<Sample>,
    /// Requests not finished (or failed) yet.
    open: usize,
    /// The faults, in time order.
    faults: Vec<Fault>,
    /// Per rack, the share of the link's bandwidth left.
    link_share: Vec<f64>,
}

/// The simulated engines' vocabulary: a decoded token's logits are a row of this many floats
/// (the model's own 49k–262k would make the sampler the simulation's cost); prompt ids are
/// folded into it, which keeps equal prompts equal and different 16-token blocks different.
const VOCAB: usize = 1024;

/// A worker's heartbeat period (the real workers').
const HEARTBEAT: Duration = proto::membership::HEARTBEAT_PERIOD;

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

impl Sim {
    /// A cluster of `cfg` about to receive `requests`.
    pub fn new(mut cfg: SimConfig, mut requests: Vec<SimRequest>) -> engine::Result<Sim> {
        cfg.model.vocab_size = VOCAB;
        for r in &mut requests {
            r.prompt.iter_mut().for_each(|t| *t %= VOCAB as u32);
        }
        let seed = engine::block_hash::identity_seed(&cfg.model, cfg.decode.engine.block_size);
        let mut sim = Sim {
            seed,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            workers: Vec::new(),
            index: KvIndex::default(),
            reqs: (0..requests.len()).map(|_| Req::default()).collect(),
            requests,
            admission: VecDeque::new(),
            waiting: 0,
            line: Default::default(),
            rr: 0,
            result: SimResult::default(),
            base: Instant::now(),
            tick_every: Duration::from_secs(1),
            plans: cfg.scaling.iter().cloned().map(PoolPlan::new).collect(),
            signals: planner::Signals::new(
                cfg.scaling
                    .first()
                    .map_or(Duration::from_secs(10), |s| s.window),
            ),
            starting: Vec::new(),
            series: Vec::new(),
            open: 0,
            faults: cfg.faults.clone(),
            link_share: vec![1.0; cfg.liveness.racks.max(1)],
            cfg,
        };
        let pools = [
            (Pool::Prefill, sim.cfg.prefill.clone()),
            (Pool::Decode, Some(sim.cfg.decode.clone())),
        ];
        for (pool, spec) in pools {
            let Some(spec) = spec else { continue };
            // A scaled pool starts at the planner's initial count.
            let n = match sim.plans.iter().find(|p| p.scaling.pool == pool) {
                Some(p) => p.desired() as usize,
                None => spec.replicas,
            };
            for _ in 0..n {
                sim.add_worker(pool, &spec)?;
            }
        }
        for i in 0..sim.requests.len() {
            // The router's call to the decode worker: one hop after the request arrives.
            let at = ns(sim.requests[i].at) + ns(sim.cfg.hop);
            sim.reqs[i].at = ns(sim.requests[i].at);
            sim.reqs[i].admit_from = sim.reqs[i].at;
            sim.reqs[i].prompt_len = sim.requests[i].prompt.len();
            sim.schedule(at, Event::Arrive(i));
        }
        for i in 0..sim.faults.len() {
            sim.schedule(ns(sim.faults[i].at), Event::Fault(i));
        }
        sim.open = sim.requests.len();
        if let Some(tick) = sim.cfg.scaling.iter().map(|s| s.tick).min() {
            sim.schedule(0, Event::Tick);
            sim.tick_every = tick;
        }
        Ok(sim)
    }

    fn add_worker(&mut self, pool: Pool, spec: &PoolSpec) -> engine::Result<()> {
        let (model, clock) = engine::Model::mock_virtual(self.cfg.model.clone(), spec.timing);
        let engine = Engine::new(Arc::new(model), spec.engine.clone(), Vec::new())?;
        let w = self.workers.len() as u64;
        // Its first heartbeat: an empty snapshot of its cache.
        let snapshot = KvEvents {
            snapshot: true,
            ..Default::default()
        };
        self.index.apply(w, &snapshot);
        self.workers.push(Worker {
            pool,
            engine,
            overhead: spec.step_overhead.clone(),
            stepped: 0,
            writes: 0,
            clock,
            busy: false,
            busy_until: 0,
            reserving: Vec::new(),
            pending: Vec::new(),
            in_flight: 0,
            queued_tokens: 0,
            capacity: 0.0,
            reported: 0.0,
            beats: 0,
            seen: Default::default(),
            kv_next: 0,
            draining: false,
            started: self.now,
            stopped: None,
            frozen: false,
            deferred: false,
            freezes: 0,
            stalled: false,
        });
        // Its heartbeats, every period from a phase of its own.
        let phase = (w.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) % ns(HEARTBEAT);
        self.schedule(self.now + phase, Event::Beat(w as usize));
        Ok(())
    }

    fn schedule(&mut self, at: u64, ev: Event) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, ev)));
    }

    /// Runs every request to its end.
    pub fn run(mut self) -> SimResult {
        while let Some(Reverse((at, _, ev))) = self.queue.pop() {
            self.now = at;
            match ev {
                Event::Arrive(r) => self.arrive(r),
                Event::StepDone(w) => self.step_done(w),
                Event::KvArrived {
                    req,
                    decode,
                    attempt,
                } => self.kv_arrived(req, decode, attempt),
                Event::TransferFailed { req, attempt } => {
                    if self.reqs[req].attempt == attempt {
                        self.recompute(req, "recomputed: transfer failed");
                    }
                }
                Event::Dispatch {
                    req,
                    decode,
                    cached,
                    attempt,
                } => {
                    if self.reqs[req].attempt == attempt && self.reqs[req].decode == Some(decode) {
                        self.prefill(req, decode, cached)
                    }
                }
                Event::Tick => self.tick(self.tick_every),
                Event::WorkerUp(pool) => self.worker_up(pool),
                Event::Fault(i) => self.strike(i),
                Event::StallCheck { worker, serial } => self.stall_check(worker, serial),
                Event::PrefillReturned { req, attempt } => {
                    if self.reqs[req].attempt == attempt {
                        self.prefill_returned(req)
                    }
                }
                Event::Thaw(w) => self.thaw(w),
                Event::LinkRestored(rack) => self.link_share[rack] = 1.0,
                Event::Beat(w) => self.beat(w),
            }
        }
        self.finish()
    }

    /// The reserved request `r` on decode worker `d`, which holds `cached` of its prompt:
    /// prefilled there when nothing (or little enough) is left to compute, else on the prefill
    /// worker the policy picks, which computes what its own cache lacks.
    fn prefill(&mut self, r: usize, d: usize, cached: usize) {
        let known = self.requests[r].prompt.len() - 1;
        let local = known - cached <= self.cfg.local_prefill_max_tokens;
        let prefill = self.pool(Pool::Prefill);
        if local || prefill.is_empty() {
            let why = if local {
                "local: short suffix"
            } else {
                "local: no prefill worker"
            };
            *self.result.decisions.entry(why).or_default() += 1;
            let _ = self.workers[d].engine.prefill_here(r as u64);
            return;
        }
        let overlap = self.overlap(r, Pool::Prefill);
        let bs = self.cfg.decode.engine.block_size;
        let cands: Vec<Candidate> = prefill
            .iter()
            .map(|&w| {
                let wk = &self.workers[w];
                Candidate {
                    load: wk.in_flight,
                    cached: overlap.get(&(w as u64)).copied().unwrap_or(0) * bs,
                    queued_tokens: wk.queued_tokens,
                    rate: wk.rate(),
                }
            })
            .collect();
        let pick = routing::prefill(&self.cfg.routing, &cands, known, self.rr)
            .expect("a prefill worker exists");
        let p = prefill[pick];
        let tokens = self.requests[r].prompt[..known].to_vec();
        // Queued on it as the router's registry counts it: less what it caches, by the index.
        let rest = known.saturating_sub(cands[pick].cached) as u64;
        *self.result.decisions.entry("remote").or_default() += 1;
        match self.workers[p]
            .engine
            .add_prefill_only(r as u64, tokens, cached)
        {
            Ok(()) => {
                self.workers[p].in_flight += 1;
                self.workers[p].queued_tokens += rest;
                // The pool's demand, as the router counts it: the prompt sent.
                self.signals.prefill_sent += known as u64;
                self.reqs[r].prefill_tokens = rest;
                self.reqs[r].reserved = Some(self.now);
                self.reqs[r].prefill_on = Some(p);
                self.reqs[r].prefill_counted = Some(p);
                self.kick(p);
            }
            Err(e) => self.fail(r, e.to_string()),
        }
    }

    /// Request `r`'s prefill call returns (or fails): the router stops counting it on its
    /// prefill worker.
    pub(crate) fn prefill_returned(&mut self, r: usize) {
        let Some(p) = self.reqs[r].prefill_counted.take() else {
            return;
        };
        let wk = &mut self.workers[p];
        wk.in_flight = wk.in_flight.saturating_sub(1);
        wk.queued_tokens = wk.queued_tokens.saturating_sub(self.reqs[r].prefill_tokens);
        self.retire(p);
    }

    fn fail(&mut self, r: usize, why: String) {
        self.leave(r);
        self.set_waiting(r, false);
        if self.reqs[r].error.is_none() {
            self.reqs[r].error = Some(why);
            self.open -= 1;
        }
    }

    /// For each serving worker of `pool` caching the start of request `r`'s prompt, how many
    /// of its leading blocks (the router's index, by the blocks' names).
    fn overlap(&mut self, r: usize, pool: Pool) -> std::collections::HashMap<u64, usize> {
        let bs = self.cfg.decode.engine.block_size;
        let prompt = &self.requests[r].prompt;
        let known = &prompt[..prompt.len().saturating_sub(1)];
        let seed = self.seed;
        let blocks = self.reqs[r]
            .blocks
            .get_or_insert_with(|| engine::block_hash::prompt_hashes(seed, bs, known));
        let workers = &self.workers;
        self.index.overlap_in(blocks, |w| {
            workers[w as usize].pool == pool && workers[w as usize].serving()
        })
    }

    /// Worker indices of `pool` that take new requests.
    fn pool(&self, pool: Pool) -> Vec<usize> {
        (0..self.workers.len())
            .filter(|&w| self.workers[w].pool == pool && self.workers[w].serving())
            .collect()
    }

    /// Starts worker `w`'s next step if it is idle and has work: the engine runs the step now,
    /// its results are delivered when the step's time has passed.
    fn kick(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        if wk.busy || wk.frozen || wk.stopped.is_some() || !wk.engine.has_work() {
            return;
        }
        match wk.engine.step() {
            Ok(events) => {
                let overhead = wk.overhead.draw(w, wk.stepped);
                wk.stepped += 1;
                let d =
                    wk.clock.load(Ordering::Relaxed) + overhead + std::mem::take(&mut wk.writes);
                let t = self.result.step_time.entry(wk.pool.name()).or_default();
                *t = (t.0 + 1, t.1 + d as f64 / 1e9);
                wk.busy = true;
                wk.busy_until = self.now + d;
                if wk.pool == Pool::Prefill {
                    wk.measure(wk.engine.last_step().0, d);
                }
                wk.pending = events;
                self.result.steps += 1;
                let at = self.now + d;
                self.schedule(at, Event::StepDone(w));
            }
            Err(e) => panic!("simulated engine step failed: {e}"),
        }
    }

    /// Worker `w`'s step ended: its tokens reach their clients, finished prefills start their
    /// transfers; then the reservations that came meanwhile, and its next step.
    pub(crate) fn step_done(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        if wk.stopped.is_some() {
            // Dead: what its last step did went with it (a drained worker has no step left).
            return;
        }
        if wk.frozen {
            wk.deferred = true;
            return;
        }
        wk.busy = false;
        for ev in std::mem::take(&mut self.workers[w].pending) {
            // Tokens of a request that has left this worker (migrated) are dropped.
            if self.reqs[ev.id as usize].decode != Some(w) {
                continue;
            }
            self.token(ev);
        }
        for id in self.workers[w].engine.take_prefilled() {
            let Some(sent) = self.workers[w].engine.discard_prefilled(id) else {
                continue;
            };
            let r = id as usize;
            if self.reqs[r].prefill_on != Some(w) {
                continue;
            }
            self.reqs[r].prefill_on = None;
            self.transfer(r, sent);
        }
        self.take_reservations(w);
        self.kick(w);
        self.retire(w);
    }

    /// Request `r`'s `tokens` of KV leave for its decode worker over the link to its rack.
    fn transfer(&mut self, r: usize, tokens: usize) {
        let Some(decode) = self.reqs[r].decode else {
            return self.prefill_returned(r);
        };
        let attempt = self.reqs[r].attempt;
        let bytes = tokens as u64 * self.kv_bytes_per_token();
        let link = self.cfg.link;
        let share = self.link_share[self.rack(decode)];
        if share <= 0.0 {
            // A cut link: the transfer fails at its deadline, and the prompt is recomputed.
            let at = self.now + ns(self.cfg.liveness.transfer_timeout);
            return self.schedule(at, Event::TransferFailed { req: r, attempt });
        }
        self.result.kv_bytes += bytes;
        self.reqs[r].kv_bytes = bytes;
        let wire = bytes as f64 / (link.bandwidth * share) * 1e9;
        let at = self.now + ns(link.latency) + wire as u64;
        self.schedule(
            at,
            Event::KvArrived {
                req: r,
                decode,
                attempt,
            },
        );
    }

    fn kv_arrived(&mut self, r: usize, d: usize, attempt: u32) {
        if self.reqs[r].attempt != attempt || self.reqs[r].decode != Some(d) {
            return;
        }
        if let Err(e) = self.workers[d].engine.admit_simulated(r as u64) {
            self.fail(r, e.to_string());
            return;
        }
        let write = self.reqs[r].kv_bytes as f64 * self.cfg.link.write_ns_per_byte;
        self.workers[d].writes += write as u64;
        // The worker's engine thread takes the KV between steps, writes it, answers: the
        // prefill's reply reaches the router a hop later.
        let step_end = self.workers[d].busy_until.max(self.now);
        let kv_in = step_end + write as u64 + ns(self.cfg.hop);
        self.reqs[r].kv_in = Some(kv_in);
        // The prefill worker's call returns with the decode worker's answer, a hop later.
        let attempt = self.reqs[r].attempt;
        self.schedule(kv_in, Event::PrefillReturned { req: r, attempt });
        self.kick(d);
    }

    fn token(&mut self, ev: engine::TokenEvent) {
        let r = ev.id as usize;
        // The client sees it a hop and its drawn delay later, not before the one before it
        // (the router's signals see it then too).
        let delay = self.cfg.token_delay.draw_token(r, self.reqs[r].tokens);
        let now = (self.now + ns(self.cfg.hop) + delay).max(self.reqs[r].last);
        let at = self.base + Duration::from_nanos(now);
        let q = &mut self.reqs[r];
        match q.first {
            None => {
                q.first = Some(now);
                if let (0, Some(admitted)) = (q.attempt, q.admitted) {
                    let ph = &mut self.result.ttft_phases;
                    let mut add = |name: &'static str, from: u64, to: u64| {
                        let e = ph.entry(name).or_default();
                        *e = (e.0 + 1, e.1 + to.saturating_sub(from) as f64 / 1e9);
                    };
                    add("admission", q.at, admitted);
                    // A token can overtake the prefill's reply.
                    let kv = q.kv_in.map_or(admitted, |k| k.min(now));
                    if q.kv_in.is_some() {
                        add("prefill", admitted, kv);
                    }
                    add("first_token", kv, now);
                }
                if let Some(t) = q.reserved {
                    self.signals
                        .prefill_ttft
                        .record(at, Duration::from_nanos(now - t));
                }
            }
            Some(_) => {
                let gap = Duration::from_nanos(now - q.last);
                q.gaps.push(gap);
                self.signals.itl.record(at, gap);
            }
        }
        q.last = now;
        q.tokens += 1;
        if ev.finish.is_some() {
            q.done = true;
            self.open -= 1;
            if let Some(d) = q.decode {
                self.workers[d].in_flight -= 1;
                self.retire(d);
            }
        }
    }

    fn kv_bytes_per_token(&self) -> u64 {
        // Keys and values, f16, every layer.
        (self.cfg.model.n_layers * self.cfg.model.kv_width() * 2 * 2) as u64
    }

    fn finish(mut self) -> SimResult {
        // The run ends with its last token (a planner tick may come after it).
        let end = self.reqs.iter().map(|q| q.last).max().unwrap_or(self.now);
        for (r, q) in self.reqs.iter().enumerate() {
            let error = q.error.clone().or_else(|| {
                (q.tokens < self.requests[r].output).then(|| "did not finish".to_string())
            });
            self.result.outcomes.push(Outcome {
                ttft: q.first.map(|t| Duration::from_nanos(t - q.at)),
                gaps: q.gaps.clone(),
                e2e: Duration::from_nanos(q.last.saturating_sub(q.at)),
                tokens: q.tokens,
                error,
            });
        }
        for w in &self.workers {
            let load = w.engine.load();
            self.result.prompt_tokens += load.prompt_tokens;
            self.result.prefix_hit_tokens += load.prefix_hit_tokens;
            let lived = w.stopped.unwrap_or(end).saturating_sub(w.started);
            *self.result.worker_seconds.entry(w.pool.name()).or_default() += lived as f64 / 1e9;
        }
        self.result.duration = Duration::from_nanos(end);
        self.result.admission_holds = self.line.holds();
        self.result.series = self.series;
        self.result
    }
}
