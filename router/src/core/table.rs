//! The router's table of workers, with no I/O: who joined, their load as their last heartbeat
//! said it, what the router counts on each (requests in flight, a prefill worker's queued
//! prompt tokens), the KV index of their caches, the line of requests waiting for room, and
//! picking a worker for a request by the routing policy. Time is passed in: the router keeps
//! one table behind a lock (`registry::Registry` adds the change channels and the `Control`
//! service), the simulator keeps one on its virtual clock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::grpc::{self, Heartbeat, JoinRequest, KvOffer, WorkerLoad};
use proto::{ModelIdentity, Pool};
use serde::{Serialize, Serializer};
use types::{BlockHash, Tier, WorkerId};

use super::line::Line;
use crate::kv_index::{KvIndex, Overlap};
use crate::routing::{self, Candidate, Policy, Routing};

/// One joined worker.
#[derive(Debug, Clone, Serialize)]
pub struct Worker {
    /// Its id (the router's, or its etcd registration's).
    pub id: WorkerId,
    /// Its pool.
    #[serde(rename = "role")]
    pub pool: Pool,
    /// Name it gave.
    pub name: String,
    /// gRPC endpoint.
    pub endpoint: String,
    /// Where prefill workers may send it KV (decode workers).
    #[serde(rename = "kv_offers", serialize_with = "offers")]
    pub offers: Vec<KvOffer>,
    /// Where it serves prefill workers the KV it holds (decode workers with peer fetch on;
    /// empty: it does not).
    pub peer_endpoint: String,
    /// KV transfers this worker made, by transport (prefill workers).
    pub kv_transfers: BTreeMap<String, u64>,
    /// The last prefill's queue + compute time and exposed KV wait, µs (prefill workers).
    pub last_prefill_us: (u64, u64),
    /// Where the worker serves Prometheus metrics (`host:port`).
    pub metrics_endpoint: String,
    /// What its engine computes on.
    pub device: String,
    /// Being drained by the planner: takes no new requests.
    pub draining: bool,
    /// Its last heartbeat's load.
    pub load: WorkerLoad,
    /// Requests the router has in flight on it.
    #[serde(serialize_with = "count")]
    pub in_flight: Arc<AtomicUsize>,
    /// Prefill: prompt tokens the router sent it that are not done yet.
    #[serde(serialize_with = "count64")]
    pub queued_tokens: Arc<AtomicU64>,
    /// Making no progress: it holds work but its engine's step count has stood still for the
    /// stall timeout (a wedged engine), or a request of it saw no token for that long. Not
    /// routed to until its steps move again.
    pub stalled: bool,
    /// Heartbeats since it joined: a request it refused asks it again only after its next.
    #[serde(skip)]
    pub beats: u64,
    #[serde(skip)]
    last_beat: Instant,
    /// Its engine's step count and when it last moved.
    #[serde(skip)]
    progress: (u64, Instant),
    /// The KV blocks it said it has when it joined: the most the KV index holds for it.
    #[serde(skip)]
    pub kv_capacity: u64,
    /// Decode: sequences the rebalancer asked to move off it that no request has taken up yet
    /// ([`Table::claim_shed`]).
    #[serde(skip)]
    pub shed: u32,
}

fn offers<S: Serializer>(o: &[KvOffer], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(o.iter().map(|o| (&o.transport, &o.endpoint)))
}

fn count<S: Serializer>(n: &Arc<AtomicUsize>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(n.load(Ordering::SeqCst) as u64)
}

fn count64<S: Serializer>(n: &Arc<AtomicU64>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(n.load(Ordering::SeqCst))
}

impl Worker {
    /// Requests in flight on it (the router's count).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// When its last heartbeat (or its join) arrived.
    pub fn last_beat(&self) -> Instant {
        self.last_beat
    }

    /// Whether it can take requests: not draining, not stalled.
    pub fn usable(&self) -> bool {
        !self.draining && !self.stalled
    }

    /// What the routing policy weighs of it, holding `cached` prompt tokens — the one
    /// definition of a worker's load: requests the router has in flight on it, plus those
    /// queued there and those whose KV is arriving, as its last heartbeat said.
    pub fn candidate(&self, cached: usize) -> Candidate {
        Candidate {
            load: self.in_flight() + (self.load.waiting + self.load.pending_transfers) as usize,
            cached,
            queued_tokens: self.queued_tokens.load(Ordering::SeqCst),
            rate: self.load.prompt_tokens_per_s as f64,
        }
    }
}

