//! `tandem plan`: capacity planning on the simulator. For the cluster of a `cluster.toml` and
//! a workload (a trace, or Poisson), the cheapest static fleet — prefill:decode, and the
//! colocated alternative — whose share of requests meeting both targets (TTFT, and the p90 of a
//! request's gaps) is at least `--attainment`; then the planner under the same load, with the
//! file's autoscaling bounds, beside it in worker-seconds.
//!
//! The search assumes attainment does not fall as a pool grows: the decode pool is sized with
//! an ample prefill pool (the largest searched), the prefill pool with an ample decode pool —
//! each pool scales on its own target, the point of disaggregation — then the pair is grown one
//! replica at a time, the cheaper step first, until it meets both together.

use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::load::Planned;
use crate::simulate::{self, SimulateArgs};

/// Arguments of `tandem plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    sim: SimulateArgs,
    /// The largest pool the search considers.
    #[arg(long, default_value_t = 64)]
    max_replicas: usize,
    /// The share of requests that must meet both targets.
    #[arg(long, default_value_t = 0.9)]
    attainment: f64,
}

/// One simulated fleet.
struct Trial {
    /// Prefill replicas (0: colocated).
    prefill: usize,
    decode: usize,
    report: Value,
}

impl Trial {
    fn attained(&self) -> f64 {
        self.report["slo_attainment"].as_f64().unwrap_or(0.0)
    }

    fn worker_seconds(&self) -> f64 {
        let ws = &self.report["simulation"]["worker_seconds"];
        ws.as_object()
            .map_or(0.0, |m| m.values().filter_map(Value::as_f64).sum())
    }

    fn row(&self, name: &str) -> Value {
        let r = &self.report;
        json!({
            "fleet": name, "prefill": self.prefill, "decode": self.decode,
            "slo_attainment": self.attained(), "ttft_p90_ms": r["ttft_ms"]["p90"],
            "itl_p90_ms": r["itl_ms"]["p90"], "worker_seconds": self.worker_seconds(),
            "errors": r["errors"],
        })
    }
}

struct Search<'a> {
    a: &'a PlanArgs,
    base: sim::SimConfig,
    planned: Vec<Planned>,
    runs: usize,
}

impl Search<'_> {
    /// The static fleet of `prefill` + `decode` workers (prefill 0: colocated).
    fn fleet(&mut self, prefill: usize, decode: usize) -> Result<Trial> {
        let mut c = self.base.clone();
        c.scaling.clear();
        match (&mut c.prefill, prefill) {
            (p, 0) => *p = None,
            (Some(p), n) => p.replicas = n,
            (None, _) => bail!("the cluster has no prefill pool"),
        }
        c.decode.replicas = decode;
        self.runs += 1;
        let (_, report) = simulate::simulate(&self.a.sim.work, c, self.planned.clone())?;
        eprintln!(
            "plan: {prefill} prefill + {decode} decode: {:.1}% of requests meet both targets",
            100.0 * report["slo_attainment"].as_f64().unwrap_or(0.0)
        );
        Ok(Trial {
            prefill,
            decode,
            report,
        })
    }

    fn meets(&self, t: &Trial) -> bool {
        t.attained() >= self.a.attainment
    }

    /// The smallest `n` in 1..=max for which `fleet(n)` meets the targets (bisection).
    fn smallest(
        &mut self,
        mut fleet: impl FnMut(&mut Self, usize) -> Result<Trial>,
    ) -> Result<Option<Trial>> {
        let max = self.a.max_replicas;
        let top = fleet(self, max)?;
        if !self.meets(&top) {
            return Ok(None);
        }
        let (mut lo, mut best) = (0, top);
        let mut hi = max;
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let t = fleet(self, mid)?;
            if self.meets(&t) {
                (hi, best) = (mid, t);
            } else {
                lo = mid;
            }
        }
        Ok(Some(best))
    }

    /// From fleet `t`, which meets the targets, one worker fewer in a pool while that still
    /// meets them: at the 90% edge attainment is not monotone in a pool's size (a pool found
    /// the least with the other at its maximum may do with one fewer beside a smaller one), so
    /// the answer is checked to need each of its workers.
    fn descend(&mut self, mut t: Trial) -> Result<Trial> {
        loop {
            let (p, d) = (t.prefill, t.decode);
            let fewer = [(p > 1).then(|| (p - 1, d)), (d > 1).then(|| (p, d - 1))];
            let mut moved = false;
            for (p, d) in fewer.into_iter().flatten() {
                let smaller = self.fleet(p, d)?;
                if self.meets(&smaller) {
                    (t, moved) = (smaller, true);
                    break;
                }
            }
            if !moved {
                return Ok(t);
            }
        }
    }

    /// The cheapest disaggregated fleet meeting the targets.
    fn disaggregated(&mut self) -> Result<Option<Trial>> {
        let max = self.a.max_replicas;
        let Some(d) = self.smallest(|s, n| s.fleet(max, n))? else {
            return Ok(None);
        };
        let Some(p) = self.smallest(|s, n| s.fleet(n, max))? else {
            return Ok(None);
        };
        let (mut p, mut d) = (p.prefill, d.decode);
        loop {
            let t = self.fleet(p, d)?;
            if self.meets(&t) {
                return self.descend(t).map(Some);
            }
            if p >= max && d >= max {
                return Ok(None);
            }
            // One more replica where it helps more (the pool whose own target is missed more
            // often), the other pool if that one is at its bound.
            let ttft_short = t.report["ttft_ms"]["p90"].as_f64().unwrap_or(f64::INFINITY)
                / self.a.sim.work.ttft_slo_ms as f64;
            let itl_short = t.report["itl_ms"]["p90"].as_f64().unwrap_or(f64::INFINITY)
                / self.a.sim.work.itl_slo_ms as f64;
            if (ttft_short >= itl_short && p < max) || d >= max {
                p += 1;
            } else {
                d += 1;
            }
        }
    }
}

