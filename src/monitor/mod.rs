//! The provider-health monitor: probes every configured provider instance (connect and list)
//! on an interval, keeps [`ProviderAvailability`] current for the reconciler (which holds new
//! provisioning while a provider is down), and hands each outcome that shows something new
//! (availability, message, instance count) to a mode's [`HealthSink`] (the log here;
//! `ProviderHealth` objects in cluster mode, in [`crate::cluster::health_sink`]). Names no mode
//! itself.

use std::{collections::HashMap, future::Future, sync::Arc, time::Duration};

use async_trait::async_trait;
use jiff::Timestamp;
use tracing::{info, warn};

use crate::{controller::ProviderAvailability, provider::ProviderRegistry, telemetry::Metrics};

/// What one probe of one provider instance found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeOutcome {
    /// Provider instance name.
    pub provider: String,
    /// Provider type.
    pub provider_type: String,
    /// It answered.
    pub available: bool,
    /// Detail: the backend's description, or why it failed.
    pub message: String,
    /// How long the probe took.
    pub latency: Duration,
    /// Instances it owns (when it answered).
    pub instance_count: Option<usize>,
    /// When.
    pub at: Timestamp,
}

/// Where outcomes are published (ProviderHealth objects in cluster mode).
#[async_trait]
pub trait HealthSink: Send + Sync {
    /// Publishes an outcome that shows something new (availability, message, instance count)
    /// since the last published one, or the first since the start.
    async fn publish(&self, outcome: &ProbeOutcome) -> Result<(), String>;
}

/// What a published outcome shows, apart from when the probe ran and how long it took: a probe
/// finding the same is not published again (no write per probe per provider).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Shown {
    available: bool,
    message: String,
    instance_count: Option<usize>,
}

impl Shown {
    fn of(outcome: &ProbeOutcome) -> Self {
        Self {
            available: outcome.available,
            message: outcome.message.clone(),
            instance_count: outcome.instance_count,
        }
    }
}

/// Called with a provider's name when its availability flips.
pub type ChangeHook = Arc<dyn Fn(&str) + Send + Sync>;

/// The monitor.
pub struct Monitor {
    providers: ProviderRegistry,
    availability: ProviderAvailability,
    sink: Arc<dyn HealthSink>,
    timeout: Duration,
    published: HashMap<String, Shown>,
    /// Availability at the last probe, for the change hook (independent of publishing).
    seen: HashMap<String, bool>,
    on_change: Option<ChangeHook>,
    metrics: Option<Arc<Metrics>>,
}

impl Monitor {
    /// A monitor over `providers`, publishing to `sink`; a probe slower than `timeout` counts
    /// as unavailable.
    pub fn new(
        providers: ProviderRegistry,
        availability: ProviderAvailability,
        sink: Arc<dyn HealthSink>,
        timeout: Duration,
    ) -> Self {
        Self {
            providers,
            availability,
            sink,
            timeout,
            published: HashMap::new(),
            seen: HashMap::new(),
            on_change: None,
            metrics: None,
        }
    }

    /// Records every probe's outcome in `epo_provider_available`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Calls `hook` with a provider's name whenever its availability flips (the controller
    /// re-reconciles that provider's Proxies). The first probe of a provider is no flip.
    pub fn on_change(mut self, hook: ChangeHook) -> Self {
        self.on_change = Some(hook);
        self
    }

    /// Probes every provider once; publishes the outcomes that show something new.
    pub async fn probe_all(&mut self) -> Vec<ProbeOutcome> {
        let mut outcomes = Vec::new();
        let providers: Vec<_> = self
            .providers
            .iter()
            .map(|(n, p)| (n.to_owned(), p.clone()))
            .collect();
        for (name, provider) in providers {
            let started = std::time::Instant::now();
            let result = tokio::time::timeout(self.timeout, provider.probe()).await;
            let latency = started.elapsed();
            let (available, message, instance_count) = match result {
                Ok(Ok(report)) => (true, report.detail, Some(report.instance_count)),
                Ok(Err(err)) => (false, err.to_string(), None),
                Err(_) => (false, format!("probe timed out after {:?}", self.timeout), None),
            };
            let outcome = ProbeOutcome {
                provider: name.clone(),
                provider_type: provider.provider_type().to_owned(),
                available,
                message,
                latency,
                instance_count,
                at: Timestamp::now(),
            };
            self.availability
                .set(&name, (!available).then(|| outcome.message.clone()));
            if let Some(metrics) = &self.metrics {
                metrics.set_provider_available(&name, available);
            }
            let shown = Shown::of(&outcome);
            let published = self.published.get(&name);
            if published != Some(&shown) {
                if published.map(|p| p.available) != Some(available) {
                    if available {
                        info!(provider = %name, "provider available");
                    } else {
                        warn!(provider = %name, reason = %outcome.message, "provider unavailable");
                    }
                }
                match self.sink.publish(&outcome).await {
                    Ok(()) => {
                        self.published.insert(name.clone(), shown);
                    }
                    // Not recorded as published: the next round retries the write.
                    Err(err) => warn!(provider = %name, error = %err, "publishing provider health failed"),
                }
            }
            if let Some(before) = self.seen.insert(name.clone(), available)
                && before != available
                && let Some(hook) = &self.on_change
            {
                hook(&name);
            }
            outcomes.push(outcome);
        }
        outcomes
    }

