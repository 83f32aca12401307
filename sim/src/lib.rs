//! A whole tandem cluster on a virtual clock (`tandem simulate`).
//!
//! What runs is the cluster's own code, with no I/O and no sleeping:
//!
//! - **The router** is the router's request core ([`router::core`]): each request is a
//!   [`router::core::Request`] moved by the inputs a real router's would get (a reservation
//!   or a refusal, the prefill's answer, tokens, a worker lost, a deadline), over the router's
//!   own table of workers ([`router::core::Table`]: their heartbeats, the KV index, the line
//!   of requests waiting for room, the one definition of a candidate's load) and its planner
//!   ([`router::planner`]). Its actions — open a decode stream, start a prefill, release a
//!   request — become events here ([`router`] module).
//! - **Each worker** is a real [`engine::Engine`] — its scheduler, continuous batching, block
//!   accounting and prefix cache — over the mock engine's timing model on a virtual clock
//!   ([`engine::Model::mock_virtual`]: a step takes no time and says how long it would take),
//!   heartbeating its load and cache events to the table as a real worker does ([`worker`]
//!   module).
//!
//! What is modelled, not run: the gRPC hops (a fixed time each), the KV transfer (its bytes
//! over a link's bandwidth plus its latency), and the faults ([`faults`]). Events are processed
//! in time order (ties in the order they were scheduled), and the routing policy breaks ties by
//! the pick's turn, so a run is a function of its configuration and requests: the same run
//! twice gives the same report.

use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{EngineConfig, MockTiming, ModelConfig};
use proto::Pool;
use router::core::{Input, PhaseName, PrefillDecision, Table};
use router::planner::{PendingPrefill, PoolPlan, Scaling, Signals, Watch};
use router::registry::InFlight;
use router::routing::Routing;
use types::{RequestId, WorkerId};

mod faults;
mod moves;
mod overhead;
mod planner;
mod router_side;
mod store;
mod worker;
pub use faults::{schedule as schedule_faults, Count, Fault, FaultKind, FaultSpec};
pub use overhead::{Overhead, OverheadError};
pub use planner::Sample;
pub use store::StoreSpec;

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
    /// The router's request settings (`[router]`: the local-prefill limits, the migration
    /// limit, the admission wait, the request timeout). Whether the cluster is disaggregated
    /// and the block names' seed follow from the pools and the model.
    pub router: router::core::Settings,
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
    /// How the router notices failures, and where the faults land.
    pub liveness: Liveness,
    /// What goes wrong, and when.
    pub faults: Vec<Fault>,
    /// The cluster KV store the workers use (none: no store).
    pub store: Option<StoreSpec>,
    /// Peer fetch (`[kv_transfer] peer_fetch`): a prefill worker takes the prompt blocks the
    /// request's decode worker holds and it lacks from that worker (priced as a store fetch).
    pub peer_fetch: bool,
    /// Rebalance the decode pool's KV by live moves past this ratio (`[router] kv_rebalance`;
    /// none: off): the router's own [`router::core::Rebalancer`], run on decode heartbeats.
    pub kv_rebalance: Option<f64>,
}

/// The router's failure detection (`[router]` and `[kv_transfer]` of cluster.toml) and where
/// the faults land.
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    /// A worker holding work whose steps stand still this long is stalled
    /// (`stall_timeout_ms`).
    pub stall: Duration,
    /// A transfer that has not completed by then has failed (`transfer_timeout_ms`).
    pub transfer_timeout: Duration,
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

/// What one request saw, as a client measures it, and the path it took.
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
    /// The router's phases for it, in order.
    pub phases: Vec<PhaseName>,
    /// Where its prompt was prefilled, each try.
    pub decisions: Vec<PrefillDecision>,
    /// Refusals by decode workers.
    pub refusals: u32,
    /// A digest of the answer's text as the client received it (FNV-1a), to compare two runs'
    /// answers request by request; `None` for a failed request or a simulated one (its mock
    /// tokens have no text).
    pub answer: Option<u64>,
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
    /// Of those, blocks loaded from the tiers below the pools (host memory, disk).
    pub tier_hits: [u64; 2],
    /// Blocks fetched from the cluster store (staged in a worker's host tier).
    pub store_hits: u64,
    /// Blocks prefill workers fetched from decode workers (peer fetch).
    pub peer_hits: u64,
    /// The router's peer-fetch decisions, by label (fetch, compute, probe, nothing).
    pub peer_fetch: BTreeMap<&'static str, u64>,
    /// Sequences the engines preempted when their pools ran out, and what resuming cost.
    pub preemptions: engine::Preemptions,
    /// Drafts the decode engines proposed and had accepted (speculative decoding).
    pub speculation: engine::SpecStats,
    /// KV bytes moved from prefill to decode workers.
    pub kv_bytes: u64,
    /// Where each request was prefilled, and why prompts were recomputed, by the router's
    /// label names.
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
    /// Requests moved off a decode worker live (paused, their KV handed to another).
    pub moves: u64,
    /// Moves that found no room in time (the request resumed where it was).
    pub moves_stayed: u64,
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

