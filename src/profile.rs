//! `--rate-profile`: a load whose arrival rate moves over the run — a quiet night, a ramp, a
//! peak, a burst — made from any schedule (a replayed trace, or Poisson arrivals) by stretching
//! and compressing its time, so every request keeps its prompt, its prefix structure and its
//! place in the order.
//!
//! A profile is a rate multiplier `m(x)` over the schedule's span, `x` from 0 (its first
//! arrival) to 1 (its last), linear between the points given. A request at `x` of the span
//! arrives at `span · ∫₀ˣ du / m(u)`: where `m` is 2 the arrivals come twice as fast as in the
//! schedule, where it is 0.3 at 0.3 times the rate. The run's length changes accordingly.

use std::str::FromStr;
use std::time::Duration;

/// The built-in profile `day`: a night at 0.3x, a ramp through the morning to a 1.5x peak, a
/// burst at 3x, then the evening's 0.6x.
pub const DAY: &str = "0:0.3,0.2:0.3,0.45:1,0.6:1.5,0.75:1.5,0.77:3,0.8:3,0.82:1,1:0.6";

/// A rate multiplier over a schedule's span: `(x, m)` points, `x` rising from 0 to 1.
#[derive(Debug, Clone, PartialEq)]
pub struct RateProfile {
    points: Vec<(f64, f64)>,
}

impl FromStr for RateProfile {
    type Err = String;

    /// `day` ([`DAY`]), or `X:M,X:M,...` with `X` rising from 0 to 1 and every `M` positive.
    fn from_str(s: &str) -> Result<RateProfile, String> {
        let text = if s == "day" { DAY } else { s };
        let point = |p: &str| -> Result<(f64, f64), String> {
            let (x, m) = p
                .split_once(':')
                .ok_or_else(|| format!("{p:?} is not X:MULTIPLIER"))?;
            let num = |v: &str| {
                v.trim()
                    .parse::<f64>()
                    .map_err(|_| format!("{v:?} in {p:?} is not a number"))
            };
            Ok((num(x)?, num(m)?))
        };
        let points = text.split(',').map(point).collect::<Result<Vec<_>, _>>()?;
        let wrong = |why: &str| {
            Err(format!(
                "rate profile {s:?}: {why} (e.g. \"day\" or \"0:0.3,0.5:1.5,1:1\")"
            ))
        };
        if points.len() < 2 || points[0].0 != 0.0 || points[points.len() - 1].0 != 1.0 {
            return wrong("its points must run from X = 0 to X = 1");
        }
        if points.windows(2).any(|w| w[1].0 <= w[0].0) {
            return wrong("its X values must rise");
        }
        if points.iter().any(|&(_, m)| !(m > 0.0 && m.is_finite())) {
            return wrong("every multiplier must be positive");
        }
        Ok(RateProfile { points })
    }
}

impl RateProfile {
    /// `∫₀ˣ du / m(u)`.
    fn stretch(&self, x: f64) -> f64 {
        let mut total = 0.0;
        for w in self.points.windows(2) {
            let ((x0, m0), (x1, m1)) = (w[0], w[1]);
            if x <= x0 {
                break;
            }
            let end = x.min(x1);
            // m is linear on the segment: m(u) = m0 + k (u - x0).
            let k = (m1 - m0) / (x1 - x0);
            let m_end = m0 + k * (end - x0);
            total += match k.abs() < 1e-12 {
                true => (end - x0) / m0,
                false => (m_end / m0).ln() / k,
            };
        }
        total
    }

    /// Remaps the arrival times `at` (in order, the first at or after 0) under this profile.
    pub fn apply(&self, at: &mut [Duration]) {
        let (Some(first), Some(last)) = (at.first().copied(), at.last().copied()) else {
            return;
        };
        let span = (last - first).as_secs_f64();
        if span <= 0.0 {
            return;
        }
        for t in at.iter_mut() {
            let x = (*t - first).as_secs_f64() / span;
            *t = first + Duration::from_secs_f64(span * self.stretch(x));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn even(n: usize) -> Vec<Duration> {
        (0..n)
            .map(|i| Duration::from_millis(10 * i as u64))
            .collect()
    }

    #[test]
    fn a_flat_profile_leaves_the_schedule_as_it_is() {
        let mut at = even(101);
        "0:1,1:1".parse::<RateProfile>().unwrap().apply(&mut at);
        for (i, t) in at.iter().enumerate() {
            assert!(
                (t.as_secs_f64() - 0.01 * i as f64).abs() < 1e-9,
                "{i}: {t:?}"
            );
        }
    }

    #[test]
    fn the_rate_follows_the_multiplier_and_the_order_is_kept() {
        let n = 10_001;
        let mut at = even(n);
        let p: RateProfile = DAY.parse().unwrap();
        p.apply(&mut at);
        assert!(at.windows(2).all(|w| w[0] <= w[1]), "in order");
        // The gap between neighbours is the schedule's (10 ms) over the multiplier there.
        let gap = |x: f64| {
            let i = (x * (n - 1) as f64) as usize;
            (at[i + 1] - at[i]).as_secs_f64() * 1e3
        };
        assert!((gap(0.1) - 10.0 / 0.3).abs() < 0.01, "night: {}", gap(0.1));
        assert!((gap(0.7) - 10.0 / 1.5).abs() < 0.01, "peak: {}", gap(0.7));
        assert!(
            (gap(0.785) - 10.0 / 3.0).abs() < 0.01,
            "burst: {}",
            gap(0.785)
        );
        // Linear between points: halfway up the ramp from 0.3 to 1, the rate is 0.65.
        assert!(
            (gap(0.325) - 10.0 / 0.65).abs() < 0.05,
            "ramp: {}",
            gap(0.325)
        );
    }

    #[test]
    fn a_bad_profile_says_what_is_wrong() {
        let e = |s: &str| s.parse::<RateProfile>().unwrap_err();
        assert!(e("0.1:1,1:1").contains("from X = 0 to X = 1"));
        assert!(e("0:1,0.5:1,0.4:1,1:1").contains("must rise"));
        assert!(e("0:1,1:0").contains("positive"));
        assert!(e("0:1,1").contains("not X:MULTIPLIER"));
        assert!(e("0:fast,1:1").contains("not a number"));
    }
}