/// The most tier blocks of one worker the KV index keeps (16 M: about 1 GiB of index), whatever
/// the worker claims: what a joined peer can make the router allocate is bounded.
pub const MAX_TIER_BLOCKS: u64 = 1 << 24;

/// A worker's measured prompt tokens per second, or the pool's `rate` before it has one.
fn own_rate(w: &Worker, rate: f64) -> f64 {
    match w.load.prompt_tokens_per_s as f64 {
        r if r > 0.0 => r,
        _ => rate,
    }
}

/// When the router gives up on a worker.
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    /// A worker silent this long (no heartbeat) is dropped.
    pub heartbeat: Duration,
    /// A worker holding work whose engine made no step this long is stalled.
    pub stall: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            heartbeat: Duration::from_secs(2),
            stall: Duration::from_secs(10),
        }
    }
}

/// Counts a request (and, on a prefill worker, its prompt tokens) against a worker's load while
/// alive.
#[derive(Debug)]
pub struct InFlight {
    n: Arc<AtomicUsize>,
    tokens: Arc<AtomicU64>,
    queued: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.n.fetch_sub(1, Ordering::SeqCst);
        self.tokens.fetch_sub(self.queued, Ordering::SeqCst);
    }
}

/// What routing a request needs to know of it.
#[derive(Debug, Clone, Default)]
pub struct Route {
    /// The names of the prompt's whole blocks ([`engine::block_hash::prompt_hashes`]) the
    /// worker could hold; empty when the policy does not look at caches.
    pub blocks: Vec<BlockHash>,
    /// Prompt tokens a prefill worker would compute without its cache.
    pub prompt_tokens: usize,
    /// Prefill: leading blocks the request's decode worker holds and serves to prefill workers
    /// (peer fetch); 0 where it serves none.
    pub peer_blocks: usize,
}

/// Whether the prefill worker fetches the blocks the request's decode worker holds of the
/// prompt (peer fetch) instead of computing them, and why: a fetched block is worth what its
/// measured fetch time saves against computing it ([`routing::tier_weight`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerFetch {
    /// The decode worker serves no peers, or holds nothing the prefill worker lacks.
    Nothing,
    /// Fetching is worth something (before a measurement: [`routing::UNMEASURED_PEER_WEIGHT`]).
    Cheaper,
    /// Fetching a block took this prefill worker as long as computing it: it computes.
    Dearer,
    /// Measured dearer, fetched anyway to measure again (one such decision in
    /// [`PEER_PROBE_EVERY`]): the network or the load may have changed.
    Probe,
}

impl PeerFetch {
    /// Whether the prefill worker is told where to fetch.
    pub fn fetches(self) -> bool {
        matches!(self, PeerFetch::Cheaper | PeerFetch::Probe)
    }

    /// Its label in `tandem_router_peer_fetch_total{decision}`.
    pub fn label(self) -> &'static str {
        match self {
            PeerFetch::Nothing => "nothing",
            PeerFetch::Cheaper => "fetch",
            PeerFetch::Dearer => "compute",
            PeerFetch::Probe => "probe",
        }
    }
}

/// One decision in this many that finds peer fetch dearer than computing fetches anyway.
pub const PEER_PROBE_EVERY: u64 = 32;

/// A worker chosen for a request.
#[derive(Debug)]
pub struct Picked {
    /// The worker.
    pub worker: WorkerId,
    /// Counts the request against it until dropped.
    pub guard: InFlight,
    /// Prompt tokens it holds in its cache, by the index.
    pub cached_tokens: usize,
    /// Prefill: whether it fetches what the decode worker holds ([`Route::peer_blocks`]).
    pub peer: PeerFetch,
}

/// Why a worker may not join.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinRefused {
    /// It speaks another protocol version.
    #[error("worker {name} speaks protocol version {theirs}, the router {ours}")]
    Protocol {
        /// The worker's name.
        name: String,
        /// Its version.
        theirs: u32,
        /// The router's.
        ours: u32,
    },
    /// Its model cannot exchange KV with the cluster's.
    #[error(
        "worker {name} cannot exchange KV with this cluster's model ({diff}; router vs worker)"
    )]
    Model {
        /// The worker's name.
        name: String,
        /// What differs.
        diff: String,
    },
    /// Its role is neither prefill nor decode.
    #[error("role must be prefill or decode")]
    Role,
}

