//! A worker's way to the cluster KV store (`tandem store`): the blocks its engine computes are
//! put there by a task of their own — offered in batches (a block the node holds already costs
//! nothing), their bytes streamed — and a request's prompt blocks the store holds are fetched
//! before the request reaches the engine, then staged below its pool.
//!
//! Nothing here slows a step: the engine thread hands blocks over with `try_send` (a full
//! queue drops them, counted), and a fetch waits at most its deadline (a slow or dead node
//! means the prompt is computed, as without a store).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::StoreBlock;
use proto::grpc::store_client::StoreClient;
use proto::grpc::{ObjectKey, PutOutcome, PutSpec, PutStartRequest, StoreStatsRequest};
use store::data;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use types::BlockHash;

/// Blocks waiting for the uploader at once.
pub const QUEUE: usize = 256;
/// Most blocks one offer names.
const BATCH: usize = 64;
/// Idle data connections kept to each node.
const POOL: usize = 8;
/// Longest one batch's put may take (a frozen node): its blocks are then dropped, counted, and
/// the next batch tries again.
const PUT_DEADLINE: Duration = Duration::from_secs(10);

/// What a worker did with the store, since it started.
#[derive(Debug, Default)]
pub struct StoreCounters {
    /// Blocks published by this worker's puts (each copy on each node it is placed on).
    pub puts: AtomicU64,
    /// Blocks offered that the node held already.
    pub held: AtomicU64,
    /// Blocks not put: refused by the node (full, busy), failed, or dropped on the way (the
    /// queue full, the node unreachable).
    pub dropped: AtomicU64,
    /// Blocks fetched for prompts.
    pub hits: AtomicU64,
    /// Bytes fetched.
    pub bytes_loaded: AtomicU64,
    /// Microseconds spent fetching.
    pub load_us: AtomicU64,
    /// Fetches that failed or ran out of time.
    pub fetch_failures: AtomicU64,
    /// The nodes used now.
    pub nodes: AtomicU64,
    /// Blocks put back on a node that lacked them (read repair; each then counted in `puts`,
    /// `held` or `dropped` as any put).
    pub repaired: AtomicU64,
}

/// How long a worker leaves the store alone after a fetch failed or ran out of time: a frozen
/// or unreachable node costs one request its fetch timeout, not every request.
const BACKOFF: Duration = Duration::from_secs(2);

/// One node of the store as a worker uses it.
#[derive(Clone)]
struct Node {
    uri: String,
    client: StoreClient<Channel>,
    /// Until when fetches skip it (after a failed one).
    backoff: Arc<std::sync::Mutex<Option<Instant>>>,
    /// Its data connections not in use.
    idle: Arc<std::sync::Mutex<Vec<data::Client>>>,
}

impl Node {
    fn resting(&self, now: Instant) -> bool {
        let b = self.backoff.lock().expect("not poisoned");
        b.is_some_and(|until| now < until)
    }

    /// A data connection to the node by `deadline`: an idle one (not near the node's idle
    /// limit), or a new one to the data port its load names.
    async fn data(
        &self,
        security: &pki::Security,
        deadline: tokio::time::Instant,
    ) -> Result<data::Client, String> {
        let fresh = |c: &data::Client| c.used.elapsed() < data::IDLE / 2;
        while let Some(c) = self.idle.lock().expect("not poisoned").pop() {
            if fresh(&c) {
                return Ok(c);
            }
        }
        let mut client = self.client.clone();
        let stats = client.stats(StoreStatsRequest {});
        let load = match tokio::time::timeout_at(deadline, stats).await {
            Ok(Ok(l)) => l.into_inner(),
            Ok(Err(e)) => return Err(e.message().to_string()),
            Err(_) => return Err("no answer within the deadline".into()),
        };
        let addr = data_addr(&self.uri, load.data_port)?;
        let c = data::Client::connect(&addr, security, deadline).await;
        c.map_err(|e| format!("{addr}: {e}"))
    }

    /// `c` kept for the next use (a connection that failed is dropped instead).
    fn keep(&self, c: data::Client) {
        let mut idle = self.idle.lock().expect("not poisoned");
        if idle.len() < POOL {
            idle.push(c);
        }
    }
}

/// The data connections' address of the node at gRPC `uri`: its host, `port`.
fn data_addr(uri: &str, port: u32) -> Result<String, String> {
    let host = uri
        .parse::<tonic::codegen::http::Uri>()
        .ok()
        .and_then(|u| u.host().map(str::to_string))
        .ok_or_else(|| format!("no host in the store's address {uri}"))?;
    if port == 0 || port > u16::MAX.into() {
        return Err(format!("the store node at {uri} names no data port"));
    }
    let host = match host.contains(':') && !host.starts_with('[') {
        true => format!("[{host}]"),
        false => host,
    };
    Ok(format!("{host}:{port}"))
}

