//! The `kubernetes` actuator against recorded API requests: an in-process fake API server
//! (axum on a loopback port) records every request and answers as the API server's scale
//! subresource and pods do. No live API server runs here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::patch;
use proto::grpc::{self, JoinRequest};
use proto::Pool;
use router::actuator::Actuator;
use router::kubernetes::{KubeApi, Kubernetes, Target};
use router::registry::Registry;
use serde_json::{json, Value};

/// One request as the API server saw it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    path: String,
    auth: String,
    content_type: String,
    body: Value,
}

#[derive(Clone, Default)]
struct Fake {
    seen: Arc<Mutex<Vec<Seen>>>,
    /// Answer 403 (no RBAC) while set.
    forbid: Arc<Mutex<bool>>,
}

async fn scale(
    State(f): State<Fake>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: String,
) -> (StatusCode, String) {
    let h = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    f.seen.lock().unwrap().push(Seen {
        path: format!("/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"),
        auth: h("authorization"),
        content_type: h("content-type"),
        body: serde_json::from_str(&body).unwrap_or(Value::Null),
    });
    if *f.forbid.lock().unwrap() {
        let e = json!({"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403});
        return (StatusCode::FORBIDDEN, e.to_string());
    }
    let n = serde_json::from_str::<Value>(&body).unwrap_or_default()["spec"]["replicas"].clone();
    let s = json!({"kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": ns}, "spec": {"replicas": n}, "status": {"replicas": 1}});
    (StatusCode::OK, s.to_string())
}

/// A pod's merge patch, recorded as the scale's are.
async fn pod(
    State(f): State<Fake>,
    Path((ns, name)): Path<(String, String)>,
    body: String,
) -> (StatusCode, String) {
    f.seen.lock().unwrap().push(Seen {
        path: format!("/api/v1/namespaces/{ns}/pods/{name}"),
        auth: String::new(),
        content_type: String::new(),
        body: serde_json::from_str(&body).unwrap_or(Value::Null),
    });
    let p = json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"name": name, "namespace": ns}});
    (StatusCode::OK, p.to_string())
}

fn registry() -> Arc<Registry> {
    let (config, _) = engine::inspect(&engine::fetch::default_model_path()).unwrap();
    Registry::with_timeout(engine::identity_of(&config, 16), Duration::from_secs(60))
}

