//! The router's side of etcd discovery: it registers its control endpoint (where workers send
//! heartbeats), adopts every worker registered under the cluster's prefix and drops each one
//! whose key goes (its lease expired: killed, frozen or cut off for the TTL; or it left).

use std::net::SocketAddr;
use std::sync::Arc;

use discovery::{Change, Kind};
use prost::Message;
use proto::grpc::JoinRequest;

use types::WorkerId;

use crate::registry::Registry;

/// Registers this router (id `id`) and follows the workers' prefix into `registry`, for as
/// long as the process runs.
pub fn start(
    d: &discovery::Config,
    id: u64,
    registry: Arc<Registry>,
    http: SocketAddr,
    control: SocketAddr,
) {
    let me = serde_json::json!({"control": format!("http://{control}"), "http": http.to_string()});
    // The task runs as long as the process: dropping its handle does not stop it.
    drop(d.register(Kind::Router, id, me.to_string().into_bytes()));
    let mut changes = d.watch(Kind::Worker);
    tokio::spawn(async move {
        while let Some(c) = changes.recv().await {
            apply(&registry, c);
        }
    });
}

/// One change of the workers' prefix. After a reconnection (`All`) workers missing from etcd
/// are kept while they heartbeat: an etcd that lost its data must not empty the cluster.
fn apply(registry: &Registry, c: Change) {
    match c {
        Change::All(all) => all.into_iter().for_each(|(id, v)| adopt(registry, id, &v)),
        Change::Put(id, v) => adopt(registry, id, &v),
        Change::Delete(id) => {
            tracing::warn!(worker = id, "its etcd registration is gone");
            registry.remove(WorkerId(id));
        }
    }
}

fn adopt(registry: &Registry, id: u64, value: &[u8]) {
    let j = match JoinRequest::decode(value) {
        Ok(j) => JoinRequest { worker_id: id, ..j },
        Err(e) => return tracing::warn!(worker = id, "unreadable etcd registration: {e}"),
    };
    if let Err(s) = registry.join(j) {
        tracing::warn!(worker = id, "etcd registration refused: {}", s.message());
    }
}
