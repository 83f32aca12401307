//! Cluster membership through etcd.
//!
//! Every member keeps one key under a lease it renews: workers `<prefix>/workers/<id>` (their
//! join request: address, role, model identity, KV offers, protocol version), routers
//! `<prefix>/routers/<id>` (their control endpoint), store nodes `<prefix>/stores/<id>` (their
//! address; `id` its hash, so a node started again at one address takes its key back).
//! Routers watch the workers' prefix, workers the routers', and both the store nodes' (with
//! `[store] discover`): each learns the others joining, leaving and expiring (a member killed
//! or cut off stops renewing; etcd deletes its key when the lease's TTL runs out) without
//! being told.
//! The planner's leader is elected through etcd's election API on `<prefix>/planner`.
//!
//! Each task here keeps going through etcd outages: it reconnects (every wait has a deadline,
//! then a pause), registers again under a new lease, lists the prefix again and resumes
//! watching. What a member already knows is kept meanwhile: an outage of etcd changes nothing
//! for requests.

use std::time::Duration;

pub mod etcd;

use tokio::sync::{mpsc, watch};
use tokio::time::timeout;

use etcd::pb::mvccpb::event::EventType;
use etcd::{Etcd, EtcdError};

/// Where etcd is and how members use it.
#[derive(Debug, Clone)]
pub struct Config {
    /// etcd's client endpoints, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// The cluster's key prefix (several clusters can share one etcd).
    pub prefix: String,
    /// A member's lease: it is gone this long after its last renewal (at least 2 s: etcd's
    /// minimum with its default timing).
    pub ttl: Duration,
    /// For `https://` endpoints: the cluster's credentials (etcd must serve a certificate for
    /// [`ETCD_NAME`] from the cluster CA, and may require this client's).
    pub tls: Option<Tls>,
}

/// The name etcd's certificate must carry (`tandem pki issue --role etcd`).
pub const ETCD_NAME: &str = "etcd.tandem";

/// A member's TLS to etcd, PEM-encoded.
#[derive(Debug, Clone)]
pub struct Tls {
    /// The cluster CA.
    pub ca: String,
    /// This member's certificate.
    pub cert: String,
    /// Its key.
    pub key: String,
}

/// What a member is, and so which prefix its key lives under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A prefill or decode worker.
    Worker,
    /// A router.
    Router,
    /// A node of the cluster KV store (its value: the address it serves on).
    Store,
}

impl Kind {
    fn dir(self) -> &'static str {
        match self {
            Kind::Worker => "workers",
            Kind::Router => "routers",
            Kind::Store => "stores",
        }
    }
}

/// A change to the members of one kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Every member there is now (first, and again after each reconnection).
    All(Vec<(u64, Vec<u8>)>),
    /// A member joined or changed its value.
    Put(u64, Vec<u8>),
    /// A member left or its lease expired.
    Delete(u64),
}

/// Why an etcd call failed (each task logs it and tries again).
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// etcd answered with an error, or the connection failed.
    #[error("etcd: {0}")]
    Etcd(#[from] EtcdError),
    /// etcd did not answer in time.
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    /// The lease could not be kept (etcd lost it, or the keep-alive stream ended).
    #[error("the lease was lost")]
    LeaseLost,
    /// The watch ended (etcd restarted or compacted past it).
    #[error("the watch ended")]
    WatchEnded,
}

type Result<T> = std::result::Result<T, DiscoveryError>;

/// How long a task waits before trying etcd again.
const RETRY: Duration = Duration::from_millis(500);

impl Config {
    fn key(&self, kind: Kind, id: u64) -> String {
        format!("{}/{}/{id:016x}", self.prefix, kind.dir())
    }

    fn dir(&self, kind: Kind) -> String {
        format!("{}/{}/", self.prefix, kind.dir())
    }

    /// The deadline of one etcd call.
    fn deadline(&self) -> Duration {
        self.ttl.max(Duration::from_secs(2))
    }

    fn ttl_secs(&self) -> i64 {
        self.ttl.as_secs().max(2) as i64
    }

    async fn connect(&self) -> Result<Etcd> {
        let d = self.deadline();
        timeout(d, Etcd::connect(&self.endpoints, d, self.tls.as_ref()))
            .await
            .map_err(|_| DiscoveryError::Timeout(d))?
            .map_err(Into::into)
    }

    /// `call` within the deadline of one etcd call.
    async fn call<T>(
        &self,
        call: impl std::future::Future<Output = std::result::Result<T, EtcdError>>,
    ) -> Result<T> {
        let d = self.deadline();
        Ok(timeout(d, call)
            .await
            .map_err(|_| DiscoveryError::Timeout(d))??)
    }

