//! A store node's put and get throughput for 1 MiB objects, side by side in one run with a raw
//! socket moving the same bytes over loopback (the link's limit here), and a get's latency.
//!
//!     cargo bench -p store --bench put_get
//!
//! The node runs twice: plain (`insecure = true`) against a raw TCP socket, and under mutual
//! TLS 1.3 with the cluster's certificates (the default) against the raw TCP socket and a raw
//! TLS stream. Offers go by gRPC, the bytes on the node's data connections.
//! `TANDEM_BENCH_OBJECTS=N` moves N objects a run (default 256, 256 MiB).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pki::{Role, Security};
use proto::grpc::store_client::StoreClient;
use proto::grpc::{ObjectKey, PutSpec, PutStartRequest};
use store::data::Client;
use store::node::{serve, Node};
use store::Limits;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tonic::transport::Channel;

const OBJECT: usize = 1 << 20;
/// Objects one offer names, and one put stream carries.
const BATCH: usize = 64;

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// A raw stream over loopback (TCP, or TLS with `tls` = (server, client) certificates): `n`
/// objects' bytes streamed, the reader acknowledging once it has them all (no framing, no
/// copies but the kernel's and TLS's own: the link's limit).
async fn raw(n: usize, tls: Option<(Security, Security)>) -> Duration {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    let (server, client) = match tls {
        Some((Security::Mutual(s), Security::Mutual(c))) => (Some(s), Some(c)),
        _ => (None, None),
    };
    tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        s.set_nodelay(true).unwrap();
        match server {
            None => sink(s, n).await,
            Some(c) => {
                let workers = [Role::Decode];
                let a = pki::accept::Acceptor::new(&c, pki::ALPN_STORE, &workers, "bench").unwrap();
                sink(a.accept(s, None).await.unwrap().0, n).await
            }
        }
    });
    let s = tokio::net::TcpStream::connect(at).await.unwrap();
    s.set_nodelay(true).unwrap();
    match client {
        None => source(s, n).await,
        Some(c) => {
            let tls = pki::accept::connect(&c, pki::ALPN_STORE, Role::Store, s);
            source(tls.await.unwrap(), n).await
        }
    }
}

async fn sink<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, n: usize) {
    let mut buf = vec![0u8; OBJECT];
    for _ in 0..n {
        s.read_exact(&mut buf).await.unwrap();
    }
    s.write_all(&[1]).await.unwrap();
    s.flush().await.unwrap();
}

async fn source<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, n: usize) -> Duration {
    let data = vec![7u8; OBJECT];
    let mut ack = [0u8; 1];
    let t0 = Instant::now();
    for _ in 0..n {
        s.write_all(&data).await.unwrap();
    }
    s.flush().await.unwrap();
    s.read_exact(&mut ack).await.unwrap();
    t0.elapsed()
}

fn key(i: usize) -> ObjectKey {
    ObjectKey {
        model: 1,
        block: i as u64,
    }
}

/// A node under `server`, and a worker's gRPC client and data connection to it under
/// `client`.
async fn node(server: Security, client: Security, n: usize) -> (StoreClient<Channel>, Client) {
    let control = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (at, data_at) = (control.local_addr().unwrap(), data.local_addr().unwrap());
    // Room for 1.2 n objects: the second n puts evict the first ones (from 90% down to 85%).
    let limits = Limits {
        capacity: (n * OBJECT * 6 / 5) as u64,
        ..Default::default()
    };
    tokio::spawn(async move { serve(control, data, &server, Node::new(limits)).await });
    let uri = format!("http://{at}");
    let e = proto::secure::endpoint(&client, &uri, Role::Store.dns()).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let conn = Client::connect(&data_at.to_string(), &client, deadline)
        .await
        .unwrap();
    (StoreClient::new(e.connect().await.unwrap()), conn)
}

fn later() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(60)
}

/// Puts objects `keys` in batches (an offer, then their bytes on the data connection).
async fn put(
    c: &mut StoreClient<Channel>,
    d: &mut Client,
    keys: std::ops::Range<usize>,
    data: &[u8],
) -> Duration {
    let sum = types::sum::sum(data);
    let t0 = Instant::now();
    for start in keys.clone().step_by(BATCH) {
        let objects = (start..(start + BATCH).min(keys.end))
            .map(|i| PutSpec {
                key: Some(key(i)),
                size: data.len() as u64,
                sum,
            })
            .collect();
        let grants = c.put_start(PutStartRequest { objects }).await.unwrap();
        let puts: Vec<(u64, &[u8])> = (grants.into_inner().grants.iter())
            .map(|g| (g.put_id, data))
            .collect();
        let done = d.put(&puts, later()).await.unwrap();
        assert!(done.failed.is_empty(), "{:?}", done.failed);
        assert_eq!(done.published as usize, puts.len());
    }
    t0.elapsed()
}

