//! Prefill and decode on different hosts: two network namespaces joined by a veth pair, with
//! delay, loss and corruption on the link that carries both the control plane and the KV:
//! `tc netem` where the kernel has it; where it does not (this development kernel has no
//! `sch_netem`), nftables drops 3% and corrupts 1% of the link's TCP packets at random and a
//! `tbf` qdisc limits it to 200 Mbit/s with up to 50 ms of queueing. Every request must either
//! complete with the single-process answer or fail with an OpenAI error — never hang — and
//! afterwards no KV block may stay reserved anywhere.
//!
//! Needs root (CI runs as root): the test creates and deletes its own namespaces. Where
//! namespaces cannot be created it says so and fails, unless `TANDEM_SKIP_NETNS=1` is set.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use engine::{ChatMessage, Engine, EngineConfig, SamplingParams};
use serde_json::{json, Value};
use tandem_tests::cluster::{get, metric_at, post_json};
use tandem_tests::load_model;
use tandem_tests::netns::sh;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");

/// Two namespaces: `p` (prefill, 10.77.0.1) and `d` (router + decode, 10.77.0.2) joined by a
/// veth pair; `d` also reaches this namespace over a second pair (10.77.9.2, here 10.77.9.1).
struct Net {
    p: String,
    d: String,
}

impl Net {
    fn new() -> Result<Net, String> {
        let id = std::process::id() % 100000;
        let (p, d) = (format!("tdmp{id}"), format!("tdmd{id}"));
        let net = Net {
            p: p.clone(),
            d: d.clone(),
        };
        let (pv, dv, hv, dh) = (
            format!("vp{id}"),
            format!("vd{id}"),
            format!("vh{id}"),
            format!("vx{id}"),
        );
        for cmd in [
            vec!["ip", "netns", "add", &p],
            vec!["ip", "netns", "add", &d],
            vec![
                "ip", "link", "add", &pv, "type", "veth", "peer", "name", &dv,
            ],
            vec!["ip", "link", "set", &pv, "netns", &p],
            vec!["ip", "link", "set", &dv, "netns", &d],
            vec!["ip", "-n", &p, "addr", "add", "10.77.0.1/24", "dev", &pv],
            vec!["ip", "-n", &d, "addr", "add", "10.77.0.2/24", "dev", &dv],
            vec![
                "ip", "link", "add", &hv, "type", "veth", "peer", "name", &dh,
            ],
            vec!["ip", "link", "set", &dh, "netns", &d],
            vec!["ip", "addr", "add", "10.77.9.1/24", "dev", &hv],
            vec!["ip", "-n", &d, "addr", "add", "10.77.9.2/24", "dev", &dh],
            vec!["ip", "link", "set", &hv, "up"],
            vec!["ip", "-n", &p, "link", "set", &pv, "up"],
            vec!["ip", "-n", &p, "link", "set", "lo", "up"],
            vec!["ip", "-n", &d, "link", "set", &dv, "up"],
            vec!["ip", "-n", &d, "link", "set", &dh, "up"],
            vec!["ip", "-n", &d, "link", "set", "lo", "up"],
        ] {
            sh(&cmd)?;
        }
        // The P-D link, both directions: 5 ms each way with jitter, 3% loss, 1% corrupted
        // packets with netem; without netem, the same loss and corruption from nftables and a
        // rate limit whose queue delays packets. tests/faults.rs injects faults in user space.
        for (ns, dev) in [(&p, &pv), (&d, &dv)] {
            let netem = [
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                "delay", "5ms", "2ms", "loss", "3%", "corrupt", "1%",
            ];
            let Err(no_netem) = sh(&netem) else {
                println!("{ns}/{dev}: netem delay 5ms±2ms, loss 3%, corrupt 1%");
                continue;
            };
            let rules = format!(
                "table inet tandem_faults {{\n                   chain out {{\n                     type filter hook output priority 0; policy accept;\n                     oifname \"{dev}\" meta l4proto tcp numgen random mod 100 < 3 counter drop\n                     oifname \"{dev}\" meta l4proto tcp numgen random mod 100 < 1 counter @ih,0,32 set 0xdeadbeef\n                   }}\n                 }}\n"
            );
            let file = std::env::temp_dir().join(format!("tandem-nft-{ns}.conf"));
            std::fs::write(&file, rules).map_err(|e| e.to_string())?;
            let nft = [
                "ip",
                "netns",
                "exec",
                ns,
                "nft",
                "-f",
                file.to_str().unwrap(),
            ];
            let tbf = [
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                "200mbit", "burst", "64kb", "latency", "50ms",
            ];
            let applied = sh(&nft).and_then(|()| sh(&tbf));
            let _ = std::fs::remove_file(&file);
            match applied {
                Ok(()) => println!(
                    "{ns}/{dev}: no netem here ({no_netem}); nftables loss 3%, corrupt 1%, tbf 200 Mbit/s"
                ),
                Err(e) => return Err(format!("no netem ({no_netem}) and no nftables/tbf: {e}")),
            }
        }
        Ok(net)
    }

