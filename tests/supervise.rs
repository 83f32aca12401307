//! `tandem up` keeps the cluster serving (issue 13, acceptance 5): under a steady load of
//! streamed requests, each worker in turn — and then the router — is killed with SIGKILL; the
//! supervisor starts it again, it rejoins within seconds, every request in flight on a worker
//! completes (migrated or recomputed) and the clients never see an error from a worker's death.
//! Mock-engine workers (real processes and KV transfers, a timing model instead of kernels).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_tests::cluster::{get, request};

const EXE: &str = env!("CARGO_BIN_EXE_tandem");

const CONFIG: &str = r#"
[router]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"

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

/// `tandem up`, stopped with SIGINT (SIGKILL after 10 s) when dropped.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: signalling our own child; `tandem up` stops everything it started.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The pid of the process whose command line has `config` and names `who` (`--name decode-0`,
/// or `router`).
fn pid_of(config: &str, who: &str) -> Option<i32> {
    let wanted: Vec<&str> = match who {
        "router" => vec!["router"],
        name => vec!["--name", name],
    };
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let has = |w: &[&str]| {
            args.windows(w.len())
                .any(|x| x.iter().zip(w).all(|(a, b)| a == b))
        };
        (args.iter().any(|a| a == config)
            && has(&wanted)
            && args.get(1).map(String::as_str) != Some("up"))
        .then_some(pid)
    })
}

/// Workers joined, by role, from `/health`.
fn joined(http: SocketAddr) -> (u64, u64) {
    let Ok((_, body)) = get(http, "/health") else {
        return (0, 0);
    };
    let v: Value = serde_json::from_str(&body).unwrap_or_default();
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    (n("prefill_workers"), n("decode_workers"))
}

/// The router's ids of the joined workers named `name`.
fn ids_of(http: SocketAddr, name: &str) -> Vec<u64> {
    let Ok((_, body)) = get(http, "/debug/workers") else {
        return Vec::new();
    };
    let v: Value = serde_json::from_str(&body).unwrap_or_default();
    let ws = v["workers"].as_array().cloned().unwrap_or_default();
    ws.iter()
        .filter(|w| w["name"] == name)
        .filter_map(|w| w["id"].as_u64())
        .collect()
}

/// Waits until worker `name` has joined again under a new id and its old id `old` is gone.
fn wait_rejoined(http: SocketAddr, name: &str, old: &[u64]) -> Duration {
    let t0 = Instant::now();
    loop {
        let ids = ids_of(http, name);
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
    let dir = std::env::temp_dir().join(format!("tandem-supervise-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("cluster.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let cfg_s = cfg.to_string_lossy().to_string();
    let mut child = Command::new(EXE)
        .args(["up", "--config", &cfg_s])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (stdout, stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let up = Up(child);
    let mut lines = BufReader::new(stdout).lines();
    let http: SocketAddr = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.split("behind http://").nth(1)?.trim().parse().ok())
        .expect("tandem up prints its address");
    std::thread::spawn(move || for _ in lines {});
    let log = Arc::new(Mutex::new(String::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            sink.lock().unwrap().push_str(&(l + "\n"));
        }
    });

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
        let pid = pid_of(&cfg_s, who).unwrap_or_else(|| panic!("{who} runs"));
        let old = ids_of(http, who);
        assert_eq!(old.len(), 1, "{who} joined once");
        // SAFETY: SIGKILL to a worker of the cluster this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let back = wait_rejoined(http, who, &old);
        eprintln!("{who} killed; joined again {back:?} later");
        wait_joined(http, (1, 2), who);
        assert_ne!(pid_of(&cfg_s, who), Some(pid), "{who} is a new process");
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
    let (_, metrics) = get(http, "/metrics").unwrap();
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
    let pid = pid_of(&cfg_s, "router").expect("the router runs");
    // SAFETY: SIGKILL to the router of the cluster this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(500));
    wait_joined(http, (1, 2), "router");
    stream_once(http, 7).expect("served after the router's restart");
    let log = log.lock().unwrap().clone();
    for who in ["prefill-0", "decode-0", "decode-1", "router"] {
        assert!(
            log.contains(&format!("tandem: {who} exited")),
            "a log line for {who}:\n{log}"
        );
    }
    drop(up);
    let _ = std::fs::remove_dir_all(&dir);
}
