//! The statistics as Prometheus metrics (prefix `epo_outcomes`), read from the table at every
//! scrape. Label cardinality is bounded by the pool: per proxy totals (`proxy`, plus closed
//! sets: `result`, `direction`, `quantile`), and nothing per domain but how many pairs are
//! tracked and evicted. Target domains are an open set (a crawl visits millions), and a top-k
//! label would churn a new series with every change of the top; per-domain numbers are in
//! `GET /v1/proxies` and on the status page instead.

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};

use super::{Failure, Outcomes};

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

        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "requests",
            "Requests and tunnels through each proxy, by result (success or the failure kind)",
            None,
            counter.metric_type(),
        )?;
        for (key, stats) in &totals {
            let mut results = vec![("success", stats.successes)];
            results.extend(
                Failure::ALL
                    .iter()
                    .map(|&kind| (kind.as_str(), stats.failures.of(kind))),
            );
            for (result, n) in results {
                let labels = [("proxy", key.as_str()), ("result", result)];
                ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
            }
        }

        let mut family = encoder.encode_descriptor(
            "bans",
            "Bans of each proxy for a target domain",
            None,
            counter.metric_type(),
        )?;
        for (key, stats) in &totals {
            ConstCounter::new(stats.bans).encode(family.encode_family(&[("proxy", key.as_str())])?)?;
        }

        let mut family = encoder.encode_descriptor(
            "bytes",
            "Bytes through each proxy: received (target to client) and sent",
            None,
            counter.metric_type(),
        )?;
        for (key, stats) in &totals {
            for (direction, n) in [("received", stats.bytes_received), ("sent", stats.bytes_sent)] {
                let labels = [("proxy", key.as_str()), ("direction", direction)];
                ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
            }
        }

        let gauge = ConstGauge::new(0.0f64);
        let mut family = encoder.encode_descriptor(
            "latency_seconds",
            "Median (quantile 0.5) and 95th percentile of each proxy's last 64 latencies",
            None,
            gauge.metric_type(),
        )?;
        for (key, stats) in &totals {
            let Some(latency) = stats.latency else { continue };
            for (quantile, ms) in [("0.5", latency.p50), ("0.95", latency.p95)] {
                let labels = [("proxy", key.as_str()), ("quantile", quantile)];
                ConstGauge::new(f64::from(ms) / 1000.0).encode(family.encode_family(&labels)?)?;
            }
        }

        let pairs = ConstGauge::new(i64::try_from(tracked.pairs).unwrap_or(i64::MAX));
        let metric = encoder.encode_descriptor(
            "tracked_pairs",
            "(proxy, target domain) pairs tracked now",
            None,
            pairs.metric_type(),
        )?;
        pairs.encode(metric)?;
        let evicted = ConstCounter::new(tracked.evicted);
        let metric = encoder.encode_descriptor(
            "evicted_pairs",
            "(proxy, target domain) pairs evicted, least recently seen first, to stay within the caps",
            None,
            evicted.metric_type(),
        )?;
        evicted.encode(metric)
    }
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
