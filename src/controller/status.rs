//! The status: what one reconcile reads back as its starting [`Record`], and the status it
//! writes from the record at the end. Pure. The status is written only when it differs from what
//! is stored, so a steady-state resync writes nothing.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use crate::{
    api::ProxyStatus,
    machine::{Phase, State, reason},
    provider::Endpoint,
};

/// The operator's finalizer on Proxies.
pub const FINALIZER: &str = "crawl.example.com/proxy-cleanup";

/// Condition types.
pub const READY: &str = "Ready";
/// The instance exists and runs.
pub const PROVISIONED: &str = "Provisioned";
/// The health checks pass.
pub const HEALTHY: &str = "Healthy";
/// The spec can be realised (provider configured, Secrets usable).
pub const SPEC_VALID: &str = "SpecValid";
/// Present (True) while health-driven replacement of this proxy is paused by the pool's brake.
pub const REMEDIATION_PAUSED: &str = "RemediationPaused";

/// How far the delete of the current instance got since it began leaving (replacing or
/// deleting). Kept in the status as the reason of `Provisioned=False`, so a restart does not
/// mistake a retried delete for a first one, nor a delete never sent for one that got stuck.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeleteProgress {
    /// No delete was sent yet (the drain may still run).
    #[default]
    NotSent,
    /// Deletes were sent, and the provider accepted none (it failed, or was down).
    Attempted,
    /// The provider accepted a delete; the instance may still be terminating.
    Accepted,
}

impl DeleteProgress {
    /// The `Provisioned=False` reason in `phase` (replacing or deleting).
    fn reason(self, phase: Phase) -> &'static str {
        match (self, phase) {
            (DeleteProgress::Accepted, _) => "DeleteAccepted",
            (DeleteProgress::Attempted, _) => "DeleteAttempted",
            (DeleteProgress::NotSent, Phase::Replacing) => "Replacing",
            (DeleteProgress::NotSent, _) => "Deleting",
        }
    }

    /// The further of the two (a failed retry does not undo an accepted delete).
    pub fn max_with(self, other: DeleteProgress) -> DeleteProgress {
        let rank = |p: DeleteProgress| match p {
            DeleteProgress::NotSent => 0,
            DeleteProgress::Attempted => 1,
            DeleteProgress::Accepted => 2,
        };
        if rank(other) > rank(self) { other } else { self }
    }

    fn from_reason(reason: &str) -> DeleteProgress {
        match reason {
            "DeleteAccepted" => DeleteProgress::Accepted,
            "DeleteAttempted" => DeleteProgress::Attempted,
            _ => DeleteProgress::NotSent,
        }
    }
}

/// What one reconcile knows and changes about a Proxy's status: the machine state plus what the
/// effects record. Built from the stored status, updated by the executors, written at the end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The machine state.
    pub state: State,
    /// Reason of the `Ready` condition (the last row that set conditions).
    pub ready_reason: String,
    /// Message of the `Ready` condition; never secret content.
    pub ready_message: String,
    /// What is wrong with the spec, as reported in `SpecValid=False`; `None`: reported valid.
    pub spec_problem: Option<String>,
    /// Provider ID of the current instance.
    pub provider_id: Option<String>,
    /// Where the current instance is reached (`status.endpoint` as text).
    pub endpoint: Option<Endpoint>,
    /// Spec hash the current instance was built from.
    pub spec_hash: Option<String>,
    /// `Provisioned=True` was reported (the instance was seen running).
    pub instance_running: bool,
    /// Consecutive failed provider calls.
    pub retry_attempts: u32,
    /// When the next attempt may start.
    pub next_attempt: Option<Timestamp>,
    /// When a health verdict last changed the status.
    pub last_health_check_time: Option<Timestamp>,
    /// How far the delete of the current instance got (replacing and deleting only).
    pub delete_progress: DeleteProgress,
    /// The last recycle request acted on (`status.lastRecycle`).
    pub last_recycle: Option<String>,
}

