//! What the router measures for the planner: latencies over a sliding window, a counter's rate,
//! a reading's peak, and the signals recorded on the request path.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Latencies over the last `window`, in slices so old ones fall out.
pub struct Window {
    window: Duration,
    slice: Duration,
    slices: VecDeque<(Instant, Histogram<u64>)>,
}

impl Window {
    /// A window of `window`, kept in slices of a tenth of it.
    pub fn new(window: Duration) -> Window {
        Window {
            window,
            slice: (window / 10).max(Duration::from_millis(10)),
            slices: VecDeque::new(),
        }
    }

    /// How far back it looks.
    pub fn span(&self) -> Duration {
        self.window
    }

    /// Records a latency at `now`.
    pub fn record(&mut self, now: Instant, value: Duration) {
        let fresh = self
            .slices
            .back()
            .is_none_or(|(start, _)| now.duration_since(*start) >= self.slice);
        if fresh {
            let h = Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("valid bounds");
            self.slices.push_back((now, h));
        }
        let us = (value.as_micros() as u64).clamp(1, 3_600_000_000);
        let h = &mut self.slices.back_mut().expect("pushed").1;
        let _ = h.record(us);
        self.expire(now);
    }

    fn expire(&mut self, now: Instant) {
        while self
            .slices
            .front()
            .is_some_and(|(start, _)| now.duration_since(*start) > self.window)
        {
            self.slices.pop_front();
        }
    }

    /// The `q` quantile (0..1) of the window at `now` and how many samples it has.
    pub fn quantile(&mut self, now: Instant, q: f64) -> (Option<Duration>, u64) {
        let ([v], n) = self.quantiles(now, [q]);
        (v, n)
    }

    /// Several quantiles of the window at `now` from one merge of its slices, and how many
    /// samples it has.
    pub fn quantiles<const N: usize>(
        &mut self,
        now: Instant,
        qs: [f64; N],
    ) -> ([Option<Duration>; N], u64) {
        self.quantiles_with(now, qs, std::iter::empty())
    }

    /// As [`Window::quantiles`], with `more` samples beside the window's (the waits of those
    /// still waiting, so far: a window of the waits that ended does not see a line growing).
    pub fn quantiles_with<const N: usize>(
        &mut self,
        now: Instant,
        qs: [f64; N],
        more: impl Iterator<Item = Duration>,
    ) -> ([Option<Duration>; N], u64) {
        self.expire(now);
        let mut all = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 2).expect("valid bounds");
        for (_, h) in &self.slices {
            let _ = all.add(h);
        }
        for v in more {
            let _ = all.record((v.as_micros() as u64).clamp(1, 3_600_000_000));
        }
        let n = all.len();
        let at = |q: f64| (n > 0).then(|| Duration::from_micros(all.value_at_quantile(q)));
        (qs.map(at), n)
    }
}

/// A counter's rate over the last `window`, from its totals read at ticks.
#[derive(Debug)]
pub struct Rate {
    window: Duration,
    points: VecDeque<(Instant, u64)>,
}

impl Rate {
    /// A rate over `window`.
    pub fn new(window: Duration) -> Rate {
        Rate {
            window,
            points: VecDeque::new(),
        }
    }

    /// Notes the counter's `total` at `now`; its rate per second over the window, once the
    /// readings span at least half of it.
    pub fn observe(&mut self, now: Instant, total: u64) -> Option<f64> {
        self.points.push_back((now, total));
        while self
            .points
            .get(1)
            .is_some_and(|(t, _)| now.duration_since(*t) >= self.window)
        {
            self.points.pop_front();
        }
        let &(t0, n0) = self.points.front()?;
        let span = now.duration_since(t0);
        (span >= self.window / 2).then(|| total.saturating_sub(n0) as f64 / span.as_secs_f64())
    }
}

/// A reading taken each tick, over the last `window`: its p90 (what a pool sized to it meets
/// nine times in ten — the margin measured from how the reading moves, not chosen) and its
/// trend (the least-squares slope, per second: where it is heading).
#[derive(Debug)]
pub struct Trend {
    window: Duration,
    points: VecDeque<(Instant, f64)>,
}

/// What a [`Trend`] says of its window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Outlook {
    /// The p90 of the readings.
    pub high: f64,
    /// Their least-squares slope, per second, less its standard error times Student's t at
    /// 97.5% for the points fitted — about two, more for few points (0 where it is within).
    pub slope: f64,
}

impl Trend {
    /// A trend over `window`.
    pub fn new(window: Duration) -> Trend {
        Trend {
            window,
            points: VecDeque::new(),
        }
    }

    /// How far back it looks.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Looks back `window` from the next reading on.
    pub fn set_window(&mut self, window: Duration) {
        self.window = window;
    }

