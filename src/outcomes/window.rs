//! The latency window: the last [`WINDOW`] samples of a (proxy, domain) pair, and their median
//! and 95th percentile by nearest rank.
//!
//! Why the last N samples rather than a decaying sketch: it is exact for what it holds, its
//! size is fixed (256 bytes), it forgets a proxy's slow past as soon as N faster answers came
//! (what a ban rule wants to see), and a reader sorts at most 64 numbers. A sketch would pay off
//! for long-run percentiles over millions of samples, which nobody here asks for.

/// Samples a window keeps.
pub const WINDOW: usize = 64;

/// The last [`WINDOW`] latencies in milliseconds, oldest overwritten first.
#[derive(Clone, Debug)]
pub(super) struct Window {
    samples: [u32; WINDOW],
    /// Where the next sample goes.
    next: u8,
    /// Samples held (up to [`WINDOW`]).
    len: u8,
}

impl Default for Window {
    fn default() -> Self {
        Self {
            samples: [0; WINDOW],
            next: 0,
            len: 0,
        }
    }
}

/// Median and 95th percentile of a window, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Quantiles {
    /// The median (nearest rank: the lower one of an even count).
    pub p50: u32,
    /// The 95th percentile (nearest rank).
    pub p95: u32,
    /// Samples they were taken over.
    pub samples: u32,
}

impl Window {
    /// Adds `ms`, forgetting the oldest sample once full.
    pub(super) fn push(&mut self, ms: u32) {
        self.samples[usize::from(self.next)] = ms;
        self.next = ((usize::from(self.next) + 1) % WINDOW) as u8;
        self.len = (usize::from(self.len) + 1).min(WINDOW) as u8;
    }

    /// The samples held, in no particular order.
    fn held(&self) -> &[u32] {
        &self.samples[..usize::from(self.len)]
    }

    /// Median and p95 of the samples held; `None` while empty.
    pub(super) fn quantiles(&self) -> Option<Quantiles> {
        if self.len == 0 {
            return None;
        }
        let mut sorted = [0u32; WINDOW];
        let held = self.held();
        let sorted = &mut sorted[..held.len()];
        sorted.copy_from_slice(held);
        sorted.sort_unstable();
        Some(Quantiles {
            p50: nearest_rank(sorted, 50),
            p95: nearest_rank(sorted, 95),
            samples: u32::from(self.len),
        })
    }
}

/// The `percent`th percentile of non-empty `sorted` by nearest rank: the smallest sample with
/// at least `percent`% of the samples at or below it.
fn nearest_rank(sorted: &[u32], percent: usize) -> u32 {
    let rank = (percent * sorted.len()).div_ceil(100).max(1);
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn an_empty_window_has_no_quantiles() {
        assert_eq!(Window::default().quantiles(), None);
    }

    #[test]
    fn nearest_rank_on_known_samples() {
        let mut window = Window::default();
        for ms in 1..=20 {
            window.push(ms);
        }
        // 50% of 20 is rank 10; 95% of 20 is rank 19.
        assert_eq!(
            window.quantiles(),
            Some(Quantiles {
                p50: 10,
                p95: 19,
                samples: 20
            })
        );
        let mut one = Window::default();
        one.push(7);
        assert_eq!(one.quantiles().map(|q| (q.p50, q.p95)), Some((7, 7)));
    }

    #[test]
    fn the_window_forgets_the_oldest() {
        let mut window = Window::default();
        // A slow past, then WINDOW fast answers: only the fast ones count.
        for _ in 0..WINDOW {
            window.push(10_000);
        }
        for _ in 0..WINDOW {
            window.push(5);
        }
        assert_eq!(
            window.quantiles().map(|q| (q.p50, q.p95, q.samples)),
            Some((5, 5, 64))
        );
    }

    proptest! {
        /// The quantiles are those of the last WINDOW samples, sorted, by nearest rank.
        #[test]
        fn quantiles_are_those_of_the_last_samples(samples in prop::collection::vec(0u32..100_000, 1..200)) {
            let mut window = Window::default();
            for &ms in &samples {
                window.push(ms);
            }
            let mut last: Vec<u32> = samples[samples.len().saturating_sub(WINDOW)..].to_vec();
            last.sort_unstable();
            let q = window.quantiles().expect("not empty");
            prop_assert_eq!(q.samples as usize, last.len());
            // At least half of the samples at or below the median, and fewer than half below it.
            let at_or_below = |v: u32| last.iter().filter(|&&s| s <= v).count();
            let below = |v: u32| last.iter().filter(|&&s| s < v).count();
            prop_assert!(at_or_below(q.p50) * 2 >= last.len());
            prop_assert!(below(q.p50) * 2 < last.len());
            prop_assert!(at_or_below(q.p95) * 100 >= last.len() * 95);
            prop_assert!(below(q.p95) * 100 < last.len() * 95);
            prop_assert!(q.p50 <= q.p95);
        }
    }
}
