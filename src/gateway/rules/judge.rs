//! [`Judge`]: the rules with their counters, and the proxy-wide steps carried out through
//! their owners (the health engine for out of rotation, [`RecycleRequests`] for a recycle).

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tracing::{info, warn};

use super::{
    Action, RecycleRequests, Rules, Seen,
    escalation::{Counts, Strikes},
    recycle_value,
};
use crate::{health::HealthHandle, lease::ProxyInfo, sync::lock};

/// How the lease of an answer that matched ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseEnd {
    /// Well: a request's own goes back, a session keeps it.
    Keep,
    /// As `banned` for the target's domain, for this time (`None`: the store's ban cooldown).
    Banned(Option<Duration>),
}

/// What a matching answer does.
#[derive(Clone, Debug)]
pub struct Verdict {
    /// The rule that matched.
    pub rule: Arc<str>,
    /// The step its counts reached.
    pub action: Action,
    /// Those counts.
    pub counts: Counts,
    /// Send a GET or HEAD once more through another proxy.
    pub resend: bool,
    /// How the lease ends.
    pub lease: LeaseEnd,
}

/// The rules, their counters, and what the proxy-wide steps act through.
pub struct Judge {
    rules: Rules,
    strikes: Mutex<Strikes>,
    health: Option<HealthHandle>,
    recycle: Option<Arc<dyn RecycleRequests>>,
    serial: AtomicU64,
}

impl Judge {
    /// `rules`, taking proxies out of rotation through `health` and recycling them through
    /// `recycle` (without them those steps only end the lease as a ban does, and say so).
    pub fn new(
        rules: Rules,
        health: Option<HealthHandle>,
        recycle: Option<Arc<dyn RecycleRequests>>,
    ) -> Self {
        Self {
            rules,
            strikes: Mutex::new(Strikes::default()),
            health,
            recycle,
            serial: AtomicU64::new(0),
        }
    }

    /// How many body bytes to read before judging an answer with this head on `proxy`.
    pub fn body_wanted(&self, proxy: &ProxyInfo, seen: &Seen<'_>) -> usize {
        self.rules.body_wanted(&proxy.attributes, seen)
    }

    /// The verdict on an answer through `proxy` for `domain`, if a rule matches; the match is
    /// counted (at `now()`, ms: the clock is read only for a match).
    pub fn decide(
        &self,
        proxy: &ProxyInfo,
        domain: Option<&str>,
        seen: &Seen<'_>,
        now: impl FnOnce() -> u64,
    ) -> Option<Verdict> {
        let (index, rule) = self.rules.judge(&proxy.attributes, seen)?;
        let now = now();
        let counts = lock(&self.strikes).strike(
            index,
            rule.window.as_millis() as u64,
            rule.keep(),
            &proxy.key,
            &proxy.endpoint_text,
            domain,
            now,
        );
        let step = rule.step(counts)?;
        let rest = |action: Option<Action>| match action {
            Some(Action::Cooldown(time)) => LeaseEnd::Banned(Some(time)),
            Some(Action::Ban(time)) => LeaseEnd::Banned(time),
            _ => LeaseEnd::Keep,
        };
        let lease = match step.action {
            Action::Retry => LeaseEnd::Keep,
            Action::Cooldown(_) | Action::Ban(_) => rest(Some(step.action)),
            Action::OutOfRotation(_) | Action::Recycle => rest(rule.domain_rest()),
        };
        Some(Verdict {
            rule: rule.name.clone(),
            action: step.action,
            counts,
            resend: rule.retry || step.action == Action::Retry,
            lease,
        })
    }

    /// Carries out a proxy-wide step of `verdict` on `proxy`: holds it out of rotation, or
    /// asks for a fresh instance (once while a request is outstanding). The gateway runs it
    /// off the request's path.
    pub async fn enforce(&self, proxy: &ProxyInfo, verdict: &Verdict, now: u64) {
        match verdict.action {
            Action::OutOfRotation(time) => {
                let Some(health) = &self.health else {
                    warn!(proxy = %proxy.key, rule = %verdict.rule, "no health engine: out of rotation is not possible here");
                    return;
                };
                let reason = format!(
                    "out of rotation for {} s by gateway rule {} ({} matches within its window)",
                    time.as_secs(),
                    verdict.rule,
                    verdict.counts.proxy
                );
                info!(proxy = %proxy.key, rule = %verdict.rule, seconds = time.as_secs(), "gateway rule takes the proxy out of rotation");
                health.hold_failing(&proxy.key, time, reason).await;
            }
            Action::Recycle => {
                let Some(recycle) = self.recycle.clone() else {
                    warn!(proxy = %proxy.key, rule = %verdict.rule, "no recycle path: the proxy is not recycled");
                    return;
                };
                if !lock(&self.strikes).may_recycle(&proxy.key, &proxy.endpoint_text, now) {
                    return;
                }
                let serial = self.serial.fetch_add(1, Ordering::Relaxed) + 1;
                let value = recycle_value(&verdict.rule, jiff::Timestamp::now(), serial);
                info!(proxy = %proxy.key, rule = %verdict.rule, request = %value, "gateway rule asks for a fresh instance");
                if let Err(error) = recycle.request(&proxy.key, &value).await {
                    warn!(proxy = %proxy.key, %error, "the gateway's recycle request failed; a later match asks again");
                    lock(&self.strikes).recycle_failed(&proxy.key);
                }
            }
            Action::Retry | Action::Cooldown(_) | Action::Ban(_) => {}
        }
    }
}
