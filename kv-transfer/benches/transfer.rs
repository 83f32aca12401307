//! KV transfer throughput and latency, side by side in one run with a raw TCP socket moving the
//! same bytes (the link's limit here) and with memcpy.
//!
//!     cargo bench -p kv-transfer --bench transfer
//!
//! `TANDEM_BENCH_ONLY=tcp|quic` leaves the other transport out; `TANDEM_BENCH_MB=16` runs one
//! size. TCP runs twice: plain (`insecure = true`) and under mutual TLS 1.3 with the cluster's
//! certificates (the default; ring's AES-GCM).
//! Loopback on one machine: the receiver acknowledges as soon as a transfer is whole (no model).

use std::time::{Duration, Instant};

use kv_transfer::quic::QuicKvReceiver;
use kv_transfer::{KvSender, Local, Offer, Transport};
use proto::ModelIdentity;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use types::RequestId;

struct Layout {
    name: &'static str,
    n_layers: u32,
    n_kv_heads: u32,
    head_dim: u32,
}

const LAYOUTS: [Layout; 2] = [
    Layout {
        name: "SmolLM2-135M",
        n_layers: 30,
        n_kv_heads: 3,
        head_dim: 64,
    },
    Layout {
        name: "Llama-8B",
        n_layers: 32,
        n_kv_heads: 8,
        head_dim: 128,
    },
];
const SIZES: [usize; 5] = [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20];

fn reps(bytes: usize) -> usize {
    ((512usize << 20) / bytes).clamp(3, 200)
}

/// Mean time of `$body` over `$n` runs after one warm-up run.
macro_rules! timed {
    ($n:expr, $body:block) => {{
        $body;
        let t0 = Instant::now();
        for _ in 0..$n {
            $body;
        }
        t0.elapsed() / $n as u32
    }};
}

fn row(what: &str, bytes: usize, per: Duration) {
    let gbs = bytes as f64 / per.as_secs_f64() / 1e9;
    println!(
        "| {what} | {:.2} | {:.1} | {gbs:.2} |",
        bytes as f64 / 1e6,
        per.as_secs_f64() * 1e6
    );
}