/// What a heartbeat changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beaten {
    /// The KV index missed some of the worker's events and wants a snapshot of its cache.
    pub resync: bool,
    /// The worker was found stalled: its engine's steps stood still while it held work.
    pub stalled: bool,
    /// The worker said it drains, for the first time (its requests may move off it).
    pub draining: bool,
}

/// The worker a heartbeat named is not in the table (it joins again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("unknown worker {0}; join again")]
pub struct UnknownWorker(pub WorkerId);

/// All joined workers, the KV index of their caches and the line of requests waiting for room.
#[derive(Debug)]
pub struct Table {
    identity: ModelIdentity,
    next_id: u64,
    /// Each pool's workers (prefill, decode), by id: a pick looks at its pool only.
    workers: [BTreeMap<WorkerId, Worker>; 2],
    index: KvIndex,
    routing: Routing,
    /// Round-robin counters: prefill, decode.
    turns: [usize; 2],
    /// Peer-fetch decisions that found fetching dearer (every [`PEER_PROBE_EVERY`]-th probes).
    peer_dearer: u64,
    /// When a worker is given up on.
    pub liveness: Liveness,
    /// The requests waiting for a decode worker with room.
    pub line: Line,
    /// The cluster store's key for this model's blocks, as the first worker using a store
    /// announced it (the key the router follows the store's holdings of).
    store_model: Option<u64>,
}

impl Table {
    /// A table admitting workers compatible with `identity`, giving up on them by `liveness`,
    /// routing by `routing`.
    pub fn new(identity: ModelIdentity, liveness: Liveness, routing: Routing) -> Table {
        Table {
            identity,
            next_id: 1,
            workers: Default::default(),
            index: KvIndex::default(),
            routing,
            turns: [0; 2],
            peer_dearer: 0,
            liveness,
            line: Line::default(),
            store_model: None,
        }
    }

    /// The cluster store's key for this model's blocks, once a worker using it has joined.
    pub fn store_model(&self) -> Option<u64> {
        self.store_model
    }

    /// The KV index, to follow the store's holdings in.
    pub fn index_mut(&mut self) -> &mut KvIndex {
        &mut self.index
    }

    /// Tokens per KV block in this cluster.
    pub fn block_size(&self) -> usize {
        self.identity.block_size as usize
    }

    /// How this table routes.
    pub fn policy(&self) -> Policy {
        self.routing.policy
    }

    /// Block entries in the KV index (one per block per worker holding it).
    pub fn indexed_blocks(&self) -> usize {
        self.index.len()
    }

    /// The KV index's entries by tier: the pool's, host memory's, disk's.
    pub fn indexed_by_tier(&self) -> [usize; 3] {
        self.index.by_tier()
    }

    /// The workers: the prefill pool's, then the decode pool's, each by id.
    pub fn iter(&self) -> impl Iterator<Item = &Worker> {
        self.workers.iter().flat_map(|m| m.values())
    }

    /// The workers of `pool`, by id.
    pub fn pool(&self, pool: Pool) -> impl Iterator<Item = &Worker> {
        self.workers[slot(pool)].values()
    }

    /// Worker `id`, if it is here.
    pub fn get(&self, id: WorkerId) -> Option<&Worker> {
        self.workers.iter().find_map(|m| m.get(&id))
    }

    fn get_mut(&mut self, id: WorkerId) -> Option<&mut Worker> {
        self.workers.iter_mut().find_map(|m| m.get_mut(&id))
    }

    /// Takes worker `id` out of its pool's map.
    fn take(&mut self, id: WorkerId) -> Option<Worker> {
        self.workers.iter_mut().find_map(|m| m.remove(&id))
    }

    /// Number of workers of a pool that take requests.
    pub fn count(&self, pool: Pool) -> usize {
        self.pool(pool).filter(|w| w.usable()).count()
    }