    fn spawn(&self, ns: &str, args: &[&str]) -> Child {
        Command::new("ip")
            .args(["netns", "exec", ns, EXE])
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a process in a namespace")
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let id = std::process::id() % 100000;
        let _ = sh(&["ip", "link", "del", &format!("vh{id}")]);
        let _ = sh(&["ip", "netns", "del", &self.p]);
        let _ = sh(&["ip", "netns", "del", &self.d]);
    }
}

struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn prefill_and_decode_in_separate_network_namespaces() {
    let net = match Net::new() {
        Ok(n) => n,
        Err(e) if std::env::var("TANDEM_SKIP_NETNS").is_ok() => {
            println!("skipped (TANDEM_SKIP_NETNS): cannot create network namespaces: {e}");
            return;
        }
        Err(e) => panic!(
            "cannot create network namespaces (run as root, or set TANDEM_SKIP_NETNS=1): {e}"
        ),
    };
    let dir = std::env::temp_dir().join(format!("tandem-netns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = tandem_tests::model_path();
    let cfg = |host: &str| {
        let path = dir.join(format!("cluster-{host}.toml"));
        std::fs::write(
            &path,
            format!(
                "[model]\npath = {model:?}\n[router]\nlisten = \"0.0.0.0:0\"\ncontrol = \"0.0.0.0:0\"\noperator = \"0.0.0.0:0\"\nallow_no_keys = true\n\
                 [prefill]\nhost = \"{host}\"\nkv_blocks = 256\n[decode]\nhost = \"{host}\"\nkv_blocks = 512\n\
                 [kv_transfer]\nprefer = [\"tcp\"]\ntransfer_timeout_ms = 5000\nconnect_timeout_ms = 2000\n"
            ),
        )
        .unwrap();
        path
    };
    let (cfg_p, cfg_d) = (cfg("10.77.0.1"), cfg("10.77.0.2"));
    let mut procs = Procs(Vec::new());
    let mut router = net.spawn(&net.d, &["router", "--config", cfg_d.to_str().unwrap()]);
    let mut lines = BufReader::new(router.stderr.take().unwrap()).lines();
    let (http_port, ctrl_port, op_port) = loop {
        let line = lines.next().expect("router output").unwrap();
        if let Some(at) = tandem_tests::cluster::router_line(&line) {
            let port = |a: std::net::SocketAddr| a.port().to_string();
            break (port(at.http), port(at.control), port(at.operator));
        }
    };
    std::thread::spawn(move || for _ in lines {});
    procs.0.push(router);
    let control = format!("http://10.77.0.2:{ctrl_port}");
    procs.0.push(net.spawn(
        &net.d,
        &[
            "decode",
            "--config",
            cfg_d.to_str().unwrap(),
            "--router",
            &control,
        ],
    ));
    procs.0.push(net.spawn(
        &net.p,
        &[
            "prefill",
            "--config",
            cfg_p.to_str().unwrap(),
            "--router",
            &control,
        ],
    ));
    let http: SocketAddr = format!("10.77.9.2:{http_port}").parse().unwrap();
    let ops: SocketAddr = format!("10.77.9.2:{op_port}").parse().unwrap();
    let t0 = Instant::now();
    while get(http, "/health").map(|(s, _)| s).ok() != Some(200) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the cluster did not come up across namespaces"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (m, tok) = load_model();
    let mut ok = 0;
    for i in 0..8 {
        let q = format!("Name {} animals that live in the sea.", 2 + i % 3);
        let t = Instant::now();
        let (status, v): (u16, Value) = post_json(
            http,
            "/v1/chat/completions",
            &json!({"temperature": 0, "max_tokens": 24, "messages": [{"role": "user", "content": q}]}),
        );
        assert!(
            t.elapsed() < Duration::from_secs(40),
            "request {i} took {:?}",
            t.elapsed()
        );
        if status == 200 {
            let text = tok
                .apply_chat_template(&[ChatMessage::user(&q)], true)
                .unwrap();
            let mut e =
                Engine::new(m.clone(), EngineConfig::default(), tok.stop_ids().to_vec()).unwrap();
            e.add(
                engine::RequestId(0),
                tok.encode(&text).unwrap(),
                SamplingParams::greedy(24),
            )
            .unwrap();
            let mut out = e
                .run_to_completion()
                .unwrap()
                .remove(&engine::RequestId(0))
                .unwrap();
            if out.last().is_some_and(|t| tok.stop_ids().contains(t)) {
                out.pop();
            }
            assert_eq!(
                v["choices"][0]["message"]["content"],
                tok.decode(&out, true).unwrap(),
                "request {i}: a success must be the right answer"
            );
            ok += 1;
        } else {
            assert!(
                status >= 500 && v["error"]["message"].is_string(),
                "request {i}: {status} {v}"
            );
            println!("request {i} failed cleanly: {status} {v}");
        }
    }
    println!("{ok} of 8 requests completed across the namespaces");
    // The faults may cost a request or two, not the path: most answers come through, and KV
    // really crossed the link (a recompute on the decode worker would answer as well).
    assert!(ok >= 6, "only {ok} of 8 requests completed");
    // Every request took the link: its KV crossed it, or the transfer broke on an injected
    // fault (corruption reaches the receiver's CRC check, which refuses the transfer) and the
    // prompt was recomputed on the decode worker, which the router counts. The router counts a
    // transfer when the prefill call returns, which may be after the response: wait for them.
    // The router's counter, not the per-worker counts of /debug/workers: a prefill worker that
    // a broken call had the router drop joins again under a new id, with counts from zero.
    let sent = || metric_at(ops, "tandem_kv_transfers_total{transport=\"tcp\"}") as u64;
    // Recomputed, or a prefill call that failed after its KV had crossed (the reply lost on
    // the faulty link: the request completed from the KV, but no transfer was counted).
    let failed = || {
        (metric_at(ops, "tandem_kv_transfer_failures_total")
            + metric_at(ops, "tandem_router_prefill_call_failures_total")) as u64
    };
    let t0 = Instant::now();
    while sent() + failed() < 8 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (sent, failed) = (sent(), failed());
    println!("KV crossed the link for {sent} requests; {failed} transfers or prefill calls broke");
    let decisions: Vec<String> = get(ops, "/metrics")
        .map(|(_, t)| t)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("tandem_router_prefill_decisions_total"))
        .map(String::from)
        .collect();
    assert!(sent >= 1, "no KV crossed the link; {decisions:?}");
    assert!(
        sent + failed >= 8,
        "every request went through the prefill pool: {sent} transfers, {failed} broken; {decisions:?}"
    );
    for ns in [&net.p, &net.d] {
        // What the injected faults actually hit (where nftables carried them).
        if let Ok(out) = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "nft",
                "list",
                "table",
                "inet",
                "tandem_faults",
            ])
            .output()
        {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if line.contains("counter") {
                    println!("{ns}: {}", line.trim());
                }
            }
        }
    }
    // The ledger balances: nothing reserved, running or pending anywhere.
    let workers = || {
        let (_, body) = get(ops, "/debug/workers").unwrap();
        let ws: Value = serde_json::from_str(&body).unwrap();
        ws["workers"].as_array().cloned().unwrap_or_default()
    };
    assert_eq!(workers().len(), 2);
    tandem_tests::cluster::wait_idle(Duration::from_secs(30), workers);
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
}