    /// Notes `value` at `now`; the window's reading from its second.
    pub fn observe(&mut self, now: Instant, value: f64) -> Option<Outlook> {
        self.points.push_back((now, value));
        while self
            .points
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > self.window)
        {
            self.points.pop_front();
        }
        let t0 = self.points.front()?.0;
        if self.points.len() < 2 {
            return None;
        }
        // A trend is read over half a window at least; the p90 from the second reading (a
        // pool started far over its load comes down within seconds, not a window).
        let trended = now.duration_since(t0) >= self.window / 2 && self.points.len() >= 3;
        let xy: Vec<(f64, f64)> = self
            .points
            .iter()
            .map(|(t, v)| (t.duration_since(t0).as_secs_f64(), *v))
            .collect();
        let n = xy.len() as f64;
        let (mx, my) = xy
            .iter()
            .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
        let sxx: f64 = xy.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
        let sxy: f64 = xy.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
        let slope = if sxx > 0.0 && trended { sxy / sxx } else { 0.0 };
        // The slope's standard error: a trend counts only as far as it stands out of the
        // readings' noise, or flat load's jitter would read as growth.
        let resid: f64 = xy
            .iter()
            .map(|(x, y)| (y - my - slope * (x - mx)).powi(2))
            .sum();
        let se = if sxx > 0.0 && trended {
            (resid / (n - 2.0) / sxx).sqrt()
        } else {
            0.0
        };
        let mut values: Vec<f64> = xy.iter().map(|p| p.1).collect();
        values.sort_by(f64::total_cmp);
        let at = ((values.len() as f64 * 0.9).ceil() as usize).clamp(1, values.len()) - 1;
        Some(Outlook {
            high: values[at],
            slope: match se > 0.0 {
                true => slope.signum() * (slope.abs() - t_975(n - 2.0) * se).max(0.0),
                false => slope,
            },
        })
    }
}

/// Student's t at 97.5% for `df` degrees of freedom (within 1% beyond the table).
fn t_975(df: f64) -> f64 {
    const TABLE: [f64; 10] = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23];
    match df as usize {
        0 => f64::INFINITY,
        d @ 1..=10 => TABLE[d - 1],
        _ => 1.96 + 2.4 / df,
    }
}

/// A reading's highest value over the last `window`, from readings at ticks.
#[derive(Debug)]
pub struct Peak {
    window: Duration,
    since: Option<Instant>,
    points: VecDeque<(Instant, u64)>,
}

impl Peak {
    /// A peak over `window`.
    pub fn new(window: Duration) -> Peak {
        Peak {
            window,
            since: None,
            points: VecDeque::new(),
        }
    }

    /// Notes `value` at `now`; the highest over the window, once readings cover a whole one.
    pub fn observe(&mut self, now: Instant, value: u64) -> Option<u64> {
        let since = *self.since.get_or_insert(now);
        while self
            .points
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > self.window)
        {
            self.points.pop_front();
        }
        // Kept falling: a value under a later one never is the peak.
        while self.points.back().is_some_and(|&(_, v)| v <= value) {
            self.points.pop_back();
        }
        self.points.push_back((now, value));
        let full = now.duration_since(since) >= self.window;
        full.then(|| self.points.front().map_or(value, |p| p.1))
    }
}
/// What the router measures for the planner (recorded on the request path, read each tick).
pub struct Signals {
    /// Every request: arrival at the router to its first token (what clients see).
    pub ttft: Mutex<Window>,
    /// Prefill pool: decode reservation to first token, remote prefills only.
    pub prefill_ttft: Mutex<Window>,
    /// Decode pool: gaps between tokens.
    pub itl: Mutex<Window>,
    /// Decode pool: time requests waited for a decode worker with room.
    pub admission: Mutex<Window>,
    /// Prompt tokens sent to the prefill pool and not yet done.
    pub prefill_pending_tokens: AtomicU64,
    /// Prompt tokens of the requests that arrived to be prefilled by the pool, ever (its
    /// demand, as a rate; the planner takes off the share the engines themselves report cached
    /// — not the index's view of the caches, which said a mock pool needed one replica where it
    /// needed two). Counted on arrival, not when sent: a line waiting for decode room holds the
    /// sending back, and in a simulated day's ramp the pool saw its demand only once the decode
    /// pool let it through.
    pub prefill_arrived_tokens: AtomicU64,
}

impl Signals {
    /// Signals over `window`.
    pub fn new(window: Duration) -> Signals {
        Signals {
            ttft: Mutex::new(Window::new(window)),
            prefill_ttft: Mutex::new(Window::new(window)),
            itl: Mutex::new(Window::new(window)),
            admission: Mutex::new(Window::new(window)),
            prefill_pending_tokens: AtomicU64::new(0),
            prefill_arrived_tokens: AtomicU64::new(0),
        }
    }

    /// A request arrived whose prompt of `tokens` the prefill pool is to compute.
    pub fn prefill_arrived(&self, tokens: u64) {
        self.prefill_arrived_tokens
            .fetch_add(tokens, Ordering::SeqCst);
    }

    /// A prompt of `tokens` went to the prefill pool; the guard marks it done when dropped.
    pub fn prefill_started(self: &Arc<Self>, tokens: u64) -> PendingPrefill {
        self.prefill_pending_tokens
            .fetch_add(tokens, Ordering::SeqCst);
        PendingPrefill(self.clone(), tokens)
    }
}

/// A prompt in the prefill pool, counted as pending until dropped (finished or given up).
pub struct PendingPrefill(Arc<Signals>, u64);

impl std::fmt::Debug for PendingPrefill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PendingPrefill({} tokens)", self.1)
    }
}

impl Drop for PendingPrefill {
    fn drop(&mut self) {
        self.0
            .prefill_pending_tokens
            .fetch_sub(self.1, Ordering::SeqCst);
    }
}
