//! `tandem simulate`: the cluster of a `cluster.toml` on a virtual clock (see the `sim` crate),
//! under the same workloads as `tandem bench load`, with the same report.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;

use crate::cluster;
use crate::load::{self, Workload};

/// Arguments of `tandem simulate`.
#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// The cluster to simulate (pools, replicas, engines, routing policy).
    #[arg(long, default_value = "cluster.toml")]
    config: PathBuf,
    #[command(flatten)]
    pub(crate) work: Workload,
    /// KV transfer bandwidth, GB/s (prefill to decode worker).
    #[arg(long, default_value_t = 2.0)]
    link_gbytes_per_s: f64,
    /// Fixed cost of one KV transfer, µs.
    #[arg(long, default_value_t = 200)]
    link_latency_us: u64,
    /// A decode engine's time to write arrived KV into its cache, ns a byte (its next step
    /// waits for it; `scripts/sim_fidelity.py` measures it). 0: free (RDMA writes in place).
    #[arg(long, default_value_t = 0.0)]
    kv_write_ns_per_byte: f64,
    /// From the planner asking for a replica to its serving, ms (pools with `[<pool>.autoscale]`).
    #[arg(long, default_value_t = 1000)]
    start_up_ms: u64,
    /// Added to each prefill worker step, µs (what a real worker spends beside the timing
    /// model's time; `scripts/sim_fidelity.py` measures it).
    #[arg(long, default_value_t = 0)]
    prefill_step_overhead_us: u64,
    /// Added to each decode worker step, µs.
    #[arg(long, default_value_t = 0)]
    decode_step_overhead_us: u64,
    /// Workers' Prometheus scrapes (one file, any number of workers' `/metrics` one after the
    /// other): each pool's steps draw their overheads from its workers'
    /// `tandem_{pool}_step_overhead_seconds` buckets instead of a fixed
    /// `--{pool}-step-overhead-us` (mock workers measure them; `scripts/sim_fidelity.py`).
    #[arg(long, value_name = "FILE")]
    step_overheads: Option<PathBuf>,
    /// One call between the router and a worker, µs.
    #[arg(long, default_value_t = 0)]
    hop_us: u64,
    /// A router's Prometheus scrape: each token's way to its client takes a delay drawn from
    /// its `tandem_router_token_delay_seconds` buckets (measured from the decode worker, so it
    /// holds the hop: give `--hop-us` 0 with it; `scripts/sim_fidelity.py` does).
    #[arg(long, value_name = "FILE")]
    token_delays: Option<PathBuf>,
    /// The simulated model's context, tokens (default: the model file's); prompts and outputs
    /// longer fail as they would on the cluster.
    #[arg(long)]
    context_len: Option<usize>,
    /// A fault (repeatable): kill:POOL:N|P%@WHEN (workers die), freeze:POOL:N|P%@WHEN+FOR,
    /// link:rackK:P%@WHEN[+FOR] (links to a rack at P% of their bandwidth), cut:rackK@WHEN[+FOR];
    /// WHEN is a time (20m, 90s) or `random` (within the arrivals; `random*5`: five of them).
    #[arg(long = "fault", value_name = "SPEC")]
    faults: Vec<sim::FaultSpec>,
    /// Racks the workers are spread over (worker i in rack i % racks), for link faults.
    #[arg(long, default_value_t = 1)]
    racks: usize,
    /// Seed of the faults' random times and of which workers they take.
    #[arg(long, default_value_t = 1)]
    fault_seed: u64,
}

/// Simulates the cluster and prints the report.
pub fn run(a: SimulateArgs) -> Result<()> {
    let (config, planned) = build(&a)?;
    let (_, report) = simulate(&a.work, config, planned)?;
    let sim = &report["simulation"];
    println!(
        "simulated {:.1} s of the cluster in {:.1} s ({} engine steps, {:.1} MB of KV moved)",
        report["duration_s"].as_f64().unwrap_or(0.0),
        sim["wall_s"].as_f64().unwrap_or(0.0),
        sim["steps"],
        sim["kv_bytes"].as_f64().unwrap_or(0.0) / 1e6
    );
    let p = &sim["preempted"];
    if p["swapped"].as_u64().unwrap_or(0) + p["recomputed"].as_u64().unwrap_or(0) > 0 {
        println!(
            "preempted: {} swapped to the host tier, {} recomputed; resumes needed {} tokens' KV, found {}",
            p["swapped"], p["recomputed"], p["resumed_tokens"], p["resumed_hit_tokens"]
        );
    }
    load::finish(&a.work, &report)
}