/// Runs `tandem plan` and prints its table.
pub fn run(a: PlanArgs) -> Result<()> {
    if !(a.attainment > 0.0 && a.attainment <= 1.0) {
        bail!("--attainment must be in (0, 1]");
    }
    if a.max_replicas == 0 {
        bail!("--max-replicas must be at least 1");
    }
    let (base, planned) = simulate::build(&a.sim)?;
    let scaled = !base.scaling.is_empty();
    let has_prefill = base.prefill.is_some();
    let mut s = Search {
        a: &a,
        base,
        planned,
        runs: 0,
    };
    let mut rows = Vec::new();
    let cheapest = if has_prefill {
        s.disaggregated()?
    } else {
        None
    };
    match &cheapest {
        Some(t) => rows.push(t.row("cheapest static, disaggregated")),
        None if has_prefill => rows.push(json!({"fleet": "cheapest static, disaggregated", "note": format!("none up to {} + {}", a.max_replicas, a.max_replicas)})),
        None => {}
    }
    match s.smallest(|s, n| s.fleet(0, n))? {
        Some(t) => rows.push(t.row("cheapest static, colocated")),
        None => rows.push(json!({"fleet": "cheapest static, colocated", "note": format!("none up to {}", a.max_replicas)})),
    }
    if scaled {
        s.runs += 1;
        let (_, report) = simulate::simulate(&a.sim.work, s.base.clone(), s.planned.clone())?;
        let t = Trial {
            prefill: 0,
            decode: 0,
            report,
        };
        let mut row = t.row("planner (the file's autoscaling)");
        row["prefill"] = Value::Null;
        row["decode"] = Value::Null;
        if let Some(c) = &cheapest {
            row["worker_seconds_vs_cheapest_static"] =
                json!(t.worker_seconds() / c.worker_seconds());
        }
        rows.push(row);
    }
    print_table(&a, &rows, s.runs, scaled);
    if let Some(p) = &a.sim.work.json {
        let out = json!({"format": "tandem-plan/1", "attainment": a.attainment,
            "slo": {"ttft_ms": a.sim.work.ttft_slo_ms, "itl_p90_ms": a.sim.work.itl_slo_ms},
            "simulations": s.runs, "fleets": rows});
        std::fs::write(p, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}

fn print_table(a: &PlanArgs, rows: &[Value], runs: usize, scaled: bool) {
    println!(
        "targets: TTFT <= {} ms and ITL p90 <= {} ms for {:.0}% of requests ({runs} simulations)",
        a.sim.work.ttft_slo_ms,
        a.sim.work.itl_slo_ms,
        a.attainment * 100.0
    );
    println!(
        "| fleet | prefill | decode | attainment | TTFT p90 ms | ITL p90 ms | worker-seconds |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let n = |v: &Value| v.as_u64().map_or("–".into(), |n| n.to_string());
    let f = |v: &Value, d: usize| v.as_f64().map_or("–".into(), |x| format!("{x:.d$}"));
    for r in rows {
        if let Some(note) = r["note"].as_str() {
            println!(
                "| {} | {note} | | | | | |",
                r["fleet"].as_str().unwrap_or("")
            );
            continue;
        }
        let att = r["slo_attainment"].as_f64().unwrap_or(0.0) * 100.0;
        let mut ws = f(&r["worker_seconds"], 1);
        if let Some(x) = r["worker_seconds_vs_cheapest_static"].as_f64() {
            ws += &format!(" ({:+.0}% vs static)", (x - 1.0) * 100.0);
        }
        println!(
            "| {} | {} | {} | {att:.1}% | {} | {} | {ws} |",
            r["fleet"].as_str().unwrap_or(""),
            n(&r["prefill"]),
            n(&r["decode"]),
            f(&r["ttft_p90_ms"], 0),
            f(&r["itl_p90_ms"], 1)
        );
    }
    if !scaled {
        println!(
            "(no [prefill.autoscale]/[decode.autoscale] in the file: no planner run to compare)"
        );
    }
}
