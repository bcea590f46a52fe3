//! Metrics (prometheus-client) and logging set-up.
//!
//! Labels are bounded: error categories, phases and transition endpoints come from closed sets.

pub mod admin;
pub mod scrape;
pub mod tracing_setup;

use std::time::Duration;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::machine::Phase;

/// Labels of a reconcile outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or the error category.
    pub result: String,
}

/// Labels of a transition.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    /// Phase before.
    pub from: String,
    /// Phase after.
    pub to: String,
    /// The row's reason (a closed set: `machine::reason::ALL`), so failures such as
    /// `DeleteFailed`, `DeleteStuck` or `RemediationPaused` can be alerted on.
    pub reason: String,
}

/// Labels naming a phase.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// The phase.
    pub phase: String,
}

/// Labels naming a provider instance.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabels {
    /// Provider instance name (from the providers config: a bounded set).
    pub provider: String,
}

/// Labels of instances GC left alone.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LeftAloneLabels {
    /// Provider instance name (from the providers config: a bounded set).
    pub provider: String,
    /// `foreign` or `legacy`.
    pub kind: String,
}

/// Labels of a health probe's outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    /// `ok`, `fail` or `timeout` (see [`ProbeResult`]).
    pub result: &'static str,
}

/// How a health probe through a proxy ended: a closed set, used as the `result` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeResult {
    /// The probe passed.
    Ok,
    /// The probe failed before its timeout (refused, bad status, wrong egress...).
    Fail,
    /// The probe did not finish within its timeout.
    Timeout,
}

impl ProbeResult {
    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Fail => "fail",
            Self::Timeout => "timeout",
        }
    }
}

type ProbeHistograms = Family<ProbeLabels, Histogram, fn() -> Histogram>;

fn probe_histogram() -> Histogram {
    // 5 ms .. ~10 s: a loopback probe up to a slow one near a long timeout.
    Histogram::new(exponential_buckets(0.005, 2.0, 12))
}

/// The health engine's probe durations; cheap to clone (the engine keeps one, see
/// [`crate::health::HealthConfig::probe_metrics`]).
#[derive(Clone, Debug)]
pub struct ProbeMetrics {
    durations: ProbeHistograms,
}

impl Default for ProbeMetrics {
    fn default() -> Self {
        Self {
            durations: Family::new_with_constructor(probe_histogram as fn() -> Histogram),
        }
    }
}

impl ProbeMetrics {
    /// Records one probe.
    pub fn observe(&self, result: ProbeResult, took: Duration) {
        self.durations
            .get_or_create(&ProbeLabels {
                result: result.as_str(),
            })
            .observe(took.as_secs_f64());
    }
}

/// The operator's metrics (controller, health engine, monitor, GC); the discovery API's are in
/// [`crate::discovery::DiscoveryMetrics`].
pub struct Metrics {
    reconciles: Family<ResultLabels, Counter>,
    reconcile_duration: Histogram,
    transitions: Family<TransitionLabels, Counter>,
    proxies: Family<PhaseLabels, Gauge>,
    gc_deletions: Family<ProviderLabels, Counter>,
    gc_adoptions: Family<ProviderLabels, Counter>,
    gc_left_alone: Family<LeftAloneLabels, Gauge>,
    provider_available: Family<ProviderLabels, Gauge>,
    probes: ProbeMetrics,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            reconciles: Family::default(),
            reconcile_duration: Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            transitions: Family::default(),
            proxies: Family::default(),
            gc_deletions: Family::default(),
            gc_adoptions: Family::default(),
            gc_left_alone: Family::default(),
            provider_available: Family::default(),
            probes: ProbeMetrics::default(),
        };
        registry.register(
            "epo_reconciles",
            "Reconciles by result (ok or error category)",
            metrics.reconciles.clone(),
        );
        registry.register(
            "epo_reconcile_duration_seconds",
            "Duration of one reconcile",
            metrics.reconcile_duration.clone(),
        );
        registry.register(
            "epo_transitions",
            "Lifecycle transitions by phase and reason",
            metrics.transitions.clone(),
        );
        registry.register(
            "epo_proxies",
            "Proxies per lifecycle phase (sampled)",
            metrics.proxies.clone(),
        );
        registry.register(
            "epo_gc_deletions",
            "Orphaned provider instances deleted by GC",
            metrics.gc_deletions.clone(),
        );
        registry.register(
            "epo_gc_adoptions",
            "Legacy-stamped provider instances adopted by GC (restamped with this installation)",
            metrics.gc_adoptions.clone(),
        );
        registry.register(
            "epo_gc_foreign_instances",
            "Provider instances GC left alone in its last pass: another installation's (foreign) \
             or legacy-stamped with no live owner here (legacy)",
            metrics.gc_left_alone.clone(),
        );
        registry.register(
            "epo_provider_available",
            "1 if the provider instance answered its last probe, else 0",
            metrics.provider_available.clone(),
        );
        registry.register(
            "epo_probe_duration_seconds",
            "Duration of health probes through proxies, by result (ok, fail, timeout)",
            metrics.probes.durations.clone(),
        );
        metrics
    }

    /// The health engine's handle on the probe histogram.
    pub fn probe_metrics(&self) -> ProbeMetrics {
        self.probes.clone()
    }

    /// Records a reconcile.
    pub fn observe_reconcile(&self, took: Duration, error_category: Option<&str>) {
        let result = error_category.unwrap_or("ok").to_owned();
        self.reconciles.get_or_create(&ResultLabels { result }).inc();
        self.reconcile_duration.observe(took.as_secs_f64());
    }

    /// Sets the number of proxies per phase (every phase is reported, zero included).
    pub fn set_phase_counts(&self, counts: &std::collections::BTreeMap<String, usize>) {
        for phase in Phase::ALL {
            let count = counts.get(phase.as_str()).copied().unwrap_or(0);
            self.proxies
                .get_or_create(&PhaseLabels {
                    phase: phase.as_str().to_owned(),
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }

    /// Counts GC deletions on `provider`.
    pub fn observe_gc_deletions(&self, provider: &str, deleted: u64) {
        self.gc_deletions
            .get_or_create(&ProviderLabels {
                provider: provider.to_owned(),
            })
            .inc_by(deleted);
    }

    /// Counts GC adoptions of legacy-stamped instances on `provider`.
    pub fn observe_gc_adoptions(&self, provider: &str, adopted: u64) {
        self.gc_adoptions
            .get_or_create(&ProviderLabels {
                provider: provider.to_owned(),
            })
            .inc_by(adopted);
    }

    /// Sets how many instances of `kind` (`foreign`, `legacy`) GC's last pass over `provider`
    /// left alone.
    pub fn set_gc_left_alone(&self, provider: &str, kind: &str, count: u64) {
        self.gc_left_alone
            .get_or_create(&LeftAloneLabels {
                provider: provider.to_owned(),
                kind: kind.to_owned(),
            })
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// Records whether `provider` answered its last probe.
    pub fn set_provider_available(&self, provider: &str, available: bool) {
        self.provider_available
            .get_or_create(&ProviderLabels {
                provider: provider.to_owned(),
            })
            .set(i64::from(available));
    }

    /// Records a transition.
    pub fn observe_transition(&self, from: &str, to: &str, reason: &str) {
        self.transitions
            .get_or_create(&TransitionLabels {
                from: from.to_owned(),
                to: to.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }
}