/// The sending side runs on this runtime's one worker thread, every receiver (tandem's and the
/// raw socket's alike) on another runtime's one thread: each end has a core, as two processes
/// would, instead of both ends competing for the same two worker threads.
#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let receivers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("receiver runtime");
    let rt = receivers.handle().clone();
    println!("| transport | MB | µs per transfer | GB/s |");
    println!("|---|---:|---:|---:|");
    for layout in &LAYOUTS {
        let identity = ModelIdentity {
            model: "bench".into(),
            kv_dtype: "f16".into(),
            block_size: 16,
            n_layers: layout.n_layers,
            n_kv_heads: layout.n_kv_heads,
            head_dim: layout.head_dim,
            windows: vec![],
        };
        let local = Local::open(identity);
        let width = layout.n_kv_heads * layout.head_dim;
        let per_token = 4 * width as usize * layout.n_layers as usize;
        // Receivers that acknowledge every whole transfer at once.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<kv_transfer::KvEvent>(4);
        rt.spawn(async move {
            while let Some(ev) = rx.recv().await {
                if let kv_transfer::KvEvent::Complete(kv) = ev {
                    kv.answer(Ok(()));
                }
            }
        });
        // Receivers' sockets belong to the receivers' runtime.
        let on_rx = |l: std::net::TcpListener| {
            let _inside = rt.enter();
            l.set_nonblocking(true).unwrap();
            tokio::net::TcpListener::from_std(l).unwrap()
        };
        let tcp = on_rx(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let tcp_addr = tcp.local_addr().unwrap();
        rt.spawn(kv_transfer::tcp::serve(
            tcp,
            local.clone(),
            tx.clone(),
            Default::default(),
        ));
        // The same listener under mutual TLS: a decode worker's certificate, a prefill worker's
        // connecting.
        let pki_dir = std::env::temp_dir().join(format!("tandem-bench-pki-{}", std::process::id()));
        let store = pki::Store::at(&pki_dir);
        let mutual = |role| {
            pki::Security::Mutual(std::sync::Arc::new(
                store.credentials(role, "bench").unwrap(),
            ))
        };
        let tls_local = |role| Local {
            security: mutual(role),
            ..local.clone()
        };
        let tls = on_rx(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let tls_addr = tls.local_addr().unwrap();
        rt.spawn(kv_transfer::tcp::serve(
            tls,
            tls_local(pki::Role::Decode),
            tx.clone(),
            Default::default(),
        ));
        let quic = {
            let _inside = rt.enter();
            QuicKvReceiver::bind("127.0.0.1:0".parse().unwrap(), &pki::Security::Insecure).unwrap()
        };
        let quic_addr = quic.local_addr().unwrap();
        let cert = quic.cert_der.clone();
        rt.spawn(quic.serve(local.clone(), tx, Default::default()));
        // Raw TCP: read exactly `len` bytes, answer one byte.
        let raw = on_rx(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let raw_addr = raw.local_addr().unwrap();
        rt.spawn(async move {
            let (mut s, _) = raw.accept().await.unwrap();
            s.set_nodelay(true).unwrap();
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let mut len = [0u8; 8];
                if s.read_exact(&mut len).await.is_err() {
                    return;
                }
                let mut left = u64::from_le_bytes(len) as usize;
                while left > 0 {
                    let n = s.read(&mut buf[..left.min(1 << 20)]).await.unwrap();
                    left -= n;
                }
                s.write_all(&[1]).await.unwrap();
            }
        });
        let mut raw_c = tokio::net::TcpStream::connect(raw_addr).await.unwrap();
        raw_c.set_nodelay(true).unwrap();
        let offers = [
            Offer {
                transport: Transport::Tcp,
                endpoint: tcp_addr.to_string(),
                cert_der: vec![],
            },
            Offer {
                transport: Transport::Quic,
                endpoint: quic_addr.to_string(),
                cert_der: cert,
            },
        ];
        let mut senders: Vec<(&str, KvSender)> = Vec::new();
        // `TANDEM_BENCH_ONLY=tcp` (or quic) measures one transport, e.g. under a profiler.
        let only = std::env::var("TANDEM_BENCH_ONLY").ok();
        for o in offers
            .iter()
            .filter(|o| only.as_deref().is_none_or(|t| t == o.transport.name()))
        {
            let name = match o.transport {
                Transport::Tcp => "tandem TCP (plain)",
                _ => "tandem QUIC",
            };
            let s = KvSender::connect(o, &local, Duration::from_secs(5)).await;
            senders.push((name, s.unwrap()));
        }
        if only.as_deref().is_none_or(|t| t == "tcp") {
            let o = Offer {
                transport: Transport::Tcp,
                endpoint: tls_addr.to_string(),
                cert_der: vec![],
            };
            let prefill = tls_local(pki::Role::Prefill);
            let s = KvSender::connect(&o, &prefill, Duration::from_secs(5)).await;
            senders.push(("tandem TCP (mutual TLS)", s.unwrap()));
        }
        let _ = std::fs::remove_dir_all(&pki_dir);
        println!(
            "| **{}** (per token {} KB) | | | |",
            layout.name,
            per_token / 1024
        );
        // `TANDEM_BENCH_MB=16` measures one size.
        let mb: Option<usize> = std::env::var("TANDEM_BENCH_MB")
            .ok()
            .and_then(|s| s.parse().ok());
        for &size in SIZES.iter().filter(|&&s| mb.is_none_or(|m| s == m << 20)) {
            let n_tokens = size.div_ceil(per_token).max(1);
            let layer_bytes = 4 * n_tokens * width as usize;
            let layers: Vec<Vec<u8>> = (0..layout.n_layers)
                .map(|l| vec![l as u8; layer_bytes])
                .collect();
            let bytes = layer_bytes * layout.n_layers as usize;
            let n = reps(bytes);
            let flat: Vec<u8> = layers.concat();
            // Checksummed where produced (the prefill worker's engine thread), not timed here.
            let kv: Vec<kv_transfer::Layer> = layers
                .iter()
                .cloned()
                .map(kv_transfer::Layer::new)
                .collect();
            let per = timed!(n, {
                raw_c
                    .write_all(&(flat.len() as u64).to_le_bytes())
                    .await
                    .unwrap();
                raw_c.write_all(&flat).await.unwrap();
                let mut ack = [0u8; 1];
                raw_c.read_exact(&mut ack).await.unwrap();
            });
            row("raw TCP socket", bytes, per);
            for (name, s) in senders.iter_mut() {
                let per = timed!(n, {
                    s.send(
                        (RequestId(1), kv_transfer::TransferTicket::default()),
                        n_tokens as u32,
                        width,
                        kv_transfer::Layers::Ready(&kv),
                        Duration::from_secs(60),
                    )
                    .await
                    .unwrap();
                });
                row(name, bytes, per);
            }
            let mut dst = vec![0u8; flat.len()];
            let per = timed!(n, {
                dst.copy_from_slice(&flat);
                std::hint::black_box(&dst);
            });
            row("memcpy", bytes, per);
        }
    }
    // The receivers' runtime cannot be dropped inside this async context.
    receivers.shutdown_background();
}
