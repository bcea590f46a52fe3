//! Pool budgets: how many of a provider instance's proxies may be unavailable or replaced at once.
//!
//! A pool is every Proxy placed on one provider instance (`spec.provider`). The reconciler keeps
//! the phase of every Proxy it has seen here (seeded by the mode from its store, updated after
//! every reconcile), so the two budget facts are computed from what this process knows *now*, not
//! from a cache that lags its own writes:
//!
//! - `replacement_budget_left`: fewer than `maxUnavailable` of the pool are unavailable (pending,
//!   provisioning or replacing), or this proxy already is (replacing it adds nothing). Like a
//!   Deployment's rolling update: a shared Secret change replaces the pool a slice at a time.
//! - `remediation_allowed`: at most `maxUnhealthy` of the pool (rounded down, at least one proxy)
//!   is degraded. Like Cluster API's
//!   MachineHealthCheck: when many fail together the cause is probably shared (a health URL, the
//!   network), and replacing them all would only take the remaining capacity down.
//!
//! Checking the replacement budget also reserves a slot (the proxy counts as replacing until its
//! reconcile ends), so parallel reconciles cannot overshoot it.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
};

use crate::{api::ProxyKey, machine::Phase};

/// The pool limits, in percent of the pool's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budgets {
    /// At most this share of a pool may be unavailable at once (rounded down, at least one proxy).
    pub max_unavailable_percent: u32,
    /// Health-driven replacement pauses while more than this share of a pool is degraded.
    pub max_unhealthy_percent: u32,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets {
            max_unavailable_percent: 25,
            max_unhealthy_percent: 40,
        }
    }
}

/// The budget facts of one proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolFacts {
    /// See the module docs.
    pub replacement_budget_left: bool,
    /// See the module docs.
    pub remediation_allowed: bool,
}

#[derive(Clone, Debug)]
struct Member {
    provider: String,
    phase: Phase,
}

/// Running counts of one pool, kept in step with its members so a lookup costs O(1) however
/// large the pool (a full pass over 10,000 Proxies must stay linear).
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    total: u64,
    unavailable: u64,
    degraded: u64,
}