/// Something that happens at a virtual instant.
#[derive(Debug)]
enum Event {
    /// A request reaches the router.
    Arrive(usize),
    /// An answer reaches the router for request `req`'s try `id`.
    Input {
        req: usize,
        id: RequestId,
        input: Box<Input>,
    },
    /// The router's call to open request `req`'s stream reaches decode worker `worker`.
    Open {
        req: usize,
        id: RequestId,
        worker: usize,
        remote: bool,
        local_max: u32,
    },
    /// The router's prefill call for `req` reaches prefill worker `worker`.
    Prefill {
        req: usize,
        id: RequestId,
        worker: usize,
        /// The decode worker its KV goes to and the tokens that one holds; the decode worker the
        /// prefill worker fetches the first blocks from (peer fetch) and the tokens it holds.
        to: (usize, u32, Option<(usize, u32)>),
    },
    /// A worker's step ends.
    StepDone(usize),
    /// The router's pause of request `req`'s try `id` (a live move) reaches decode worker
    /// `worker`.
    Pause {
        req: usize,
        id: RequestId,
        worker: usize,
    },
    /// The router's handoff call for `req` (now try `id`) reaches decode worker `from`, which
    /// holds it paused as `paused`; its KV goes to decode worker `decode`, which holds `skip`.
    Handoff {
        req: usize,
        id: RequestId,
        from: usize,
        paused: RequestId,
        decode: usize,
        skip: u32,
    },
    /// Request `req`'s KV has crossed the link to decode worker `decode`.
    KvArrived {
        req: usize,
        id: RequestId,
        decode: usize,
    },
    /// Request `req`'s transfer gave up at its deadline.
    TransferFailed {
        req: usize,
        id: RequestId,
    },
    /// Request `req`'s prefill call returns: the decode worker took its KV.
    PrefillReturned {
        req: usize,
        id: RequestId,
    },
    /// Request `req` may be past its admission deadline.
    AdmissionDeadline {
        req: usize,
        id: RequestId,
    },
    /// Request `req` is past its deadline (`request_timeout`).
    Timeout(usize),
    Tick,
    WorkerUp(Pool),
    Fault(usize),
    Thaw(usize),
    LinkRestored(usize),
    Beat(usize),
}

/// An event at its time; `seq` orders ties by scheduling.
struct Scheduled {
    at: u64,
    seq: u64,
    ev: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}

impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// A prefill call in progress, counted on its worker and in the planner's pending tokens
/// until it returns.
struct Call {
    worker: usize,
    _guards: (InFlight, PendingPrefill),
}

/// One request: the router's core for it and what its client has seen.
#[derive(Default)]
struct Req {
    at: u64,
    core: Option<router::core::Request>,
    /// Its prefill call.
    call: Option<Call>,
    /// Bytes of its KV transfer under way.
    kv_bytes: u64,
    first: Option<u64>,
    last: u64,
    gaps: Vec<Duration>,
    tokens: usize,
    done: bool,
    error: Option<String>,
    phases: Vec<PhaseName>,
    decisions: Vec<PrefillDecision>,
    refusals: u32,
    /// An admission-deadline event is scheduled for the current try.
    deadline_set: Option<RequestId>,
    /// The try `by_id` knows it by.
    known_as: Option<RequestId>,
}

