//! A store node served over mutual TLS on loopback ports, called as workers and the router call
//! it (offers by gRPC, bytes on the data connections): puts published whole or not at all,
//! gets that stop at the first miss, the callers' roles and the puts' owners checked, watchers
//! told of every change.

use std::sync::Arc;
use std::time::Duration;

use pki::{Role, Security};
use proto::grpc::store_client::StoreClient;
use proto::grpc::{
    ObjectKey, PinKind, PinRequest, PutOutcome, PutSpec, PutStartRequest, StoreStatsRequest,
    WatchRequest,
};
use store::data::{Client, DataError, MAGIC};
use store::node::{serve, Node};
use store::Limits;
use tokio::io::AsyncWriteExt;
use tonic::transport::Channel;
use tonic::Code;

const MODEL: u64 = 0x5eed;

struct Fixture {
    pki: pki::Store,
    addr: std::net::SocketAddr,
    data: std::net::SocketAddr,
    dir: std::path::PathBuf,
    /// Each role's one certificate (a put belongs to the certificate that started it).
    issued: std::sync::Mutex<Vec<(Role, Security)>>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A node of `capacity` bytes on a loopback port, under a new cluster CA.
async fn node(name: &str, capacity: u64) -> Fixture {
    let dir = std::env::temp_dir().join(format!("tandem-store-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pki = pki::Store::at(dir.join("pki"));
    let creds = pki.credentials(Role::Store, "store-0").unwrap();
    let security = Security::Mutual(Arc::new(creds));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (addr, data_at) = (listener.local_addr().unwrap(), data.local_addr().unwrap());
    let limits = Limits {
        capacity,
        ..Default::default()
    };
    tokio::spawn(async move { serve(listener, data, &security, Node::new(limits)).await });
    Fixture {
        pki,
        addr,
        data: data_at,
        dir,
        issued: Default::default(),
    }
}

impl Fixture {
    /// A client holding a certificate of `role`.
    async fn client(&self, role: Role) -> StoreClient<Channel> {
        let security = self.security(role);
        let uri = format!("http://{}", self.addr);
        let endpoint = proto::secure::endpoint(&security, &uri, Role::Store.dns()).unwrap();
        StoreClient::new(endpoint.connect().await.unwrap())
    }

    fn security(&self, role: Role) -> Security {
        let mut issued = self.issued.lock().unwrap();
        if let Some((_, s)) = issued.iter().find(|(r, _)| *r == role) {
            return s.clone();
        }
        let creds = self.pki.credentials(role, role.name()).unwrap();
        let s = Security::Mutual(Arc::new(creds));
        issued.push((role, s.clone()));
        s
    }

    /// A data connection holding a certificate of `role`.
    async fn data(&self, role: Role) -> Result<Client, DataError> {
        Client::connect(&self.data.to_string(), &self.security(role), soon()).await
    }
}

fn soon() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(10)
}

fn key(block: u64) -> ObjectKey {
    ObjectKey {
        model: MODEL,
        block,
    }
}

fn object(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (i as usize * 131 + j * 7 + j / 251) as u8)
        .collect()
}

fn spec(block: u64, data: &[u8]) -> PutSpec {
    PutSpec {
        key: Some(key(block)),
        size: data.len() as u64,
        sum: types::sum::sum(data),
    }
}

/// Offers `objects`; returns each grant's (outcome, put id).
async fn offer(c: &mut StoreClient<Channel>, objects: &[(u64, &[u8])]) -> Vec<(PutOutcome, u64)> {
    let objects = objects.iter().map(|(b, d)| spec(*b, d)).collect();
    let reply = c.put_start(PutStartRequest { objects }).await.unwrap();
    let grants = reply.into_inner().grants;
    grants
        .into_iter()
        .map(|g| (PutOutcome::try_from(g.outcome).unwrap(), g.put_id))
        .collect()
}

/// Gets `blocks`: each object whole, in order, its checksum checked.
async fn get(d: &mut Client, blocks: &[u64]) -> Vec<Vec<u8>> {
    let keys: Vec<(u64, u64)> = blocks.iter().map(|b| (MODEL, *b)).collect();
    let got = d.get(&keys, soon()).await.unwrap();
    for o in &got {
        assert_eq!(types::sum::sum(&o.data), o.sum, "whole and as put");
    }
    got.into_iter().map(|o| o.data).collect()
}

#[tokio::test]
async fn puts_are_published_whole_and_a_get_stops_at_the_first_miss() {
    let f = node("round-trip", 64 << 20).await;
    let mut c = f.client(Role::Decode).await;
    let mut d = f.data(Role::Decode).await.unwrap();
    let objects: Vec<Vec<u8>> = (0..3)
        .map(|i| object(i, (1 << 20) + 1000 * i as usize))
        .collect();
    let offered: Vec<(u64, &[u8])> = (0..3).map(|i| (i, &objects[i as usize][..])).collect();
    let grants = offer(&mut c, &offered).await;
    assert!(grants.iter().all(|g| g.0 == PutOutcome::PutWrite));
    let puts: Vec<(u64, &[u8])> = grants
        .iter()
        .zip(&offered)
        .map(|(g, o)| (g.1, o.1))
        .collect();
    let done = d.put(&puts, soon()).await.unwrap();
    assert_eq!((done.published, done.failed.len()), (3, 0));
    assert!(
        offer(&mut c, &offered)
            .await
            .iter()
            .all(|g| g.0 == PutOutcome::PutHeld),
        "held: nothing to send again"
    );
    let got = get(&mut d, &[0, 1, 99, 2]).await;
    assert_eq!(got, objects[..2].to_vec(), "0 and 1, then the miss ends it");
    let s = c.stats(StoreStatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.objects, s.puts, s.hits, s.misses), (3, 3, 2, 1));
    assert_eq!(s.bytes, objects.iter().map(|o| o.len() as u64).sum::<u64>());
    assert_eq!(
        s.data_port,
        u32::from(f.data.port()),
        "the node names its data port"
    );
}

