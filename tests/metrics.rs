//! What the processes of a real cluster export: the router's counts of requests, latencies and
//! transfers by transport; `tandem bench load` replaying a Mooncake trace against it; every
//! process's `/metrics` accepted by Prometheus' linter.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_tests::cluster::{post_json, Cluster};

const EXE: &str = env!("CARGO_BIN_EXE_tandem");

#[test]
fn router_metrics_count_requests_latencies_and_transfers_by_transport() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    for _ in 0..2 {
        let (status, _) = post_json(
            c.http,
            "/v1/completions",
            &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
        );
        assert_eq!(status, 200);
    }
    let (status, _) = post_json(
        c.http,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": -1}),
    );
    assert_eq!(status, 400);
    c.wait_transfers("tcp", 2);
    let (status, text) = tandem_tests::cluster::get(c.operator, "/metrics").unwrap();
    assert_eq!(status, 200);
    let value = |needle: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(needle))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {needle} in\n{text}"))
    };
    assert_eq!(value("tandem_router_requests_total{outcome=\"ok\"}"), 2.0);
    assert_eq!(
        value("tandem_router_requests_total{outcome=\"client_error\"}"),
        1.0
    );
    assert_eq!(value("tandem_router_ttft_seconds_count"), 2.0);
    assert_eq!(value("tandem_router_itl_seconds_count"), 6.0);
    // Where the TTFT went, each phase of both (remote) first tries; every token's way from
    // the decode worker timed.
    for phase in ["admission", "prefill", "first_token"] {
        let n = value(&format!(
            "tandem_router_ttft_phase_seconds_count{{phase=\"{phase}\"}}"
        ));
        assert_eq!(n, 2.0, "{phase}");
    }
    assert_eq!(value("tandem_router_token_delay_seconds_count"), 8.0);
    assert_eq!(value("tandem_kv_transfers_total{transport=\"tcp\"}"), 2.0);
    assert!(value("tandem_kv_transfer_bytes_total{transport=\"tcp\"}") > 0.0);
    assert!(
        text.contains("tandem_worker_kv_blocks_free{worker=\"decode-0\",role=\"decode\"}"),
        "{text}"
    );
    // The ledger from heartbeats: nothing reserved or in flight once the requests are done.
    let t0 = Instant::now();
    loop {
        let (_, text) = tandem_tests::cluster::get(c.operator, "/metrics").unwrap();
        let held: f64 = text
            .lines()
            .filter(|l| {
                l.starts_with("tandem_worker_kv_blocks_reserved")
                    || l.starts_with("tandem_worker_transfers_in_flight")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        let reported = text.contains("tandem_worker_transfers_in_flight{worker=\"prefill-0\"");
        if reported && held == 0.0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "ledger not balanced: {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn bench_load_replays_a_mooncake_trace_against_the_cluster() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let dir = std::env::temp_dir().join(format!("tandem-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Three requests; the second shares the first's leading block (a shared prefix).
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 200, \"hash_ids\": [0, 1]}\n\
         {\"timestamp\": 100, \"input_length\": 700, \"output_length\": 100, \"hash_ids\": [0, 2]}\n\
         {\"timestamp\": 200, \"input_length\": 300, \"output_length\": 50, \"hash_ids\": [3]}\n",
    )
    .unwrap();
    let report = dir.join("report.json");
    let out = std::process::Command::new(EXE)
        .args(["bench", "load", "--addr", &c.http.to_string()])
        .args(["--operator", &c.operator.to_string(), "--trace"])
        .arg(&trace)
        .args(["--length-scale", "0.05", "--time-scale", "1", "--json"])
        .arg(&report)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["requests"], 3, "{r}");
    assert_eq!(r["completed"], 3, "{r}");
    assert!(r["ttft_ms"]["p50"].as_f64().unwrap() > 0.0, "{r}");
    // Output lengths are exact (ignore_eos): 10 + 5 + 3 (rounded 200/100/50 x 0.05 = 10/5/2.5).
    let tokens = r["output_tokens_per_s"].as_f64().unwrap() * r["duration_s"].as_f64().unwrap();
    assert!((tokens - 18.0).abs() < 0.5, "{r}");
    c.wait_all_free(Duration::from_secs(5));
    c.wait_transfers("tcp", 3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_process_serves_metrics_that_promtool_accepts() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    let (status, _) = post_json(
        c.http,
        "/v1/chat/completions",
        &json!({"temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(status, 200);
    c.wait_all_free(Duration::from_secs(5));
    c.wait_transfers("tcp", 1);
    let mut texts = vec![(
        "router".to_string(),
        tandem_tests::cluster::get(c.operator, "/metrics")
            .unwrap()
            .1,
    )];
    for w in c.workers() {
        let at: std::net::SocketAddr = w["metrics_endpoint"].as_str().unwrap().parse().unwrap();
        let (status, text) = tandem_tests::cluster::get(at, "/metrics").unwrap();
        assert_eq!(status, 200, "{w}");
        texts.push((w["name"].as_str().unwrap().to_string(), text));
    }
    for (who, text) in &texts {
        tandem_tests::cluster::promtool_check(text)
            .unwrap_or_else(|e| panic!("{who}: {e}\n{text}"));
    }
    let find = |who: &str, metric: &str| {
        let (_, text) = texts.iter().find(|(w, _)| w.starts_with(who)).unwrap();
        assert!(text.contains(metric), "{who} has no {metric}:\n{text}");
    };
    find("router", "tandem_router_ttft_seconds_bucket");
    find("prefill", "tandem_prefill_prompt_tokens_total");
    find("prefill", "tandem_prefill_queue_depth");
    find("prefill", "tandem_kv_sent_bytes_total{transport=\"tcp\"}");
    find("decode", "tandem_decode_step_seconds_bucket");
    find("decode", "tandem_decode_kv_blocks_free");
    find(
        "decode",
        "tandem_decode_kv_ledger_blocks{state=\"reserved\"} 0",
    );
}
