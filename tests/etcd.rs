//! Discovery through etcd (issue 16, acceptances 1 and 2): a real etcd and two routers, two
//! prefill and two decode workers as separate processes that are told nothing but etcd's
//! address. Requests through either router succeed over the prefill pool; a router killed
//! with SIGKILL takes nothing from the other; a killed worker is gone from the routers once its
//! lease expires (the routers' own heartbeat timeout is set far longer, so only etcd can have
//! told them); etcd killed and restarted changes nothing for requests, and every worker
//! registers again under a new lease. With autoscaling on, one planner leads (metrics say
//! which) and the other takes over within the lease TTL when the leader is killed.
//! Mock-engine workers (real processes, KV transfers, a timing model instead of kernels).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_tests::cluster::{get, metric_at, post_json, RouterAt};
use tandem_tests::etcd::{self, Etcd};
use tandem_tests::netns::Lan;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const TTL_MS: u64 = 2000;

fn config(etcd: &str, prefix: &str, autoscale: bool) -> String {
    let scale = if autoscale {
        "[decode.autoscale]\nmin = 1\nmax = 2\ntick_ms = 200\ncooldown_ms = 60000\nwindow_ms = 2000\nactuator = \"command\"\ncommand = \"true\"\n"
    } else {
        ""
    };
    format!(
        r#"
[router]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"
operator = "127.0.0.1:0"
allow_no_keys = true
heartbeat_timeout_ms = 60000
stall_timeout_ms = 60000

[discovery]
etcd = ["{etcd}"]
prefix = "{prefix}"
lease_ttl_ms = {TTL_MS}

[prefill]
replicas = 2
engine = "mock"
kv_blocks = 512
max_batch_tokens = 512
[prefill.mock]
preset = "cpu-smollm2"

[decode]
replicas = 2
engine = "mock"
kv_blocks = 1024
max_batch_tokens = 256
[decode.mock]
preset = "cpu-smollm2"
[decode.slo]
itl_p90_ms = 200
{scale}"#
    )
}

/// The cluster's processes, killed when dropped.
struct Procs(Vec<(String, Child)>);

impl Procs {
    fn kill(&mut self, name: &str) {
        let i = self
            .0
            .iter()
            .position(|(n, _)| n == name)
            .expect("a process of that name");
        let (_, mut c) = self.0.remove(i);
        c.kill().unwrap();
        c.wait().unwrap();
    }