/// The simulation `a` describes: the cluster of its file, its faults, and the requests of
/// its workload.
pub fn build(a: &SimulateArgs) -> Result<(sim::SimConfig, Vec<load::Planned>)> {
    let (cfg, model) = cluster::load(&a.config)?;
    if a.link_gbytes_per_s <= 0.0 {
        bail!("--link-gbytes-per-s must be positive");
    }
    if !(a.kv_write_ns_per_byte >= 0.0 && a.kv_write_ns_per_byte.is_finite()) {
        bail!("--kv-write-ns-per-byte must be a number of at least 0");
    }
    if a.racks == 0 {
        bail!("--racks must be at least 1");
    }
    if let Some(r) = a.faults.iter().find_map(|f| match f.kind {
        sim::FaultKind::Link { rack, .. } if rack >= a.racks => Some(rack),
        _ => None,
    }) {
        bail!(
            "--fault names rack{r}, but there are {} racks (--racks)",
            a.racks
        );
    }
    let (mut shape, _) = engine::inspect(&model)?;
    if let Some(c) = a.context_len {
        shape.context_len = c;
    }
    let measured = match &a.step_overheads {
        Some(path) => step_overheads(path)?,
        None => Default::default(),
    };
    let overhead = |name: &str, us: u64| match measured.get(name) {
        Some(_) if us > 0 => bail!(
            "--step-overheads gives the {name} pool's overheads; --{name}-step-overhead-us {us} too"
        ),
        Some(o) => Ok(o.clone()),
        None => Ok(sim::Overhead::fixed(Duration::from_micros(us))),
    };
    let (prefill_overhead, decode_overhead) = (
        overhead("prefill", a.prefill_step_overhead_us)?,
        overhead("decode", a.decode_step_overhead_us)?,
    );
    let pool = |p: &proto::config::PoolSection, name: &str, overhead: &sim::Overhead| {
        let timing = cluster::mock_timing(p).unwrap_or(engine::MockTiming::CPU_SMOLLM2);
        if *p.engine.get_ref() != proto::config::EngineKind::Mock {
            eprintln!("simulate: the {name} pool runs the real engine; simulated with the mock's cpu-smollm2 timing");
        }
        sim::PoolSpec {
            replicas: *p.replicas.get_ref() as usize,
            engine: engine::EngineConfig {
                tiers: cluster::tier_config(p, &a.config, name),
                ..cluster::engine_config(&cfg, p)
            },
            timing,
            step_overhead: overhead.clone(),
        }
    };
    let planned = load::plan(&a.work)?;
    if planned.is_empty() {
        bail!("no requests to simulate");
    }
    let horizon = planned.last().map_or(Duration::ZERO, |p| p.at);
    let config = sim::SimConfig {
        kv_rebalance: Some(*cfg.router.kv_rebalance.get_ref()).filter(|&r| r > 0.0),
        model: shape,
        prefill: cfg
            .prefill
            .as_ref()
            .map(|p| pool(p, "prefill", &prefill_overhead)),
        decode: pool(&cfg.decode, "decode", &decode_overhead),
        routing: cluster::routing(&cfg),
        router: router::core::Settings {
            local_prefill_max_tokens: cfg.router.local_prefill_max_tokens,
            local_prefill_busy_max_tokens: cfg.router.local_prefill_busy_max_tokens,
            migration_limit: cfg.router.migration_limit,
            request_timeout: Duration::from_millis(*cfg.router.request_timeout_ms.get_ref()),
            ..Default::default()
        },
        link: sim::Link {
            bandwidth: a.link_gbytes_per_s * 1e9,
            latency: Duration::from_micros(a.link_latency_us),
            write_ns_per_byte: a.kv_write_ns_per_byte,
        },
        scaling: cluster::scaling(&cfg),
        start_up: Duration::from_millis(a.start_up_ms),
        hop: Duration::from_micros(a.hop_us),
        token_delay: match &a.token_delays {
            Some(path) => token_delays(path)?,
            None => sim::Overhead::default(),
        },
        liveness: sim::Liveness {
            stall: Duration::from_millis(*cfg.router.stall_timeout_ms.get_ref()),
            transfer_timeout: Duration::from_millis(*cfg.kv_transfer.transfer_timeout_ms.get_ref()),
            racks: a.racks,
            fault_seed: a.fault_seed,
        },
        faults: sim::schedule_faults(&a.faults, a.fault_seed, horizon),
        // Workers pointed at a store node, or given one by `tandem up`, use the cluster store:
        // the simulator keeps one.
        store: (cfg.store.nodes_span().is_some() || cfg.embedded_store()).then(|| sim::StoreSpec {
            capacity_bytes: *cfg.store.capacity_bytes.get_ref(),
        }),
        peer_fetch: *cfg.kv_transfer.peer_fetch.get_ref(),
    };
    Ok((config, planned))
}

