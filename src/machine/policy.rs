//! Time policy: the durations behind the table's timers, the retry backoff, and the wake-up time.
//!
//! The table says *which* state waits for *which* timer (`timer:` of a state) and which rows
//! schedule a retry (`schedule_retry`); this module says *how long*, from the operator's
//! configuration. Pure functions of the state, the time and the configuration: the caller passes
//! `now`, so the clock never hides inside a decision.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

use super::table::{State, TimerKind};

/// The durations of the table's timers, plus how often a waiting state is looked at again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timers {
    /// `provisioning_timeout`: a new instance must pass its first health check within this.
    pub provisioning_timeout: Duration,
    /// `degraded_timeout`: a proxy failing its health checks this long is replaced (budgets allowing).
    pub degraded_timeout: Duration,
    /// `drain_timeout`: how long a drain waits for leases, and how often an unfinished delete is retried.
    pub drain_timeout: Duration,
    /// How often a state that waits for the world (a boot, a drain, a delete) is looked at again
    /// when nothing wakes the reconciler earlier.
    pub poll: Duration,
    /// Steady-state resync of states that wait for nothing (watches and health verdicts wake them).
    pub resync: Duration,
}

impl Default for Timers {
    fn default() -> Self {
        Timers {
            provisioning_timeout: TimerKind::ProvisioningTimeout.default_duration(),
            degraded_timeout: TimerKind::DegradedTimeout.default_duration(),
            drain_timeout: TimerKind::DrainTimeout.default_duration(),
            poll: Duration::from_secs(10),
            resync: Duration::from_secs(300),
        }
    }
}

impl Timers {
    /// The configured duration of `timer`.
    pub fn duration(&self, timer: TimerKind) -> Duration {
        match timer {
            TimerKind::ProvisioningTimeout => self.provisioning_timeout,
            TimerKind::DegradedTimeout => self.degraded_timeout,
            TimerKind::DrainTimeout => self.drain_timeout,
        }
    }

    /// Whether the timer of `state` has run out at `now` (never for a state without a timer).
    pub fn expired(&self, state: &State, now: Timestamp) -> bool {
        state
            .phase()
            .timer()
            .is_some_and(|timer| remaining(state.since(), self.duration(timer), now).is_zero())
    }

    /// Time left until the timer of `state` runs out, if it has one.
    pub fn remaining(&self, state: &State, now: Timestamp) -> Option<Duration> {
        let timer = state.phase().timer()?;
        Some(remaining(state.since(), self.duration(timer), now))
    }
}

/// Exponential retry backoff with jitter and a cap: `initial`, doubling per consecutive failure,
/// at most `cap`; each delay is drawn uniformly from [delay × (1 − jitter), delay].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub initial: Duration,
    /// The longest delay.
    pub cap: Duration,
    /// Fraction of each delay that is randomised away (0 = none), so that a pool that failed
    /// together does not retry in lock-step.
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(10),
            cap: Duration::from_secs(300),
            jitter: 0.1,
        }
    }
}

impl Backoff {
    /// The undrawn delay after `failures` consecutive failures (1 = the first).
    pub fn nominal(&self, failures: u32) -> Duration {
        let exponent = failures.saturating_sub(1).min(20);
        self.initial.saturating_mul(1u32 << exponent).min(self.cap)
    }

    /// The delay after `failures` consecutive failures, with `unit` (in [0, 1)) drawing the jitter.
    pub fn delay(&self, failures: u32, unit: f64) -> Duration {
        let nominal = self.nominal(failures);
        let jitter = self.jitter.clamp(0.0, 1.0) * unit.clamp(0.0, 1.0);
        nominal.mul_f64(1.0 - jitter)
    }
}

/// Time left until `since + limit`, zero when past (a clock going backwards counts as no time elapsed).
pub fn remaining(since: Timestamp, limit: Duration, now: Timestamp) -> Duration {
    let elapsed = now.duration_since(since);
    let elapsed = if elapsed.is_negative() {
        SignedDuration::ZERO
    } else {
        elapsed
    };
    let elapsed = Duration::try_from(elapsed).unwrap_or(Duration::ZERO);
    limit.saturating_sub(elapsed)
}

/// Time until `at`, zero when past.
pub fn until(at: Timestamp, now: Timestamp) -> Duration {
    Duration::try_from(at.duration_since(now)).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::Phase;

    use crate::machine::test_time as t;

    /// A timer expires at its limit (provisioning: 600 s), a clock going backwards counts as no
    /// time elapsed, and a state without a timer never expires.
    #[test]
    fn timers_expire_at_the_limit_and_clock_skew_counts_as_no_time_elapsed() {
        let timers = Timers::default();
        // (phase, entered at, now, expired)
        let cases = [
            (Phase::Provisioning, 0, 599, false),
            (Phase::Provisioning, 0, 600, true),
            (Phase::Degraded, 100, 0, false),
            (Phase::Degraded, 100, 1000, true),
            (Phase::Pending, 0, 1_000_000, false),
        ];
        for (phase, since, now, expired) in cases {
            let state = State::new(phase, t(since));
            assert_eq!(
                timers.expired(&state, t(now)),
                expired,
                "{phase} since {since}, at {now}"
            );
        }
        let provisioning = State::new(Phase::Provisioning, t(0));
        assert_eq!(
            timers.remaining(&provisioning, t(595)),
            Some(Duration::from_secs(5))
        );
        assert_eq!(timers.remaining(&State::new(Phase::Healthy, t(0)), t(595)), None);
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_jitter_only_shortens() {
        let backoff = Backoff::default();
        let nominal: Vec<u64> = (1..=7).map(|n| backoff.nominal(n).as_secs()).collect();
        assert_eq!(nominal, [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(backoff.delay(3, 0.0), Duration::from_secs(40));
        assert_eq!(backoff.delay(3, 1.0), Duration::from_secs(36));
        assert_eq!(backoff.nominal(u32::MAX), Duration::from_secs(300));
    }
}