    /// Probes every `interval` until `shutdown` resolves.
    pub async fn run(mut self, interval: Duration, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            self.probe_all().await;
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}

/// A sink that only logs (standalone mode: availability is what matters there).
pub struct LogSink;

#[async_trait]
impl HealthSink for LogSink {
    async fn publish(&self, outcome: &ProbeOutcome) -> Result<(), String> {
        // Not `message`: the log's own message field would swallow the key.
        info!(
            provider = %outcome.provider,
            available = outcome.available,
            instances = outcome.instance_count,
            detail = %outcome.message,
            "provider health"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::provider::memory::MemoryProvider;

    #[derive(Default)]
    struct Recorded(Mutex<Vec<ProbeOutcome>>);

    impl Recorded {
        fn availability(&self) -> Vec<(String, bool)> {
            let published = self.0.lock().unwrap();
            published
                .iter()
                .map(|o| (o.provider.clone(), o.available))
                .collect()
        }
    }

    #[async_trait]
    impl HealthSink for Recorded {
        async fn publish(&self, outcome: &ProbeOutcome) -> Result<(), String> {
            self.0.lock().unwrap().push(outcome.clone());
            Ok(())
        }
    }

    fn monitor_of(provider: &Arc<MemoryProvider>, sink: &Arc<Recorded>) -> Monitor {
        let mut registry = ProviderRegistry::new();
        registry.insert(provider.clone());
        Monitor::new(
            registry,
            ProviderAvailability::default(),
            sink.clone(),
            Duration::from_secs(5),
        )
    }

    /// What the published object shows follows the provider: an instance made or gone is
    /// published with the probe that finds it (the object said "0 instances" while three ran),
    /// and a probe finding the same is not.
    #[tokio::test]
    async fn publishes_what_it_shows_when_that_changes_not_only_availability() {
        let provider = Arc::new(MemoryProvider::new("mem"));
        let sink = Arc::new(Recorded::default());
        let mut monitor = monitor_of(&provider, &sink);
        monitor.probe_all().await;
        let request = crate::provider::InstanceRequest {
            name: "one".into(),
            owner: crate::provider::Owner {
                uid: "u".into(),
                namespace: "crawl".into(),
                name: "one".into(),
            },
            spec_hash: "h".into(),
            placement: Default::default(),
            port: 3128,
            user_data: None,
            credentials: None,
        };
        crate::provider::Provider::create(provider.as_ref(), &request)
            .await
            .expect("created");
        monitor.probe_all().await;
        monitor.probe_all().await;
        let counts: Vec<_> = sink.0.lock().unwrap().iter().map(|o| o.instance_count).collect();
        assert_eq!(counts, [Some(0), Some(1)]);
    }

    #[tokio::test]
    async fn publishes_only_changes_and_tracks_availability() {
        let provider = Arc::new(MemoryProvider::new("mem"));
        let mut registry = ProviderRegistry::new();
        registry.insert(provider.clone());
        let availability = ProviderAvailability::default();
        let sink = Arc::new(Recorded::default());
        let mut monitor = Monitor::new(
            registry,
            availability.clone(),
            sink.clone(),
            Duration::from_secs(5),
        );

        monitor.probe_all().await;
        monitor.probe_all().await;
        assert_eq!(
            sink.availability(),
            [("mem".to_owned(), true)],
            "steady state publishes once"
        );
        assert_eq!(availability.down_reason("mem"), None);

        provider.set_unavailable(true);
        monitor.probe_all().await;
        monitor.probe_all().await;
        assert!(
            availability
                .down_reason("mem")
                .expect("down")
                .contains("switched off")
        );
        provider.set_unavailable(false);
        monitor.probe_all().await;
        assert_eq!(
            sink.availability(),
            [
                ("mem".to_owned(), true),
                ("mem".to_owned(), false),
                ("mem".to_owned(), true)
            ]
        );
        assert_eq!(availability.down_reason("mem"), None);
    }
}
