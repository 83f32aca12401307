//! Nobody gets in without the cluster's credentials: a rogue process next to a running cluster
//! (secure by default: the test's cluster.toml says nothing about security) tries every
//! internal door — joining and heartbeating on the control plane, each worker's gRPC calls,
//! the KV listeners with a handshake in the clear and with frames — as a stranger with no
//! certificate, as one whose certificate is from another CA, and as a compromised worker whose
//! genuine certificate names the wrong role. Each attempt is refused, and the test asserts the
//! path: the refusals counted by listener and reason, no worker joined or drained, no prompt
//! reached the rogue, the KV index unchanged, the decode worker's memory flat.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pki::{Credentials, Role, Security, Store};
use proto::grpc;
use serde_json::{json, Value};
use tandem_tests::cluster::{metric_at, post_json, Cluster};
use tandem_tests::store::StoreNode;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");

/// Who the rogue pretends to be, next to a cluster whose config file is in `dir`.
fn impostors(dir: &Path) -> Vec<(&'static str, Security)> {
    let own = Store::at(dir.join("rogue-pki"))
        .credentials(Role::Router, "rogue")
        .unwrap();
    let (cert, key, _) = own.pems();
    // The cluster CA's certificate is no secret: the stranger trusts it, so the refusal is the
    // server's, of a certificate from another CA.
    let ca = std::fs::read_to_string(dir.join(".tandem/pki/ca.crt")).unwrap();
    let stranger = Credentials::from_pems(Role::Router, cert.into(), key.into(), ca).unwrap();
    vec![
        ("no certificate", Security::Insecure),
        ("another CA", Security::Mutual(Arc::new(stranger))),
    ]
}

/// A compromised worker or node: a genuine certificate of the cluster, of `role`.
fn cluster_cert(dir: &Path, role: Role) -> Security {
    let creds = Store::at(dir.join(".tandem/pki"))
        .credentials(role, "compromised")
        .unwrap();
    Security::Mutual(Arc::new(creds))
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn refused(metrics: SocketAddr, listener: &str, reason: &str) -> f64 {
    let series =
        format!("tandem_auth_refused_total{{listener=\"{listener}\",reason=\"{reason}\"}}");
    metric_at(metrics, &series)
}

/// Every call the rogue makes fails; returns how many it made.
async fn attack_grpc(security: &Security, control: &str, workers: &[Value]) -> usize {
    let mut calls = 0;
    let channel = |uri: &str, name: &str| {
        let e = proto::secure::endpoint(security, uri, name).unwrap();
        e.connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5))
            .connect_lazy()
    };
    let mut ctl = grpc::control_client::ControlClient::new(channel(control, Role::Router.dns()));
    let join = grpc::JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::Prefill as i32,
        name: "rogue".into(),
        endpoint: "http://127.0.0.1:9".into(),
        ..Default::default()
    };
    assert!(ctl.join(join).await.is_err(), "a rogue joined");
    calls += 1;
    for guess in 1..=3 {
        let beat = grpc::Heartbeat {
            worker_id: guess,
            ..Default::default()
        };
        assert!(
            ctl.beat(beat).await.is_err(),
            "a rogue beat for worker {guess}"
        );
        calls += 1;
    }
    for w in workers {
        calls += attack_worker(
            &channel(w["endpoint"].as_str().unwrap(), Role::WORKER_DNS),
            w,
        )
        .await;
    }
    calls
}

