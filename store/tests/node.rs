//! A store node served over mutual TLS on a loopback port, called as workers and the router
//! call it: puts published whole or not at all, gets that stop at the first miss, the callers'
//! roles and the puts' owners checked, watchers told of every change.

use std::sync::Arc;
use std::time::Duration;

use pki::{Role, Security};
use proto::grpc::store_client::StoreClient;
use proto::grpc::{
    GetRequest, ObjectKey, PinKind, PinRequest, PutChunk, PutOutcome, PutSpec, PutStartRequest,
    StoreStatsRequest, WatchRequest,
};
use store::node::{serve, Node, CHUNK};
use store::Limits;
use tonic::transport::Channel;
use tonic::Code;

const MODEL: u64 = 0x5eed;

struct Fixture {
    pki: pki::Store,
    addr: std::net::SocketAddr,
    dir: std::path::PathBuf,
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
    let addr = listener.local_addr().unwrap();
    let limits = Limits {
        capacity,
        ..Default::default()
    };
    tokio::spawn(async move { serve(listener, &security, Node::new(limits)).await });
    Fixture { pki, addr, dir }
}

impl Fixture {
    /// A client holding a certificate of `role`.
    async fn client(&self, role: Role) -> StoreClient<Channel> {
        let creds = self.pki.credentials(role, role.name()).unwrap();
        let security = Security::Mutual(Arc::new(creds));
        let uri = format!("http://{}", self.addr);
        let endpoint = proto::secure::endpoint(&security, &uri, Role::Store.dns()).unwrap();
        StoreClient::new(endpoint.connect().await.unwrap())
    }
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

/// `data` as a put's chunks of `size` bytes, the last one ending it when `end`.
fn chunks(put_id: u64, data: &[u8], size: usize, end: bool) -> Vec<PutChunk> {
    let n = data.len().div_ceil(size).max(1);
    (0..n)
        .map(|i| {
            let part = &data[(i * size).min(data.len())..((i + 1) * size).min(data.len())];
            PutChunk {
                put_id,
                offset: (i * size) as u64,
                data: part.to_vec(),
                end: end && i + 1 == n,
            }
        })
        .collect()
}

/// Gets `blocks`: each object sent whole, in order, reassembled, its checksum checked.
async fn get(c: &mut StoreClient<Channel>, blocks: &[u64]) -> Vec<Vec<u8>> {
    let keys = blocks.iter().map(|b| key(*b)).collect();
    let mut s = c.get(GetRequest { keys }).await.unwrap().into_inner();
    let mut out: Vec<Vec<u8>> = Vec::new();
    let mut sums = Vec::new();
    while let Some(chunk) = s.message().await.unwrap() {
        if chunk.index as usize == out.len() {
            out.push(Vec::with_capacity(chunk.size as usize));
            sums.push(chunk.sum);
        }
        let o = out.last_mut().unwrap();
        assert_eq!(chunk.offset, o.len() as u64, "in order");
        o.extend_from_slice(&chunk.data);
    }
    for (o, s) in out.iter().zip(sums) {
        assert_eq!(types::sum::sum(o), s, "whole and as put");
    }
    out
}

#[tokio::test]
async fn puts_are_published_whole_and_a_get_stops_at_the_first_miss() {
    let f = node("round-trip", 64 << 20).await;
    let mut c = f.client(Role::Decode).await;
    // Bigger than a get chunk: sent in parts.
    let objects: Vec<Vec<u8>> = (0..3)
        .map(|i| object(i, CHUNK + 1000 * i as usize))
        .collect();
    let offered: Vec<(u64, &[u8])> = (0..3).map(|i| (i, &objects[i as usize][..])).collect();
    let grants = offer(&mut c, &offered).await;
    assert!(grants.iter().all(|g| g.0 == PutOutcome::PutWrite));
    // Object 2 is only half sent when the stream has published 0 and 1.
    let mut stream = Vec::new();
    for (i, (_, id)) in grants.iter().enumerate() {
        stream.extend(chunks(*id, &objects[i], 300_000, true));
    }
    let reply = c
        .put(tokio_stream::iter(stream))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((reply.published, reply.failed.len()), (3, 0));
    assert!(
        offer(&mut c, &offered)
            .await
            .iter()
            .all(|g| g.0 == PutOutcome::PutHeld),
        "held: nothing to send again"
    );
    let got = get(&mut c, &[0, 1, 99, 2]).await;
    assert_eq!(got, objects[..2].to_vec(), "0 and 1, then the miss ends it");
    let s = c.stats(StoreStatsRequest {}).await.unwrap().into_inner();
    assert_eq!((s.objects, s.puts, s.hits, s.misses), (3, 3, 2, 1));
    assert_eq!(s.bytes, objects.iter().map(|o| o.len() as u64).sum::<u64>());
}

#[tokio::test]
async fn a_corrupt_or_unfinished_put_is_never_visible() {
    let f = node("faults", 64 << 20).await;
    let mut c = f.client(Role::Prefill).await;
    let (good, bad) = (object(1, 5000), object(2, 5000));
    let grants = offer(&mut c, &[(1, &good), (2, &bad)]).await;
    let mut flipped = bad.clone();
    flipped[4321] ^= 1;
    let mut stream = chunks(grants[0].1, &good[..2000], 1000, false);
    stream.extend(chunks(grants[1].1, &flipped, 1000, true));
    // The stream ends with object 1 a third written.
    let reply = c
        .put(tokio_stream::iter(stream))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.published, 0);
    assert!(reply.failed[0].contains("checksum"), "{:?}", reply.failed);
    assert!(get(&mut c, &[1]).await.is_empty() && get(&mut c, &[2]).await.is_empty());
    let s = c.stats(StoreStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (s.puts_corrupt, s.puts_abandoned, s.pending_bytes),
        (1, 1, 0)
    );
    // Both can be put again.
    let grants = offer(&mut c, &[(1, &good), (2, &bad)]).await;
    assert!(grants.iter().all(|g| g.0 == PutOutcome::PutWrite));
}

