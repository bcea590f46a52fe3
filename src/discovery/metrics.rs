//! The discovery API's Prometheus metrics (all labels bounded).

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

/// A route, as a metric label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    /// `list`, `acquire`, `renew`, `release`, `healthz`, `readyz`, `metrics`, `other`.
    pub route: &'static str,
}

/// A route and the answer's code (`ok` or a stable error code).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// The route.
    pub route: &'static str,
    /// `ok` or the error code.
    pub code: &'static str,
}

/// A stable code as a label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    /// Why, or how.
    pub code: &'static str,
}

type HistogramFamily = Family<RouteLabels, Histogram, fn() -> Histogram>;

/// Handles to the discovery metrics.
#[derive(Clone, Debug)]
pub struct DiscoveryMetrics {
    pub(crate) requests: Family<ResultLabels, Counter>,
    pub(crate) durations: HistogramFamily,
    pub(crate) acquired: Counter,
    pub(crate) refused: Family<CodeLabels, Counter>,
    pub(crate) released: Family<CodeLabels, Counter>,
    pub(crate) active: Gauge,
}

fn duration_histogram() -> Histogram {
    // 50 µs .. ~1.6 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl DiscoveryMetrics {
    /// Creates the metrics and registers them (prefix `epo_discovery`) in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            requests: Family::default(),
            durations: Family::new_with_constructor(duration_histogram as fn() -> Histogram),
            acquired: Counter::default(),
            refused: Family::default(),
            released: Family::default(),
            active: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("epo_discovery");
        r.register(
            "requests",
            "Discovery API requests by route and result code",
            metrics.requests.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Discovery API request handling time by route",
            metrics.durations.clone(),
        );
        r.register("leases_acquired", "Leases granted", metrics.acquired.clone());
        r.register(
            "lease_acquire_refused",
            "Lease acquisitions refused, by reason",
            metrics.refused.clone(),
        );
        r.register(
            "leases_released",
            "Leases released, by outcome",
            metrics.released.clone(),
        );
        r.register(
            "leases_active",
            "Active leases (sampled at scrape)",
            metrics.active.clone(),
        );
        metrics
    }
}
