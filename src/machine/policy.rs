//! Timer policy: pure functions of the state, the time and [`Timers`].
//!
//! The table says *that* a row requeues (`requeue_after`) and names the timeout events; this module
//! says *when*. The controller calls [`due_timer`] on each reconcile to derive
//! `provisioning_timeout` / `degraded_too_long` from the state's `since`, and [`requeue_after`] to
//! turn the `RequeueAfter` effect into a delay. Keeping both here (not in the controller) keeps the
//! clock out of decisions: the caller passes `now`.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

use super::table::{Event, State};

/// Durations the lifecycle depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timers {
    /// Requeue delay while pending (provider down, attempts exhausted).
    pub pending_retry: Duration,
    /// Requeue delay while provisioning (waiting for the instance to run and pass).
    pub provisioning_poll: Duration,
    /// Requeue delay while degraded (to notice `degraded_too_long`).
    pub degraded_poll: Duration,
    /// Requeue delay while replacing or deleting (waiting for a drain or a delete).
    pub draining_poll: Duration,
    /// Steady-state resync for healthy (health results wake the controller anyway).
    pub resync: Duration,
    /// Provisioning longer than this yields `provisioning_timeout`.
    pub provisioning_timeout: Duration,
    /// Degraded longer than this yields `degraded_too_long`.
    pub degraded_max: Duration,
}

impl Default for Timers {
    fn default() -> Self {
        Timers {
            pending_retry: Duration::from_secs(60),
            provisioning_poll: Duration::from_secs(10),
            degraded_poll: Duration::from_secs(30),
            draining_poll: Duration::from_secs(10),
            resync: Duration::from_secs(300),
            provisioning_timeout: Duration::from_secs(600),
            degraded_max: Duration::from_secs(900),
        }
    }
}

/// How long to wait before reconciling again in `state` (the `RequeueAfter` effect's parameter).
///
/// While a timeout is pending the delay is capped so that the timeout event is not noticed late.
pub fn requeue_after(state: &State, now: Timestamp, timers: &Timers) -> Duration {
    let (poll, deadline) = match state {
        State::Pending => (timers.pending_retry, None),
        State::Provisioning { since, .. } => (
            timers.provisioning_poll,
            Some((*since, timers.provisioning_timeout)),
        ),
        State::Healthy { .. } | State::Deleted { .. } => (timers.resync, None),
        State::Degraded { since } => (timers.degraded_poll, Some((*since, timers.degraded_max))),
        State::Replacing { .. } | State::Deleting { .. } => (timers.draining_poll, None),
    };
    match deadline {
        Some((since, limit)) => poll.min(remaining(since, limit, now)),
        None => poll,
    }
}

/// The timeout event that is due in `state` at `now`, if any.
pub fn due_timer(state: &State, now: Timestamp, timers: &Timers) -> Option<Event> {
    match state {
        State::Provisioning { since, .. }
            if remaining(*since, timers.provisioning_timeout, now).is_zero() =>
        {
            Some(Event::ProvisioningTimeout)
        }
        State::Degraded { since } if remaining(*since, timers.degraded_max, now).is_zero() => {
            Some(Event::DegradedTooLong)
        }
        _ => None,
    }
}

/// Time left until `since + limit`, zero when past (a clock going backwards counts as no time elapsed).
fn remaining(since: Timestamp, limit: Duration, now: Timestamp) -> Duration {
    let elapsed = now.duration_since(since);
    let elapsed = if elapsed.is_negative() {
        SignedDuration::ZERO
    } else {
        elapsed
    };
    let elapsed = Duration::try_from(elapsed).unwrap_or(Duration::ZERO);
    limit.saturating_sub(elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_750_000_000 + secs).expect("valid test timestamp")
    }

    #[test]
    fn provisioning_times_out_at_the_limit() {
        let timers = Timers::default();
        let state = State::Provisioning {
            since: t(0),
            attempts: 1,
        };
        assert_eq!(due_timer(&state, t(599), &timers), None);
        assert_eq!(
            due_timer(&state, t(600), &timers),
            Some(Event::ProvisioningTimeout)
        );
        assert_eq!(requeue_after(&state, t(595), &timers), Duration::from_secs(5));
    }

    #[test]
    fn degraded_too_long_and_clock_skew() {
        let timers = Timers::default();
        let state = State::Degraded { since: t(100) };
        assert_eq!(due_timer(&state, t(0), &timers), None);
        assert_eq!(due_timer(&state, t(1000), &timers), Some(Event::DegradedTooLong));
        assert_eq!(due_timer(&State::Pending, t(1_000_000), &timers), None);
    }
}
