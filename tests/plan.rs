//! `tandem plan` (issue 17): the cheapest static fleet it names meets the targets in a
//! simulation of its own, and one worker fewer in either pool does not — the search's claim,
//! checked by `tandem simulate`.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");

fn cluster(dir: &Path, prefill: usize, decode: usize) -> std::path::PathBuf {
    let model = tandem_tests::model_path();
    let text = format!(
        "[model]\npath = {model:?}\n\n[prefill]\nreplicas = {prefill}\nengine = \"mock\"\nkv_blocks = 1024\n\
         [decode]\nreplicas = {decode}\nengine = \"mock\"\nkv_blocks = 1024\nmax_running = 8\n"
    );
    let p = dir.join(format!("cluster-{prefill}-{decode}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// The load both commands replay: Poisson, 40 requests/s of 256-token prompts.
const LOAD: [&str; 12] = [
    "--rate",
    "40",
    "--requests",
    "120",
    "--prompt-tokens",
    "256",
    "--output-tokens",
    "32",
    "--ttft-p90-ms",
    "400",
    "--itl-p90-ms",
    "40",
];

fn attainment(config: &Path) -> f64 {
    let out = Command::new(EXE)
        .args(["simulate", "--config"])
        .arg(config)
        .args(LOAD)
        .args(["--json", "/dev/stdout"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let json = &text[text.find("{\n").expect("the JSON report")..];
    let v: Value = serde_json::from_str(json).unwrap();
    v["slo_attainment"].as_f64().unwrap()
}

#[test]
fn the_cheapest_fleet_meets_the_targets_and_one_worker_fewer_does_not() {
    let dir = std::env::temp_dir().join(format!("tandem-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = cluster(&dir, 1, 1);
    let report = dir.join("plan.json");
    let out = Command::new(EXE)
        .args(["plan", "--config"])
        .arg(&base)
        .args(LOAD)
        .args(["--max-replicas", "16", "--json"])
        .arg(&report)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        table.contains("| cheapest static, disaggregated |"),
        "{table}"
    );
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let fleet = &plan["fleets"][0];
    let (p, d) = (
        fleet["prefill"].as_u64().unwrap() as usize,
        fleet["decode"].as_u64().unwrap() as usize,
    );
    assert!(fleet["slo_attainment"].as_f64().unwrap() >= 0.9, "{fleet}");
    // The load needs more than one of each (else the check below is empty).
    assert!(p + d > 2, "{fleet}");
    assert!(attainment(&cluster(&dir, p, d)) >= 0.9);
    if p > 1 {
        assert!(
            attainment(&cluster(&dir, p - 1, d)) < 0.9,
            "{p} - 1 prefill workers would do"
        );
    }
    if d > 1 {
        assert!(
            attainment(&cluster(&dir, p, d - 1)) < 0.9,
            "{d} - 1 decode workers would do"
        );
    }
    assert_eq!(plan["fleets"][1]["fleet"], "cheapest static, colocated");
    let _ = std::fs::remove_dir_all(&dir);
}