    /// Renews `keeper`'s lease every third of the TTL, for as long as it lives: ends with
    /// the error that ended it.
    async fn keep(&self, keeper: &mut etcd::KeepAlive) -> DiscoveryError {
        let mut ticks = tokio::time::interval(self.ttl / 3);
        loop {
            ticks.tick().await;
            match self.call(keeper.renew()).await {
                Ok(ttl) if ttl > 0 => {}
                Ok(_) => return DiscoveryError::LeaseLost,
                Err(e) => return e,
            }
        }
    }

    /// Keeps `<prefix>/<kind>/<id> = value` in etcd under a lease renewed every third of the
    /// TTL, for as long as the returned task runs; registers again after any failure. Abort
    /// the task to stop (the key then goes with its lease).
    pub fn register(&self, kind: Kind, id: u64, value: Vec<u8>) -> tokio::task::JoinHandle<()> {
        let cfg = self.clone();
        tokio::spawn(async move {
            loop {
                match cfg.register_once(kind, id, &value).await {
                    Ok(()) => return,
                    Err(e) => tracing::warn!(?kind, id, "etcd registration: {e}; again"),
                }
                tokio::time::sleep(RETRY).await;
            }
        })
    }

    async fn register_once(&self, kind: Kind, id: u64, value: &[u8]) -> Result<()> {
        let c = self.connect().await?;
        let lease = self.call(c.grant(self.ttl_secs())).await?;
        self.call(c.put(&self.key(kind, id), value.to_vec(), lease))
            .await?;
        tracing::info!(?kind, id, lease, "registered in etcd");
        let mut keeper = self.call(c.keep_alive(lease)).await?;
        Err(self.keep(&mut keeper).await)
    }

    /// The members of `kind`: all of them first, then each change, and all of them again
    /// after a reconnection. The task ends when the receiver is dropped.
    pub fn watch(&self, kind: Kind) -> mpsc::UnboundedReceiver<Change> {
        let (tx, rx) = mpsc::unbounded_channel();
        let cfg = self.clone();
        tokio::spawn(async move {
            while !tx.is_closed() {
                if let Err(e) = cfg.watch_once(kind, &tx).await {
                    tracing::warn!(?kind, "etcd watch: {e}; again");
                }
                tokio::time::sleep(RETRY).await;
            }
        });
        rx
    }

    async fn watch_once(&self, kind: Kind, tx: &mpsc::UnboundedSender<Change>) -> Result<()> {
        let dir = self.dir(kind);
        let c = self.connect().await?;
        let (kvs, revision) = self.call(c.list(&dir)).await?;
        let all = kvs
            .iter()
            .filter_map(|kv| Some((member_id(&dir, &kv.key)?, kv.value.clone())))
            .collect();
        if tx.send(Change::All(all)).is_err() {
            return Ok(());
        }
        let mut stream = self.call(c.watch(&dir, revision + 1)).await?;
        // A watch waits for changes for as long as there are none: no deadline here. A dead
        // etcd ends it with an error (its connection's keep-alive sees to a silent one).
        while let Some(r) = stream.next().await? {
            if r.canceled {
                return Err(DiscoveryError::WatchEnded);
            }
            for e in r.events {
                let Some(kv) = e.kv else { continue };
                let Some(id) = member_id(&dir, &kv.key) else {
                    continue;
                };
                let change = match EventType::try_from(e.r#type) {
                    Ok(EventType::Put) => Change::Put(id, kv.value),
                    Ok(EventType::Delete) => Change::Delete(id),
                    Err(_) => continue,
                };
                if tx.send(change).is_err() {
                    return Ok(());
                }
            }
        }
        Err(DiscoveryError::WatchEnded)
    }

    /// Campaigns for the leadership of `name` (e.g. the planner) with `value` (who this is):
    /// the receiver reads `true` while this member leads. A leader that loses its lease (etcd
    /// unreachable past the TTL) reads `false` and campaigns again; when it dies, its lease
    /// expires and the next campaigner leads within the TTL.
    pub fn lead(&self, name: &str, value: Vec<u8>) -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        let (cfg, name) = (self.clone(), format!("{}/{name}", self.prefix));
        tokio::spawn(async move {
            while !tx.is_closed() {
                if let Err(e) = cfg.lead_once(&name, &value, &tx).await {
                    tracing::warn!(%name, "etcd election: {e}; again");
                }
                tx.send_replace(false);
                tokio::time::sleep(RETRY).await;
            }
        });
        rx
    }

    async fn lead_once(&self, name: &str, value: &[u8], tx: &watch::Sender<bool>) -> Result<()> {
        let c = self.connect().await?;
        let lease = self.call(c.grant(self.ttl_secs())).await?;
        let mut keeper = self.call(c.keep_alive(lease)).await?;
        let campaign = async {
            // Waits while another member leads: the lease kept alive beside it bounds it.
            c.campaign(name, value.to_vec(), lease).await?;
            tracing::info!(%name, lease, "elected leader");
            tx.send_replace(true);
            std::future::pending::<Result<()>>().await
        };
        let r = tokio::select! {
            e = self.keep(&mut keeper) => Err(e),
            r = campaign => r,
        };
        // Best effort: a revoked lease hands the leadership on at once instead of at its TTL.
        let _ = self.call(c.revoke(lease)).await;
        r
    }
}