    fn all_running(&mut self) -> bool {
        self.0
            .iter_mut()
            .all(|(_, c)| c.try_wait().unwrap().is_none())
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts a router on `cfg`; returns it and its addresses.
fn router(cfg: &std::path::Path) -> (Child, RouterAt) {
    let c = Command::new(EXE)
        .args(["router", "--config"])
        .arg(cfg)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start router");
    router_address(c)
}

/// The router's addresses, from its first lines (the rest of its log drained).
fn router_address(mut c: Child) -> (Child, RouterAt) {
    let mut lines = BufReader::new(c.stderr.take().unwrap()).lines();
    let http = loop {
        let line = lines
            .next()
            .expect("the router printed its address")
            .unwrap();
        if let Some(at) = tandem_tests::cluster::router_line(&line) {
            break at;
        }
    };
    std::thread::spawn(move || for _ in lines {});
    (c, http)
}

fn worker(cfg: &std::path::Path, role: &str, name: &str) -> Child {
    Command::new(EXE)
        .args([role, "--name", name, "--config"])
        .arg(cfg)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start worker")
}

/// The workers a router counts, (prefill, decode).
fn counts(r: RouterAt) -> Option<(u64, u64)> {
    let (_, body) = get(r.http, "/health").ok()?;
    let v: Value = serde_json::from_str(&body).ok()?;
    Some((
        v["prefill_workers"].as_u64()?,
        v["decode_workers"].as_u64()?,
    ))
}

/// Waits until `http` counts `want` workers; returns how long it took.
fn wait_counts(r: RouterAt, want: (u64, u64), limit: Duration) -> Duration {
    let t0 = Instant::now();
    while counts(r) != Some(want) {
        assert!(
            t0.elapsed() < limit,
            "router {} counts {:?}, not {want:?}, after {limit:?}",
            r.http,
            counts(r)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

/// A completion through `http`; panics unless it answers 200 with text.
fn complete(r: RouterAt, prompt: &str) {
    let http = r.http;
    let body = json!({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": 8,
        "temperature": 0});
    let (status, v) = post_json(http, "/v1/completions", &body);
    assert_eq!(status, 200, "through {http}: {v}");
    assert!(
        !v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .is_empty(),
        "{v}"
    );
}

fn remote(r: RouterAt) -> f64 {
    metric_at(
        r.operator,
        "tandem_router_prefill_decisions_total{decision=\"remote\"}",
    )
}

/// A long prompt, so that the prefill pool computes it (not the decode worker itself).
fn prompt(i: usize) -> String {
    format!(
        "{i}: {}",
        "a long prompt that the prefill pool computes ".repeat(20)
    )
}

fn scratch(etcd: &Etcd, autoscale: bool) -> (std::path::PathBuf, String) {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("tandem-etcd-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = format!("/tandem/test-{n}");
    let cfg = dir.join("cluster.toml");
    let text = format!(
        "[model]\npath = {:?}\nblock_size = 16\n{}",
        tandem_tests::model_path(),
        config(&etcd.endpoint(), &prefix, autoscale)
    );
    std::fs::write(&cfg, text).unwrap();
    (cfg, prefix)
}

#[test]
fn two_routers_and_four_workers_find_each_other_through_etcd_and_survive_deaths() {
    if !etcd::available() {
        return eprintln!("skipped: no etcd binary (apt install etcd-server)");
    }
    let mut etcd = Etcd::start();
    let (cfg, prefix) = scratch(&etcd, false);
    let mut procs = Procs(Vec::new());
    let ((ra, a), (rb, b)) = (router(&cfg), router(&cfg));
    procs
        .0
        .extend([("router-a".to_string(), ra), ("router-b".to_string(), rb)]);
    for (role, name) in [
        ("prefill", "p0"),
        ("prefill", "p1"),
        ("decode", "d0"),
        ("decode", "d1"),
    ] {
        procs.0.push((name.into(), worker(&cfg, role, name)));
    }
    for r in [a, b] {
        wait_counts(r, (2, 2), Duration::from_secs(60));
    }
    let workers = format!("{prefix}/workers/");
    assert_eq!(etcd.leases(&workers).len(), 4);
    assert_eq!(etcd.leases(&format!("{prefix}/routers/")).len(), 2);
    for i in 0..4 {
        complete(a, &prompt(i));
        complete(b, &prompt(i + 10));
    }
    assert!(
        remote(a) >= 4.0 && remote(b) >= 4.0,
        "the prefill pool served both routers"
    );

    // A worker killed: gone from both routers once its lease expires (their heartbeat timeout
    // is 60 s: within 30 s only etcd can have told them; a loaded machine has taken 6 s+).
    procs.kill("d1");
    for r in [a, b] {
        let gone = wait_counts(r, (2, 1), Duration::from_secs(30));
        eprintln!(
            "killed decode worker gone from router {} after {gone:?} (lease TTL {TTL_MS} ms)",
            r.http
        );
    }
    complete(a, &prompt(30));
    complete(b, &prompt(31));

    // A router killed: the other serves on, and no worker notices.
    procs.kill("router-a");
    for i in 0..4 {
        complete(b, &prompt(i + 20));
    }
    assert_eq!(counts(b), Some((2, 1)));
    assert!(procs.all_running(), "no worker exited with the router");
    let t0 = Instant::now();
    while etcd.leases(&format!("{prefix}/routers/")).len() != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the dead router's key stayed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // etcd killed: requests go on; restarted: every worker registers again under a new lease.
    let before = etcd.leases(&workers);
    assert_eq!(before.len(), 3);
    etcd.kill();
    for i in 0..4 {
        complete(b, &prompt(i + 40));
    }
    assert_eq!(counts(b), Some((2, 1)));
    etcd.restart();
    let t0 = Instant::now();
    loop {
        let now = etcd.leases(&workers);
        let renewed = now.len() == 3
            && now
                .iter()
                .all(|(k, l)| before.iter().any(|(k0, l0)| k0 == k && l0 != l));
        if renewed {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "workers did not register again: {before:?} then {now:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    complete(b, &prompt(50));
    assert_eq!(counts(b), Some((2, 1)));
    // A router started now learns every worker from etcd alone.
    let (rc, c) = router(&cfg);
    procs.0.push(("router-c".into(), rc));
    wait_counts(c, (2, 1), Duration::from_secs(30));
    complete(c, &prompt(60));
    assert!(remote(c) >= 1.0);
}

#[test]
fn one_planner_leads_and_another_takes_over_within_the_lease_ttl() {
    if !etcd::available() {
        return eprintln!("skipped: no etcd binary (apt install etcd-server)");
    }
    let etcd = Etcd::start();
    let (cfg, _) = scratch(&etcd, true);
    let mut procs = Procs(Vec::new());
    let ((ra, a), (rb, b)) = (router(&cfg), router(&cfg));
    procs
        .0
        .extend([("a".to_string(), ra), ("b".to_string(), rb)]);
    let leader = |r: RouterAt| {
        get(r.operator, "/metrics")
            .is_ok_and(|(_, t)| t.lines().any(|l| l == "tandem_planner_leader 1"))
    };
    let follower = |r: RouterAt| {
        get(r.operator, "/metrics")
            .is_ok_and(|(_, t)| t.lines().any(|l| l == "tandem_planner_leader 0"))
    };
    let t0 = Instant::now();
    let (lead, follow) = loop {
        match (leader(a), leader(b), follower(a), follower(b)) {
            (true, false, _, true) => break (("a", a), b),
            (false, true, true, _) => break (("b", b), a),
            _ => {}
        }
        let lines = |r: RouterAt| -> Vec<String> {
            let text = get(r.operator, "/metrics")
                .map(|(_, t)| t)
                .unwrap_or_default();
            text.lines()
                .filter(|l| l.starts_with("tandem_planner_leader"))
                .map(String::from)
                .collect()
        };
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no single leader: {:?} {:?}",
            lines(a),
            lines(b)
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // Only the leader decides: the follower's decision counters stay at zero.
    std::thread::sleep(Duration::from_millis(1000));
    // Every decision of the decode pool, whatever its action.
    let decisions = |r: RouterAt| -> f64 {
        let (_, text) = get(r.operator, "/metrics").unwrap();
        text.lines()
            .filter(|l| l.starts_with("tandem_planner_decisions_total{pool=\"decode\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(decisions(lead.1) > 0.0, "the leader decides");
    assert_eq!(decisions(follow), 0.0, "a follower decides nothing");
    procs.kill(lead.0);
    let t0 = Instant::now();
    while !leader(follow) {
        assert!(
            t0.elapsed() < Duration::from_millis(TTL_MS + 3000),
            "the follower did not take over within the lease TTL"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "took over {:?} after the leader was killed (lease TTL {TTL_MS} ms)",
        t0.elapsed()
    );
    let t1 = Instant::now();
    while decisions(follow) == 0.0 {
        assert!(
            t1.elapsed() < Duration::from_secs(5),
            "the new leader does not decide"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Acceptance 3: etcd, the routers and each pool on hosts of their own (network namespaces on
/// one bridge): members find each other across hosts, and the KV crosses them.
#[test]
fn etcd_routers_and_workers_on_separate_hosts() {
    if !etcd::available() {
        return eprintln!("skipped: no etcd binary (apt install etcd-server)");
    }
    // Hosts: 1 etcd, 2 both routers, 3 the prefill worker, 4 the decode worker.
    let lan = match Lan::new(78, 4) {
        Ok(l) => l,
        Err(e) if std::env::var("TANDEM_SKIP_NETNS").is_ok() => {
            return println!("skipped (TANDEM_SKIP_NETNS): cannot create network namespaces: {e}");
        }
        Err(e) => panic!(
            "cannot create network namespaces (run as root, or set TANDEM_SKIP_NETNS=1): {e}"
        ),
    };
    let etcd = Etcd::start_in(lan.netns(1), &lan.ip(1));
    let (cfg, prefix) = scratch(&etcd, false);
    let cfg_s = cfg.to_str().unwrap();
    let mut procs = Procs(Vec::new());
    let at = format!("{}:0", lan.ip(2));
    let mut routers = Vec::new();
    for name in ["router-a", "router-b"] {
        let c = lan.spawn(
            2,
            EXE,
            &[
                "router",
                "--config",
                cfg_s,
                "--listen",
                &at,
                "--control",
                &at,
                "--operator",
                &at,
            ],
        );
        let (c, http) = router_address(c);
        procs.0.push((name.into(), c));
        routers.push(http);
    }
    for (h, role) in [(3, "prefill"), (4, "decode")] {
        let mut c = lan.spawn(
            h,
            EXE,
            &[
                role,
                "--config",
                cfg_s,
                "--host",
                &lan.ip(h),
                "--name",
                role,
            ],
        );
        let err = c.stderr.take().unwrap();
        std::thread::spawn(move || for _ in BufReader::new(err).lines() {});
        procs.0.push((role.into(), c));
    }
    for &r in &routers {
        wait_counts(r, (1, 1), Duration::from_secs(60));
    }
    // Every member registered the address it can be reached at on the LAN.
    let keys = etcd.leases(&format!("{prefix}/"));
    assert_eq!(keys.len(), 4, "{keys:?}");
    for (i, &r) in routers.iter().enumerate() {
        for j in 0..3 {
            complete(r, &prompt(10 * i + j));
        }
        assert!(
            remote(r) >= 3.0,
            "router {}: prompts prefilled on the prefill host",
            r.http
        );
    }
    // The KV crossed from host 3 to host 4 over TCP (the router's counter: a worker re-admitted
    // under a new id would start its own counts from zero).
    let sent = metric_at(
        routers[0].operator,
        "tandem_kv_transfers_total{transport=\"tcp\"}",
    );
    assert!(sent >= 1.0, "no KV crossed hosts");
    let (_, body) = get(routers[0].operator, "/debug/workers").unwrap();
    let ws: Value = serde_json::from_str(&body).unwrap();
    let endpoints: Vec<&str> = ws["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w["endpoint"].as_str())
        .collect();
    assert!(
        endpoints.iter().any(|e| e.contains(&lan.ip(3)))
            && endpoints.iter().any(|e| e.contains(&lan.ip(4))),
        "workers registered their hosts' addresses: {endpoints:?}"
    );
}

/// etcd with mutual TLS under the cluster CA (`https://` endpoints): the members find each
/// other through it and serve; a client without the cluster's certificate gets nothing from it.
#[test]
fn members_find_each_other_through_etcd_over_mutual_tls() {
    if !etcd::available() {
        return eprintln!("skipped: no etcd binary (apt install etcd-server)");
    }
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("tandem-etcd-tls-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The cluster's own certificate directory (the default beside cluster.toml).
    let etcd = Etcd::start_tls(&dir.join(".tandem/pki"));
    assert!(etcd.endpoint().starts_with("https://"));
    let cfg = dir.join("cluster.toml");
    let text = format!(
        "[model]\npath = {:?}\nblock_size = 16\n{}",
        tandem_tests::model_path(),
        config(&etcd.endpoint(), "/tandem/tls", false)
    );
    std::fs::write(&cfg, text).unwrap();
    let mut procs = Procs(Vec::new());
    let (r, http) = router(&cfg);
    procs.0.push(("router".into(), r));
    for (role, name) in [("prefill", "prefill-0"), ("decode", "decode-0")] {
        procs.0.push((name.into(), worker(&cfg, role, name)));
    }
    wait_counts(http, (1, 1), Duration::from_secs(30));
    complete(http, &prompt(0));
    // Plain HTTP to etcd's client port (its JSON gateway) is refused: TLS only.
    let plain = get(etcd.client, "/health");
    assert!(
        !plain.as_ref().is_ok_and(|(s, _)| *s == 200),
        "etcd answered in the clear: {plain:?}"
    );
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
}
