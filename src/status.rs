//! `tandem status`: the status page's picture (the router's `/status.json`) in the terminal —
//! pools against their targets, a table of workers, the prefix cache, transfers and the
//! planner's last decisions; `--watch` redraws it.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use serde_json::Value;

/// Arguments of `tandem status`.
#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The router's operator address (host:port; `router.operator`).
    #[arg(long, default_value = "127.0.0.1:8002")]
    addr: String,
    /// Redraw every `--every` seconds until interrupted.
    #[arg(long)]
    watch: bool,
    /// Seconds between redraws with `--watch`.
    #[arg(long, default_value_t = 2.0)]
    every: f64,
}

/// How long one fetch of the picture may take.
const FETCH_WAIT: Duration = Duration::from_secs(5);

async fn fetch(http: &reqwest::Client, addr: &str) -> Result<Value> {
    let url = format!("http://{addr}/status.json");
    let r = http
        .get(&url)
        .timeout(FETCH_WAIT)
        .send()
        .await
        .with_context(|| format!("cannot reach the router at {addr}"))?;
    if !r.status().is_success() {
        return Err(anyhow!("{url}: {}", r.status()));
    }
    r.json()
        .await
        .with_context(|| format!("{url}: not the status JSON"))
}

/// Runs `tandem status`.
pub fn run(a: StatusArgs) -> Result<()> {
    if !(a.every > 0.0 && a.every.is_finite()) {
        return Err(anyhow!("--every must be a positive number of seconds"));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let http = reqwest::Client::new();
    if !a.watch {
        let s = rt.block_on(fetch(&http, &a.addr))?;
        print!("{}", render(&a.addr, &s));
        return Ok(());
    }
    loop {
        let text = match rt.block_on(fetch(&http, &a.addr)) {
            Ok(s) => render(&a.addr, &s),
            Err(e) => format!("{e:#}; retrying\n"),
        };
        // Clear the screen, then draw.
        print!("\x1b[2J\x1b[H{text}");
        rt.block_on(tokio::time::sleep(Duration::from_secs_f64(a.every)));
    }
}

fn ms(v: &Value) -> String {
    v.as_f64().map_or("–".into(), |v| format!("{v:.1} ms"))
}

/// One pool's line: workers, health, its latency against its target.
/// A KV tier's cell: blocks held and hits served (`–` where the worker has no such tier).
fn tier_cell(t: &Value) -> String {
    match (t["blocks"].as_u64(), t["hits"].as_u64()) {
        (Some(0), Some(0)) | (None, _) | (_, None) => "–".into(),
        (Some(b), Some(h)) => format!("{b} ({h} hits)"),
    }
}

/// A worker's use of the cluster store: "put / fetched" blocks, failed fetches after a "!",
/// or a dash when none.
fn store_cell(s: &Value) -> String {
    let n = |k: &str| s[k].as_u64().unwrap_or(0);
    match (n("puts") + n("held"), n("hits"), n("fetch_failures")) {
        (0, 0, 0) => "–".into(),
        (p, h, 0) => format!("{p} put / {h} fetched"),
        (p, h, f) => format!("{p} put / {h} fetched / {f} failed"),
    }
}

/// A store node's line: its address, whether the router follows it, and its figures.
fn store_node_line(n: &Value) -> String {
    let uri = n["uri"].as_str().unwrap_or("?");
    let up = if n["up"] == true { "followed" } else { "down" };
    let state = match n["source"].as_str() {
        Some("etcd") => format!("{up} (found in etcd)"),
        _ => up.to_string(),
    };
    let l = &n["load"];
    if l.is_null() {
        return format!("store node {uri}: {state}, no figures yet\n");
    }
    let mb = |k: &str| l[k].as_f64().unwrap_or(0.0) / 1e6;
    format!(
        "store node {uri}: {state} · {} objects, {:.1} of {:.1} MB · {} hits, {} misses · {} puts ({} refused, {} corrupt) · {} evicted · {} leases, {} pinned\n",
        l["objects"], mb("bytes"), mb("capacity"), l["hits"], l["misses"], l["puts"],
        l["puts_refused"], l["puts_corrupt"], l["evictions"], l["leases"],
        l["soft_pins"].as_u64().unwrap_or(0) + l["hard_pins"].as_u64().unwrap_or(0)
    )
}

/// A worker's preemptions: "swapped / recomputed", or a dash when none.
fn preempted_cell(p: &Value) -> String {
    match (p["swapped"].as_u64(), p["recomputed"].as_u64()) {
        (Some(0), Some(0)) | (None, _) | (_, None) => "–".into(),
        (Some(s), Some(r)) => format!("{s} swapped / {r} recomputed"),
    }
}

fn pool_line(name: &str, p: &Value, lat: &Value) -> String {
    let (now, target) = (&lat["p90_ms"], &p["target_p90_ms"]);
    let verdict = match (now.as_f64(), target.as_f64()) {
        (Some(n), Some(t)) if n <= t => " (meets)",
        (Some(_), Some(_)) => " (MISSES)",
        _ => "",
    };
    let signal = p["signal"].as_str().unwrap_or("").to_uppercase();
    format!(
        "{name}: {} workers ({} healthy), {signal} p90 {} / target {}{verdict}\n",
        p["workers"],
        p["healthy"],
        ms(now),
        ms(target)
    )
}

/// The picture as text.
pub fn render(addr: &str, s: &Value) -> String {
    let mut out = String::new();
    let mode = if s["disaggregated"] == true {
        "disaggregated"
    } else {
        "colocated"
    };
    let up = s["uptime_s"].as_f64().unwrap_or(0.0);
    let _ = writeln!(
        out,
        "tandem at {addr}: {} · {mode} · up {up:.0} s",
        s["model"].as_str().unwrap_or("?")
    );
    if s["disaggregated"] == true {
        out += &pool_line("prefill", &s["pools"]["prefill"], &s["latency"]["ttft"]);
    }
    out += &pool_line("decode", &s["pools"]["decode"], &s["latency"]["itl"]);
    let header = [
        "name",
        "role",
        "health",
        "device",
        "transport",
        "KV used",
        "cached",
        "free",
        "host",
        "disk",
        "store",
        "preempted",
        "running",
        "waiting",
        "heartbeat",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for w in s["workers"].as_array().into_iter().flatten() {
        let kv = &w["kv_blocks"];
        let transport = if w["role"] == "decode" {
            let offers: Vec<&str> = w["kv_offers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            offers.join(",")
        } else {
            let sent: Vec<String> = w["kv_transfers"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(t, n)| format!("{t}×{n}"))
                .collect();
            sent.join(",")
        };
        let text = |v: &Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
        rows.push(vec![
            text(&w["name"]),
            text(&w["role"]),
            text(&w["health"]),
            text(&w["device"]),
            if transport.is_empty() {
                "–".into()
            } else {
                transport
            },
            format!("{}/{}", kv["used"], kv["total"]),
            text(&kv["cached"]),
            text(&kv["free"]),
            tier_cell(&w["kv_tiers"]["host"]),
            tier_cell(&w["kv_tiers"]["disk"]),
            store_cell(&w["kv_tiers"]["store"]),
            preempted_cell(&w["preempted"]),
            text(&w["running"]),
            text(&w["waiting"]),
            format!("{} ms", w["heartbeat_age_ms"]),
        ]);
    }
    out += &table(&rows);
    let p = &s["prefix"];
    let ratio = p["hit_ratio"]
        .as_f64()
        .map_or("–".into(), |r| format!("{:.1}%", 100.0 * r));
    let _ = write!(
        out,
        "prefix cache: {ratio} of {} prompt tokens found cached",
        p["prompt_tokens"]
    );
    let transfers: Vec<String> = s["transfers"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(t, n)| format!("{t} {n}"))
        .collect();
    let _ = writeln!(
        out,
        " · KV transfers: {}",
        if transfers.is_empty() {
            "none".into()
        } else {
            transfers.join(", ")
        }
    );
    for n in s["store_nodes"].as_array().into_iter().flatten() {
        out += &store_node_line(n);
    }
    let decisions = s["planner"]["decisions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for d in decisions.iter().rev().take(5) {
        let _ = writeln!(
            out,
            "planner {:>6.0} s: {} {} to {} ({})",
            d["at_s"].as_f64().unwrap_or(0.0),
            d["pool"].as_str().unwrap_or("?"),
            d["action"].as_str().unwrap_or("?"),
            d["desired"],
            d["why"].as_str().unwrap_or("")
        );
    }
    out
}

/// Rows as columns padded to their widest cell (the first row is the header).
fn table(rows: &[Vec<String>]) -> String {
    let n = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..n)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out += cells.join("  ").trim_end();
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_picture_lists_pools_workers_and_decisions() {
        let s = json!({
            "model": "m", "disaggregated": true, "uptime_s": 12.0,
            "pools": {"prefill": {"workers": 1, "healthy": 1, "target_p90_ms": 800.0, "signal": "ttft"},
                      "decode": {"workers": 2, "healthy": 1, "target_p90_ms": 50.0, "signal": "itl"}},
            "latency": {"ttft": {"p90_ms": 300.0}, "itl": {"p90_ms": 75.5}},
            "workers": [
                {"name": "prefill-0", "role": "prefill", "health": "ok", "device": "cpu-avx2",
                 "kv_transfers": {"tcp": 3}, "kv_blocks": {"used": 4, "total": 512, "cached": 12, "free": 496},
                 "running": 0, "waiting": 0, "heartbeat_age_ms": 120},
                {"name": "decode-long-name-0", "role": "decode", "health": "stalled", "device": "mock",
                 "kv_offers": ["tcp", "quic"], "kv_blocks": {"used": 40, "total": 1024, "cached": 0, "free": 984},
                 "kv_tiers": {"host": {"blocks": 300, "hits": 7}, "disk": {"blocks": 0, "hits": 0},
                              "store": {"puts": 20, "held": 4, "hits": 6, "fetch_failures": 1}},
                 "preempted": {"swapped": 4, "recomputed": 0},
                 "running": 3, "waiting": 1, "heartbeat_age_ms": 2500},
            ],
            "prefix": {"hit_ratio": 0.25, "prompt_tokens": 400},
            "transfers": {"tcp": 3},
            "planner": {"decisions": [{"at_s": 9.0, "pool": "decode", "action": "up", "desired": 2, "why": "p90 over target"}]},
            "store_nodes": [
                {"uri": "http://10.0.0.5:7400", "up": true, "load": {"objects": 6, "bytes": 2_500_000,
                 "capacity": 1_000_000_000, "hits": 12, "misses": 3, "puts": 6, "puts_refused": 0,
                 "puts_corrupt": 1, "evictions": 0, "leases": 2, "soft_pins": 1, "hard_pins": 1}},
                {"uri": "http://10.0.0.6:7400", "up": false, "load": null},
            ],
        });
        let text = render("127.0.0.1:8000", &s);
        assert!(
            text.contains(
                "prefill: 1 workers (1 healthy), TTFT p90 300.0 ms / target 800.0 ms (meets)"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "decode: 2 workers (1 healthy), ITL p90 75.5 ms / target 50.0 ms (MISSES)"
            ),
            "{text}"
        );
        assert!(text.contains("prefix cache: 25.0% of 400"), "{text}");
        assert!(
            text.contains("store node http://10.0.0.5:7400: followed · 6 objects, 2.5 of 1000.0 MB · 12 hits, 3 misses · 6 puts (0 refused, 1 corrupt) · 0 evicted · 2 leases, 2 pinned"),
            "{text}"
        );
        assert!(
            text.contains("store node http://10.0.0.6:7400: down, no figures yet"),
            "{text}"
        );
        assert!(
            text.contains("planner      9 s: decode up to 2 (p90 over target)"),
            "{text}"
        );
        let lines: Vec<&str> = text.lines().collect();
        let header = lines.iter().position(|l| l.starts_with("name")).unwrap();
        // Columns line up: each row's "health" cell starts where the header's does.
        let col = lines[header].find("health").unwrap();
        assert_eq!(&lines[header + 1][col..col + 2], "ok", "{text}");
        assert_eq!(&lines[header + 2][col..col + 7], "stalled", "{text}");
        assert!(lines[header + 2].contains("300 (7 hits)"), "{text}");
        assert!(
            lines[header + 2].contains("24 put / 6 fetched / 1 failed"),
            "{text}"
        );
        assert!(
            lines[header + 2].contains("4 swapped / 0 recomputed"),
            "{text}"
        );
        assert!(
            lines[header + 1].contains("tcp×3") && lines[header + 2].contains("tcp,quic"),
            "{text}"
        );
    }
}