impl Record {
    /// The record a stored status describes; a new Proxy starts `pending` at `now`.
    pub fn from_status(status: Option<&ProxyStatus>, now: Timestamp) -> Result<Record, String> {
        let Some(status) = status else {
            return Ok(Record::new(now));
        };
        let state = match status.phase.as_deref() {
            None => State::new(Phase::INITIAL, now),
            Some(name) => {
                let phase =
                    Phase::from_name(name).ok_or_else(|| format!("unknown phase {name:?} in status"))?;
                State::new(phase, status.phase_since.as_ref().map_or(now, |t| t.0))
            }
        };
        let ready = find(&status.conditions, READY);
        let spec_valid = find(&status.conditions, SPEC_VALID);
        let provisioned = find(&status.conditions, PROVISIONED);
        let delete_progress = match state.phase() {
            Phase::Replacing | Phase::Deleting => provisioned.map_or(DeleteProgress::NotSent, |c| {
                DeleteProgress::from_reason(&c.reason)
            }),
            _ => DeleteProgress::NotSent,
        };
        Ok(Record {
            state,
            ready_reason: ready.map_or_else(|| "Accepted".to_owned(), |c| c.reason.clone()),
            ready_message: ready.map(|c| c.message.clone()).unwrap_or_default(),
            spec_problem: spec_valid
                .filter(|c| c.status == "False")
                .map(|c| c.message.clone()),
            provider_id: status.provider_id.clone(),
            // Written by `to_status` from an `Endpoint`; text that is not one names no endpoint.
            endpoint: status.endpoint.as_deref().and_then(|e| e.parse().ok()),
            spec_hash: status.spec_hash.clone(),
            instance_running: provisioned.is_some_and(|c| c.status == "True"),
            retry_attempts: status.retry_attempts.map_or(0, |n| u32::try_from(n).unwrap_or(0)),
            next_attempt: status.next_attempt_time.as_ref().map(|t| t.0),
            last_health_check_time: status.last_health_check_time.as_ref().map(|t| t.0),
            delete_progress,
            last_recycle: status.last_recycle.clone(),
        })
    }

    /// The record of a Proxy never reconciled.
    pub fn new(now: Timestamp) -> Record {
        Record {
            state: State::new(Phase::INITIAL, now),
            ready_reason: "Accepted".to_owned(),
            ready_message: String::new(),
            spec_problem: None,
            provider_id: None,
            endpoint: None,
            spec_hash: None,
            instance_running: false,
            retry_attempts: 0,
            next_attempt: None,
            last_health_check_time: None,
            delete_progress: DeleteProgress::NotSent,
            last_recycle: None,
        }
    }

    /// Record `instance` as the current one: its ID, endpoint and the hash it was built from
    /// (its own stamp, else `requested`, the hash it was created for).
    pub fn point_at(&mut self, instance: &crate::provider::Instance, requested: Option<&str>) {
        self.provider_id = Some(instance.id.to_string());
        self.endpoint = instance.endpoint.clone();
        self.spec_hash = instance
            .spec_hash
            .clone()
            .or_else(|| requested.map(str::to_owned));
        self.delete_progress = DeleteProgress::NotSent;
    }

    /// Forget the current instance (it is gone).
    pub fn forget_instance(&mut self) {
        self.provider_id = None;
        self.endpoint = None;
        self.spec_hash = None;
        self.instance_running = false;
        self.delete_progress = DeleteProgress::NotSent;
    }

