//! What an operator sees (issue 18): the router's status page in headless Chromium over a real
//! cluster of mock-engine workers — every worker shown, the page following a join and a death
//! without reloading, a screenshot that shows something — and the Grafana dashboard's queries
//! naming only metrics a live cluster exports.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{json, Value};
use tandem_tests::chromium::{png_summary, Browser};
use tandem_tests::cluster::{get, post_json, Cluster};

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

const MOCK_CLUSTER: &str = r#"
[router]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"
operator = "127.0.0.1:0"
heartbeat_timeout_ms = 1500

[prefill]
engine = "mock"
kv_blocks = 512
[prefill.slo]
ttft_p90_ms = 800

[decode]
engine = "mock"
kv_blocks = 1024
[decode.slo]
itl_p90_ms = 100
"#;

/// One completion of `n` prompt tokens (ids), 8 tokens long.
fn complete(http: SocketAddr, n: u32) {
    let prompt: Vec<u32> = (0..n).map(|i| 1_000 + i * 7 % 20_000).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": true});
    let (status, v) = post_json(http, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
}

/// JS: resolves with the page's worker rows (`name:role:health`, sorted) on the first redraw
/// for which `cond(rows)` holds; rejects after 30 s with what the page last showed.
fn rows_when(cond: &str) -> String {
    format!(
        r#"new Promise((resolve, reject) => {{
  const rows = () => [...document.querySelectorAll('#workers tr[data-worker]')]
    .map(r => r.dataset.worker + ':' + r.dataset.role + ':' + r.dataset.health).sort();
  const cond = {cond};
  const check = () => {{ if (cond(rows())) {{ window.removeEventListener('tandem-status', check); resolve(rows()); }} }};
  window.addEventListener('tandem-status', check);
  check();
  setTimeout(() => reject(new Error('page still shows ' + JSON.stringify(rows()))), 30000);
}})"#
    )
}