impl Counts {
    fn add(&mut self, phase: Phase, sign: i64) {
        let apply = |n: &mut u64| *n = n.saturating_add_signed(sign);
        if in_pool(phase) {
            apply(&mut self.total);
        }
        if unavailable(phase) {
            apply(&mut self.unavailable);
        }
        if phase == Phase::Degraded {
            apply(&mut self.degraded);
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    members: HashMap<ProxyKey, Member>,
    pools: HashMap<String, Counts>,
}

impl Inner {
    fn put(&mut self, key: &ProxyKey, provider: &str, phase: Option<Phase>) {
        if let Some(old) = self.members.remove(key) {
            self.pools.entry(old.provider).or_default().add(old.phase, -1);
        }
        if let Some(phase) = phase {
            self.pools.entry(provider.to_owned()).or_default().add(phase, 1);
            self.members.insert(
                key.clone(),
                Member {
                    provider: provider.to_owned(),
                    phase,
                },
            );
        }
    }
}

/// The phases of every known Proxy, by pool.
#[derive(Debug, Default)]
pub struct Pools {
    inner: Mutex<Inner>,
}

fn unavailable(phase: Phase) -> bool {
    matches!(phase, Phase::Pending | Phase::Provisioning | Phase::Replacing)
}

fn in_pool(phase: Phase) -> bool {
    !matches!(phase, Phase::Deleting | Phase::Deleted)
}

impl Pools {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        crate::sync::lock(&self.inner)
    }

    /// Records that `key` (on `provider`) is in `phase`; a deleted Proxy leaves its pool.
    pub fn set(&self, key: &ProxyKey, provider: &str, phase: Phase) {
        self.lock()
            .put(key, provider, (phase != Phase::Deleted).then_some(phase));
    }

    /// Records every `(key, provider, phase)` not known yet (a mode's store at start).
    pub fn seed(&self, known: impl IntoIterator<Item = (ProxyKey, String, Phase)>) {
        let mut inner = self.lock();
        for (key, provider, phase) in known {
            if !inner.members.contains_key(&key) {
                inner.put(&key, &provider, Some(phase));
            }
        }
    }

    /// The budget facts of `key` in `phase`. With `reserve`, a granted replacement budget marks
    /// `key` replacing at once (the end of its reconcile records its real phase).
    pub fn facts(
        &self,
        key: &ProxyKey,
        provider: &str,
        phase: Phase,
        budgets: &Budgets,
        reserve: bool,
    ) -> PoolFacts {
        let mut inner = self.lock();
        // Count this proxy with the phase it has now, whatever was recorded before.
        inner.put(key, provider, Some(phase));
        let counts = inner.pools.get(provider).copied().unwrap_or_default();
        let unavailable_others = counts.unavailable - u64::from(unavailable(phase));
        let limit = (counts.total * u64::from(budgets.max_unavailable_percent) / 100).max(1);
        let replacement_budget_left = unavailable(phase) || unavailable_others < limit;
        // At least one degraded proxy may always be replaced: a pool of one must heal too.
        let remediation_allowed =
            counts.degraded <= (counts.total * u64::from(budgets.max_unhealthy_percent) / 100).max(1);
        if reserve && replacement_budget_left && !unavailable(phase) {
            inner.put(key, provider, Some(Phase::Replacing));
        }
        PoolFacts {
            replacement_budget_left,
            remediation_allowed,
        }
    }

    /// How many proxies of `provider` are in each phase (for metrics and the status page).
    pub fn counts(&self, provider: &str) -> HashMap<Phase, usize> {
        let mut counts = HashMap::new();
        for member in self.lock().members.values().filter(|m| m.provider == provider) {
            *counts.entry(member.phase).or_insert(0) += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: usize) -> ProxyKey {
        ProxyKey::new("crawl", &format!("p{i}"))
    }

    fn pool(phases: &[Phase]) -> Pools {
        let pools = Pools::default();
        pools.seed(
            phases
                .iter()
                .enumerate()
                .map(|(i, p)| (key(i), "kvm".to_owned(), *p)),
        );
        pools
    }

    #[test]
    fn a_quarter_of_twenty_may_be_replaced_and_reservations_count() {
        let pools = pool(&[Phase::Healthy; 20]);
        let budgets = Budgets::default();
        let granted: Vec<bool> = (0..20)
            .map(|i| {
                pools
                    .facts(&key(i), "kvm", Phase::Healthy, &budgets, true)
                    .replacement_budget_left
            })
            .collect();
        assert_eq!(granted.iter().filter(|g| **g).count(), 5, "{granted:?}");
        // A proxy already unavailable may always be replaced: it takes nothing more down.
        assert!(
            pools
                .facts(&key(0), "kvm", Phase::Replacing, &budgets, false)
                .replacement_budget_left
        );
        // Other pools are not affected.
        assert!(
            pools
                .facts(&key(99), "other", Phase::Healthy, &budgets, false)
                .replacement_budget_left
        );
    }

    #[test]
    fn the_brake_holds_while_too_many_are_degraded() {
        let budgets = Budgets::default();
        let pools = pool(&[Phase::Degraded; 20]);
        assert!(
            !pools
                .facts(&key(0), "kvm", Phase::Degraded, &budgets, false)
                .remediation_allowed
        );
        let mut phases = vec![Phase::Healthy; 20];
        phases[..8].fill(Phase::Degraded);
        let pools = pool(&phases);
        assert!(
            pools
                .facts(&key(0), "kvm", Phase::Degraded, &budgets, false)
                .remediation_allowed
        );
        phases[8] = Phase::Degraded;
        let pools = pool(&phases);
        assert!(
            !pools
                .facts(&key(0), "kvm", Phase::Degraded, &budgets, false)
                .remediation_allowed
        );
    }

    #[test]
    fn a_pool_of_one_can_always_replace_its_proxy() {
        let pools = Pools::default();
        let facts = pools.facts(&key(0), "kvm", Phase::Healthy, &Budgets::default(), true);
        assert!(facts.replacement_budget_left);
        let facts = pools.facts(&key(1), "solo", Phase::Degraded, &Budgets::default(), false);
        assert!(facts.remediation_allowed);
    }
}