    /// Drops the workers silent past the heartbeat timeout at `now`; returns them.
    pub fn prune(&mut self, now: Instant) -> Vec<WorkerId> {
        let timeout = self.liveness.heartbeat;
        let gone: Vec<WorkerId> = self
            .iter()
            .filter(|w| now.saturating_duration_since(w.last_beat) >= timeout)
            .map(|w| w.id)
            .collect();
        for &id in &gone {
            let w = self.take(id).expect("listed");
            tracing::warn!(worker = %id, name = %w.name, "worker missed its heartbeats; dropped");
            self.index.remove_worker(id);
        }
        gone
    }

    /// Forgets a worker at once (its connection broke, its lease expired), and its cache;
    /// whether it was here.
    pub fn remove(&mut self, id: WorkerId) -> bool {
        let here = self.take(id).is_some();
        if here {
            self.index.remove_worker(id);
            tracing::warn!(worker = %id, "worker removed");
        }
        here
    }

    /// Asks `n` of the sequences decoding on worker `id` to move off it (the rebalancer).
    pub fn shed(&mut self, id: WorkerId, n: u32) {
        if let Some(w) = self.get_mut(id) {
            w.shed = n;
        }
    }

    /// Whether a request decoding on worker `id` is to move off it: one of those the
    /// rebalancer asked for, taken up by this call.
    pub fn claim_shed(&mut self, id: WorkerId) -> bool {
        match self.get_mut(id) {
            Some(w) if w.shed > 0 && w.usable() => {
                w.shed -= 1;
                true
            }
            _ => false,
        }
    }

    /// Stops routing new requests to worker `id` (it is being drained).
    pub fn set_draining(&mut self, id: WorkerId) {
        if let Some(w) = self.get_mut(id) {
            w.draining = true;
        }
    }

    /// Marks worker `id` stalled (a request of it saw no token within the stall timeout): it is
    /// not routed to until its engine's steps move again.
    pub fn set_stalled(&mut self, id: WorkerId) {
        if let Some(w) = self.get_mut(id) {
            tracing::warn!(worker = %id, name = %w.name, "worker stalled: a request saw no progress");
            w.stalled = true;
        }
    }

    /// When worker `id` is lost unless a heartbeat comes first; `None` when it is lost already
    /// (removed, or stalled).
    pub fn due(&self, id: WorkerId) -> Option<Instant> {
        match self.get(id) {
            Some(w) if !w.stalled => Some(w.last_beat + self.liveness.heartbeat),
            _ => None,
        }
    }

    /// The workers of `pool` that take requests and that `keep` keeps, in id order, with what
    /// the policy weighs of each for `route`.
    pub fn candidates(
        &self,
        pool: Pool,
        keep: impl Fn(&Worker) -> bool,
        route: &Route,
    ) -> (Vec<WorkerId>, Vec<Candidate>) {
        let is = |w: &Worker| w.pool == pool && w.usable() && keep(w);
        let ws: Vec<&Worker> = self.pool(pool).filter(|w| is(w)).collect();
        let ids: Vec<WorkerId> = ws.iter().map(|w| w.id).collect();
        if ids.is_empty() {
            return (ids, Vec::new());
        }
        // The candidates' cached prefixes only (asked of the few holding the first block); `ids`
        // is in id order.
        let overlap = match self.routing.policy {
            Policy::Kv => self
                .index
                .overlap_in(&route.blocks, |w| ids.binary_search(&w).is_ok()),
            _ => Default::default(),
        };
        let bs = self.block_size();
        let rate = self.prefill_rate();
        // A worker holding none of the prompt's first block fetches what the store holds.
        let fetched = Overlap {
            store: match self.routing.policy {
                Policy::Kv => self.index.store_run(&route.blocks),
                _ => 0,
            },
            ..Overlap::default()
        };
        let c = ws
            .iter()
            .map(|w| {
                let o = overlap.get(&w.id).copied().unwrap_or(fetched);
                let weights = self.tier_weights(w, rate);
                // What the decode worker holds past them, fetched at its measured cost.
                let peer = match route.peer_blocks.saturating_sub(o.blocks()) {
                    0 => 0.0,
                    n => n as f64 * self.peer_weight(w, rate),
                };
                w.candidate(((o.weighed(&weights) + peer) * bs as f64).round() as usize)
            })
            .collect();
        (ids, c)
    }

