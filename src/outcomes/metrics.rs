//! The statistics as Prometheus metrics (prefix `epo_outcomes`), read from the table at every
//! scrape. Label cardinality is bounded by the pool: per proxy totals (`proxy`, plus closed
//! sets: `result`, `direction`, `quantile`), and nothing per domain but how many pairs are
//! tracked and evicted. Target domains are an open set (a crawl visits millions), and a top-k
//! label would churn a new series with every change of the top; per-domain numbers are in
//! `GET /v1/proxies` and on the status page instead.

use prometheus_client::{
    collector::Collector,
    encoding::DescriptorEncoder,
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};

use super::{Failure, Outcomes, Stats};
use crate::api::ProxyKey;
use crate::telemetry::scrape::{count_gauge, encode_family, encode_metric};

impl Outcomes {
    /// Registers the metrics of these statistics in `registry` (prefix `epo_outcomes`).
    pub fn register(&self, registry: &mut Registry) {
        registry
            .sub_registry_with_prefix("epo_outcomes")
            .register_collector(Box::new(Scrape(self.clone())));
    }
}

#[derive(Debug)]
struct Scrape(Outcomes);

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let totals = self.0.totals();
        let tracked = self.0.tracked();
        encode_family(
            &mut encoder,
            "requests",
            "Requests and tunnels through each proxy, by result (success or the failure kind)",
            by_proxy_and(&totals, "result", |stats| {
                let failures = Failure::ALL
                    .iter()
                    .map(|&kind| (kind.as_str(), stats.failures.of(kind)));
                std::iter::once(("success", stats.successes))
                    .chain(failures)
                    .map(|(result, n)| (result, ConstCounter::new(n)))
            }),
        )?;
        encode_family(
            &mut encoder,
            "bans",
            "Bans of each proxy for a target domain",
            totals
                .iter()
                .map(|(key, stats)| ([("proxy", key.as_str())], ConstCounter::new(stats.bans))),
        )?;
        encode_family(
            &mut encoder,
            "bytes",
            "Bytes through each proxy: received (target to client) and sent",
            by_proxy_and(&totals, "direction", |stats| {
                [("received", stats.bytes_received), ("sent", stats.bytes_sent)]
                    .map(|(direction, n)| (direction, ConstCounter::new(n)))
            }),
        )?;
        encode_family(
            &mut encoder,
            "latency_seconds",
            "Median (quantile 0.5) and 95th percentile of each proxy's last 64 latencies",
            by_proxy_and(&totals, "quantile", |stats| {
                let quantiles = stats.latency.map(|l| [("0.5", l.p50), ("0.95", l.p95)]);
                (quantiles.into_iter().flatten())
                    .map(|(quantile, ms)| (quantile, ConstGauge::new(f64::from(ms) / 1000.0)))
            }),
        )?;
        encode_metric(
            &mut encoder,
            "tracked_pairs",
            "(proxy, target domain) pairs tracked now",
            count_gauge(tracked.pairs),
        )?;
        encode_metric(
            &mut encoder,
            "evicted_pairs",
            "(proxy, target domain) pairs evicted, least recently seen first, to stay within the caps",
            ConstCounter::new(tracked.evicted),
        )
    }
}

/// The samples of a per-proxy family with a second label, `label`: `split` gives each value of
/// it and its metric for one proxy's statistics.
fn by_proxy_and<'a, M, I: IntoIterator<Item = (&'static str, M)> + 'a>(
    totals: &'a [(ProxyKey, Stats)],
    label: &'static str,
    split: impl Fn(&'a Stats) -> I + 'a,
) -> impl Iterator<Item = ([(&'static str, &'a str); 2], M)> + 'a {
    totals.iter().flat_map(move |(key, stats)| {
        split(stats)
            .into_iter()
            .map(move |(value, metric)| ([("proxy", key.as_str()), (label, value)], metric))
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        api::ProxyKey,
        outcomes::{Ended, Seen},
    };

    #[test]
    fn a_scrape_shows_per_proxy_totals_and_no_domain() {
        let outcomes = Outcomes::default();
        let mut registry = Registry::default();
        outcomes.register(&mut registry);
        let seen = Seen {
            ended: Ended::Status(200),
            latency: Some(Duration::from_millis(250)),
            bytes_received: 7,
            bytes_sent: 3,
            banned: false,
        };
        outcomes.record(&ProxyKey::new("crawl", "a"), "shop.example", &seen, 0);
        outcomes.record(
            &ProxyKey::new("crawl", "a"),
            "shop.example",
            &Seen {
                ended: Ended::Failed(Failure::Reset),
                ..seen
            },
            0,
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        for line in [
            r#"epo_outcomes_requests_total{proxy="crawl/a",result="success"} 1"#,
            r#"epo_outcomes_requests_total{proxy="crawl/a",result="reset"} 1"#,
            r#"epo_outcomes_requests_total{proxy="crawl/a",result="connect"} 0"#,
            r#"epo_outcomes_bans_total{proxy="crawl/a"} 0"#,
            r#"epo_outcomes_bytes_total{proxy="crawl/a",direction="received"} 14"#,
            r#"epo_outcomes_latency_seconds{proxy="crawl/a",quantile="0.95"} 0.25"#,
            "epo_outcomes_tracked_pairs 1",
            "epo_outcomes_evicted_pairs_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
        assert!(!text.contains("shop.example"), "{text}");
    }
}
