//! `tandem up` keeps the cluster serving (issue 13, acceptance 5): under a steady load of
//! streamed requests, each worker in turn — and then the router — is killed with SIGKILL; the
//! supervisor starts it again, it rejoins within seconds, every request in flight on a worker
//! completes (migrated or recomputed) and the clients never see an error from a worker's death.
//! Mock-engine workers (real processes and KV transfers, a timing model instead of kernels).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_tests::cluster::{get, request};
use tandem_tests::up::Up;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");

const CONFIG: &str = r#"
[router]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"
operator = "127.0.0.1:0"

[prefill]
replicas = 1
engine = "mock"
kv_blocks = 1024
max_batch_tokens = 512
[prefill.mock]
preset = "cpu-smollm2"

[decode]
replicas = 2
engine = "mock"
kv_blocks = 2048
max_batch_tokens = 256
[decode.mock]
preset = "cpu-smollm2"
"#;

/// Workers joined, by role, from `/health`.
fn joined(http: SocketAddr) -> (u64, u64) {
    let Ok((_, body)) = get(http, "/health") else {
        return (0, 0);
    };
    let v: Value = serde_json::from_str(&body).unwrap_or_default();
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    (n("prefill_workers"), n("decode_workers"))
}

/// Waits until worker `name` has joined again under a new id and its old id `old` is gone.
fn wait_rejoined(up: &Up, name: &str, old: &[u64]) -> Duration {
    let t0 = Instant::now();
    loop {
        let ids = up.ids_of(name);
        if !ids.is_empty() && ids.iter().all(|id| !old.contains(id)) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{name}: back within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_joined(http: SocketAddr, want: (u64, u64), what: &str) -> Duration {
    let t0 = Instant::now();
    while joined(http) != want {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{what}: back within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    t0.elapsed()
}

/// One streamed completion: `Ok` once `[DONE]` came after `n` tokens' worth of chunks, else why.
fn stream_once(http: SocketAddr, k: u64) -> Result<(), String> {
    let prompt: Vec<u32> = (0..256)
        .map(|i| 300 + (k * 131 + i * 7) as u32 % 40_000)
        .collect();
    let body = json!({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": 32,
                      "ignore_eos": true, "stream": true});
    let mut r = request(
        http,
        "POST",
        "/v1/completions",
        "application/json",
        &body.to_string(),
    )
    .map_err(|e| e.to_string())?;
    if r.status != 200 {
        let status = r.status;
        return Err(format!("status {status}: {}", r.body()));
    }
    while let Some((name, data)) = r.next_event() {
        if name == "error" {
            return Err(data);
        }
        if data == "[DONE]" {
            return Ok(());
        }
    }
    Err("the stream ended without [DONE]".into())
}

#[test]
fn killed_workers_are_started_again_and_the_cluster_serves_throughout() {
    let up = Up::start(EXE.as_ref(), CONFIG);
    let http = up.http;
    // Four clients stream requests back to back until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4u64)
        .map(|c| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut ok, mut failed) = (0, Vec::new());
                for k in 0.. {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    match stream_once(http, c * 100_000 + k) {
                        Ok(()) => ok += 1,
                        Err(e) => failed.push(e),
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    for who in ["prefill-0", "decode-0", "decode-1"] {
        let old = up.ids_of(who);
        assert_eq!(old.len(), 1, "{who} joined once");
        let pid = up.signal(who, libc::SIGKILL);
        let back = wait_rejoined(&up, who, &old);
        eprintln!("{who} killed; joined again {back:?} later");
        wait_joined(http, (1, 2), who);
        assert_ne!(up.pid_of(who), Some(pid), "{who} is a new process");
        std::thread::sleep(Duration::from_secs(2));
    }
    stop.store(true, Ordering::SeqCst);
    let (mut ok, mut failed) = (0, Vec::new());
    for c in clients {
        let (o, f) = c.join().unwrap();
        ok += o;
        failed.extend(f);
    }
    eprintln!("{ok} requests completed, {} failed", failed.len());
    assert!(
        failed.is_empty(),
        "no client saw a worker's death: {failed:?}"
    );
    assert!(ok >= 20, "the cluster served throughout ({ok} requests)");
    let (_, metrics) = get(up.operator, "/metrics").unwrap();
    let moved = |series: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let migrated = moved("tandem_router_migrations_total");
    let recomputed = moved("tandem_router_request_phases_total{phase=\"recomputing\"}");
    eprintln!("migrated {migrated}, recomputed {recomputed}");
    assert!(migrated >= 1.0, "a decode worker's streams moved");

    // The router too: started again on the same addresses, rejoined by every worker.
    up.signal("router", libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(500));
    wait_joined(http, (1, 2), "router");
    stream_once(http, 7).expect("served after the router's restart");
    let log = up.log();
    for who in ["prefill-0", "decode-0", "decode-1", "router"] {
        assert!(
            log.contains(&format!("tandem: {who} exited")),
            "a log line for {who}:\n{log}"
        );
    }
}

/// Several models from one cluster.toml: `[[models]]` names Gemma 3's cluster file; `tandem up`
/// starts both clusters (each its own router, pools and planner) and the main router answers
/// for both by name, streams included; `/v1/models` lists both.
#[test]
fn tandem_up_serves_two_models_from_one_config() {
    let main = "[router]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\noperator = \"127.0.0.1:0\"\n\n[decode]\nreplicas = 1\nthreads = 1\nkv_blocks = 128\n\n[[models]]\nconfig = \"gemma.toml\"\n";
    let gemma = format!(
        "[model]\npath = {:?}\n\n[router]\nlisten = \"127.0.0.1:0\"\ncontrol = \"127.0.0.1:0\"\noperator = \"127.0.0.1:0\"\n\n[decode]\nreplicas = 1\nthreads = 1\nkv_blocks = 64\n",
        tandem_tests::gemma3_path()
    );
    let up = Up::start_with_files(EXE.as_ref(), main, &[("gemma.toml", &gemma)]);
    let ids = tandem_tests::cluster::model_ids(up.http);
    assert_eq!(ids, ["SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-q4_k_m"]);
    for model in &ids {
        let body = json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4,
                          "temperature": 0, "stream": true});
        let mut r = request(
            up.http,
            "POST",
            "/v1/completions",
            "application/json",
            &body.to_string(),
        )
        .unwrap();
        assert_eq!(r.status, 200, "{model}");
        let mut last = None;
        while let Some((name, data)) = r.next_event() {
            assert_eq!(name, "message", "{model}: {data}");
            if data == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(&data).unwrap();
            assert_eq!(v["model"], model.as_str());
            last = v["choices"][0]["finish_reason"]
                .as_str()
                .map(String::from)
                .or(last);
        }
        assert_eq!(
            last.as_deref(),
            Some("length"),
            "{model} streamed to its end"
        );
    }
}