async fn attack_worker(ch: &tonic::transport::Channel, w: &Value) -> usize {
    let mut worker = grpc::worker_client::WorkerClient::new(ch.clone());
    assert!(
        worker.drain(grpc::DrainRequest {}).await.is_err(),
        "drained {w}"
    );
    let cancel = grpc::CancelRequest {
        request_id: 1,
        ..Default::default()
    };
    assert!(worker.cancel(cancel).await.is_err(), "cancelled on {w}");
    if w["role"] == "decode" {
        let mut d = grpc::decode_client::DecodeClient::new(ch.clone());
        let g = grpc::GenerateRequest {
            request_id: 7,
            prompt: vec![1, 2, 3],
            ..Default::default()
        };
        assert!(d.generate(g).await.is_err(), "generated on {w}");
    } else {
        // Relaying: the rogue asks the prefill worker to send KV (and so to answer a handshake)
        // to an endpoint of its choosing.
        let mut p = grpc::prefill_client::PrefillClient::new(ch.clone());
        let r = grpc::PrefillRequest {
            request_id: 7,
            tokens: vec![1, 2, 3],
            offers: vec![grpc::KvOffer {
                transport: "tcp".into(),
                endpoint: "127.0.0.1:9".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert!(p.prefill(r).await.is_err(), "prefilled on {w}");
    }
    3
}

/// KV frames at the decode worker's TCP listener: a handshake in the clear (as `insecure`
/// clusters speak it), then `Begin` and a `Layer` claiming a gigabyte.
async fn attack_kv(security: &Security, tcp: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let identity = proto::ModelIdentity {
        model: "rogue".into(),
        kv_dtype: "f16".into(),
        block_size: 16,
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 64,
        windows: Vec::new(),
    };
    let local = kv_transfer::Local {
        security: security.clone(),
        ..kv_transfer::Local::open(identity)
    };
    let offer = kv_transfer::Offer {
        transport: kv_transfer::Transport::Tcp,
        endpoint: tcp.into(),
        cert_der: Vec::new(),
    };
    let r = kv_transfer::KvSender::connect(&offer, &local, Duration::from_secs(3)).await;
    assert!(r.is_err(), "a rogue passed the KV handshake");
    // Raw frames: kind 4 (Begin) and kind 5 (Layer, 1 GiB announced).
    let mut s = tokio::net::TcpStream::connect(tcp).await.unwrap();
    let mut frames = vec![4u8];
    frames.extend(20u32.to_le_bytes());
    frames.extend([0u8; 4 + 20]);
    frames.push(5);
    frames.extend((1u32 << 30).to_le_bytes());
    frames.extend([0u8; 4 + 12]);
    frames.extend(vec![0u8; 1 << 20]);
    let _ = s.write_all(&frames).await;
    // At most a TLS alert (record type 21) comes back, then the connection closes.
    let mut back = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut back)).await;
    assert!(read.is_ok(), "the KV listener kept the connection open");
    assert!(
        back.is_empty() || back[0] == 21,
        "the KV listener answered {back:?}"
    );
}

/// A compromised KV sender — a genuine prefill (or decode: handing a sequence off) certificate
/// and the cluster's model — with no ticket: the KV it sends into a request the router did not
/// hand it is refused at `Begin`.
async fn send_without_ticket(security: &Security, tcp: &str) -> kv_transfer::TransferError {
    let (config, _) = engine::inspect(&tandem_tests::model_path()).unwrap();
    let identity = engine::identity_of(&config, 16);
    let local = kv_transfer::Local {
        security: security.clone(),
        ..kv_transfer::Local::open(identity.clone())
    };
    let offer = kv_transfer::Offer {
        transport: kv_transfer::Transport::Tcp,
        endpoint: tcp.into(),
        cert_der: Vec::new(),
    };
    let t = Duration::from_secs(5);
    let mut conn = kv_transfer::KvSender::connect(&offer, &local, t)
        .await
        .expect("a KV sender's certificate passes the handshake");
    let n_tokens = 16;
    let layers: Vec<kv_transfer::Layer> = (0..identity.n_layers as usize)
        .map(|l| kv_transfer::core::layer_bytes(&identity, l, n_tokens) as usize)
        .map(|n| kv_transfer::Layer::new(vec![7; n]))
        .collect();
    let width = identity.n_kv_heads * identity.head_dim;
    let guess = (engine::RequestId(1), kv_transfer::TransferTicket([1; 16]));
    let ready = kv_transfer::Layers::Ready(&layers);
    conn.send(guess, n_tokens, width, ready, t)
        .await
        .expect_err("a transfer without its ticket")
}

#[test]
fn a_rogue_without_the_clusters_credentials_gets_nowhere() {
    let c = Cluster::of(1, 1).start(EXE.as_ref());
    let ask = || {
        let body = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0});
        post_json(c.http, "/v1/completions", &body)
    };
    let (status, v) = ask();
    assert_eq!(status, 200, "{v}");
    let before = c.workers();
    let decode = before
        .iter()
        .find(|w| w["role"] == "decode")
        .unwrap()
        .clone();
    let prefill = before
        .iter()
        .find(|w| w["role"] == "prefill")
        .unwrap()
        .clone();
    let tcp = tcp_offer(&decode);
    let indexed = metric_at(c.operator, "tandem_router_kv_index_blocks");
    let pid = c.pid("decode-0").unwrap();
    let rss0 = rss_kib(pid);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut attackers = impostors(c.dir());
    let decode_cert = cluster_cert(c.dir(), Role::Decode);
    attackers.push(("a decode worker's certificate", decode_cert.clone()));
    for (who, security) in &attackers {
        let calls = rt.block_on(attack_grpc(security, &c.control, &before));
        eprintln!("{who}: {calls} gRPC calls refused");
    }
    // A store node's certificate is of the wrong role for the KV listener (only prefill
    // workers and decode workers send KV).
    let mut kv_attackers = impostors(c.dir());
    kv_attackers.push((
        "a store node's certificate",
        cluster_cert(c.dir(), Role::Store),
    ));
    for (_, security) in &kv_attackers {
        rt.block_on(attack_kv(security, &tcp));
    }
    for (who, cert) in [
        ("prefill", cluster_cert(c.dir(), Role::Prefill)),
        ("decode", decode_cert),
    ] {
        let e = rt.block_on(send_without_ticket(&cert, &tcp));
        // The sender sees the refusal, or (when its layers were still going out as the receiver
        // closed) a broken pipe; the receiver counted why, before it read a layer.
        eprintln!("a {who} certificate without the ticket: {e}");
    }
    assert!(refused(metrics(&decode), "kv", "ticket") >= 2.0);

    // The path: refused at each listener, by reason.
    for (listener, at) in [
        ("control", c.operator),
        ("worker", metrics(&decode)),
        ("worker", metrics(&prefill)),
    ] {
        for reason in ["not_tls", "untrusted_certificate"] {
            assert!(refused(at, listener, reason) >= 1.0, "{listener} {reason}");
        }
    }
    for w in [&decode, &prefill] {
        assert!(
            refused(metrics(w), "worker", "wrong_role") >= 1.0,
            "a decode cert calling {w}"
        );
    }
    // A decode worker's certificate reaches the control plane, but may not join the prefill
    // pool, nor heartbeat for another decode worker, and may send KV only with a ticket.
    let id = decode["id"].as_u64().unwrap();
    let beat = rt.block_on(async {
        let e = proto::secure::endpoint(&attackers[2].1, &c.control, Role::Router.dns()).unwrap();
        let mut ctl = grpc::control_client::ControlClient::new(e.connect().await.unwrap());
        let b = grpc::Heartbeat {
            worker_id: id,
            ..Default::default()
        };
        ctl.beat(b).await
    });
    assert_eq!(beat.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert!(refused(c.operator, "control", "not_owner") >= 1.0);
    assert!(refused(c.operator, "control", "wrong_pool") >= 1.0);
    for reason in ["not_tls", "untrusted_certificate", "wrong_role"] {
        assert!(
            refused(metrics(&decode), "kv_tcp", reason) >= 1.0,
            "kv_tcp {reason}"
        );
    }
    unchanged(&c, &before, indexed);
    let grown = rss_kib(pid).saturating_sub(rss0);
    assert!(grown < 16 << 10, "the decode worker grew by {grown} KiB");
}