/// The simulation state.
pub struct Sim {
    cfg: SimConfig,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    workers: Vec<worker::Worker>,
    /// The router's table of workers (worker `i` is `WorkerId(i + 1)`).
    table: Table,
    signals: Arc<Signals>,
    /// Request ids handed out so far.
    ids: u64,
    requests: Vec<SimRequest>,
    reqs: Vec<Req>,
    /// Which request each try's id belongs to.
    by_id: HashMap<RequestId, usize>,
    /// Requests waiting for a decode worker with room (asked again on the table's changes).
    waiting: Vec<usize>,
    /// While the waiting requests ask again after a decode worker's heartbeat: that worker and
    /// its free blocks left (see `router_side::Sim::open`).
    poking: Option<(usize, usize)>,
    /// Workers the planner let go that still hold requests.
    draining: Vec<usize>,
    /// The decode pool's KV rebalancer (`kv_rebalance`).
    rebalancer: Option<router::core::Rebalancer>,
    result: SimResult,
    /// The virtual clock's zero as an instant.
    base: Instant,
    /// The planner's period (its shortest pool tick).
    tick_every: Duration,
    plans: Vec<PoolPlan>,
    watch: Watch,
    /// Replicas asked for and not joined yet.
    starting: Vec<Pool>,
    series: Vec<Sample>,
    /// Requests not finished (or failed) yet.
    open: usize,
    /// The faults, in time order.
    faults: Vec<Fault>,
    /// Per rack, the share of the link's bandwidth left.
    link_share: Vec<f64>,
    /// The cluster KV store, once a worker using it has joined.
    store: Option<store::SimStore>,
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

/// The table's id of worker `w`.
fn wid(w: usize) -> WorkerId {
    WorkerId(w as u64 + 1)
}

/// The worker of the table's id `id`.
fn widx(id: WorkerId) -> usize {
    id.0 as usize - 1
}

impl Sim {
    /// A cluster of `cfg` about to receive `requests`.
    pub fn new(mut cfg: SimConfig, mut requests: Vec<SimRequest>) -> engine::Result<Sim> {
        cfg.model.vocab_size = VOCAB;
        for r in &mut requests {
            r.prompt.iter_mut().for_each(|t| *t %= VOCAB as u32);
        }
        let bs = cfg.decode.engine.block_size;
        cfg.router.block_seed = engine::block_hash::identity_seed(&cfg.model, bs);
        cfg.router.disaggregated = cfg.prefill.is_some();
        let identity = engine::identity_of(&cfg.model, bs);
        let liveness = router::core::Liveness {
            stall: cfg.liveness.stall,
            ..Default::default()
        };
        let plans: Vec<PoolPlan> = cfg.scaling.iter().cloned().map(PoolPlan::new).collect();
        let window = cfg
            .scaling
            .iter()
            .map(|s| s.window)
            .max()
            .unwrap_or(Duration::from_secs(10));
        let mut sim = Sim {
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            workers: Vec::new(),
            table: Table::new(identity, liveness, cfg.routing),
            signals: Arc::new(Signals::new(window)),
            ids: 0,
            reqs: (0..requests.len()).map(|_| Req::default()).collect(),
            requests,
            by_id: HashMap::new(),
            waiting: Vec::new(),
            poking: None,
            draining: Vec::new(),
            rebalancer: cfg.kv_rebalance.map(router::core::Rebalancer::new),
            result: SimResult::default(),
            base: Instant::now(),
            tick_every: Duration::from_secs(1),
            watch: Watch::for_plans(&plans),
            plans,
            starting: Vec::new(),
            series: Vec::new(),
            open: 0,
            faults: cfg.faults.clone(),
            link_share: vec![1.0; cfg.liveness.racks.max(1)],
            store: None,
            cfg,
        };
        sim.start_pools()?;
        sim.schedule_load();
        Ok(sim)
    }

    /// Every pool's first workers: a scaled pool's at the planner's initial count.
    fn start_pools(&mut self) -> engine::Result<()> {
        let pools = [
            (Pool::Prefill, self.cfg.prefill.clone()),
            (Pool::Decode, Some(self.cfg.decode.clone())),
        ];
        for (pool, spec) in pools {
            let Some(spec) = spec else { continue };
            let n = match self.plans.iter().find(|p| p.scaling.pool == pool) {
                Some(p) => p.desired() as usize,
                None => spec.replicas,
            };
            for _ in 0..n {
                self.add_worker(pool, &spec)?;
            }
        }
        Ok(())
    }

    /// The requests' arrivals and deadlines, the faults, the planner's first tick.
    fn schedule_load(&mut self) {
        let timeout = ns(self.cfg.router.request_timeout);
        for i in 0..self.requests.len() {
            let at = ns(self.requests[i].at);
            self.reqs[i].at = at;
            self.schedule(at, Event::Arrive(i));
            self.schedule(at + timeout, Event::Timeout(i));
        }
        for i in 0..self.faults.len() {
            self.schedule(ns(self.faults[i].at), Event::Fault(i));
        }
        self.open = self.requests.len();
        if let Some(tick) = self.cfg.scaling.iter().map(|s| s.tick).min() {
            self.schedule(0, Event::Tick);
            self.tick_every = tick;
        }
    }

