//! `tandem store`: one node of the cluster KV store (`[store]` in cluster.toml), serving the
//! `Store` gRPC service to the workers and the router, and its data connections to the workers,
//! under the cluster's certificates.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use proto::config::ClusterConfig;

use crate::cluster::{self, RoleArgs};

/// Fault injection for tests and chaos runs: set, every block the node sends has a bit
/// flipped (readers must find it by its checksum and compute the block instead).
const CORRUPT: &str = "TANDEM_FAULT_STORE_CORRUPT_GETS";

/// The node's limits from `[store]`.
fn limits(cfg: &ClusterConfig) -> store::Limits {
    let s = &cfg.store;
    let lease = Duration::from_millis(*s.lease_ms.get_ref());
    store::Limits {
        capacity: *s.capacity_bytes.get_ref(),
        max_object: *s.max_object_bytes.get_ref(),
        lease,
        lease_max: lease * 6,
        put_deadline: Duration::from_millis(*s.put_deadline_ms.get_ref()),
        ..Default::default()
    }
}

/// The address the node registers in etcd: `store.advertise`, else the one it serves on; none
/// (said) when that is 0.0.0.0 or [::], which no other machine can dial.
fn advertised(cfg: &ClusterConfig, bound: SocketAddr) -> Option<String> {
    if let Some(a) = &cfg.store.advertise {
        return Some(a.get_ref().clone());
    }
    if bound.ip().is_unspecified() {
        tracing::warn!(
            "the store serves on {bound}, which no other machine can dial: not registered in \
             etcd (set store.advertise to the http://HOST:PORT workers and routers reach it at)"
        );
        return None;
    }
    Some(format!("http://{bound}"))
}

/// `tandem store`.
pub fn run(a: RoleArgs) -> Result<()> {
    let cfg = ClusterConfig::load(&a.config)?;
    let name = a.name.clone().unwrap_or_else(|| "store-0".into());
    let listen = a
        .listen
        .clone()
        .unwrap_or(cfg.store.listen.get_ref().clone());
    let at: SocketAddr = listen
        .parse()
        .with_context(|| format!("--listen {listen:?}: not a host:port socket address"))?;
    if cfg.security.insecure && !at.ip().is_loopback() {
        bail!(
            "store.listen {at} is reachable from other machines and [security] insecure = true: \
             anyone who reaches it could put KV that workers then use; listen on loopback, or \
             drop insecure"
        );
    }
    let security = cluster::security(&cfg, &a.config, pki::Role::Store, &name)?;
    let node = store::node::Node::new(limits(&cfg));
    if std::env::var_os(CORRUPT).is_some() {
        tracing::warn!(
            "{CORRUPT} is set: fault injection on, every block this node sends is corrupted"
        );
        node.corrupt_what_it_sends();
    }
    cluster::runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(at)
            .await
            .with_context(|| format!("binding the store's gRPC on {at}"))?;
        let bound = listener.local_addr().context("the store's bound address")?;
        let data_at = SocketAddr::new(at.ip(), cfg.store.data_port);
        let data = tokio::net::TcpListener::bind(data_at)
            .await
            .with_context(|| {
                format!("binding the store's data connections on {data_at} (store.data_port)")
            })?;
        let data_bound = data
            .local_addr()
            .context("the store's bound data address")?;
        let metrics = proto::metrics::start(&bound.ip().to_string())
            .await
            .context("binding the store's metrics")?;
        let catalogue = store::node::CATALOGUE.map(|(n, h)| (n, proto::metrics::Kind::Gauge, h));
        proto::metrics::describe(&catalogue);
        if let Some(m) = metrics {
            eprintln!("tandem store: {name} metrics on http://{m}/metrics");
        }
        eprintln!(
            "tandem store: {name} serving on http://{bound} (data connections on {data_bound})"
        );
        // Only with [discovery]: a node without it is never told it is not registered.
        let register =
            cluster::discovery(&cfg, &security).and_then(|d| Some((d, advertised(&cfg, bound)?)));
        cluster::report_ready(a.ready_fd, &serde_json::json!({"store": bound}), "store");
        if let Some((d, uri)) = register {
            // Registered for as long as the node serves (the key goes with its lease).
            drop(d.register(
                discovery::Kind::Store,
                store::node_id(&uri),
                uri.clone().into_bytes(),
            ));
            eprintln!("tandem store: {name} registered in etcd as {uri}");
        }
        store::node::serve(listener, data, &security, node)
            .await
            .map_err(|e| anyhow::anyhow!("the store node on {bound}: {e}"))
    })
}