    /// The prefill pool's mean measured rate (prompt tokens/s), or [`routing::DEFAULT_RATE`].
    fn prefill_rate(&self) -> f64 {
        let (n, sum) = self
            .pool(Pool::Prefill)
            .map(|w| w.load.prompt_tokens_per_s as f64)
            .filter(|&r| r > 0.0)
            .fold((0, 0.0), |(n, s), r| (n + 1, s + r));
        if n == 0 {
            return routing::DEFAULT_RATE;
        }
        sum / n as f64
    }

    /// What a block in each of worker `w`'s tiers, then in the store, counts for (the pool's
    /// 1 first): the configured weights, else each tier's measured load time a block against
    /// computing it at `rate` (the worker's own rate where it measured one).
    fn tier_weights(&self, w: &Worker, rate: f64) -> [f64; 4] {
        let rate = own_rate(w, rate);
        let bs = self.block_size();
        let l = &w.load;
        let measured = |seconds: f64, blocks: u64, unmeasured: f64| match blocks {
            0 => unmeasured,
            n => routing::tier_weight(seconds / n as f64, bs, rate),
        };
        let store = measured(
            l.kv_store_load_seconds,
            l.kv_store_hits,
            routing::UNMEASURED_STORE_WEIGHT,
        );
        if let Some(([host, disk], configured)) = self.routing.tier_weights {
            return [1.0, host, disk, configured.unwrap_or(store)];
        }
        let [host, disk] = routing::UNMEASURED_TIER_WEIGHTS;
        [
            1.0,
            measured(l.kv_host_load_seconds, l.kv_host_hits, host),
            measured(l.kv_disk_load_seconds, l.kv_disk_hits, disk),
            store,
        ]
    }

    /// What a block prefill worker `w` fetches from a decode worker counts for: its measured
    /// fetch time a block (failed fetches' time included) against computing the block at
    /// `rate` (its own where measured); [`routing::UNMEASURED_PEER_WEIGHT`] before it fetched.
    fn peer_weight(&self, w: &Worker, rate: f64) -> f64 {
        let l = &w.load;
        match (l.kv_peer_hits, l.kv_peer_fetch_failures) {
            (0, 0) => routing::UNMEASURED_PEER_WEIGHT,
            (0, _) => 0.0,
            (n, _) => {
                let per_block = l.kv_peer_load_seconds / n as f64;
                routing::tier_weight(per_block, self.block_size(), own_rate(w, rate))
            }
        }
    }

    /// The decode worker a prefill worker may fetch `route`'s first blocks from (peer fetch),
    /// and the tokens it holds in whole blocks: the request's decode worker `decode`, which
    /// holds the first `skip` for it, unless another decode worker serving peers holds a
    /// longer run in its pool and host tier by the KV index; `None` where none serves or holds any.
    pub fn peer_source(
        &self,
        decode: WorkerId,
        skip: usize,
        route: &Route,
    ) -> Option<(WorkerId, usize)> {
        let bs = self.block_size();
        let serves = |id: WorkerId| {
            self.get(id).is_some_and(|w| {
                w.pool == Pool::Decode && !w.stalled && !w.peer_endpoint.is_empty()
            })
        };
        let own = serves(decode).then_some((decode, skip / bs * bs));
        let other = match self.routing.policy {
            Policy::Kv => self
                .index
                .overlap_in(&route.blocks, |w| w != decode && serves(w))
                .into_iter()
                // What a decode worker serves peers: its pool's blocks and its host tier's.
                .map(|(w, o)| (w, (o.of(Tier::Pool) + o.of(Tier::Host)) * bs))
                .max_by_key(|&(w, tokens)| (tokens, std::cmp::Reverse(w))),
            _ => None,
        };
        match (own, other) {
            (Some(own), Some(other)) if other.1 > own.1 => Some(other),
            (own, other) => own.or(other),
        }
        .filter(|&(_, tokens)| tokens > 0)
    }