/// The store's nodes at one moment: those `cluster.toml` names and, with `[store] discover`,
/// those registered in etcd now.
#[derive(Default)]
struct Members {
    nodes: Vec<Node>,
    uris: Vec<String>,
}

/// The store's nodes as a worker uses them: each block put on its `replicas` nodes by
/// rendezvous hashing ([`store::place`]), fetched from the first of them that answers. Each
/// batch of puts and each fetch works on the nodes of its moment.
#[derive(Clone)]
pub struct StoreLink {
    members: Arc<std::sync::RwLock<Arc<Members>>>,
    security: pki::Security,
    replicas: usize,
    /// The engine's block-name seed and the store's model key ([`engine::Engine::store_names`]).
    names: (u64, u64),
    block_size: usize,
    fetch_timeout: Duration,
    /// The counters, shared with the load a worker reports.
    pub counters: Arc<StoreCounters>,
}

impl StoreLink {
    /// The store's key for this engine's blocks (its names' seed and its weights).
    pub fn model(&self) -> u64 {
        self.names.1
    }

    /// A link to the nodes at `uris` (each dialled when first used), whose certificates must
    /// name the store role; each block on `replicas` of them.
    pub fn new(
        security: &pki::Security,
        uris: &[String],
        replicas: usize,
        names: (u64, u64),
        block_size: usize,
        fetch_timeout: Duration,
    ) -> Result<StoreLink, String> {
        let link = StoreLink {
            members: Arc::default(),
            security: security.clone(),
            replicas: replicas.max(1),
            names,
            block_size,
            fetch_timeout,
            counters: Arc::default(),
        };
        match link.set_nodes(uris.to_vec()).into_iter().next() {
            Some(e) => Err(e),
            None => Ok(link),
        }
    }

    /// The nodes now.
    fn members(&self) -> Arc<Members> {
        self.members.read().expect("not poisoned").clone()
    }

    /// Uses the nodes at `uris` from now on (a node kept keeps its connections); returns why
    /// each one left out could not be used.
    pub fn set_nodes(&self, uris: Vec<String>) -> Vec<String> {
        let now = self.members();
        let mut next = Members::default();
        let mut bad = Vec::new();
        for uri in uris {
            let node = match now.uris.iter().position(|u| *u == uri) {
                Some(i) => Ok(now.nodes[i].clone()),
                None => self.dial(&uri),
            };
            match node {
                Ok(node) => {
                    next.nodes.push(node);
                    next.uris.push(uri);
                }
                Err(e) => bad.push(e),
            }
        }
        let n = next.uris.len() as u64;
        *self.members.write().expect("not poisoned") = Arc::new(next);
        self.counters.nodes.store(n, Ordering::Relaxed);
        bad
    }

    /// Node `uri`, dialled when first used.
    fn dial(&self, uri: &str) -> Result<Node, String> {
        let endpoint = proto::secure::endpoint(&self.security, uri, pki::Role::Store.dns())
            .map_err(|e| format!("the store at {uri}: {}", proto::secure::explain(&e)))?
            .connect_timeout(self.fetch_timeout.max(Duration::from_secs(1)));
        Ok(Node {
            uri: uri.to_string(),
            client: StoreClient::new(endpoint.connect_lazy()),
            backoff: Arc::default(),
            idle: Arc::default(),
        })
    }

    /// Follows the store nodes registered in etcd, beside the `fixed` ones, for as long as
    /// the worker runs.
    pub fn discover(&self, d: &discovery::Config, fixed: Vec<String>) {
        let mut changes = d.watch(discovery::Kind::Store);
        let link = self.clone();
        tokio::spawn(async move {
            let mut members = discovery::Members::default();
            while let Some(c) = changes.recv().await {
                if members.apply(c) == discovery::Diff::default() {
                    continue;
                }
                let mut uris = fixed.clone();
                for v in members.values() {
                    let uri = String::from_utf8_lossy(v).into_owned();
                    if !uris.contains(&uri) {
                        uris.push(uri);
                    }
                }
                tracing::info!(nodes = ?uris, "the cluster store's nodes changed (etcd)");
                for e in link.set_nodes(uris) {
                    tracing::warn!("a store node registered in etcd is left out: {e}");
                }
            }
        });
    }