#[test]
fn the_status_page_shows_every_worker_and_follows_a_join_and_a_death() {
    let mut c = Cluster::of(1, 1).toml(MOCK_CLUSTER).start(EXE.as_ref());
    complete(c.http, 200);
    c.wait_transfers("tcp", 1);
    let mut b = Browser::open(&format!("http://{}/status", c.operator), 1400, 1000);

    let shown = b
        .eval(&rows_when("r => r.length === 2"))
        .expect("the page shows the cluster's workers");
    assert_eq!(
        shown,
        json!(["decode-0:decode:ok", "prefill-0:prefill:ok"]),
        "{shown}"
    );
    // The rest of the picture: the transfer by its transport, the devices, the targets.
    let picture = b
        .eval(
            r#"({
  transports: [...document.querySelectorAll('#transfers tr[data-transport]')].map(r => r.dataset.transport),
  devices: [...document.querySelectorAll('#workers tr[data-worker] td:nth-child(4)')].map(td => td.textContent),
  pools: document.getElementById('pools').textContent,
  charts: document.querySelectorAll('#ttft-chart path, #itl-chart path').length,
})"#,
        )
        .unwrap();
    assert_eq!(picture["transports"], json!(["tcp"]), "{picture}");
    assert_eq!(picture["devices"], json!(["mock", "mock"]), "{picture}");
    let pools = picture["pools"].as_str().unwrap();
    assert!(
        pools.contains("target 800 ms") && pools.contains("target 100 ms"),
        "{pools}"
    );
    // The page marks its window, so a reload would show as the mark gone.
    b.eval("window.__loaded_once = true").unwrap();

    let png = b.screenshot();
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    std::fs::write(&out, &png).unwrap();
    let (w, h, colours, ink) = png_summary(&png);
    assert_eq!((w, h), (1400, 1000), "screenshot size ({})", out.display());
    // A blank or unstyled page has a handful of colours and almost no ink.
    assert!(
        colours >= 32 && ink > 0.05,
        "the screenshot ({}) shows too little: {colours} colours, {:.1}% not background",
        out.display(),
        ink * 100.0
    );

    // A worker joins: the open page shows it.
    let cfg = c.config_file().to_path_buf();
    c.add_worker("decode", "decode-1", &cfg);
    let shown = b
        .eval(&rows_when("r => r.some(x => x.startsWith('decode-1:'))"))
        .expect("the page shows the worker that joined");
    assert_eq!(shown.as_array().unwrap().len(), 3, "{shown}");
    // `tandem status` prints the same picture in the terminal.
    let out = std::process::Command::new(EXE)
        .args(["status", "--addr", &c.operator.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for w in ["prefill-0", "decode-0", "decode-1"] {
        assert!(text.contains(w), "tandem status lacks {w}:\n{text}");
    }
    assert!(text.contains("KV transfers: tcp 1"), "{text}");
    // It dies: the router drops it after the heartbeat timeout, and so does the page.
    c.kill_worker("decode-1");
    let shown = b
        .eval(&rows_when("r => !r.some(x => x.startsWith('decode-1:'))"))
        .expect("the page drops the worker that died");
    assert_eq!(shown.as_array().unwrap().len(), 2, "{shown}");
    assert_eq!(
        b.eval("window.__loaded_once === true && Number(document.body.dataset.updates) > 2")
            .unwrap(),
        json!(true),
        "the page updated itself, without reloading"
    );
}

/// A mock-engine cluster under `tandem up` whose planner runs (both pools autoscaled, bounds
/// 1..1, so it decides and exports without acting).
const PLANNED_CLUSTER: &str = r#"
[router]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"
operator = "127.0.0.1:0"

[prefill]
engine = "mock"
kv_blocks = 512
[prefill.slo]
ttft_p90_ms = 800
[prefill.autoscale]
min = 1
max = 1
tick_ms = 200

[decode]
engine = "mock"
kv_blocks = 1024
[decode.slo]
itl_p90_ms = 100
[decode.autoscale]
min = 1
max = 1
tick_ms = 200
"#;

/// The sample names of a Prometheus text exposition.
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Every `tandem_*` name in a PromQL expression.
fn names_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("tandem_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        // A label name (tandem_worker, tandem_role) is followed by `=`, `,` or `)` inside a
        // `by (...)`/selector, never by `[`, `{`, ` ` or the end as a metric is.
        let before = rest[..i].trim_end().chars().last();
        let label = before.is_some_and(|c| c == '(' || c == ',' || c == '{')
            && tail[end..].starts_with([')', ',', '=', '!']);
        if !label {
            out.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

fn promtool(args: &[&str]) {
    let out = std::process::Command::new("promtool")
        .args(args)
        .output()
        .expect("promtool (Debian package `prometheus`, installed by scripts/test.sh)");
    assert!(
        out.status.success(),
        "promtool {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_grafana_dashboard_queries_only_metrics_a_live_cluster_exports() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    promtool(&[
        "check",
        "config",
        dir.join("prometheus/prometheus.yml").to_str().unwrap(),
    ]);
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("grafana/tandem.json")).unwrap())
            .expect("the dashboard is JSON");
    let panels = dash["panels"].as_array().unwrap();
    let ids: BTreeSet<u64> = panels.iter().map(|p| p["id"].as_u64().unwrap()).collect();
    assert_eq!(ids.len(), panels.len(), "panel ids are unique");
    let exprs: Vec<String> = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{t}");
            t["expr"].as_str().unwrap().to_string()
        })
        .collect();
    assert!(exprs.len() >= 20, "{} queries", exprs.len());

    // Every expression parses as PromQL: promtool checks a rule file made of them.
    let rules = dir.join("..").join("target").join("dashboard-rules.yml");
    let mut text = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        text += &format!(
            "      - record: dashboard:q{i}\n        expr: {}\n",
            serde_json::to_string(e).unwrap()
        );
    }
    std::fs::write(&rules, text).unwrap();
    promtool(&["check", "rules", rules.to_str().unwrap()]);

    // A live cluster: one request through both pools, the planner ticking.
    let up = tandem_tests::up::Up::start(EXE.as_ref(), PLANNED_CLUSTER);
    up.wait_joined(1, 1, Duration::from_secs(60));
    complete(up.http, 200);
    let (_, targets) = get(up.operator, "/prometheus/targets").unwrap();
    let targets: Value = serde_json::from_str(&targets).unwrap();
    let endpoints: Vec<String> = targets
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["targets"][0].as_str().unwrap().to_string())
        .collect();
    assert_eq!(endpoints.len(), 2, "{targets}");
    // The transfer is counted when the prefill call returns, the planner's gauges on its
    // next tick: wait for both (with a deadline).
    let t0 = std::time::Instant::now();
    let scrape = loop {
        let mut names = BTreeSet::new();
        let (_, text) = get(up.operator, "/metrics").unwrap();
        names.extend(sample_names(&text));
        for e in &endpoints {
            let (_, text) = get(e.parse().unwrap(), "/metrics").unwrap();
            names.extend(sample_names(&text));
        }
        if names.contains("tandem_kv_transfers_total")
            && names.contains("tandem_planner_live_replicas")
        {
            break names;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{names:?}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut missing = BTreeSet::new();
    for e in &exprs {
        for n in names_in(e) {
            if !scrape.contains(&n) {
                missing.insert(n);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the dashboard names metrics no process exports: {missing:?}"
    );
}
