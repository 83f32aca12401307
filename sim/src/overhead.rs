//! What a real worker spends on a step beside its timing model's time — the engine's own work,
//! the wake-ups of the mock's sleeps, the other processes on the machine. A mean alone gives
//! every simulated step the same time (an ITL p90 equal to its p50); real steps have a tail, so
//! the simulator draws each step's overhead from the distribution a real worker measured: the
//! buckets of its `tandem_{pool}_step_overhead_seconds` histogram.

use std::time::Duration;

use crate::faults::mix;

/// A distribution of step overheads: fixed, or piecewise uniform over a histogram's buckets
/// (as Prometheus' `histogram_quantile` reads them).
#[derive(Debug, Clone, PartialEq)]
pub struct Overhead {
    /// `(low ns, high ns, cumulative share)`, shares increasing to 1.
    pieces: Vec<(u64, u64, f64)>,
}

/// Why a histogram cannot be drawn from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OverheadError {
    /// It counted no step.
    #[error("the histogram counts no step")]
    Empty,
    /// Its bounds or counts go down, or one is not a number.
    #[error("bucket le={le}: bounds must increase and counts must not decrease")]
    Unordered {
        /// The offending bucket's upper bound (seconds).
        le: f64,
    },
}

impl Default for Overhead {
    fn default() -> Overhead {
        Overhead::fixed(Duration::ZERO)
    }
}

impl Overhead {
    /// The same overhead on every step.
    pub fn fixed(d: Duration) -> Overhead {
        let n = d.as_nanos() as u64;
        Overhead {
            pieces: vec![(n, n, 1.0)],
        }
    }

    /// From a histogram's buckets: `(le seconds, cumulative count)` in order of `le`, the last
    /// may be `+Inf` (its steps are put at the last finite bound, the most the buckets say).
    pub fn from_buckets(buckets: &[(f64, f64)]) -> Result<Overhead, OverheadError> {
        let total = buckets.last().map_or(0.0, |b| b.1);
        if total.is_nan() || total <= 0.0 {
            return Err(OverheadError::Empty);
        }
        let (mut pieces, mut low, mut below, mut last_le) = (Vec::new(), 0u64, 0.0, -1.0);
        for &(le, count) in buckets {
            // (NaNs fail both comparisons.)
            if !(le > last_le && le >= 0.0 && count >= below) {
                return Err(OverheadError::Unordered { le });
            }
            let high = if le.is_infinite() {
                low
            } else {
                (le * 1e9) as u64
            };
            if count > below {
                pieces.push((low, high, count / total));
            }
            (low, below, last_le) = (high, count, le);
        }
        Ok(Overhead { pieces })
    }

    /// The overhead of step `step` of worker `worker`: a function of the two alone, so a
    /// simulation stays a function of its inputs.
    pub fn draw(&self, worker: usize, step: u64) -> u64 {
        self.draw_keyed(0x6f76_6572_6865_6164, worker, step)
    }

    /// The delay of token `token` of request `request` on its way to the client (drawn
    /// apart from the steps' overheads).
    pub fn draw_token(&self, request: usize, token: usize) -> u64 {
        self.draw_keyed(0x746f_6b65_6e64_6c79, request, token as u64)
    }

    fn draw_keyed(&self, salt: u64, a: usize, b: u64) -> u64 {
        let u = (mix(salt ^ (a as u64) << 40 ^ b) >> 11) as f64 / (1u64 << 53) as f64;
        self.at(u)
    }

    /// The overhead at quantile `u` (0..1).
    fn at(&self, u: f64) -> u64 {
        let i = self.pieces.partition_point(|p| p.2 <= u);
        let Some(&(low, high, upto)) = self.pieces.get(i).or(self.pieces.last()) else {
            return 0;
        };
        let from = if i == 0 { 0.0 } else { self.pieces[i - 1].2 };
        let within = ((u - from) / (upto - from)).clamp(0.0, 1.0);
        low + ((high - low) as f64 * within) as u64
    }

    /// The distribution's mean, ns.
    pub fn mean_ns(&self) -> f64 {
        let mut below = 0.0;
        self.pieces
            .iter()
            .map(|&(low, high, upto)| {
                let share = upto - below;
                below = upto;
                share * (low + high) as f64 / 2.0
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_overhead_is_drawn_every_time() {
        let o = Overhead::fixed(Duration::from_micros(442));
        assert!((0..100).all(|s| o.draw(3, s) == 442_000));
        assert_eq!(o.mean_ns(), 442_000.0);
    }

    #[test]
    fn draws_follow_the_buckets() {
        // 80 steps within 1 ms, 15 in 1..2 ms, 5 in 2..10 ms.
        let o = Overhead::from_buckets(&[
            (0.001, 80.0),
            (0.002, 95.0),
            (0.01, 100.0),
            (f64::INFINITY, 100.0),
        ])
        .unwrap();
        let draws: Vec<u64> = (0..20_000).map(|s| o.draw(0, s)).collect();
        let share = |lo: u64, hi: u64| {
            draws.iter().filter(|&&d| d >= lo && d < hi).count() as f64 / draws.len() as f64
        };
        assert!(
            (share(0, 1_000_000) - 0.80).abs() < 0.02,
            "{}",
            share(0, 1_000_000)
        );
        assert!((share(1_000_000, 2_000_000) - 0.15).abs() < 0.02);
        assert!((share(2_000_000, 10_000_001) - 0.05).abs() < 0.01);
        // The same worker and step draw the same; another worker draws otherwise.
        assert_eq!(o.draw(0, 7), draws[7]);
        assert_ne!(
            (0..50).map(|s| o.draw(1, s)).collect::<Vec<_>>(),
            draws[..50]
        );
        let mean = 0.8 * 0.5e6 + 0.15 * 1.5e6 + 0.05 * 6e6;
        assert!((o.mean_ns() - mean).abs() < 1.0);
    }

    #[test]
    fn steps_past_the_last_bound_sit_at_it() {
        let o =
            Overhead::from_buckets(&[(0.001, 0.0), (0.002, 1.0), (f64::INFINITY, 2.0)]).unwrap();
        assert!((0..1000).all(|s| (1_000_000..=2_000_000).contains(&o.draw(0, s))));
        assert!((0..1000).any(|s| o.draw(0, s) == 2_000_000));
    }

    #[test]
    fn bad_histograms_are_refused() {
        assert_eq!(Overhead::from_buckets(&[]), Err(OverheadError::Empty));
        assert_eq!(
            Overhead::from_buckets(&[(0.001, 0.0), (f64::INFINITY, 0.0)]),
            Err(OverheadError::Empty)
        );
        assert_eq!(
            Overhead::from_buckets(&[(0.002, 5.0), (0.001, 6.0)]),
            Err(OverheadError::Unordered { le: 0.001 })
        );
        assert_eq!(
            Overhead::from_buckets(&[(0.001, 5.0), (0.002, 4.0)]),
            Err(OverheadError::Unordered { le: 0.002 })
        );
    }
}