/// Each pool's step overheads from Prometheus scrapes of its workers: the buckets of
/// `tandem_{pool}_step_overhead_seconds`, summed over the workers (they share the bounds).
/// Pools the file has no buckets for are left out.
fn step_overheads(path: &std::path::Path) -> Result<HashMap<&'static str, sim::Overhead>> {
    let text = scrape(path, "--step-overheads")?;
    let mut out = HashMap::new();
    for pool in ["prefill", "decode"] {
        let name = format!("tandem_{pool}_step_overhead_seconds");
        if let Some(o) = histogram(&text, path, "--step-overheads", &name)? {
            out.insert(pool, o);
        }
    }
    if out.is_empty() {
        bail!(
            "--step-overheads {}: no tandem_prefill_step_overhead_seconds or tandem_decode_step_overhead_seconds buckets (a mock worker's /metrics has them)",
            path.display()
        );
    }
    Ok(out)
}

/// The tokens' delays on their way out from a router's scrape: its
/// `tandem_router_token_delay_seconds` buckets.
fn token_delays(path: &std::path::Path) -> Result<sim::Overhead> {
    let text = scrape(path, "--token-delays")?;
    histogram(&text, path, "--token-delays", "tandem_router_token_delay_seconds")?.ok_or_else(
        || {
            anyhow::anyhow!(
                "--token-delays {}: no tandem_router_token_delay_seconds buckets (a router's /metrics has them)",
                path.display()
            )
        },
    )
}

fn scrape(path: &std::path::Path, flag: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{flag} {}: {e}", path.display()))
}

/// The distribution of histogram `name` in Prometheus text, its buckets summed over every
/// series (they share the bounds); `None` where the text has none.
fn histogram(
    text: &str,
    path: &std::path::Path,
    flag: &str,
    name: &str,
) -> Result<Option<sim::Overhead>> {
    let prefix = format!("{name}_bucket{{");
    let mut sums: Vec<(f64, f64)> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let Some(rest) = line.strip_prefix(&prefix) else {
            continue;
        };
        let bucket = (|| {
            let le = rest.split("le=\"").nth(1)?.split('"').next()?;
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let count: f64 = rest.rsplit(' ').next()?.parse().ok()?;
            Some((le, count))
        })();
        let Some((le, count)) = bucket else {
            bail!(
                "{}:{}: not a histogram bucket line: {line}",
                path.display(),
                n + 1
            );
        };
        match sums.iter_mut().find(|(l, _)| *l == le) {
            Some(s) => s.1 += count,
            None => sums.push((le, count)),
        }
    }
    if sums.is_empty() {
        return Ok(None);
    }
    sums.sort_by(|a, b| a.0.total_cmp(&b.0));
    sim::Overhead::from_buckets(&sums)
        .map(Some)
        .map_err(|e| anyhow::anyhow!("{flag} {}: {name}: {e}", path.display()))
}

/// Runs one simulation and reports it as `tandem bench load` would, plus its `simulation`.
pub fn simulate(
    work: &Workload,
    config: sim::SimConfig,
    planned: Vec<load::Planned>,
) -> Result<(sim::SimResult, serde_json::Value)> {
    let sent: usize = planned.iter().map(|p| p.prompt.len()).sum();
    let at: Vec<Duration> = planned.iter().map(|p| p.at).collect();
    let started = std::time::Instant::now();
    let r = sim::Sim::new(config, planned)?.run();
    let wall = started.elapsed().as_secs_f64();
    let secs = r.duration.as_secs_f64();
    let cache = Some(load::CacheCounts {
        prompt: r.prompt_tokens,
        hit: r.prefix_hit_tokens,
        tier_hits: r.tier_hits,
    });
    let run = load::Run {
        at: &at,
        outcomes: &r.outcomes,
        secs,
        samples: &[],
    };
    let mut report = load::report(work, &run, sent, cache);
    report["simulation"] = serde_json::json!({
        "wall_s": wall, "steps": r.steps, "kv_bytes": r.kv_bytes,
        "worker_seconds": r.worker_seconds, "prefill_decisions": r.decisions,
        "migrations": r.migrations, "moves": r.moves, "moves_stayed": r.moves_stayed,
        "deaths": r.deaths, "stalls": r.stalls,
        "admission_holds": r.admission_holds,
        "refusals": r.outcomes.iter().map(|o| o.refusals as u64).sum::<u64>(),
        "store_hits": r.store_hits,
        "peer_hits": r.peer_hits,
        "peer_fetch": r.peer_fetch,
        "speculation": {"proposed": r.speculation.proposed, "accepted": r.speculation.accepted,
            "verifies": r.speculation.verifies, "declined": r.speculation.declined},
        "preempted": {"swapped": r.preemptions.swapped, "recomputed": r.preemptions.recomputed,
            "resumed_tokens": r.preemptions.resumed_tokens,
            "resumed_hit_tokens": r.preemptions.resumed_hit_tokens},
        "faults": r.faults.iter().map(|(t, f)| serde_json::json!({"t_s": t, "fault": f})).collect::<Vec<_>>(),
        "ttft_phase_seconds": counted(&r.ttft_phases),
        "step_seconds": counted(&r.step_time),
        "series": r.series.iter().map(|s| serde_json::json!({
            "t_s": s.t, "pool": s.pool, "live": s.live, "starting": s.starting, "desired": s.desired,
            "queued": s.queued, "p90_ms": s.p90_ms, "action": s.action.label(),
            "needed": s.needed, "needed_ahead": s.needed_ahead,
        })).collect::<Vec<_>>(),
    });
    Ok((r, report))
}