    /// The status this record stands for; conditions keep their transition times from
    /// `previous` when their status did not change.
    pub fn to_status(&self, previous: &ProxyStatus, generation: Option<i64>, now: Timestamp) -> ProxyStatus {
        let phase = self.state.phase();
        let (provisioned, provisioned_reason) = match phase {
            Phase::Healthy | Phase::Degraded => ("True", "InstanceRunning"),
            Phase::Provisioning if self.instance_running => ("True", "InstanceRunning"),
            Phase::Provisioning => ("False", "InstanceStarting"),
            Phase::Replacing | Phase::Deleting => ("False", self.delete_progress.reason(phase)),
            Phase::Deleted => ("False", "Deleting"),
            Phase::Pending => ("False", "NotProvisioned"),
        };
        let (healthy, healthy_reason) = match phase {
            Phase::Healthy => ("True", "HealthCheckPassing"),
            Phase::Degraded => ("False", "HealthCheckFailing"),
            _ => ("Unknown", "NotChecked"),
        };
        let ready = if phase == Phase::Healthy { "True" } else { "False" };
        let (spec_valid, spec_reason, spec_message) = match &self.spec_problem {
            None => ("True", "Valid", ""),
            Some(problem) => ("False", reason::INVALID_SPEC, problem.as_str()),
        };
        let old = &previous.conditions;
        let make = |type_: &str, status: &str, reason: &str, message: &str| {
            condition(old, type_, status, reason, message, generation, now)
        };
        let mut conditions = vec![
            make(READY, ready, &self.ready_reason, &self.ready_message),
            make(PROVISIONED, provisioned, provisioned_reason, ""),
            make(HEALTHY, healthy, healthy_reason, ""),
            make(SPEC_VALID, spec_valid, spec_reason, spec_message),
        ];
        if phase == Phase::Degraded && self.ready_reason == reason::REMEDIATION_PAUSED {
            conditions.push(make(
                REMEDIATION_PAUSED,
                "True",
                reason::REMEDIATION_PAUSED,
                &self.ready_message,
            ));
        }
        ProxyStatus {
            phase: Some(phase.as_str().to_owned()),
            phase_since: Some(Time(self.state.since())),
            retry_attempts: (self.retry_attempts > 0)
                .then(|| i32::try_from(self.retry_attempts).unwrap_or(i32::MAX)),
            next_attempt_time: self.next_attempt.map(Time),
            conditions,
            observed_generation: generation,
            spec_hash: self.spec_hash.clone(),
            provider_id: self.provider_id.clone(),
            endpoint: self.endpoint.as_ref().map(ToString::to_string),
            last_health_check_time: self.last_health_check_time.map(Time),
            last_recycle: self.last_recycle.clone(),
        }
    }
}

fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// A condition; its transition time moves only when its status does.
fn condition(
    previous: &[Condition],
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: generation,
        last_transition_time,
    }
}

/// The phase a stored status reports; a new Proxy (or an unknown phase name) counts as the
/// initial phase.
pub fn phase_of(status: Option<&ProxyStatus>) -> Phase {
    status
        .and_then(|s| s.phase.as_deref())
        .and_then(Phase::from_name)
        .unwrap_or(Phase::INITIAL)
}

/// Proxies per reported phase name (`pending` for a Proxy without one), as `epo_proxies`
/// counts them in both modes.
pub fn count_phases<'a>(
    statuses: impl IntoIterator<Item = Option<&'a ProxyStatus>>,
) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for status in statuses {
        let phase = status
            .and_then(|s| s.phase.clone())
            .unwrap_or_else(|| "pending".to_owned());
        *counts.entry(phase).or_insert(0) += 1;
    }
    counts
}

/// [`count_phases`] kept up to date one Proxy at a time: a Proxy's reported phase is noted when
/// it may have changed ([`Self::note`], [`Self::forget`]), so keeping the counts costs what
/// changed, not a pass over every Proxy (standalone mode refreshed its progress line that way
/// on every step: at 10,000 proxies, the largest share of its periodic work).
#[derive(Debug)]
pub struct PhaseTally<K> {
    by_key: std::collections::HashMap<K, String>,
    counts: std::collections::BTreeMap<String, usize>,
}