/// The fake API server on a loopback port.
async fn serve_api(fake: Fake) -> std::net::SocketAddr {
    let app = axum::Router::new()
        .route(
            "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
            patch(scale),
        )
        .route("/api/v1/namespaces/{ns}/pods/{name}", patch(pod))
        .with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The decode pool's deployment in the API's namespace, the prefill pool's in its own.
fn two_targets() -> HashMap<Pool, Target> {
    HashMap::from([
        (
            Pool::Decode,
            Target {
                deployment: "tandem-decode".into(),
                namespace: None,
            },
        ),
        (
            Pool::Prefill,
            Target {
                deployment: "tandem-prefill".into(),
                namespace: Some("other".into()),
            },
        ),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_patches_each_pools_deployment_scale_with_a_fresh_token() {
    let fake = Fake::default();
    let addr = serve_api(fake.clone()).await;
    let dir = std::env::temp_dir().join(format!("tandem-kube-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "tok-1\n").unwrap();
    let api = KubeApi {
        base: format!("http://{addr}"),
        token_file: token.clone(),
        ca_pem: None,
        namespace: "serving".into(),
    };
    let mut k = Kubernetes::new(api, two_targets()).unwrap();
    let reg = registry();
    let seen = || fake.seen.lock().unwrap().clone();

    // Three decode replicas wanted, none joined: one PATCH, and three on their way.
    assert_eq!(k.reconcile(Pool::Decode, 3, &reg).await, 3);
    let want = Seen {
        path: "/apis/apps/v1/namespaces/serving/deployments/tandem-decode/scale".into(),
        auth: "Bearer tok-1".into(),
        content_type: "application/merge-patch+json".into(),
        body: json!({"spec": {"replicas": 3}}),
    };
    assert_eq!(seen(), vec![want.clone()]);
    // The same count again: no request. One worker joins: two on their way.
    let (config, _) = engine::inspect(&engine::fetch::default_model_path()).unwrap();
    reg.join(JoinRequest {
        protocol_version: proto::PROTOCOL_VERSION,
        role: grpc::Role::Decode as i32,
        identity: Some(engine::identity_of(&config, 16).into()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(k.reconcile(Pool::Decode, 3, &reg).await, 2);
    assert_eq!(seen().len(), 1);

    // The token rotated, the pool's namespace is its own.
    std::fs::write(&token, "tok-2\n").unwrap();
    k.reconcile(Pool::Prefill, 2, &reg).await;
    let last = seen().last().cloned().unwrap();
    assert_eq!(
        last.path,
        "/apis/apps/v1/namespaces/other/deployments/tandem-prefill/scale"
    );
    assert_eq!(last.auth, "Bearer tok-2");

    // Forbidden (RBAC missing): not counted as applied, tried again on the next tick.
    *fake.forbid.lock().unwrap() = true;
    k.reconcile(Pool::Decode, 1, &reg).await;
    k.reconcile(Pool::Decode, 1, &reg).await;
    assert_eq!(seen().len(), 4, "{:?}", seen());
    *fake.forbid.lock().unwrap() = false;
    k.reconcile(Pool::Decode, 1, &reg).await;
    k.reconcile(Pool::Decode, 1, &reg).await;
    assert_eq!(seen().len(), 5);
    assert_eq!(seen()[4].body, json!({"spec": {"replicas": 1}}));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Scaling down, the actuator picks the pods that go: the least busy workers (a worker is named
/// after its pod) get the lowest deletion cost before the scale is written, so the ReplicaSet
/// removes those (which then drain themselves on SIGTERM); scaling up marks none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_marks_the_least_busy_pods_to_go() {
    let fake = Fake::default();
    let addr = serve_api(fake.clone()).await;
    let dir = std::env::temp_dir().join(format!("tandem-kube-down-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("token"), "tok").unwrap();
    let api = KubeApi {
        base: format!("http://{addr}"),
        token_file: dir.join("token"),
        ca_pem: None,
        namespace: "serving".into(),
    };
    let mut k = Kubernetes::new(api, two_targets()).unwrap();
    let reg = registry();
    let (config, _) = engine::inspect(&engine::fetch::default_model_path()).unwrap();
    // Three decode pods holding 5, 0 and 2 requests.
    for (name, running) in [("decode-a", 5), ("decode-b", 0), ("decode-c", 2)] {
        let id = reg
            .join(JoinRequest {
                protocol_version: proto::PROTOCOL_VERSION,
                role: grpc::Role::Decode as i32,
                identity: Some(engine::identity_of(&config, 16).into()),
                name: name.into(),
                ..Default::default()
            })
            .unwrap();
        let beat = grpc::Heartbeat {
            worker_id: id.0,
            load: Some(grpc::WorkerLoad {
                running,
                ..Default::default()
            }),
            kv: None,
        };
        reg.with(|t| t.beat(beat, std::time::Instant::now()))
            .unwrap();
    }
    let seen = || fake.seen.lock().unwrap().clone();
    assert_eq!(k.reconcile(Pool::Decode, 3, &reg).await, 0);
    assert_eq!(seen().len(), 1, "up to 3: the scale alone");
    k.reconcile(Pool::Decode, 1, &reg).await;
    let paths: Vec<String> = seen()[1..].iter().map(|s| s.path.clone()).collect();
    assert_eq!(
        paths,
        [
            "/api/v1/namespaces/serving/pods/decode-b",
            "/api/v1/namespaces/serving/pods/decode-c",
            "/apis/apps/v1/namespaces/serving/deployments/tandem-decode/scale",
        ]
    );
    // Each scale-down's pods one lower than the last's: the first, -1001.
    let cost = json!({"metadata": {"annotations": {router::kubernetes::DELETION_COST: "-1001"}}});
    assert_eq!(
        (seen()[1].body.clone(), seen()[2].body.clone()),
        (cost.clone(), cost)
    );
    assert_eq!(seen()[3].body, json!({"spec": {"replicas": 1}}));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TLS acceptor for 127.0.0.1, its certificate signed by a new CA, and that CA's PEM.
fn tls_signed_by_a_new_ca() -> (tokio_rustls::TlsAcceptor, Vec<u8>) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().unwrap())
        .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    (acceptor, ca.pem().into_bytes())
}

/// A raw TLS listener that records the first request (up to its JSON body) and answers 200.
fn record_one_patch(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) -> Arc<Mutex<String>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let seen = Arc::new(Mutex::new(String::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut tls = acceptor.accept(tcp).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let mut got = Vec::new();
        while !String::from_utf8_lossy(&got).contains("{\"spec\"") {
            let n = tls.read(&mut buf).await.unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        *record.lock().unwrap() = String::from_utf8_lossy(&got).into_owned();
        let body = r#"{"kind":"Scale"}"#;
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(answer.as_bytes()).await.unwrap();
        tls.flush().await.unwrap();
    });
    seen
}

/// The API server over HTTPS, its certificate issued by the cluster's CA: the actuator trusts
/// that CA alone (a raw TLS listener records the request and answers 200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_to_the_api_server_trusts_the_clusters_ca() {
    let (acceptor, ca_pem) = tls_signed_by_a_new_ca();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = record_one_patch(listener, acceptor);
    let dir = std::env::temp_dir().join(format!("tandem-kube-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("token"), "tok").unwrap();
    let api = KubeApi {
        base: format!("https://{addr}"),
        token_file: dir.join("token"),
        ca_pem: Some(ca_pem),
        namespace: "serving".into(),
    };
    let targets = HashMap::from([(
        Pool::Decode,
        Target {
            deployment: "d".into(),
            namespace: None,
        },
    )]);
    let mut k = Kubernetes::new(api, targets).unwrap();
    assert_eq!(
        k.reconcile(Pool::Decode, 2, &registry()).await,
        2,
        "applied: 2 on their way"
    );
    let req = seen.lock().unwrap().clone();
    assert!(
        req.starts_with("PATCH /apis/apps/v1/namespaces/serving/deployments/d/scale HTTP/1.1"),
        "{req}"
    );
    assert!(
        req.to_lowercase().contains("authorization: bearer tok"),
        "{req}"
    );
    // Without the CA an https API server is refused at once.
    let api = KubeApi {
        base: "https://127.0.0.1:1".into(),
        token_file: dir.join("token"),
        ca_pem: None,
        namespace: "x".into(),
    };
    assert!(Kubernetes::new(api, HashMap::new()).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}
