//! A prefill worker's measured speed: prompt tokens per second of engine time, a moving
//! average over the steps that computed prompt tokens. The worker reports it in its heartbeats
//! (the router routes prompts and sizes the prefill pool by it); the simulator's workers
//! measure theirs the same way on the virtual clock.

/// Prompt tokens per second of engine time, averaged over busy steps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PromptRate(f64);

impl PromptRate {
    /// A step computed `tokens` prompt tokens in `secs` of engine time (a step without prompt
    /// tokens says nothing of the rate).
    pub fn measure(&mut self, tokens: usize, secs: f64) {
        if tokens > 0 && secs > 0.0 {
            let rate = tokens as f64 / secs;
            self.0 = match self.0 {
                r if r > 0.0 => 0.8 * r + 0.2 * rate,
                _ => rate,
            };
        }
    }

    /// Tokens per second (0 before any step computed a prompt token).
    pub fn per_s(&self) -> f64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_busy_step_sets_the_rate_and_later_ones_move_it_a_fifth() {
        let mut r = PromptRate::default();
        r.measure(0, 1.0);
        assert_eq!(r.per_s(), 0.0, "an idle step says nothing");
        r.measure(100, 1.0);
        assert_eq!(r.per_s(), 100.0);
        r.measure(200, 1.0);
        assert!((r.per_s() - 120.0).abs() < 1e-9);
    }
}