impl<K> Default for PhaseTally<K> {
    fn default() -> Self {
        Self {
            by_key: std::collections::HashMap::new(),
            counts: std::collections::BTreeMap::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq + Clone> PhaseTally<K> {
    /// Notes `key`'s status as it is now; returns whether the counts changed.
    pub fn note(&mut self, key: &K, status: Option<&ProxyStatus>) -> bool {
        let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("pending");
        match self.by_key.get_mut(key) {
            Some(have) if have == phase => false,
            Some(have) => {
                let old = std::mem::replace(have, phase.to_owned());
                self.decrement(&old);
                *self.counts.entry(phase.to_owned()).or_insert(0) += 1;
                true
            }
            None => {
                self.by_key.insert(key.clone(), phase.to_owned());
                *self.counts.entry(phase.to_owned()).or_insert(0) += 1;
                true
            }
        }
    }

    /// Notes that `key` is gone; returns whether the counts changed.
    pub fn forget(&mut self, key: &K) -> bool {
        match self.by_key.remove(key) {
            Some(old) => {
                self.decrement(&old);
                true
            }
            None => false,
        }
    }

    fn decrement(&mut self, phase: &str) {
        if let Some(n) = self.counts.get_mut(phase) {
            *n -= 1;
            if *n == 0 {
                // As `count_phases`: only phases some Proxy is in.
                self.counts.remove(phase);
            }
        }
    }

    /// Proxies per reported phase name, as [`count_phases`] over every noted Proxy.
    pub fn counts(&self) -> &std::collections::BTreeMap<String, usize> {
        &self.counts
    }
}

/// The stored `Ready` condition, if any.
pub fn ready_condition(status: Option<&ProxyStatus>) -> Option<&Condition> {
    find(&status?.conditions, READY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phase_name(status: Option<&ProxyStatus>) -> String {
        count_phases([status]).into_keys().next().unwrap()
    }

    /// The tally, fed each change, always equals counting every Proxy again.
    #[test]
    fn a_phase_tally_fed_the_changes_equals_counting_all() {
        let phases = [
            None,
            Some("pending"),
            Some("healthy"),
            Some("degraded"),
            Some("deleting"),
        ];
        let status = |i: usize| {
            phases[i].map(|p| ProxyStatus {
                phase: Some(p.to_owned()),
                ..ProxyStatus::default()
            })
        };
        let mut rng = fastrand::Rng::with_seed(3);
        let mut all: std::collections::HashMap<u32, Option<ProxyStatus>> = std::collections::HashMap::new();
        let mut tally = PhaseTally::default();
        for _ in 0..5_000 {
            let key = rng.u32(..50);
            if rng.u8(..5) == 0 {
                let had = all.remove(&key).is_some();
                assert_eq!(tally.forget(&key), had, "a count changes when a noted Proxy goes");
            } else {
                let s = status(rng.usize(..phases.len()));
                let same = all.get(&key).map(|had| phase_name(had.as_ref())) == Some(phase_name(s.as_ref()));
                assert_eq!(
                    tally.note(&key, s.as_ref()),
                    !same,
                    "a count changes when the phase does"
                );
                all.insert(key, s);
            }
            assert_eq!(tally.counts(), &count_phases(all.values().map(Option::as_ref)));
        }
    }

    use crate::machine::test_time as t;

    /// `record` written as the status of generation `generation`, then read back.
    fn read_back(record: &Record, generation: i64) -> Record {
        let status = record.to_status(&ProxyStatus::default(), Some(generation), t(6));
        Record::from_status(Some(&status), t(99)).expect("readable")
    }

    #[test]
    fn a_record_survives_the_round_trip_through_the_status() {
        let mut record = Record::new(t(0));
        record.state = State::new(Phase::Provisioning, t(5));
        record.ready_reason = reason::CREATE_FAILED.to_owned();
        record.ready_message = "provider error: boom".to_owned();
        record.spec_problem = Some("CloudInitSecretUnusable: gone".to_owned());
        record.retry_attempts = 2;
        record.next_attempt = Some(t(30));
        record.instance_running = true;
        assert_eq!(read_back(&record, 3), record);
    }

    #[test]
    fn how_far_a_delete_got_survives_the_round_trip() {
        for progress in [
            DeleteProgress::NotSent,
            DeleteProgress::Attempted,
            DeleteProgress::Accepted,
        ] {
            for phase in [Phase::Replacing, Phase::Deleting] {
                let mut record = Record::new(t(0));
                record.state = State::new(phase, t(5));
                record.delete_progress = progress;
                assert_eq!(read_back(&record, 1), record);
            }
        }
    }

    #[test]
    fn unchanged_conditions_keep_their_transition_time() {
        let record = Record::new(t(0));
        let first = record.to_status(&ProxyStatus::default(), Some(1), t(1));
        let second = record.to_status(&first, Some(1), t(50));
        assert_eq!(first, second);
    }

    #[test]
    fn an_unknown_phase_is_an_error_not_a_restart() {
        let status = ProxyStatus {
            phase: Some("booting".to_owned()),
            ..ProxyStatus::default()
        };
        assert!(Record::from_status(Some(&status), t(0)).is_err());
    }
}
