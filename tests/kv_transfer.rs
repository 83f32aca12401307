//! KV between real prefill and decode worker processes: each transport (TCP and QUIC,
//! layer-wise or whole) carries it to the same tokens and says which it chose and why; a
//! preferred transport the machine lacks falls back visibly, a required one fails closed; a
//! cluster secret keeps outsiders from writing KV.

use std::time::Duration;

use engine::SamplingParams;
use serde_json::json;
use tandem_tests::cluster::{metric_at, post_json, Cluster};
use tandem_tests::engine_chat as engine_text;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

#[test]
fn tcp_and_quic_layerwise_or_whole_carry_the_kv_to_identical_tokens_and_say_which() {
    let q = "Explain photosynthesis in one sentence.";
    let mut texts = Vec::new();
    for (transport, layerwise) in [("tcp", true), ("quic", true), ("tcp", false)] {
        let kv = format!("prefer = [\"{transport}\"]\nlayerwise = {layerwise}");
        let c = Cluster::of(1, 1).kv(&kv).start(EXE.as_ref());
        let (status, v) = post_json(
            c.http,
            "/v1/chat/completions",
            &json!({"model": MODEL, "temperature": 0.7, "seed": 3, "max_tokens": 40, "messages": [{"role": "user", "content": q}]}),
        );
        assert_eq!(status, 200, "{v}");
        texts.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        );
        c.wait_transfers(transport, 1);
    }
    assert_eq!(texts[0], texts[1]);
    assert_eq!(texts[0], texts[2]);
    let params = SamplingParams {
        max_tokens: Some(40),
        temperature: 0.7,
        seed: 3,
        ..Default::default()
    };
    assert_eq!(texts[0], engine_text(q, params).0);
}

#[test]
fn preferring_rdma_without_a_device_falls_back_visibly_and_requiring_it_fails_closed() {
    // Default preference is rdma, tcp, quic: this build has no RDMA, so TCP is chosen.
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let (status, _) = post_json(
        c.http,
        "/v1/completions",
        &json!({"prompt": "Hello there", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    c.wait_transfers("tcp", 1);
    // The fallback and its reason are in the router's metrics.
    let (_, metrics) = tandem_tests::cluster::get(c.operator, "/metrics").unwrap();
    let chosen = metrics
        .lines()
        .find(|l| l.starts_with("tandem_kv_transport_chosen_total{"))
        .unwrap_or_else(|| panic!("no transport choice in /metrics:\n{metrics}"));
    assert!(
        chosen.contains("transport=\"tcp\"") && chosen.contains("rdma: "),
        "{chosen}"
    );
    // A prefill worker that requires RDMA refuses to start, saying why.
    let cfg = c.config(&Cluster::of(1, 1).kv("require = \"rdma\""));
    let out = c
        .spawn_worker("prefill", "rdma-only", &cfg)
        .wait_with_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("require") && err.contains("rdma"), "{err}");
}

/// Kills a process when dropped (so a failing test leaves nothing running).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_cluster_secret_keeps_outsiders_from_writing_kv() {
    let dir = std::env::temp_dir().join(format!("tandem-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "correct horse battery staple\n").unwrap();
    let kv = format!("secret_file = {secret:?}");
    let ask = |c: &Cluster| {
        post_json(
            c.http,
            "/v1/completions",
            &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
        )
    };
    // Members with the secret: served through the prefill pool.
    let c = Cluster::of(1, 1).kv(&kv).start(EXE.as_ref());
    let (status, v) = ask(&c);
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["text"].as_str().unwrap().contains("Paris"),
        "{v}"
    );
    c.wait_transfers("tcp", 1);
    drop(c);
    // A decode worker with the secret, and a prefill worker without it (it holds the cluster's
    // certificates, so it joins: a process without them cannot, see tests/security.rs): its KV
    // is refused at the handshake, before the decode worker reads any of it; the router
    // recomputes the prompt on the decode worker, so the client still gets the right answer.
    let c = Cluster::of(0, 1).kv(&kv).start(EXE.as_ref());
    let outsider_cfg = c.config(&Cluster::of(1, 1));
    let outsider = Reaped(c.spawn_worker("prefill", "outsider", &outsider_cfg));
    c.wait_for(1, 1);
    let (status, v) = ask(&c);
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["text"].as_str().unwrap().contains("Paris"),
        "{v}"
    );
    let ws = c.workers();
    let p = ws.iter().find(|w| w["role"] == "prefill").unwrap();
    assert_eq!(
        p["kv_transfers"],
        json!({}),
        "the outsider wrote no KV: {p}"
    );
    // It was tried: the prompt went to it, its KV was refused, the decode worker recomputed.
    let phase = |name: &str| {
        metric_at(
            c.operator,
            &format!("tandem_router_request_phases_total{{phase=\"{name}\"}}"),
        )
    };
    assert_eq!((phase("prefilling"), phase("recomputing")), (1.0, 1.0));
    c.wait_all_free(Duration::from_secs(5));
    drop(outsider);
    let _ = std::fs::remove_dir_all(&dir);
}