/// Counts and sums by name, as `{name: {"count": n, "sum": seconds}}`.
fn counted(m: &std::collections::BTreeMap<&'static str, (u64, f64)>) -> serde_json::Value {
    m.iter()
        .map(|(k, (n, t))| (k.to_string(), serde_json::json!({"count": n, "sum": t})))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

#[cfg(test)]
mod tests {
    use super::{step_overheads, token_delays};

    fn file(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("tandem-overheads-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// Two decode workers' buckets are summed bound by bound: 3 of their 4 steps within 1 ms
    /// (drawn below it three times in four), the fourth at 1..2 ms; no prefill buckets, so
    /// the prefill pool is left to its fixed flag.
    #[test]
    fn scrapes_of_several_workers_sum_into_one_distribution() {
        let b = "tandem_decode_step_overhead_seconds_bucket";
        let text = format!(
            "# TYPE x histogram\n{b}{{le=\"0.001\"}} 2\n{b}{{le=\"0.002\"}} 2\n{b}{{le=\"+Inf\"}} 2\n\
             tandem_decode_step_overhead_seconds_sum 0.001\n\
             {b}{{le=\"0.001\"}} 1\n{b}{{le=\"0.002\"}} 2\n{b}{{le=\"+Inf\"}} 2\n"
        );
        let got = step_overheads(&file("two.txt", &text)).unwrap();
        assert!(!got.contains_key("prefill"));
        let d = &got["decode"];
        let below = (0..4000).filter(|&s| d.draw(0, s) < 1_000_000).count();
        assert!((2800..3200).contains(&below), "{below} of 4000 below 1 ms");
        assert!((0..4000).all(|s| d.draw(0, s) <= 2_000_000));
    }

    #[test]
    fn bad_scrapes_say_where_and_why() {
        let e =
            step_overheads(&file("none.txt", "tandem_decode_step_seconds_sum 1\n")).unwrap_err();
        assert!(
            e.to_string()
                .contains("no tandem_prefill_step_overhead_seconds"),
            "{e}"
        );
        let bad = "tandem_prefill_step_overhead_seconds_bucket{le=\"x\"} 1\n";
        let e = step_overheads(&file("bad.txt", bad)).unwrap_err();
        assert!(
            e.to_string()
                .contains("bad.txt:1: not a histogram bucket line"),
            "{e}"
        );
        let down = "tandem_prefill_step_overhead_seconds_bucket{le=\"0.001\"} 5\n\
                    tandem_prefill_step_overhead_seconds_bucket{le=\"0.002\"} 3\n";
        let e = step_overheads(&file("down.txt", down)).unwrap_err();
        assert!(e.to_string().contains("counts must not decrease"), "{e}");
        let e = step_overheads(std::path::Path::new("/nonexistent/m.txt")).unwrap_err();
        assert!(
            e.to_string()
                .contains("--step-overheads /nonexistent/m.txt"),
            "{e}"
        );
    }

    /// A router's scrape gives the tokens' delays (every token under 1 ms here); one without
    /// them, a worker's, is refused by name.
    #[test]
    fn token_delays_come_from_a_routers_scrape() {
        let b = "tandem_router_token_delay_seconds_bucket";
        let text = format!("{b}{{le=\"0.0005\"}} 3\n{b}{{le=\"0.001\"}} 4\n{b}{{le=\"+Inf\"}} 4\n");
        let d = token_delays(&file("router.txt", &text)).unwrap();
        assert!((0..1000).all(|t| d.draw_token(7, t) <= 1_000_000));
        let worker = "tandem_decode_step_overhead_seconds_bucket{le=\"0.001\"} 1\n";
        let e = token_delays(&file("worker.txt", worker)).unwrap_err();
        assert!(
            e.to_string()
                .contains("no tandem_router_token_delay_seconds buckets"),
            "{e}"
        );
    }
}
