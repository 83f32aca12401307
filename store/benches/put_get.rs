//! A store node's put and get throughput for 1 MiB objects, side by side in one run with a raw
//! socket moving the same bytes over loopback (the link's limit here), and a get's latency.
//!
//!     cargo bench -p store --bench put_get
//!
//! The node runs twice: plain (`insecure = true`) against a raw TCP socket, and under mutual
//! TLS 1.3 with the cluster's certificates (the default) against the raw TCP socket and a raw
//! TLS stream. Offers go by gRPC, the bytes on the node's data connections. The plain node is
//! also held against a raw TCP socket whose reader keeps what it reads ("TCP kept": each
//! object into its own buffer, all touched before — as a node's recycled ones are), the limit
//! of a reader that stores: the plain raw reader reads every object into one buffer, which
//! stays in the CPU's cache.
//! `TANDEM_BENCH_OBJECTS=N` moves N objects a run (default 256, 256 MiB);
//! `TANDEM_BENCH_PLAIN_ONLY=1` runs the plain node alone (to profile it).

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
/// copies but the kernel's and TLS's own: the link's limit); with `kept`, the reader puts each
/// object in its own buffer of [`KEPT`].
async fn raw(n: usize, tls: Option<(Security, Security)>, kept: bool) -> Duration {
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
            None => sink(s, n, kept).await,
            Some(c) => {
                let workers = [Role::Decode];
                let a = pki::accept::Acceptor::new(&c, pki::ALPN_STORE, &workers, "bench").unwrap();
                sink(a.accept(s, None).await.unwrap().0, n, kept).await
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

/// Buffers a "kept" raw reader fills, one an object, touched when made.
static KEPT: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

async fn sink<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, n: usize, kept: bool) {
    let mut one = vec![0u8; OBJECT];
    let mut all = std::mem::take(&mut *KEPT.lock().unwrap());
    if kept {
        all.resize_with(n, || vec![1u8; OBJECT]);
    }
    for i in 0..n {
        let buf = if kept { &mut all[i] } else { &mut one };
        s.read_exact(buf).await.unwrap();
    }
    *KEPT.lock().unwrap() = all;
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
    // Room for 1.2 n objects: each n puts after the first evict older ones (from 90% down to
    // 85%).
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

/// Rounds of the steady state (each: the raw streams, n puts into the full node, then gets).
const ROUNDS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One arm: put throughput into the empty node (every page it keeps new to the process), then
/// [`ROUNDS`] rounds of the raw streams (`raws`: name, TLS certificates or none), n puts into
/// the full node (evicting as it goes: a cache's steady state) and gets of what it holds
/// (`BATCH` objects a request), each figure against the raw streams of its round, the median
/// round's shown; and one object's get latency p50 and p99.
async fn arm(name: &str, (server, client): (Security, Security), n: usize, raws: &[Raw]) {
    let (mut c, mut d) = node(server, client, n).await;
    let data: Vec<u8> = (0..OBJECT).map(|i| (i * 31 + i / 4099) as u8).collect();
    let bytes = n * OBJECT;
    let raw_first: Vec<Duration> = futures_raw(n, raws).await;
    let fill = gbps(bytes, put(&mut c, &mut d, 0..n, &data).await);
    let mut rounds = Vec::new();
    for r in 1..=ROUNDS {
        let raw_t = futures_raw(n, raws).await;
        let put_g = gbps(bytes, put(&mut c, &mut d, r * n..(r + 1) * n, &data).await);
        // The latest n - n/5 objects are held.
        let held = (r + 1) * n - (n - n / 5)..(r + 1) * n;
        let t0 = Instant::now();
        let mut got = 0;
        for start in held.clone().step_by(BATCH) {
            got += get(&mut d, start..(start + BATCH).min(held.end)).await;
        }
        let get_g = gbps(got, t0.elapsed());
        rounds.push((raw_t, put_g, get_g));
    }
    let last = (ROUNDS + 1) * n;
    let mut lat: Vec<Duration> = Vec::new();
    for i in 0..200 {
        let k = last - 1 - i % (n / 2);
        let t0 = Instant::now();
        assert_eq!(get(&mut d, k..k + 1).await, OBJECT);
        lat.push(t0.elapsed());
    }
    lat.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // Each figure against raw stream j of its round, the median over the rounds.
    let ratio = |pick: &dyn Fn(&(Vec<Duration>, f64, f64)) -> f64| -> String {
        let x: Vec<String> = (0..raws.len())
            .map(|j| {
                let r = median(
                    rounds
                        .iter()
                        .map(|x| pick(x) / gbps(bytes, x.0[j]))
                        .collect(),
                );
                format!("{r:.2}x {}", raws[j].0)
            })
            .collect();
        let g = median(rounds.iter().map(pick).collect());
        format!("{g:.2} GB/s ({})", x.join(", "))
    };
    let fill_x: Vec<String> = (0..raws.len())
        .map(|j| format!("{:.2}x {}", fill / gbps(bytes, raw_first[j]), raws[j].0))
        .collect();
    let raw_g: Vec<String> = (0..raws.len())
        .map(|j| {
            let g = median(rounds.iter().map(|x| gbps(bytes, x.0[j])).collect());
            format!("{} {g:.2} GB/s", raws[j].0)
        })
        .collect();
    println!(
        "| {name} | {} | {} | {fill:.2} GB/s ({}) | {} | {:.2} / {:.2} ms |",
        ratio(&|x| x.1),
        ratio(&|x| x.2),
        fill_x.join(", "),
        raw_g.join(", "),
        ms(lat[lat.len() / 2]),
        ms(lat[lat.len() * 99 / 100]),
    );
}

/// A raw stream's name, TLS certificates (or none) and whether its reader keeps each object.
type Raw = (&'static str, Option<(Security, Security)>, bool);

/// Each raw stream of `raws` once, in turn.
async fn futures_raw(n: usize, raws: &[Raw]) -> Vec<Duration> {
    let mut out = Vec::new();
    for (_, tls, kept) in raws {
        out.push(raw(n, tls.clone(), *kept).await);
    }
    out
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
    println!("{n} objects of 1 MiB a round over loopback; the median of {ROUNDS} rounds, each against the raw streams of its round");
    println!("| node | put, full node (x raw) | get (x raw) | put, empty node (x raw) | raw streams | get 1 MiB p50 / p99 |");
    println!("|---|---:|---:|---:|---|---:|");
    // The kept reader's buffers, made and touched before any stream is timed.
    KEPT.lock().unwrap().resize_with(n, || vec![1u8; OBJECT]);
    rt.block_on(async {
        let plain = (Security::Insecure, Security::Insecure);
        let raws = [("TCP", None, false), ("TCP kept", None, true)];
        arm("plain", plain, n, &raws).await;
        if std::env::var("TANDEM_BENCH_PLAIN_ONLY").is_ok() {
            return;
        }
        let mutual = (mutual(Role::Store), mutual(Role::Decode));
        let raws = [("TCP", None, false), ("TLS", Some(mutual.clone()), false)];
        arm("mutual TLS", mutual, n, &raws).await;
    });
    let _ = std::fs::remove_dir_all(&dir);
}
