//! The discovery API's Prometheus metrics (all labels bounded).

use std::sync::{Arc, OnceLock};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet},
    metrics::{
        counter::Counter,
        family::Family,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::{
    lease::LeaseStore,
    telemetry::scrape::{count_gauge, encode_metric},
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

/// Every route label, in [`crate::discovery`]'s route index order.
pub(crate) const ROUTES: [&str; 13] = [
    "healthz", "readyz", "metrics", "openapi", "list", "acquire", "renew", "release", "other", "ui",
    "leases", "outcomes", "usage",
];

/// A route's `ok` counter and duration histogram, resolved from their families on first use:
/// the hot path then skips the families' lock and label hashing.
#[derive(Debug, Default)]
pub(crate) struct HotRoute {
    ok: OnceLock<Counter>,
    duration: OnceLock<Histogram>,
}

/// Handles to the discovery metrics.
#[derive(Clone, Debug)]
pub struct DiscoveryMetrics {
    pub(crate) requests: Family<ResultLabels, Counter>,
    pub(crate) durations: HistogramFamily,
    pub(crate) acquired: Counter,
    pub(crate) refused: Family<CodeLabels, Counter>,
    pub(crate) released: Family<CodeLabels, Counter>,
    pub(crate) active: ActiveLeases,
    hot: Arc<[HotRoute; ROUTES.len()]>,
    /// `released`'s counter per outcome, resolved on first use like [`HotRoute`]'s.
    hot_released: Arc<[OnceLock<Counter>; 3]>,
}

/// `leases_active`, read from the lease store at every scrape of whichever endpoint serves the
/// registry (the admin server's `/metrics` as well as the discovery API's). The store is
/// attached by [`crate::discovery::DiscoveryState::new`]; until then it reads 0.
#[derive(Clone, Default)]
pub(crate) struct ActiveLeases(pub(crate) Arc<OnceLock<LeaseStore>>);

impl std::fmt::Debug for ActiveLeases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActiveLeases")
            .field("attached", &self.0.get().is_some())
            .finish()
    }
}

impl Collector for ActiveLeases {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let active = self.0.get().map_or(0, LeaseStore::active_total);
        encode_metric(
            &mut encoder,
            "leases_active",
            "Active leases (sampled at scrape)",
            count_gauge(active),
        )
    }
}

fn duration_histogram() -> Histogram {
    // 50 µs .. ~1.6 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl DiscoveryMetrics {
    /// Counts one answer of route number `route` ([`ROUTES`]) with `code` (`ok` or an error
    /// code) that took `seconds`.
    pub(crate) fn record(&self, route: usize, code: &'static str, seconds: f64) {
        let label = ROUTES[route];
        let hot = &self.hot[route];
        if code == "ok" {
            hot.ok
                .get_or_init(|| {
                    self.requests
                        .get_or_create(&ResultLabels { route: label, code })
                        .clone()
                })
                .inc();
        } else {
            self.requests
                .get_or_create(&ResultLabels { route: label, code })
                .inc();
        }
        hot.duration
            .get_or_init(|| {
                self.durations
                    .get_or_create(&RouteLabels { route: label })
                    .clone()
            })
            .observe(seconds);
    }

    /// Counts one release with `outcome`.
    pub(crate) fn count_release(&self, outcome: crate::lease::Outcome) {
        use crate::lease::Outcome;
        let code = outcome.as_str();
        let slot = match outcome {
            Outcome::Ok => 0,
            Outcome::Banned => 1,
            Outcome::Error => 2,
        };
        self.hot_released[slot]
            .get_or_init(|| self.released.get_or_create(&CodeLabels { code }).clone())
            .inc();
    }

    /// Creates the metrics and registers them (prefix `epo_discovery`) in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            requests: Family::default(),
            durations: Family::new_with_constructor(duration_histogram as fn() -> Histogram),
            acquired: Counter::default(),
            refused: Family::default(),
            released: Family::default(),
            active: ActiveLeases::default(),
            hot: Arc::default(),
            hot_released: Arc::default(),
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
        r.register_collector(Box::new(metrics.active.clone()));
        metrics
    }
}