    /// Whether prefill worker `w` fetches `route`'s peer blocks it lacks.
    fn peer_fetch(&mut self, w: WorkerId, route: &Route) -> PeerFetch {
        let Some(worker) = self.get(w).filter(|_| route.peer_blocks > 0) else {
            return PeerFetch::Nothing;
        };
        let peer = &route.blocks[..route.peer_blocks.min(route.blocks.len())];
        let own = self.index.overlap_in(peer, |x| x == w);
        if own.get(&w).map_or(0, |o| o.tiers.iter().sum()) >= peer.len() {
            return PeerFetch::Nothing;
        }
        if self.peer_weight(worker, self.prefill_rate()) > 0.0 {
            return PeerFetch::Cheaper;
        }
        self.peer_dearer += 1;
        match self.peer_dearer % PEER_PROBE_EVERY {
            0 => PeerFetch::Probe,
            _ => PeerFetch::Dearer,
        }
    }

    /// The worker of `pool` that the policy chooses for `route` among those `keep` keeps,
    /// counted against it (in flight, and for a prefill its queued tokens) until the guard is
    /// dropped.
    pub fn pick(
        &mut self,
        pool: Pool,
        keep: impl Fn(&Worker) -> bool,
        route: &Route,
    ) -> Option<Picked> {
        let (ids, c) = self.candidates(pool, keep, route);
        let k = slot(pool);
        let turn = self.turns[k];
        self.turns[k] += 1;
        let i = match pool {
            Pool::Decode => routing::decode(self.routing.policy, &c, turn),
            Pool::Prefill => routing::prefill(&self.routing, &c, route.prompt_tokens, turn),
        }?;
        let peer = match pool {
            Pool::Prefill => self.peer_fetch(ids[i], route),
            Pool::Decode => PeerFetch::Nothing,
        };
        let w = &self.workers[k][&ids[i]];
        let queued = match pool {
            Pool::Prefill => route.prompt_tokens.saturating_sub(c[i].cached) as u64,
            Pool::Decode => 0,
        };
        w.in_flight.fetch_add(1, Ordering::SeqCst);
        w.queued_tokens.fetch_add(queued, Ordering::SeqCst);
        let guard = InFlight {
            n: w.in_flight.clone(),
            tokens: w.queued_tokens.clone(),
            queued,
        };
        Some(Picked {
            worker: w.id,
            guard,
            cached_tokens: c[i].cached,
            peer,
        })
    }

