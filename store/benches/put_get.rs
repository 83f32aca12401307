//! A store node's put and get throughput for 1 MiB objects, side by side in one run with a raw
//! TCP socket moving the same bytes over loopback (the link's limit here), and a get's latency.
//!
//!     cargo bench -p store --bench put_get
//!
//! The node runs twice: plain gRPC (`insecure = true`) and under mutual TLS 1.3 with the
//! cluster's certificates (the default). `TANDEM_BENCH_OBJECTS=N` moves N objects a run
//! (default 256, 256 MiB).

use std::sync::Arc;
use std::time::{Duration, Instant};

use pki::{Role, Security};
use proto::grpc::store_client::StoreClient;
use proto::grpc::{GetRequest, ObjectKey, PutChunk, PutSpec, PutStartRequest};
use store::node::{serve, Node};
use store::Limits;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

const OBJECT: usize = 1 << 20;
/// Objects one offer names, and one put stream carries.
const BATCH: usize = 64;

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Raw TCP over loopback: `n` objects' bytes streamed, the reader acknowledging once it has
/// them all (no framing, no copies but the kernel's: the link's limit).
async fn raw(n: usize) -> Duration {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; OBJECT];
        for _ in 0..n {
            s.read_exact(&mut buf).await.unwrap();
        }
        s.write_all(&[1]).await.unwrap();
    });
    let mut s = tokio::net::TcpStream::connect(at).await.unwrap();
    s.set_nodelay(true).unwrap();
    let data = vec![7u8; OBJECT];
    let mut ack = [0u8; 1];
    let t0 = Instant::now();
    for _ in 0..n {
        s.write_all(&data).await.unwrap();
    }
    s.read_exact(&mut ack).await.unwrap();
    t0.elapsed()
}

fn key(i: usize) -> ObjectKey {
    ObjectKey {
        model: 1,
        block: i as u64,
    }
}

/// A node under `server`, and a worker's client of it under `client`.
async fn node(server: Security, client: Security, n: usize) -> StoreClient<Channel> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap();
    let limits = Limits {
        capacity: (3 * n * OBJECT) as u64,
        ..Default::default()
    };
    tokio::spawn(async move { serve(l, &server, Node::new(limits)).await });
    let uri = format!("http://{at}");
    let e = proto::secure::endpoint(&client, &uri, Role::Store.dns())
        .unwrap()
        .initial_stream_window_size(store::node::WINDOW)
        .initial_connection_window_size(store::node::WINDOW * 2)
        .max_frame_size(store::node::FRAME);
    StoreClient::new(e.connect().await.unwrap())
}

/// Puts `n` objects in batches (an offer, then one stream of their bytes in 1 MiB chunks).
async fn put(c: &mut StoreClient<Channel>, n: usize, data: &[u8]) -> Duration {
    let sum = types::sum::sum(data);
    let t0 = Instant::now();
    for start in (0..n).step_by(BATCH) {
        let objects = (start..(start + BATCH).min(n))
            .map(|i| PutSpec {
                key: Some(key(i)),
                size: data.len() as u64,
                sum,
            })
            .collect();
        let grants = c.put_start(PutStartRequest { objects }).await.unwrap();
        let chunks: Vec<PutChunk> = (grants.into_inner().grants.iter())
            .map(|g| PutChunk {
                put_id: g.put_id,
                offset: 0,
                data: data.to_vec(),
                end: true,
            })
            .collect();
        let reply = c
            .put(tokio_stream::iter(chunks))
            .await
            .unwrap()
            .into_inner();
        assert!(reply.failed.is_empty(), "{:?}", reply.failed);
    }
    t0.elapsed()
}

/// Gets objects `range`, one request each; returns the bytes received.
async fn get(c: &mut StoreClient<Channel>, range: std::ops::Range<usize>) -> usize {
    let keys = range.map(key).collect();
    let mut s = c.get(GetRequest { keys }).await.unwrap().into_inner();
    let mut bytes = 0;
    while let Some(chunk) = s.message().await.unwrap() {
        bytes += chunk.data.len();
    }
    bytes
}

/// One arm: put throughput, get throughput (a prefix of `BATCH` objects a request), and one
/// object's get latency p50 and p99.
async fn arm(name: &str, server: Security, client: Security, n: usize, raw: Duration) {
    let mut c = node(server, client, n).await;
    let data: Vec<u8> = (0..OBJECT).map(|i| (i * 31 + i / 4099) as u8).collect();
    let put_t = put(&mut c, n, &data).await;
    let t0 = Instant::now();
    let mut got = 0;
    for start in (0..n).step_by(BATCH) {
        got += get(&mut c, start..(start + BATCH).min(n)).await;
    }
    let get_t = t0.elapsed();
    assert_eq!(got, n * OBJECT);
    let mut lat: Vec<Duration> = Vec::new();
    for i in 0..200 {
        let t0 = Instant::now();
        assert_eq!(get(&mut c, i % n..i % n + 1).await, OBJECT);
        lat.push(t0.elapsed());
    }
    lat.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (raw_g, put_g, get_g) = (
        gbps(n * OBJECT, raw),
        gbps(n * OBJECT, put_t),
        gbps(got, get_t),
    );
    println!(
        "| {name} | {put_g:.2} GB/s ({:.2}x) | {get_g:.2} GB/s ({:.2}x) | {raw_g:.2} GB/s | {:.2} / {:.2} ms |",
        put_g / raw_g,
        get_g / raw_g,
        ms(lat[lat.len() / 2]),
        ms(lat[lat.len() * 99 / 100]),
    );
}

fn main() {
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
    println!("{n} objects of 1 MiB over loopback; the raw socket measured just before each arm");
    println!("| node | put (x raw) | get (x raw) | raw TCP | get 1 MiB p50 / p99 |");
    println!("|---|---:|---:|---:|---:|");
    rt.block_on(async {
        let r = raw(n).await;
        arm("plain gRPC", Security::Insecure, Security::Insecure, n, r).await;
        let r = raw(n).await;
        let (server, client) = (mutual(Role::Store), mutual(Role::Decode));
        arm("mutual TLS", server, client, n, r).await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}