/// The members of one kind as a watch's changes leave them: what joined and what left with
/// each change.
#[derive(Debug, Default)]
pub struct Members(std::collections::BTreeMap<u64, Vec<u8>>);

/// What one change did to [`Members`]: members gone (a new value counts as the old one gone
/// and the new one come), then members come.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Left (or changed: their old value).
    pub gone: Vec<(u64, Vec<u8>)>,
    /// Joined (or changed: their new value).
    pub came: Vec<(u64, Vec<u8>)>,
}

impl Members {
    /// Applies `c`: an [`Change::All`] drops whoever it does not list.
    pub fn apply(&mut self, c: Change) -> Diff {
        let mut d = Diff::default();
        let puts = match c {
            Change::All(all) => {
                let listed = |id: &u64| all.iter().any(|(i, _)| i == id);
                let gone: Vec<u64> = self.0.keys().copied().filter(|i| !listed(i)).collect();
                for id in gone {
                    d.gone.extend(self.0.remove(&id).map(|v| (id, v)));
                }
                all
            }
            Change::Put(id, v) => vec![(id, v)],
            Change::Delete(id) => {
                d.gone.extend(self.0.remove(&id).map(|v| (id, v)));
                Vec::new()
            }
        };
        for (id, v) in puts {
            match self.0.insert(id, v.clone()) {
                Some(old) if old == v => {}
                old => {
                    d.gone.extend(old.map(|o| (id, o)));
                    d.came.push((id, v));
                }
            }
        }
        d
    }

    /// Every member's value, by id.
    pub fn values(&self) -> impl Iterator<Item = &[u8]> {
        self.0.values().map(Vec::as_slice)
    }
}

/// The id in a member's key `<dir><16 hex digits>`.
fn member_id(dir: &str, key: &[u8]) -> Option<u64> {
    let rest = std::str::from_utf8(key).ok()?.strip_prefix(dir)?;
    u64::from_str_radix(rest, 16).ok()
}

/// A random member id (never 0): from the standard library's randomly seeded hasher, mixed
/// with the time and the process id.
pub fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| t.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_say_who_came_and_went() {
        let mut m = Members::default();
        let v = |s: &str| s.as_bytes().to_vec();
        let d = m.apply(Change::All(vec![(1, v("a")), (2, v("b"))]));
        assert_eq!(d.came, [(1, v("a")), (2, v("b"))]);
        assert!(d.gone.is_empty());
        assert_eq!(
            m.apply(Change::Put(2, v("b"))),
            Diff::default(),
            "no change"
        );
        let d = m.apply(Change::Put(2, v("c")));
        assert_eq!((d.gone, d.came), (vec![(2, v("b"))], vec![(2, v("c"))]));
        let d = m.apply(Change::All(vec![(2, v("c")), (3, v("d"))]));
        assert_eq!((d.gone, d.came), (vec![(1, v("a"))], vec![(3, v("d"))]));
        let d = m.apply(Change::Delete(3));
        assert_eq!((d.gone, d.came), (vec![(3, v("d"))], vec![]));
        assert_eq!(m.apply(Change::Delete(9)), Diff::default(), "unknown");
        assert_eq!(m.values().collect::<Vec<_>>(), [b"c"]);
    }

    #[test]
    fn keys_name_their_kind_and_id() {
        let c = Config {
            endpoints: vec![],
            prefix: "/tandem/a".into(),
            ttl: Duration::from_secs(3),
            tls: None,
        };
        let k = c.key(Kind::Worker, 0xabc);
        assert_eq!(k, "/tandem/a/workers/0000000000000abc");
        assert_eq!(member_id(&c.dir(Kind::Worker), k.as_bytes()), Some(0xabc));
        assert_eq!(member_id(&c.dir(Kind::Router), k.as_bytes()), None);
        assert_eq!(
            member_id(&c.dir(Kind::Worker), b"/tandem/a/workers/zz"),
            None
        );
        assert_ne!(random_id(), random_id());
    }
}