/// A data connection as a worker holding `role`'s certificate opens it, to write frames by
/// hand.
async fn raw(f: &Fixture, role: Role) -> impl tokio::io::AsyncWrite + Unpin {
    let Security::Mutual(creds) = f.security(role) else {
        unreachable!()
    };
    let tcp = tokio::net::TcpStream::connect(f.data).await.unwrap();
    let mut s = pki::accept::connect(&creds, pki::ALPN_STORE, Role::Store, tcp)
        .await
        .unwrap();
    s.write_all(&MAGIC).await.unwrap();
    s
}

/// Waits up to 10 s for the node's load to satisfy `f`.
async fn until(c: &mut StoreClient<Channel>, f: impl Fn(&proto::grpc::StoreLoad) -> bool) {
    let by = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = c.stats(StoreStatsRequest {}).await.unwrap().into_inner();
        if f(&s) {
            return;
        }
        assert!(std::time::Instant::now() < by, "not within 10 s: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_corrupt_or_interrupted_put_is_never_visible() {
    let f = node("faults", 64 << 20).await;
    let mut c = f.client(Role::Prefill).await;
    let (good, bad) = (object(1, 5000), object(2, 5000));
    let grants = offer(&mut c, &[(1, &good), (2, &bad)]).await;
    let mut flipped = bad.clone();
    flipped[4321] ^= 1;
    let mut d = f.data(Role::Prefill).await.unwrap();
    let done = d.put(&[(grants[1].1, &flipped)], soon()).await.unwrap();
    assert_eq!(done.published, 0);
    assert!(done.failed[0].contains("checksum"), "{:?}", done.failed);
    // Object 1's frame breaks off after 2,000 of its 5,000 bytes.
    let mut s = raw(&f, Role::Prefill).await;
    let mut frame = vec![b'P'];
    frame.extend(grants[0].1.to_le_bytes());
    frame.extend((good.len() as u64).to_le_bytes());
    frame.extend(&good[..2000]);
    s.write_all(&frame).await.unwrap();
    s.flush().await.unwrap();
    drop(s);
    until(&mut c, |s| s.puts_abandoned == 1).await;
    assert!(get(&mut d, &[1]).await.is_empty() && get(&mut d, &[2]).await.is_empty());
    let s = c.stats(StoreStatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.puts_corrupt, s.puts, s.pending_bytes), (1, 0, 0));
    // Both can be put again.
    let grants = offer(&mut c, &[(1, &good), (2, &bad)]).await;
    assert!(grants.iter().all(|g| g.0 == PutOutcome::PutWrite));
}

