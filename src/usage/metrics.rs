//! Usage as Prometheus metrics (prefix `epo_usage`), read at every scrape: per token only. A
//! `token` label is bounded: tokens are configured (a token file, a token Secret) or
//! TokenReview users, and the table keeps at most [`super::MAX_TOKENS`]. Holders are an open
//! set (whatever crawlers name themselves), so they get no series: per-holder numbers are in
//! `GET /v1/usage` and on the status page.

use prometheus_client::{
    collector::Collector, encoding::DescriptorEncoder, metrics::counter::ConstCounter, registry::Registry,
};

use super::Usage;
use crate::telemetry::scrape::{count_gauge, encode_family};

impl Usage {
    /// Registers the metrics of this usage in `registry` (prefix `epo_usage`).
    pub fn register(&self, registry: &mut Registry) {
        registry
            .sub_registry_with_prefix("epo_usage")
            .register_collector(Box::new(Scrape(self.clone())));
    }
}

#[derive(Debug)]
struct Scrape(Usage);

/// A counter family: its name, help and the counter it reads.
type Family = (&'static str, &'static str, fn(&super::Counters) -> u64);

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // The quota windows are not needed here: `now` only rolls them.
        let tokens = self.0.tokens(0);
        let families: [Family; 3] = [
            (
                "requests",
                "Requests admitted for each token (gateway requests and tunnels, lease acquires)",
                |c| c.requests,
            ),
            (
                "bytes",
                "Bytes through the gateway and reported in outcome reports, by token",
                |c| c.bytes,
            ),
            (
                "bans",
                "Leases released with outcome banned, by the token that released them",
                |c| c.bans,
            ),
        ];
        for (name, help, value) in families {
            let samples = tokens.iter().map(|usage| {
                (
                    [("token", usage.token.as_str())],
                    ConstCounter::new(value(&usage.counters)),
                )
            });
            encode_family(&mut encoder, name, help, samples)?;
        }
        encode_family(
            &mut encoder,
            "lease_seconds",
            "Seconds leases were held, grant to release, by the token that released them",
            tokens.iter().map(|usage| {
                let seconds = ConstCounter::new(usage.counters.lease_seconds());
                ([("token", usage.token.as_str())], seconds)
            }),
        )?;
        let (tokens, holders) = self.0.tracked();
        encode_family(
            &mut encoder,
            "tracked",
            "Tokens and holders whose usage is tracked now (at most 10,000 each)",
            [("tokens", tokens), ("holders", holders)].map(|(kind, n)| ([("kind", kind)], count_gauge(n))),
        )
    }
}