/// A decode worker's TCP KV endpoint, from `/debug/workers`.
fn tcp_offer(decode: &Value) -> String {
    let offers = decode["kv_offers"].as_array().unwrap();
    let tcp = offers.iter().find(|o| o[0] == "tcp").unwrap();
    tcp[1].as_str().unwrap().to_string()
}

/// `tandem up` with nothing said about security is secure: the rogue's attacks fail against it.
#[test]
fn tandem_up_with_no_configuration_keeps_the_rogue_out() {
    let toml = format!(
        "[model]\npath = {:?}\n[router]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\noperator = \"127.0.0.1:0\"\n\
         [prefill]\nengine = \"mock\"\n[decode]\nengine = \"mock\"\n",
        tandem_tests::model_path()
    );
    let up = tandem_tests::up::Up::start(EXE.as_ref(), &toml);
    up.wait_joined(1, 1, Duration::from_secs(30));
    let log = up.log();
    let control = log
        .split("(control ")
        .nth(1)
        .and_then(|r| r.split([',', ')']).next())
        .unwrap_or_else(|| panic!("the router's control address is not in the log:\n{log}"))
        .to_string();
    let workers = up.workers();
    let decode = workers.iter().find(|w| w["role"] == "decode").unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (who, security) in impostors(up.dir()) {
        let calls = rt.block_on(attack_grpc(&security, &control, &workers));
        rt.block_on(attack_kv(&security, &tcp_offer(decode)));
        eprintln!("{who}: {calls} gRPC calls and the KV listener refused");
    }
    for reason in ["not_tls", "untrusted_certificate"] {
        assert!(
            refused(up.operator, "control", reason) >= 1.0,
            "control {reason}"
        );
        assert!(
            refused(metrics(decode), "kv_tcp", reason) >= 1.0,
            "kv_tcp {reason}"
        );
        for w in &workers {
            assert!(
                refused(metrics(w), "worker", reason) >= 1.0,
                "worker {reason}"
            );
        }
    }
    let ids = |ws: &[Value]| ws.iter().map(|w| w["id"].clone()).collect::<Vec<_>>();
    assert_eq!(
        ids(&up.workers()),
        ids(&workers),
        "no worker joined or left"
    );
    assert!(
        log.contains("mutual TLS"),
        "tandem up says how its hops are secured:\n{log}"
    );
    // The map of the cluster is not on the API's port; the operator's (loopback) serves it.
    for path in [
        "/metrics",
        "/status.json",
        "/prometheus/targets",
        "/debug/workers",
    ] {
        let (api, _) = tandem_tests::cluster::get(up.http, path).unwrap();
        let (ops, _) = tandem_tests::cluster::get(up.operator, path).unwrap();
        assert_eq!((api, ops), (404, 200), "{path}");
    }
    assert!(up.operator.ip().is_loopback(), "{}", up.operator);
}

