//! Writing metrics read from state at scrape time (a [`Collector`]'s `encode`): one family of
//! labelled samples, or one metric alone, its type taken from the metric's own type.
//!
//! [`Collector`]: prometheus_client::collector::Collector

use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{TypedMetric, gauge::ConstGauge},
};

/// Writes the family `name` (`help`): each sample's metric with its labels. The family is
/// described even with no sample, so a scrape always lists it.
pub fn encode_family<L: EncodeLabelSet, M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, M::TYPE)?;
    for (labels, metric) in samples {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Writes the metric `name` (`help`), without labels.
pub fn encode_metric<M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric: M,
) -> Result<(), std::fmt::Error> {
    metric.encode(encoder.encode_descriptor(name, help, None, M::TYPE)?)
}

/// A count as a gauge (saturating: a count of things in memory never gets near `i64::MAX`).
pub fn count_gauge(n: usize) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
}
