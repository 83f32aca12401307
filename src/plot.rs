//! `--plot out.svg` of `tandem bench load` and `tandem simulate`: a run's report (and earlier
//! runs' reports, `--plot-with LABEL=report.json`, drawn over it) as TTFT and ITL CDFs,
//! output tokens per second and SLO attainment over time — and, for a simulation with a
//! planner, replicas and the planner's p90 per pool over time.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

/// One run to draw: its label and its report (`tandem-bench-load/3`).
pub type Run = (String, Value);

const COLOURS: [RGBColor; 6] = [
    RGBColor(37, 99, 235),
    RGBColor(220, 38, 38),
    RGBColor(22, 163, 74),
    RGBColor(147, 51, 234),
    RGBColor(234, 88, 12),
    RGBColor(8, 145, 178),
];

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e}")
}

fn floats(v: &Value) -> Vec<Option<f64>> {
    v.as_array()
        .map(|a| a.iter().map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// Reads `LABEL=path` (`--plot-with`): an earlier run's report.
pub fn earlier(spec: &str) -> Result<Run> {
    // The label may hold `=` itself ("policy = kv"); the path is after the last one.
    let (label, path) = spec
        .rsplit_once('=')
        .ok_or_else(|| anyhow!("--plot-with {spec:?}: expected LABEL=REPORT.json"))?;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let report: Value =
        serde_json::from_str(&text).with_context(|| format!("{path}: not a JSON report"))?;
    if report["ttft_cdf_ms"].as_array().is_none() {
        return Err(anyhow!(
            "{path}: no ttft_cdf_ms (a report of tandem-bench-load/3 or later is needed)"
        ));
    }
    Ok((label.to_string(), report))
}

/// Writes the runs' plot to `path` (SVG).
pub fn write(path: &Path, runs: &[Run]) -> Result<()> {
    let sim = runs.iter().any(|(_, r)| {
        r["simulation"]["series"]
            .as_array()
            .is_some_and(|s| !s.is_empty())
    });
    let hits = runs
        .iter()
        .any(|(_, r)| r["timeline"]["prefix_hit_ratio"].is_array());
    let rows = 2 + sim as u32 + hits as u32;
    let root = SVGBackend::new(path, (1200, 400 * rows)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let panes = root.split_evenly((rows as usize, 2));
    let slo = |k: &str| runs.first().and_then(|(_, r)| r["slo"][k].as_f64());
    cdf(&panes[0], "TTFT", "ttft_cdf_ms", slo("ttft_ms"), runs)?;
    cdf(
        &panes[1],
        "ITL (every gap)",
        "itl_cdf_ms",
        slo("itl_p90_ms"),
        runs,
    )?;
    let over_time = |k: &'static str| move |r: &Value| floats(&r["timeline"][k]);
    let bin = |r: &Value| r["timeline"]["bin_s"].as_f64().unwrap_or(1.0);
    let tokens = over_time("output_tokens_per_s");
    let attained = over_time("slo_attainment");
    timeline(
        &panes[2],
        "output tokens/s",
        runs,
        &|r| series(&tokens(r), bin(r)),
        None,
    )?;
    timeline(
        &panes[3],
        "SLO attainment (by arrival)",
        runs,
        &|r| series(&attained(r), bin(r)),
        Some(1.05),
    )?;
    if sim {
        planner(
            &panes[4],
            "replicas: live, the demand's need, predicted a start-up ahead",
            runs,
            &[
                ("live", ""),
                ("needed", " needs"),
                ("needed_ahead", " predicted"),
            ],
        )?;
        planner(
            &panes[5],
            "planner's p90 (ms; prefill TTFT, decode ITL)",
            runs,
            &[("p90_ms", "")],
        )?;
    }
    if hits {
        let ratio = over_time("prefix_hit_ratio");
        timeline(
            &panes[if sim { 6 } else { 4 }],
            "prefix-hit ratio (prompt tokens admitted, by when)",
            runs,
            &|r| series(&ratio(r), bin(r)),
            Some(1.05),
        )?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// A tick label: whole numbers from 10 up, two decimals below.
fn short(v: f64) -> String {
    if v.abs() >= 10.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Points of a binned series (bin centres).
fn series(v: &[Option<f64>], bin: f64) -> Vec<(f64, f64)> {
    v.iter()
        .enumerate()
        .filter_map(|(i, y)| y.map(|y| ((i as f64 + 0.5) * bin, y)))
        .collect()
}

/// A CDF pane: each run's percentiles (x, ms, log scale) against the share below (y).
fn cdf(pane: &Area, title: &str, key: &str, target: Option<f64>, runs: &[Run]) -> Result<()> {
    let lines: Vec<Vec<(f64, f64)>> = runs
        .iter()
        .map(|(_, r)| {
            floats(&r[key])
                .iter()
                .enumerate()
                .filter_map(|(p, v)| v.filter(|v| *v > 0.0).map(|v| (v, p as f64 / 100.0)))
                .collect()
        })
        .collect();
    let xs = lines.iter().flatten().map(|p| p.0).chain(target);
    let lo = xs.clone().fold(f64::INFINITY, f64::min).min(1e9) * 0.8;
    let hi = xs.fold(0.0, f64::max).max(lo * 2.0) * 1.25;
    let mut chart = ChartBuilder::on(pane)
        .caption(format!("{title}: CDF"), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d((lo.max(1e-3)..hi).log_scale(), 0.0..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_labels(8)
        .x_label_formatter(&|v| short(*v))
        .x_desc("ms (log)")
        .y_desc("share of samples")
        .draw()
        .map_err(err)?;
    if let Some(t) = target {
        let red = RGBColor(120, 120, 120);
        chart
            .draw_series(LineSeries::new([(t, 0.0), (t, 1.0)], red.stroke_width(1)))
            .map_err(err)?
            .label(format!("target {t:.0} ms"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], red));
    }
    for (i, (pts, (label, _))) in lines.into_iter().zip(runs).enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    legend(&mut chart)
}

fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(err)
}

/// A pane of each run's series over time (s).
fn timeline(
    pane: &Area,
    title: &str,
    runs: &[Run],
    points: &dyn Fn(&Value) -> Vec<(f64, f64)>,
    y_max: Option<f64>,
) -> Result<()> {
    let lines: Vec<(String, Vec<(f64, f64)>)> =
        runs.iter().map(|(l, r)| (l.clone(), points(r))).collect();
    line_pane(pane, title, "s since the first request", lines, y_max)
}

/// Per pool, a simulation's planner series `key` over time.
/// A simulation's planner series: for each run and pool, a line per `(key, name)`.
fn planner(pane: &Area, title: &str, runs: &[Run], keys: &[(&str, &str)]) -> Result<()> {
    let mut lines = Vec::new();
    for (label, r) in runs {
        for pool in ["prefill", "decode"] {
            for (key, name) in keys {
                let pts: Vec<(f64, f64)> = r["simulation"]["series"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|s| s["pool"] == pool)
                    .filter_map(|s| Some((s["t_s"].as_f64()?, s[*key].as_f64()?)))
                    .collect();
                if !pts.is_empty() {
                    lines.push((format!("{label}: {pool}{name}"), pts));
                }
            }
        }
    }
    line_pane(pane, title, "s (virtual)", lines, None)
}

fn line_pane(
    pane: &Area,
    title: &str,
    x_desc: &str,
    lines: Vec<(String, Vec<(f64, f64)>)>,
    y_max: Option<f64>,
) -> Result<()> {
    let pts = lines.iter().flat_map(|(_, p)| p);
    let x_hi = pts.clone().map(|p| p.0).fold(1.0, f64::max);
    let y_hi = y_max.unwrap_or_else(|| pts.map(|p| p.1).fold(1.0, f64::max) * 1.1);
    let mut chart = ChartBuilder::on(pane)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_hi, 0.0..y_hi)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_label_formatter(&|v| short(*v))
        .y_label_formatter(&|v| short(*v))
        .x_desc(x_desc)
        .draw()
        .map_err(err)?;
    for (i, (label, pts)) in lines.into_iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    legend(&mut chart)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn report(scale: f64, simulated: bool) -> Value {
        let cdf: Vec<f64> = (0..=100).map(|p| scale * (1.0 + p as f64)).collect();
        let mut r = json!({
            "slo": {"ttft_ms": 200, "itl_p90_ms": 50},
            "ttft_cdf_ms": cdf, "itl_cdf_ms": cdf,
            "timeline": {"bin_s": 1.0, "output_tokens_per_s": [10.0, 20.0, 15.0],
                         "slo_attainment": [1.0, null, 0.5]},
        });
        if !simulated {
            r["timeline"]["prefix_hit_ratio"] = json!([0.8, 0.1, 0.7]);
        }
        if simulated {
            r["simulation"] = json!({"series": [
                {"t_s": 0.0, "pool": "decode", "live": 1, "p90_ms": 30.0},
                {"t_s": 5.0, "pool": "decode", "live": 2, "p90_ms": 60.0},
            ]});
        }
        r
    }

    #[test]
    fn runs_are_drawn_over_each_other_with_their_labels() {
        let dir = std::env::temp_dir().join(format!("tandem-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let earlier = dir.join("earlier.json");
        std::fs::write(&earlier, report(2.0, false).to_string()).unwrap();
        let out = dir.join("out.svg");
        let runs = vec![
            ("disaggregated".to_string(), report(1.0, true)),
            earlier_run(&format!("colocated={}", earlier.display())),
        ];
        write(&out, &runs).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80]);
        for text in [
            "disaggregated",
            "colocated",
            "target 200 ms",
            "TTFT: CDF",
            "replicas: live",
            "prefix-hit ratio",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
        // Two CDF panes, two timelines, two planner panes: a line per run, per pool.
        assert!(
            svg.matches("<polyline").count() >= 10,
            "{}",
            svg.matches("<polyline").count()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn earlier_run(spec: &str) -> Run {
        earlier(spec).unwrap()
    }

    #[test]
    fn an_earlier_run_must_be_a_labelled_report_with_its_distributions() {
        let e = earlier("no-label.json").unwrap_err().to_string();
        assert!(e.contains("LABEL=REPORT.json"), "{e}");
        let old = std::env::temp_dir().join(format!("tandem-plot-old-{}.json", std::process::id()));
        std::fs::write(&old, r#"{"format": "tandem-bench-load/2"}"#).unwrap();
        let e = earlier(&format!("old={}", old.display()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no ttft_cdf_ms"), "{e}");
        let _ = std::fs::remove_file(&old);
    }
}