    fn schedule(&mut self, at: u64, ev: Event) {
        self.seq += 1;
        self.queue.push(Reverse(Scheduled {
            at,
            seq: self.seq,
            ev,
        }));
    }

    /// The virtual time `at` as an `Instant` (the router's core and planner take instants).
    fn instant_at(&self, at: u64) -> Instant {
        self.base + Duration::from_nanos(at)
    }

    /// The virtual clock as an `Instant`.
    pub(crate) fn instant(&self) -> Instant {
        self.instant_at(self.now)
    }

    /// Runs every request to its end.
    pub fn run(mut self) -> SimResult {
        while let Some(Reverse(s)) = self.queue.pop() {
            self.now = s.at;
            self.dispatch(s.ev);
        }
        self.finish()
    }

    fn dispatch(&mut self, ev: Event) {
        match ev {
            Event::Arrive(r) => self.arrive(r),
            Event::Input { req, id, input } => self.input(req, id, *input, self.now),
            Event::Open {
                req,
                id,
                worker,
                remote,
                local_max,
            } => self.open_at(req, id, worker, remote, local_max),
            Event::Prefill {
                req,
                id,
                worker,
                to,
            } => self.prefill_at(req, id, worker, to),
            Event::StepDone(w) => self.step_done(w),
            Event::KvArrived { req, id, decode } => self.kv_arrived(req, id, decode),
            Event::Pause { req, id, worker } => self.pause_at(req, id, worker),
            Event::Handoff {
                req,
                id,
                from,
                paused,
                decode,
                skip,
            } => self.handoff_at(req, id, (from, paused), decode, skip),
            Event::TransferFailed { req, id } => {
                let why = "the KV transfer did not complete within its deadline".into();
                let failed = Input::PrefillFailed(proto::Cause::KvTransfer, why);
                self.input(req, id, failed, self.now)
            }
            Event::PrefillReturned { req, id } => self.prefill_returned(req, id),
            Event::AdmissionDeadline { req, id } => self.admission_deadline(req, id),
            Event::Timeout(r) => self.timeout(r),
            Event::Tick => self.tick(self.tick_every),
            Event::WorkerUp(pool) => self.worker_up(pool),
            Event::Fault(i) => self.strike(i),
            Event::Thaw(w) => self.thaw(w),
            Event::LinkRestored(rack) => self.link_share[rack] = 1.0,
            Event::Beat(w) => self.beat(w),
        }
    }

    fn kv_bytes_per_token(&self) -> u64 {
        // Keys and values, f16, every layer.
        (self.cfg.model.n_layers * self.cfg.model.kv_width() * 2 * 2) as u64
    }

    fn finish(mut self) -> SimResult {
        // The run ends with its last token (a planner tick may come after it).
        let end = self.reqs.iter().map(|q| q.last).max().unwrap_or(self.now);
        for (r, q) in self.reqs.iter_mut().enumerate() {
            let error = q.error.clone().or_else(|| {
                (q.tokens < self.requests[r].output).then(|| "did not finish".to_string())
            });
            self.result.outcomes.push(Outcome {
                ttft: q.first.map(|t| Duration::from_nanos(t - q.at)),
                gaps: std::mem::take(&mut q.gaps),
                e2e: Duration::from_nanos(q.last.saturating_sub(q.at)),
                tokens: q.tokens,
                error,
                phases: std::mem::take(&mut q.phases),
                decisions: std::mem::take(&mut q.decisions),
                refusals: q.refusals,
                answer: None,
            });
        }
        for w in &self.workers {
            let load = w.engine.load();
            self.result.prompt_tokens += load.prompt_tokens;
            self.result.prefix_hit_tokens += load.prefix_hit_tokens;
            self.result.tier_hits[0] += load.tiers.host.hits;
            self.result.tier_hits[1] += load.tiers.disk.hits;
            let (p, q) = (&mut self.result.preemptions, load.preemptions);
            p.swapped += q.swapped;
            p.recomputed += q.recomputed;
            p.resumed_tokens += q.resumed_tokens;
            p.resumed_hit_tokens += q.resumed_hit_tokens;
            let (s, t) = (&mut self.result.speculation, load.speculation);
            s.proposed += t.proposed;
            s.accepted += t.accepted;
            s.verifies += t.verifies;
            s.declined += t.declined;
            let lived = w.stopped.unwrap_or(end).saturating_sub(w.started);
            *self.result.worker_seconds.entry(w.pool.name()).or_default() += lived as f64 / 1e9;
        }
        self.result.duration = Duration::from_nanos(end);
        self.result.series = self.series;
        self.result
    }
}