    /// The prefill pool's predicted wait: the least time any prefill worker needs for the
    /// tokens already queued on it, with that worker's rate (tokens/s); `None` without one.
    pub fn prefill_wait(&self) -> Option<(Duration, f64)> {
        let (_, mut c) = self.candidates(Pool::Prefill, |_| true, &Route::default());
        routing::fill_rates(&mut c);
        c.iter()
            .map(|x| (x.wait_s(), x.rate_or_default()))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(s, rate)| (Duration::from_secs_f64(s), rate))
    }

    /// The decode worker request `id` must keep off at `now`: the one the line holds for
    /// another (see [`Line::kept_off`]), over the decode workers that take requests.
    pub fn kept_off(&mut self, id: types::RequestId, now: Instant) -> Option<WorkerId> {
        let free: Vec<(WorkerId, u32)> = self
            .pool(Pool::Decode)
            .filter(|w| w.usable())
            .map(|w| (w.id, w.load.kv_blocks_free))
            .collect();
        self.line.kept_off(id, now, &free)
    }

    /// Counts a KV transfer made by worker `id` and keeps its timings.
    pub fn record_transfer(&mut self, id: WorkerId, reply: &grpc::PrefillReply) {
        if let Some(w) = self.get_mut(id) {
            *w.kv_transfers.entry(reply.transport.clone()).or_default() += 1;
            w.last_prefill_us = (reply.compute_us, reply.transfer_us);
        }
    }

    /// Admits a worker that asks to join at `now`, or says why not.
    pub fn join(&mut self, j: JoinRequest, now: Instant) -> Result<WorkerId, JoinRefused> {
        if j.protocol_version != proto::PROTOCOL_VERSION {
            return Err(JoinRefused::Protocol {
                name: j.name,
                theirs: j.protocol_version,
                ours: proto::PROTOCOL_VERSION,
            });
        }
        let theirs: ModelIdentity = j.identity.clone().unwrap_or_default().into();
        if let Some(diff) = self.identity.incompatibility(&theirs) {
            tracing::warn!(name = %j.name, "refused worker: {diff}");
            return Err(JoinRefused::Model { name: j.name, diff });
        }
        let pool = grpc::Role::try_from(j.role)
            .ok()
            .and_then(|r| Pool::try_from(r).ok())
            .ok_or(JoinRefused::Role)?;
        match (j.store_model, self.store_model) {
            (0, _) => {}
            (key, None) => self.store_model = Some(key),
            (key, Some(k)) if key != k => {
                tracing::warn!(name = %j.name, "this worker's blocks have another store key ({key:016x}, not {k:016x}: other weights under the same names); the router follows the first's")
            }
            _ => {}
        }
        // A worker registered in etcd brings its cluster-wide id; joining again (through the
        // watch and through this call, or after an outage) changes nothing.
        let id = match WorkerId(j.worker_id) {
            WorkerId(0) => {
                self.next_id += 1;
                WorkerId(self.next_id - 1)
            }
            id if self.get(id).is_some() => return Ok(id),
            id => id,
        };
        let w = joined(id, pool, j, now);
        tracing::info!(worker = %id, %pool, name = %w.name, endpoint = %w.endpoint, "worker joined");
        self.workers[slot(pool)].insert(id, w);
        Ok(id)
    }

    /// Records a heartbeat at `now` and its KV events.
    pub fn beat(&mut self, b: Heartbeat, now: Instant) -> Result<Beaten, UnknownWorker> {
        let id = WorkerId(b.worker_id);
        let stall = self.liveness.stall;
        let w = self.get_mut(id).ok_or(UnknownWorker(id))?;
        w.load = b.load.unwrap_or_default();
        let draining = w.load.draining && !w.draining;
        if draining {
            // Sent SIGTERM (or told to drain): it admits nothing new, so nothing is routed to it.
            tracing::info!(worker = %id, name = %w.name, "worker draining: no new requests");
            w.draining = true;
        }
        w.last_beat = now;
        w.beats += 1;
        let was = w.stalled;
        w.stalled = stalled(w, now, stall);
        if w.stalled != was {
            tracing::warn!(worker = %id, name = %w.name, stalled = w.stalled, "worker progress");
        }
        let stalled = w.stalled && !was;
        let cap = w.kv_capacity as usize;
        let resync = match &b.kv {
            Some(kv) => self.index.apply(id, kv, cap),
            None => false,
        };
        Ok(Beaten {
            resync,
            stalled,
            draining,
        })
    }
}

/// `pool`'s place in the table's maps.
fn slot(pool: Pool) -> usize {
    match pool {
        Pool::Prefill => 0,
        Pool::Decode => 1,
    }
}

/// A worker that just joined with `j` at `now`.
fn joined(id: WorkerId, pool: Pool, j: JoinRequest, now: Instant) -> Worker {
    Worker {
        id,
        pool,
        name: j.name,
        endpoint: j.endpoint,
        offers: j.kv_offers,
        peer_endpoint: j.peer_endpoint,
        kv_transfers: BTreeMap::new(),
        last_prefill_us: (0, 0),
        metrics_endpoint: j.metrics_endpoint,
        device: j.device,
        draining: false,
        load: WorkerLoad {
            kv_blocks_free: j.kv_blocks_total,
            kv_blocks_total: j.kv_blocks_total,
            ..Default::default()
        },
        in_flight: Arc::new(AtomicUsize::new(0)),
        shed: 0,
        queued_tokens: Arc::new(AtomicU64::new(0)),
        stalled: false,
        beats: 0,
        last_beat: now,
        progress: (0, now),
        kv_capacity: (j.kv_blocks_total as u64)
            .saturating_add(j.kv_tier_blocks.min(MAX_TIER_BLOCKS)),
    }
}

/// Whether `w`, whose heartbeat just arrived at `now`, is stalled: its engine's steps stood
/// still for `stall` while it held work — or, marked stalled by a request, have not moved since.
fn stalled(w: &mut Worker, now: Instant, stall: Duration) -> bool {
    let busy = w.load.running + w.load.waiting > 0;
    if w.load.engine_steps != w.progress.0 || !busy {
        // Moving, or idle and answering (its load is fresh): the stall clock starts over.
        w.progress = (w.load.engine_steps, now);
        return false;
    }
    w.stalled || now.saturating_duration_since(w.progress.1) >= stall
}