#[tokio::test]
async fn callers_are_checked_by_role_and_a_put_by_its_owner() {
    let f = node("roles", 64 << 20).await;
    let (mut decode, mut prefill) = (f.client(Role::Decode).await, f.client(Role::Prefill).await);
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
    // The decode worker's put: the prefill worker cannot write into it.
    let id = offer(&mut decode, &[(7, &data)]).await[0].1;
    let stolen = chunks(id, &data, 4000, true);
    let reply = prefill
        .put(tokio_stream::iter(stolen))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.published, 0);
    assert!(reply.failed[0].contains("not one this caller started"));
    let mine = chunks(id, &data, 4000, true);
    let reply = decode
        .put(tokio_stream::iter(mine))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.published, 1);
    let pinned = router.pin(pin).await.unwrap().into_inner();
    assert_eq!(pinned.pinned, 1);
    // A certificate of no role the node serves is refused at the handshake.
    let creds = f.pki.credentials(Role::Etcd, "etcd").unwrap();
    let security = Security::Mutual(Arc::new(creds));
    let uri = format!("http://{}", f.addr);
    let endpoint = proto::secure::endpoint(&security, &uri, Role::Store.dns()).unwrap();
    let refused = match endpoint.connect().await {
        Err(_) => true,
        Ok(ch) => StoreClient::new(ch)
            .stats(StoreStatsRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "etcd's certificate got in");
}

/// The next events of a watch, within 10 s.
async fn next(s: &mut tonic::Streaming<proto::grpc::KvEvents>) -> proto::grpc::KvEvents {
    tokio::time::timeout(Duration::from_secs(10), s.message())
        .await
        .expect("an event within 10 s")
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn a_watcher_gets_a_snapshot_then_every_change() {
    let f = node("watch", 64 << 20).await;
    let mut decode = f.client(Role::Decode).await;
    let mut router = f.client(Role::Router).await;
    let first = object(1, 1000);
    let id = offer(&mut decode, &[(1, &first)]).await[0].1;
    decode
        .put(tokio_stream::iter(chunks(id, &first, 1000, true)))
        .await
        .unwrap();
    let watch = WatchRequest { model: MODEL };
    let mut events = router.watch(watch).await.unwrap().into_inner();
    let snap = next(&mut events).await;
    assert!(snap.snapshot);
    assert_eq!(snap.hashes, vec![1]);
    let second = object(2, 1000);
    let id = offer(&mut decode, &[(2, &second)]).await[0].1;
    decode
        .put(tokio_stream::iter(chunks(id, &second, 1000, true)))
        .await
        .unwrap();
    let e = next(&mut events).await;
    assert_eq!((e.snapshot, e.first, e.next), (false, 0, 1));
    assert_eq!((e.hashes, e.stored), (vec![2], vec![true]));
    // Another model's objects are not this watcher's.
    let other = PutSpec {
        key: Some(ObjectKey {
            model: MODEL + 1,
            block: 3,
        }),
        ..spec(3, &second)
    };
    let grant = decode
        .put_start(PutStartRequest {
            objects: vec![other],
        })
        .await
        .unwrap();
    let id = grant.into_inner().grants[0].put_id;
    decode
        .put(tokio_stream::iter(chunks(id, &second, 1000, true)))
        .await
        .unwrap();
    let third = object(4, 1000);
    let id = offer(&mut decode, &[(4, &third)]).await[0].1;
    decode
        .put(tokio_stream::iter(chunks(id, &third, 1000, true)))
        .await
        .unwrap();
    let e = next(&mut events).await;
    assert_eq!(
        (e.first, e.hashes),
        (1, vec![4]),
        "block 3 was another model's"
    );
}