/// Gets objects `range`, one request; returns the bytes received.
async fn get(d: &mut Client, range: std::ops::Range<usize>) -> usize {
    let keys: Vec<(u64, u64)> = range.map(|i| (1, i as u64)).collect();
    let got = d.get(&keys, later()).await.unwrap();
    assert_eq!(got.len(), keys.len());
    got.iter().map(|o| o.data.len()).sum()
}

/// One arm: put throughput into the empty node (every page it keeps new to the process) and
/// into the full node (evicting as it goes: a cache's steady state), get throughput (`BATCH`
/// objects a request), and one object's get latency p50 and p99, each against the raw streams'
/// (`raw`: name, time).
async fn arm(name: &str, server: Security, client: Security, n: usize, raw: &[(&str, Duration)]) {
    let (mut c, mut d) = node(server, client, n).await;
    let data: Vec<u8> = (0..OBJECT).map(|i| (i * 31 + i / 4099) as u8).collect();
    let fill_t = put(&mut c, &mut d, 0..n, &data).await;
    let put_t = put(&mut c, &mut d, n..2 * n, &data).await;
    let t0 = Instant::now();
    let mut got = 0;
    // The latest n - n/5 objects are held.
    let held = 2 * n - (n - n / 5)..2 * n;
    for start in held.clone().step_by(BATCH) {
        got += get(&mut d, start..(start + BATCH).min(held.end)).await;
    }
    let get_t = t0.elapsed();
    assert_eq!(got, held.len() * OBJECT);
    let mut lat: Vec<Duration> = Vec::new();
    for i in 0..200 {
        let k = held.start + i % held.len();
        let t0 = Instant::now();
        assert_eq!(get(&mut d, k..k + 1).await, OBJECT);
        lat.push(t0.elapsed());
    }
    lat.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let g = |bytes: usize, t: Duration| gbps(bytes, t);
    let (fill_g, put_g, get_g) = (g(n * OBJECT, fill_t), g(n * OBJECT, put_t), g(got, get_t));
    let against = |g: f64| {
        let x: Vec<String> = raw
            .iter()
            .map(|(r, t)| format!("{:.2}x {r}", g / gbps(n * OBJECT, *t)))
            .collect();
        x.join(", ")
    };
    let raws: Vec<String> = raw
        .iter()
        .map(|(r, t)| format!("{r} {:.2} GB/s", gbps(n * OBJECT, *t)))
        .collect();
    println!(
        "| {name} | {put_g:.2} GB/s ({}) | {get_g:.2} GB/s ({}) | {fill_g:.2} GB/s ({}) | {} | {:.2} / {:.2} ms |",
        against(put_g),
        against(get_g),
        against(fill_g),
        raws.join(", "),
        ms(lat[lat.len() / 2]),
        ms(lat[lat.len() * 99 / 100]),
    );
}

fn main() {
    if std::env::var("TANDEM_BENCH_MALLOC_DEFAULTS").is_err() {
        // As the tandem binary does.
        store::keep_freed_memory();
    }
    let n: usize = std::env::var("TANDEM_BENCH_OBJECTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir().join(format!("tandem-store-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pki = pki::Store::at(dir.join("pki"));
    let mutual = |role: Role| Security::Mutual(Arc::new(pki.credentials(role, "bench").unwrap()));
    println!("{n} objects of 1 MiB over loopback; the raw streams measured just before each arm");
    println!("| node | put, full node (x raw) | get (x raw) | put, empty node (x raw) | raw streams | get 1 MiB p50 / p99 |");
    println!("|---|---:|---:|---:|---|---:|");
    rt.block_on(async {
        let tcp = raw(n, None).await;
        arm(
            "plain",
            Security::Insecure,
            Security::Insecure,
            n,
            &[("TCP", tcp)],
        )
        .await;
        let (server, client) = (mutual(Role::Store), mutual(Role::Decode));
        let tcp = raw(n, None).await;
        let tls = raw(n, Some((server.clone(), client.clone()))).await;
        arm(
            "mutual TLS",
            server,
            client,
            n,
            &[("TCP", tcp), ("TLS", tls)],
        )
        .await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}
