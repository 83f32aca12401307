//! Peer fetch: the decode worker a prefill sends to holds the prompt's first blocks (the
//! conversation's previous turn, found in its prefix cache when it reserved the request): the
//! prefill worker fetches the ones it lacks from that worker instead of computing them.
//!
//! A decode worker with `[kv_transfer] peer_fetch` serves its cached blocks on a listener of
//! its own, speaking the cluster store's data protocol (gets only; mutual TLS, workers'
//! certificates only, as the store's data connections): each get's blocks are copied out of
//! its pool by the engine thread between two steps, at most [`MAX_BLOCKS`] a get, on at most
//! [`store::data::MAX_PEER_CONNECTIONS`] connections at once. The router
//! names that endpoint in the prefill request beside the tokens the decode worker holds; the
//! prefill worker asks for the blocks of those tokens past the run it holds itself, stages
//! what comes in G2 (checksums checked there), and its prefix lookup loads them like its own.
//! A slow or failed fetch costs at most its deadline and computes the rest, counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::StoreBlock;
use pki::{Role, Security};
use store::data::{self, Fetched};
use store::ObjectKey;
use types::BlockHash;

use crate::EngineHandle;

/// Most blocks one get asks for (and one export copies between two steps: ~23 MB of SmolLM2's
/// KV, a few milliseconds).
pub const MAX_BLOCKS: usize = 64;

/// What a worker did with peer fetch, since it started.
#[derive(Debug, Default)]
pub struct PeerCounters {
    /// Prefill: blocks fetched from decode workers.
    pub hits: AtomicU64,
    /// Prefill: bytes fetched.
    pub bytes_loaded: AtomicU64,
    /// Prefill: microseconds spent fetching.
    pub load_us: AtomicU64,
    /// Prefill: fetches that failed or ran out of time.
    pub fetch_failures: AtomicU64,
    /// Decode: blocks served to fetches.
    pub served: AtomicU64,
}

/// Fills the peer-fetch figures into a worker's load.
pub fn fill(c: &PeerCounters, l: &mut proto::grpc::WorkerLoad) {
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    l.kv_peer_hits = get(&c.hits);
    l.kv_peer_bytes_loaded = get(&c.bytes_loaded);
    l.kv_peer_load_seconds = get(&c.load_us) as f64 / 1e6;
    l.kv_peer_fetch_failures = get(&c.fetch_failures);
    l.kv_peer_served = get(&c.served);
}

/// A decode worker's side: serves the cached blocks of `model` (its store key) its engine
/// holds to the workers that connect to `listener`, for as long as the process lives.
pub fn serve<C: Send + 'static>(
    listener: tokio::net::TcpListener,
    security: Security,
    engine: EngineHandle<C>,
    model: u64,
    counters: Arc<PeerCounters>,
) {
    let export = move |keys: Vec<ObjectKey>| {
        let (engine, counters) = (engine.clone(), counters.clone());
        async move {
            // Another model's keys are not held here: the answer stops at the first.
            let hashes: Vec<BlockHash> = keys
                .iter()
                .take_while(|k| k.model == model)
                .take(MAX_BLOCKS)
                .map(|k| k.block)
                .collect();
            let blocks = engine.export(hashes).await.unwrap_or_default();
            counters
                .served
                .fetch_add(blocks.len() as u64, Ordering::Relaxed);
            let fetched = blocks.into_iter().map(|b| Fetched {
                data: b.bytes,
                sum: b.sum,
            });
            fetched.collect()
        }
    };
    tokio::spawn(async move {
        if let Err(e) = data::serve_gets(listener, &security, export).await {
            tracing::error!("peer fetch listener: {e}");
        }
    });
}

/// A prefill worker's way to fetch blocks from decode workers.
#[derive(Clone)]
pub struct PeerLink {
    /// The block names' seed and the store key of this engine's blocks.
    names: (u64, u64),
    block_size: usize,
    security: Security,
    /// Longest a fetch may take (then the rest is computed).
    timeout: Duration,
    /// What it fetched.
    pub counters: Arc<PeerCounters>,
}