/// A worker's metrics endpoint, from `/debug/workers`.
fn metrics(w: &Value) -> SocketAddr {
    w["metrics_endpoint"].as_str().unwrap().parse().unwrap()
}

/// Nothing changed: the same workers as `before`, none draining, the KV index as it was
/// (`indexed` blocks), and the cluster still serves through its prefill pool.
fn unchanged(c: &Cluster, before: &[Value], indexed: f64) {
    let after = c.workers();
    let ids = |ws: &[Value]| ws.iter().map(|w| w["id"].clone()).collect::<Vec<_>>();
    assert_eq!(ids(&after), ids(before));
    assert!(after.iter().all(|w| w["draining"] == false), "{after:?}");
    assert_eq!(
        metric_at(c.operator, "tandem_router_kv_index_blocks"),
        indexed
    );
    let transfers =
        |ws: &[Value]| ws.iter().find(|w| w["role"] == "prefill").unwrap()["kv_transfers"].clone();
    let body = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0});
    let (status, v) = post_json(c.http, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        transfers(&c.workers())["tcp"],
        transfers(&after)["tcp"].as_u64().unwrap() + 1
    );
}

#[test]
fn a_store_node_serves_the_clusters_workers_and_no_one_else() {
    let dir = std::env::temp_dir().join(format!("tandem-store-rogue-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("cluster.toml"),
        "[decode]\n[store]\ncapacity_bytes = 1000000000\n",
    )
    .unwrap();
    let (_store, at) = StoreNode::start(EXE.as_ref(), &dir.join("cluster.toml"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = |security: Security| {
        let at = at.clone();
        async move {
            let e = proto::secure::endpoint(&security, &at, Role::Store.dns()).unwrap();
            e.connect().await.map(grpc::store_client::StoreClient::new)
        }
    };
    let pki = Store::at(dir.join(".tandem/pki"));
    let worker = Security::Mutual(Arc::new(pki.credentials(Role::Decode, "d").unwrap()));
    let data: Vec<u8> = (0..50_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
    let key = grpc::ObjectKey { model: 1, block: 2 };
    rt.block_on(async {
        // The cluster's decode worker puts a block and gets it back.
        let mut c = client(worker.clone()).await.unwrap();
        let spec = grpc::PutSpec {
            key: Some(key),
            size: data.len() as u64,
            sum: types::sum::sum(&data),
        };
        let objects = vec![spec.clone()];
        let grants = c
            .put_start(grpc::PutStartRequest { objects })
            .await
            .unwrap();
        let id = grants.into_inner().grants[0].put_id;
        // The bytes go on the node's data connection, at the port its load names.
        let load = c
            .stats(grpc::StoreStatsRequest {})
            .await
            .unwrap()
            .into_inner();
        let data_at = format!("127.0.0.1:{}", load.data_port);
        let soon = || tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut d = store::data::Client::connect(&data_at, &worker, soon())
            .await
            .unwrap();
        let done = d.put(&[(id, &data)], soon()).await.unwrap();
        assert_eq!(done.published, 1);
        let back = d.get(&[(key.model, key.block)], soon()).await.unwrap();
        assert_eq!(back[0].data, data);
        // Nor does a stranger get a data connection.
        for (who, security) in impostors(&dir) {
            let refused = match store::data::Client::connect(&data_at, &security, soon()).await {
                Err(_) => true,
                Ok(mut s) => s.get(&[(key.model, key.block)], soon()).await.is_err(),
            };
            assert!(refused, "{who} got a data connection");
        }
        // Strangers are refused at the handshake; the router's certificate may not put.
        for (who, security) in impostors(&dir) {
            let refused = match client(security).await {
                Err(_) => true,
                Ok(mut s) => s.stats(grpc::StoreStatsRequest {}).await.is_err(),
            };
            assert!(refused, "{who} got in");
        }
        let router = Security::Mutual(Arc::new(pki.credentials(Role::Router, "r").unwrap()));
        let mut r = client(router).await.unwrap();
        let objects = vec![spec];
        let e = r
            .put_start(grpc::PutStartRequest { objects })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        let s = r
            .stats(grpc::StoreStatsRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!((s.objects, s.puts, s.hits), (1, 1, 1));
    });
    // Open to anyone, it would take anyone's KV: refused at start.
    let insecure = "[decode]\n[security]\ninsecure = true\n";
    std::fs::write(dir.join("cluster.toml"), insecure).unwrap();
    let out = std::process::Command::new(EXE)
        .args(["store", "--config"])
        .arg(dir.join("cluster.toml"))
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("reachable from other machines"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Peer fetch's listener (a decode worker serving its cached KV blocks) takes the cluster's
/// workers only: a stranger, a certificate of another CA, and a store node's genuine one are
/// refused (counted by reason); a prefill worker's certificate gets the blocks.
#[test]
fn a_decode_workers_peer_fetch_listener_serves_the_clusters_workers_only() {
    let c = Cluster::of(1, 1)
        .pools(["[prefill.kv_tiers]\nhost_bytes = 100_000_000\n", ""])
        .kv("peer_fetch = true")
        .start(EXE.as_ref());
    let decode = c
        .workers()
        .into_iter()
        .find(|w| w["role"] == "decode")
        .unwrap();
    let peer = decode["peer_endpoint"].as_str().unwrap().to_string();
    assert!(!peer.is_empty(), "{decode}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let soon = || tokio::time::Instant::now() + Duration::from_secs(5);
    let get = |security: Security| {
        let peer = peer.clone();
        rt.block_on(async move {
            let mut s = store::data::Client::connect_to(&peer, &security, Role::Decode, soon())
                .await
                .map_err(|e| e.to_string())?;
            s.get(&[(1, 2)], soon()).await.map_err(|e| e.to_string())
        })
    };
    let mut rogues = impostors(c.dir());
    rogues.push((
        "a store node's certificate",
        cluster_cert(c.dir(), Role::Store),
    ));
    for (who, security) in rogues {
        assert!(get(security).is_err(), "{who} got a peer connection");
    }
    // A worker of the cluster asks, and is answered (nothing held under that key).
    let got = get(cluster_cert(c.dir(), Role::Prefill)).unwrap();
    assert!(got.is_empty());
    for reason in ["not_tls", "untrusted_certificate", "wrong_role"] {
        assert!(
            refused(metrics(&decode), "peer_data", reason) >= 1.0,
            "peer_data {reason}"
        );
    }
}