#[tokio::test]
async fn callers_are_checked_by_role_and_a_put_by_its_owner() {
    let f = node("roles", 64 << 20).await;
    let mut decode = f.client(Role::Decode).await;
    let mut router = f.client(Role::Router).await;
    let data = object(7, 4000);
    let e = router
        .put_start(PutStartRequest {
            objects: vec![spec(7, &data)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    let pin = PinRequest {
        keys: vec![key(7)],
        pin: PinKind::PinHard as i32,
    };
    let e = decode.pin(pin.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e}");
    // The decode worker's put: the prefill worker cannot write into it, nor claim another
    // size for it.
    let id = offer(&mut decode, &[(7, &data)]).await[0].1;
    let mut prefill = f.data(Role::Prefill).await.unwrap();
    let e = prefill.put(&[(id, &data)], soon()).await.unwrap_err();
    assert!(
        matches!(&e, DataError::Refused(m) if m.contains("not a put this certificate started")),
        "{e}"
    );
    let mut mine = f.data(Role::Decode).await.unwrap();
    let e = mine.put(&[(id, &data[..100])], soon()).await.unwrap_err();
    assert!(
        matches!(&e, DataError::Refused(m) if m.contains("of that size")),
        "{e}"
    );
    let mut mine = f.data(Role::Decode).await.unwrap();
    let done = mine.put(&[(id, &data)], soon()).await.unwrap();
    assert_eq!(done.published, 1);
    let pinned = router.pin(pin).await.unwrap().into_inner();
    assert_eq!(pinned.pinned, 1);
    // The router's certificate (no worker's) gets no data connection; one of no role the node
    // serves is refused at either handshake.
    assert!(
        refused(&f, f.security(Role::Router)).await,
        "the router got a data connection"
    );
    let etcd = f.security(Role::Etcd);
    assert!(
        refused(&f, etcd.clone()).await,
        "etcd got a data connection"
    );
    let uri = format!("http://{}", f.addr);
    let endpoint = proto::secure::endpoint(&etcd, &uri, Role::Store.dns()).unwrap();
    let refused = match endpoint.connect().await {
        Err(_) => true,
        Ok(ch) => StoreClient::new(ch)
            .stats(StoreStatsRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "etcd's certificate got in");
}

/// Whether a data connection under `security` is refused (at the handshake, or at its first
/// request: TLS 1.3 checks the client's certificate after the client is done).
async fn refused(f: &Fixture, security: Security) -> bool {
    match Client::connect(&f.data.to_string(), &security, soon()).await {
        Err(_) => true,
        Ok(mut d) => d.get(&[(MODEL, 7)], soon()).await.is_err(),
    }
}

/// The next events of a watch, within 10 s.
async fn next(s: &mut tonic::Streaming<proto::grpc::KvEvents>) -> proto::grpc::KvEvents {
    tokio::time::timeout(Duration::from_secs(10), s.message())
        .await
        .expect("an event within 10 s")
        .unwrap()
        .unwrap()
}

/// Offers and puts `object` as `key` (on a data connection of its own).
async fn put_one(f: &Fixture, c: &mut StoreClient<Channel>, key: ObjectKey, object: &[u8]) {
    let spec = PutSpec {
        key: Some(key),
        ..spec(0, object)
    };
    let grant = c
        .put_start(PutStartRequest {
            objects: vec![spec],
        })
        .await
        .unwrap();
    let id = grant.into_inner().grants[0].put_id;
    let mut d = f.data(Role::Decode).await.unwrap();
    assert_eq!(d.put(&[(id, object)], soon()).await.unwrap().published, 1);
}

#[tokio::test]
async fn a_watcher_gets_a_snapshot_then_every_change() {
    let f = node("watch", 64 << 20).await;
    let mut decode = f.client(Role::Decode).await;
    let mut router = f.client(Role::Router).await;
    put_one(&f, &mut decode, key(1), &object(1, 1000)).await;
    let watch = WatchRequest { model: MODEL };
    let mut events = router.watch(watch).await.unwrap().into_inner();
    let snap = next(&mut events).await;
    assert!(snap.snapshot);
    assert_eq!(snap.hashes, vec![1]);
    put_one(&f, &mut decode, key(2), &object(2, 1000)).await;
    let e = next(&mut events).await;
    assert_eq!((e.snapshot, e.first, e.next), (false, 0, 1));
    assert_eq!((e.hashes, e.stored), (vec![2], vec![true]));
    // Another model's objects are not this watcher's.
    let other = ObjectKey {
        model: MODEL + 1,
        block: 3,
    };
    put_one(&f, &mut decode, other, &object(3, 1000)).await;
    put_one(&f, &mut decode, key(4), &object(4, 1000)).await;
    let e = next(&mut events).await;
    assert_eq!(
        (e.first, e.hashes),
        (1, vec![4]),
        "block 3 was another model's"
    );
}