impl PeerLink {
    /// The link of a worker of `settings` whose engine names its blocks with `names` (see
    /// [`engine::Engine::store_names`]); `None` where peer fetch is off or its blocks could not
    /// be staged (no host tier: logged).
    pub fn new(settings: &crate::Settings, names: Option<(u64, u64)>) -> Option<PeerLink> {
        if !settings.peer_fetch {
            return None;
        }
        let (Some(names), true) = (names, settings.engine.tiers.host_bytes > 0) else {
            tracing::warn!("peer fetch is on, but this worker has no prefix cache or no host tier to stage fetched blocks in: not used");
            return None;
        };
        Some(PeerLink {
            names,
            block_size: settings.engine.block_size,
            security: settings.security.clone(),
            timeout: settings.store_fetch_timeout,
            counters: Arc::default(),
        })
    }

    /// The blocks of `wanted` the decode worker at `endpoint` holds, in order up to the first
    /// it does not or the deadline; each checked against its checksum when staged.
    pub async fn fetch(&self, endpoint: &str, wanted: &[BlockHash]) -> Vec<StoreBlock> {
        let t0 = Instant::now();
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut got = Vec::new();
        let r = tokio::time::timeout_at(deadline, self.get(endpoint, wanted, deadline, &mut got));
        let failed = match r.await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(format!("no answer within {:?}", self.timeout)),
        };
        let c = &self.counters;
        if let Some(why) = failed {
            tracing::warn!("peer fetch from {endpoint} failed ({why}): computing the rest");
            c.fetch_failures.fetch_add(1, Ordering::Relaxed);
        }
        c.hits.fetch_add(got.len() as u64, Ordering::Relaxed);
        let bytes = got.iter().map(|b| b.bytes.len() as u64).sum::<u64>();
        c.bytes_loaded.fetch_add(bytes, Ordering::Relaxed);
        c.load_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        got
    }

    /// Gets `wanted` from `endpoint` [`MAX_BLOCKS`] at a time into `got`, until one answer
    /// comes short.
    async fn get(
        &self,
        endpoint: &str,
        wanted: &[BlockHash],
        deadline: tokio::time::Instant,
        got: &mut Vec<StoreBlock>,
    ) -> Result<(), String> {
        let conn = data::Client::connect_to(endpoint, &self.security, Role::Decode, deadline);
        let mut conn = conn.await.map_err(|e| e.to_string())?;
        for part in wanted.chunks(MAX_BLOCKS) {
            let keys: Vec<(u64, u64)> = part.iter().map(|h| (self.names.1, h.0)).collect();
            let objects = conn.get(&keys, deadline).await.map_err(|e| e.to_string())?;
            let n = objects.len();
            got.extend(part.iter().zip(objects).map(|(&hash, f)| StoreBlock {
                hash,
                bytes: f.data,
                sum: f.sum,
            }));
            if n < part.len() {
                break;
            }
        }
        Ok(())
    }
}

/// Fetches from the decode worker at `endpoint` the blocks of the first `held_there` tokens
/// of `prompt` the engine behind `engine` lacks, and stages them there ahead of the command
/// that follows. Returns how many of the prompt's first blocks are now held or staged here.
pub async fn prefetch<C: Send + 'static>(
    link: &PeerLink,
    engine: &EngineHandle<C>,
    endpoint: &str,
    (prompt, held_there): (&[u32], usize),
    salt: Option<&str>,
) -> Result<usize, tonic::Status> {
    // All but the prompt's last token are ever found cached.
    let known = &prompt[..held_there.min(prompt.len().saturating_sub(1))];
    let root = engine::block_hash::root(salt);
    let blocks = engine::block_hash::prompt_hashes(link.names.0, root, link.block_size, known);
    let held = engine.held_run(&blocks);
    if held >= blocks.len() {
        return Ok(held);
    }
    let fetched = link.fetch(endpoint, &blocks[held..]).await;
    let n = fetched.len();
    if n > 0 {
        engine.stage(fetched)?;
    }
    Ok(held + n)
}