    fn key(&self, block: BlockHash) -> ObjectKey {
        ObjectKey {
            model: self.names.1,
            block: block.0,
        }
    }

    /// The nodes of `m` holding `block`, best first (their numbers there).
    fn holders(&self, m: &Members, block: BlockHash) -> Vec<usize> {
        let key = store::ObjectKey {
            model: self.names.1,
            block,
        };
        store::place(key, &m.uris, self.replicas)
            .into_iter()
            .filter_map(|u| m.uris.iter().position(|x| x == u))
            .collect()
    }

    /// Starts the task that puts what the engine thread sends it, each batch on every node
    /// its blocks are placed on at once; returns its queue.
    pub fn uploader(&self) -> mpsc::Sender<StoreBlock> {
        let (tx, mut rx) = mpsc::channel::<StoreBlock>(QUEUE);
        let link = self.clone();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(BATCH);
            while rx.recv_many(&mut batch, BATCH).await > 0 {
                let m = link.members();
                if m.nodes.is_empty() {
                    // No node yet (none registered in etcd): nowhere to put them.
                    let n = batch.drain(..).len() as u64;
                    link.counters.dropped.fetch_add(n, Ordering::Relaxed);
                    continue;
                }
                let mut by_node = vec![Vec::new(); m.nodes.len()];
                for b in batch.drain(..) {
                    for n in link.holders(&m, b.hash) {
                        by_node[n].push(b.clone());
                    }
                }
                let mut puts = tokio::task::JoinSet::new();
                for (node, blocks) in m.nodes.iter().zip(by_node) {
                    if !blocks.is_empty() {
                        puts.spawn(link.clone().put_within(node.clone(), blocks));
                    }
                }
                puts.join_all().await;
            }
        });
        tx
    }

    /// [`StoreLink::put`] on `node` within [`PUT_DEADLINE`]; a failure drops the blocks,
    /// counted.
    async fn put_within(self, node: Node, blocks: Vec<StoreBlock>) {
        let count = blocks.len() as u64;
        let deadline = tokio::time::Instant::now() + PUT_DEADLINE;
        let put = self.put(&node, blocks, deadline);
        let why = match tokio::time::timeout_at(deadline, put).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => format!("no answer within {PUT_DEADLINE:?}"),
        };
        self.counters.dropped.fetch_add(count, Ordering::Relaxed);
        let uri = &node.uri;
        tracing::debug!("store put of {count} blocks on {uri} failed: {why}");
    }

    /// Offers `blocks` to `node`, then sends the bytes of those it wants on a data
    /// connection.
    async fn put(
        &self,
        node: &Node,
        blocks: Vec<StoreBlock>,
        deadline: tokio::time::Instant,
    ) -> Result<(), String> {
        let objects = blocks
            .iter()
            .map(|b| PutSpec {
                key: Some(self.key(b.hash)),
                size: b.bytes.len() as u64,
                sum: b.sum,
            })
            .collect();
        let mut client = node.client.clone();
        let offer = client.put_start(PutStartRequest { objects });
        let grants = offer.await.map_err(|e| e.message().to_string())?;
        let mut puts = Vec::new();
        let count = |a: &AtomicU64| a.fetch_add(1, Ordering::Relaxed);
        for (b, g) in blocks.iter().zip(grants.into_inner().grants) {
            match PutOutcome::try_from(g.outcome) {
                Ok(PutOutcome::PutWrite) => puts.push((g.put_id, &b.bytes[..])),
                Ok(PutOutcome::PutHeld) => _ = count(&self.counters.held),
                _ => _ = count(&self.counters.dropped),
            }
        }
        if puts.is_empty() {
            return Ok(());
        }
        let mut conn = node.data(&self.security, deadline).await?;
        let done = conn.put(&puts, deadline).await.map_err(|e| e.to_string())?;
        node.keep(conn);
        let c = &self.counters;
        c.puts.fetch_add(done.published as u64, Ordering::Relaxed);
        c.dropped
            .fetch_add(done.failed.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The names of `prompt`'s whole blocks a prefix lookup could find (all but its last
    /// token, which is always computed).
    pub fn prompt_blocks(&self, prompt: &[u32], salt: Option<&str>) -> Vec<BlockHash> {
        let known = &prompt[..prompt.len().saturating_sub(1)];
        let root = engine::block_hash::root(salt);
        engine::block_hash::prompt_hashes(self.names.0, root, self.block_size, known)
    }

    /// The store's blocks of `wanted`, in order up to the first no node gives within the
    /// deadline; each checked against its checksum by the engine when staged. Each block is
    /// asked of its first holder, what that one lacks or fails of the next — the nodes asked
    /// at once; a node that fails is left alone a while ([`BACKOFF`]).
    pub async fn fetch(&self, wanted: &[BlockHash]) -> Vec<StoreBlock> {
        let t0 = Instant::now();
        let deadline = tokio::time::Instant::now() + self.fetch_timeout;
        let mut got: Vec<Option<StoreBlock>> = vec![None; wanted.len()];
        let m = self.members();
        let holders: Vec<Vec<usize>> = wanted.iter().map(|h| self.holders(&m, *h)).collect();
        let mut tried = vec![0usize; wanted.len()];
        // The nodes that answered without each block.
        let mut lacked: Vec<Vec<usize>> = vec![Vec::new(); wanted.len()];
        let mut asked = false;
        for _ in 0..self.replicas {
            // Each missing block from its next holder not resting.
            let mut asks: Vec<Vec<usize>> = vec![Vec::new(); m.nodes.len()];
            for (i, hs) in holders.iter().enumerate() {
                let rest = hs.iter().skip(tried[i]);
                let next = rest.copied().find(|&n| !m.nodes[n].resting(Instant::now()));
                if let (None, Some(n)) = (&got[i], next) {
                    tried[i] = hs.iter().position(|&x| x == n).map_or(hs.len(), |p| p + 1);
                    asks[n].push(i);
                }
            }
            let mut gets = tokio::task::JoinSet::new();
            for (n, idx) in asks.into_iter().enumerate().filter(|(_, v)| !v.is_empty()) {
                let (link, node) = (self.clone(), m.nodes[n].clone());
                let hashes = idx.iter().map(|&i| wanted[i]).collect::<Vec<_>>();
                gets.spawn(async move {
                    let r = tokio::time::timeout_at(deadline, link.get(&node, &hashes, deadline));
                    (n, idx, r.await)
                });
            }
            if gets.is_empty() {
                break;
            }
            asked = true;
            while let Some(joined) = gets.join_next().await {
                // (A get's task panicking loses only its blocks: they are computed.)
                let Ok((n, idx, r)) = joined else { continue };
                if let Ok(Ok(b)) = &r {
                    idx[b.len()..].iter().for_each(|&i| lacked[i].push(n));
                }
                let blocks = match r {
                    Ok(Ok(b)) => b,
                    Ok(Err(e)) => self.failed(&m.nodes[n], e),
                    Err(_) => {
                        let why = format!("no answer within {:?}", self.fetch_timeout);
                        self.failed(&m.nodes[n], why)
                    }
                };
                for (i, b) in idx.into_iter().zip(blocks) {
                    got[i] = Some(b);
                }
            }
            if got.iter().all(Option::is_some) || tokio::time::Instant::now() >= deadline {
                break;
            }
        }
        if !asked {
            // Nothing wanted, or every holder resting after a failure.
            return Vec::new();
        }
        let blocks: Vec<StoreBlock> = got.into_iter().map_while(|b| b).collect();
        self.repair(&m, &lacked, &blocks);
        let c = &self.counters;
        c.hits.fetch_add(blocks.len() as u64, Ordering::Relaxed);
        let bytes = blocks.iter().map(|b| b.bytes.len() as u64).sum::<u64>();
        c.bytes_loaded.fetch_add(bytes, Ordering::Relaxed);
        c.load_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        blocks
    }

    /// Puts `blocks` (a fetch's, in order) back on the nodes that answered without them
    /// (`lacked`, by block) while another replica had them — read repair, so a node restarted
    /// empty or one that evicted a block holds it again — off the request's path.
    fn repair(&self, m: &Members, lacked: &[Vec<usize>], blocks: &[StoreBlock]) {
        let mut by_node = vec![Vec::new(); m.nodes.len()];
        for (b, nodes) in blocks.iter().zip(lacked) {
            nodes.iter().for_each(|&n| by_node[n].push(b.clone()));
        }
        for (node, blocks) in m.nodes.iter().zip(by_node) {
            if !blocks.is_empty() {
                let n = blocks.len() as u64;
                self.counters.repaired.fetch_add(n, Ordering::Relaxed);
                tokio::spawn(self.clone().put_within(node.clone(), blocks));
            }
        }
    }

    /// A fetch from `node` failed: counted, and the node left alone for [`BACKOFF`].
    fn failed(&self, node: &Node, why: String) -> Vec<StoreBlock> {
        let uri = &node.uri;
        tracing::warn!("store fetch from {uri} failed ({why}): another replica or computing instead; {uri} is left alone for {BACKOFF:?}");
        self.counters.fetch_failures.fetch_add(1, Ordering::Relaxed);
        *node.backoff.lock().expect("not poisoned") = Some(Instant::now() + BACKOFF);
        Vec::new()
    }

    /// The blocks of `hashes` `node` holds, in order up to the first it does not.
    async fn get(
        &self,
        node: &Node,
        hashes: &[BlockHash],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<StoreBlock>, String> {
        let keys: Vec<(u64, u64)> = hashes.iter().map(|h| (self.names.1, h.0)).collect();
        let mut conn = node.data(&self.security, deadline).await?;
        let got = conn.get(&keys, deadline).await.map_err(|e| e.to_string())?;
        node.keep(conn);
        let blocks = hashes.iter().zip(got).map(|(&hash, f)| StoreBlock {
            hash,
            bytes: f.data,
            sum: f.sum,
        });
        Ok(blocks.collect())
    }
}

/// Fetches the blocks of `prompt` the engine behind `engine` lacks (past its first `staged`,
/// held or just staged by a peer fetch) and the store holds, and stages them there ahead of
/// the command that follows; returns how many were staged.
pub async fn prefetch<C: Send + 'static>(
    link: &StoreLink,
    engine: &crate::EngineHandle<C>,
    prompt: &[u32],
    salt: Option<&str>,
    staged: usize,
) -> Result<usize, tonic::Status> {
    let blocks = link.prompt_blocks(prompt, salt);
    let held = engine.held_run(&blocks).max(staged).min(blocks.len());
    let fetched = link.fetch(&blocks[held..]).await;
    let n = fetched.len();
    if n > 0 {
        engine.stage(fetched)?;
    }
    Ok(n)
}

/// A worker's link to the store of `settings` (none without one), its engine set to copy out
/// what it computes; `None` too where the engine cannot take part (a windowed model, a GPU
/// pool, the mock engine: logged).
pub fn link(
    settings: &crate::Settings,
    engine: &mut engine::Engine,
) -> Result<Option<(StoreLink, crate::engine_thread::StoreOut)>, crate::WorkerError> {
    let discover = settings
        .discovery
        .as_ref()
        .filter(|_| settings.store_discover);
    if settings.store.is_empty() && discover.is_none() {
        return Ok(None);
    }
    let Some(names) = engine.store_names() else {
        tracing::warn!("the cluster store is set but the prefix cache is off: not used");
        return Ok(None);
    };
    if !engine.set_store_out(QUEUE) {
        tracing::warn!("this engine cannot share KV through the cluster store yet (windowed layer groups or a GPU pool): not used");
        return Ok(None);
    }
    let bs = settings.engine.block_size;
    let link = StoreLink::new(
        &settings.security,
        &settings.store,
        settings.store_replicas,
        names,
        bs,
        settings.store_fetch_timeout,
    )
    .map_err(crate::WorkerError::Security)?;
    if let Some(d) = discover {
        link.discover(d, settings.store.clone());
    }
    let out = (link.uploader(), link.counters.clone());
    Ok(Some((link, out)))
}

/// Fills the store's figures into a worker's load.
pub fn fill(c: &StoreCounters, l: &mut proto::grpc::WorkerLoad) {
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    l.kv_store_hits = get(&c.hits);
    l.kv_store_bytes_loaded = get(&c.bytes_loaded);
    l.kv_store_load_seconds = get(&c.load_us) as f64 / 1e6;
    l.kv_store_puts = get(&c.puts);
    l.kv_store_puts_held = get(&c.held);
    l.kv_store_puts_dropped = get(&c.dropped);
    l.kv_store_fetch_failures = get(&c.fetch_failures);
    l.kv_store_nodes = get(&c.nodes) as u32;
    l.kv_store_repaired = get(&c.repaired);
}

#[cfg(test)]
mod tests {
    use super::data_addr;

    #[test]
    fn the_data_port_is_on_the_host_of_the_nodes_grpc_address() {
        let at = |uri, port| data_addr(uri, port);
        assert_eq!(at("http://10.0.0.7:7400", 7401).unwrap(), "10.0.0.7:7401");
        assert_eq!(
            at("https://tandem-store-0.tandem-store:7400", 7401).unwrap(),
            "tandem-store-0.tandem-store:7401"
        );
        assert_eq!(at("http://[::1]:7400", 9).unwrap(), "[::1]:9");
        assert!(at("http://10.0.0.7:7400", 0)
            .unwrap_err()
            .contains("no data port"));
        assert!(at("not a uri", 1).is_err());
    }
}
