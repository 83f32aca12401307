//! The cluster KV store in the router's KV index: once a worker using the store has joined
//! (announcing the store's key for this model's blocks), the router follows each node's `Watch`
//! — a snapshot, then each block stored or removed — into its index, where every worker's
//! cached prefix goes on through the blocks only the store holds (fetched before computing,
//! at the store's measured load cost). A broken watch clears what the index knew of the store
//! and is followed again after a pause; a gap in its numbers asks for a new snapshot.
//!
//! The nodes are those `cluster.toml` names and, with `[store] discover`, those registered in
//! etcd: each followed from its registration, and forgotten — its blocks out of the index —
//! when the registration goes (the node left, or was killed or cut off for the lease's TTL).

use std::sync::Arc;
use std::time::Duration;

use proto::grpc::store_client::StoreClient;
use proto::grpc::{StoreLoad, StoreStatsRequest, WatchRequest};
use tokio_stream::StreamExt;

use crate::registry::Registry;

/// Pauses between attempts to follow the store, growing to the last.
const RETRY: [Duration; 4] = [
    Duration::from_millis(200),
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(5),
];

/// How long connecting to the node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A watch pings the node this often and gives it up when a ping goes unanswered this long: a
/// frozen or cut-off node's blocks leave the index instead of being counted on forever.
const PING: (Duration, Duration) = (Duration::from_secs(2), Duration::from_secs(2));

/// How often a followed node is asked for its figures (the status page's), and how long it
/// may take to answer.
const STATS: (Duration, Duration) = (Duration::from_secs(2), Duration::from_secs(1));

/// How the router knows of a store node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Source {
    /// Named in `cluster.toml` (or `--store`).
    #[default]
    Config,
    /// Registered in etcd.
    Etcd,
}

impl Source {
    /// Both, in the order metrics list them.
    pub const ALL: [Source; 2] = [Source::Config, Source::Etcd];

    /// Its name in metrics and on the status page.
    pub fn name(self) -> &'static str {
        match self {
            Source::Config => "config",
            Source::Etcd => "etcd",
        }
    }
}

/// A store node as the router last saw it.
#[derive(Debug, Clone, Default)]
pub struct NodeView {
    /// Where it serves.
    pub uri: String,
    /// How the router knows of it.
    pub source: Source,
    /// Whether its watch holds now.
    pub up: bool,
    /// Its figures when last asked (none before the first answer).
    pub load: Option<StoreLoad>,
}

/// Follows the store at `uri` (node number `node`, known from `source`) into `registry`'s KV
/// index for as long as the router runs (or until aborted).
pub async fn follow(
    registry: Arc<Registry>,
    security: pki::Security,
    (node, source): (usize, Source),
    uri: String,
) {
    registry.set_store_node(node, |v| {
        v.uri = uri.clone();
        v.source = source;
    });
    let key = store_key(&registry).await;
    tracing::info!(store = %uri, key = format!("{key:016x}"), "following the cluster store's blocks in the KV index");
    let mut tries = 0usize;
    loop {
        let since = std::time::Instant::now();
        match watch(&registry, &security, node, &uri, key).await {
            Ok(()) => tracing::warn!(store = %uri, "the store's watch ended"),
            Err(e) => tracing::warn!(store = %uri, "the store's watch failed: {e}"),
        }
        // A watch that held a while starts the pauses over.
        if since.elapsed() > RETRY[RETRY.len() - 1] {
            tries = 0;
        }
        registry.with(|t| t.index_mut().clear_store(node));
        registry.set_store_node(node, |v| v.up = false);
        tokio::time::sleep(RETRY[tries.min(RETRY.len() - 1)]).await;
        tries += 1;
    }
}

/// Follows the store nodes registered in etcd, numbered after the `fixed` ones named in
/// `cluster.toml` (a node named there too is left to that): each one from its registration
/// on, each forgotten when its registration goes.
pub fn discover(
    d: &discovery::Config,
    registry: Arc<Registry>,
    security: pki::Security,
    fixed: &[String],
) {
    let mut changes = d.watch(discovery::Kind::Store);
    let fixed = fixed.to_vec();
    tokio::spawn(async move {
        let mut members = discovery::Members::default();
        // Numbers by address, kept: a node that comes back takes its number again.
        let mut numbers = std::collections::HashMap::<String, usize>::new();
        let mut following = std::collections::HashMap::new();
        while let Some(c) = changes.recv().await {
            let diff = members.apply(c);
            for (id, _) in diff.gone {
                let Some((node, task)) = following.remove(&id) else {
                    continue;
                };
                forget(&registry, node, task).await;
            }
            for (id, uri) in diff.came {
                let uri = String::from_utf8_lossy(&uri).into_owned();
                if fixed.contains(&uri) {
                    continue;
                }
                let next = fixed.len() + numbers.len();
                let node = *numbers.entry(uri.clone()).or_insert(next);
                tracing::info!(store = %uri, "a store node registered in etcd");
                let at = (node, Source::Etcd);
                let task = tokio::spawn(follow(registry.clone(), security.clone(), at, uri));
                following.insert(id, (node, task));
            }
        }
    });
}

/// Stops following store node `node` (`task`) and forgets it.
async fn forget(registry: &Registry, node: usize, task: tokio::task::JoinHandle<()>) {
    task.abort();
    // Once it has ended, nothing of the node's can reach the index after it is cleared.
    let _ = task.await;
    tracing::warn!(
        node,
        "a store node's etcd registration is gone: its blocks leave the KV index"
    );
    registry.forget_store_node(node);
}

/// The store's key for this model's blocks, once a worker using the store has announced it.
async fn store_key(registry: &Registry) -> u64 {
    let mut changed = registry.subscribe();
    loop {
        if let Some(key) = registry.with(|t| t.store_model()) {
            return key;
        }
        // Every join and heartbeat wakes it; a closed channel (the router stopping) ends it.
        if changed.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// One watch: its snapshot and changes applied until it ends, fails or skips an event.
async fn watch(
    registry: &Registry,
    security: &pki::Security,
    node: usize,
    uri: &str,
    key: u64,
) -> Result<(), String> {
    let endpoint = proto::secure::endpoint(security, uri, pki::Role::Store.dns())
        .map_err(|e| proto::secure::explain(&e))?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(PING.0)
        .keep_alive_timeout(PING.1)
        .keep_alive_while_idle(true);
    let channel = endpoint.connect().await.map_err(|e| e.to_string())?;
    let client = StoreClient::new(channel);
    let mut events = client
        .clone()
        .watch(WatchRequest { model: key })
        .await
        .map_err(|s| s.message().to_string())?
        .into_inner();
    let mut stats = tokio::time::interval(STATS.0);
    stats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            ev = events.next() => {
                let Some(ev) = ev else { return Ok(()) };
                let ev = ev.map_err(|s| s.message().to_string())?;
                if registry.with(|t| t.index_mut().apply_store(node, &ev)) {
                    return Err("an event was missed: following it again from a snapshot".into());
                }
            }
            _ = stats.tick() => {
                let mut c = client.clone();
                let asked = c.stats(StoreStatsRequest {});
                if let Ok(Ok(load)) = tokio::time::timeout(STATS.1, asked).await {
                    registry.set_store_node(node, |v| {
                        v.up = true;
                        v.load = Some(load.into_inner());
                    });
                }
            }
        }
    }
}
