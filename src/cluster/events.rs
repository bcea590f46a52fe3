//! Publishes the audit trail as `events.k8s.io/v1` Events, with the series semantics of
//! kube-runtime's `Recorder`: the first occurrence of an event (type, action, reason, regarding
//! object, note) creates an Event; a repeat within six minutes patches that Event's `series`
//! (count, last observed time) instead of creating another. The note is part of what makes a
//! repeat because events.k8s.io/v1 keeps an Event's note immutable: a patch that changed it
//! would be refused (422) and the occurrence lost.
//!
//! Why not `Recorder` itself: it sweeps its whole cache on every publish and keeps every
//! published Event object in it, so publishing is O(Events of the last six minutes) in time and
//! a full Event per entry in memory. At 10,000 Proxies (five Events each on the way to Healthy)
//! that sweep dominated convergence (quadratic) and the cache held tens of MB. Here a cache entry
//! is a hash, a timestamp and a count, and the sweep runs at most once a minute (amortised O(1)).

use std::{
    collections::HashMap,
    hash::{DefaultHasher, Hash, Hasher},
    sync::Mutex,
    time::Duration,
};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event as K8sEvent},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
    runtime::events::{Event, EventType, Reporter},
};
use serde_json::json;

use crate::sync::lock;

/// How long a repeat joins the earlier Event's series (kube-runtime's and client-go's value).
const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// How often the cache drops entries older than [`SERIES_WINDOW`].
const SWEEP_INTERVAL: Duration = Duration::from_secs(60);

/// The Event a repeat is added to. Its name is `{regarding name}.{created_ns:x}` (as
/// kube-runtime names them), so only the timestamp is kept, not the name.
struct Cached {
    created_ns: i64,
    count: i32,
    /// Unix seconds: entry size matters, there is one per Event of the last six minutes.
    last_observed: i64,
}

#[derive(Default)]
struct Cache {
    /// Keyed by a hash of (type, action, reason, regarding): a collision (odds ~n²/2⁶⁵) would
    /// only count one event in another's series.
    entries: HashMap<u64, Cached>,
    last_sweep: Option<Timestamp>,
}

/// Publishes Events for one reporting controller instance.
pub struct EventPublisher {
    client: Client,
    reporter: Reporter,
    cache: Mutex<Cache>,
}

impl EventPublisher {
    /// A publisher reporting as `reporter`.
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            cache: Mutex::default(),
        }
    }

    /// Publishes `event` about `regarding` (cluster-scoped objects' Events go to `default`).
    pub async fn publish(&self, event: &Event, regarding: &ObjectReference) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = key_of(event, regarding);
        let repeat = {
            let mut cache = lock(&self.cache);
            sweep(&mut cache, now);
            cache
                .entries
                .get(&key)
                .filter(|c| c.last_observed + SERIES_WINDOW.as_secs() > now.as_second())
                .map(|c| (c.created_ns, c.count + 1))
        };
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let events: Api<K8sEvent> = Api::namespaced(self.client.clone(), namespace);
        let (created_ns, count) = match repeat {
            Some((created_ns, count)) => {
                let name = self.event_name(regarding, created_ns);
                let patch = json!({
                    "series": {"count": count, "lastObservedTime": MicroTime(now)},
                });
                events
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                (created_ns, count)
            }
            None => {
                let created = self.generate(event, regarding, now);
                events.create(&PostParams::default(), &created).await?;
                // A series' count starts at 2 (the first repeat), as client-go's.
                (nanos(now), 1)
            }
        };
        lock(&self.cache).entries.insert(
            key,
            Cached {
                created_ns,
                count,
                last_observed: now.as_second(),
            },
        );
        Ok(())
    }

    fn event_name(&self, regarding: &ObjectReference, created_ns: i64) -> String {
        let base = regarding.name.as_ref().unwrap_or(&self.reporter.controller);
        format!("{base}.{created_ns:x}")
    }

    fn generate(&self, event: &Event, regarding: &ObjectReference, now: Timestamp) -> K8sEvent {
        K8sEvent {
            action: Some(event.action.clone()),
            reason: Some(event.reason.clone()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            related: event.secondary.clone(),
            note: event.note.clone(),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                name: Some(self.event_name(regarding, nanos(now))),
                ..ObjectMeta::default()
            },
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: Some(
                self.reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| self.reporter.controller.clone()),
            ),
            type_: Some(
                match event.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            ..K8sEvent::default()
        }
    }
}

/// Nanoseconds since the epoch; an i64 holds them until 2262.
fn nanos(at: Timestamp) -> i64 {
    i64::try_from(at.as_nanosecond()).unwrap_or(i64::MAX)
}

fn key_of(event: &Event, regarding: &ObjectReference) -> u64 {
    let mut hasher = DefaultHasher::new();
    event.type_.hash(&mut hasher);
    event.action.hash(&mut hasher);
    event.reason.hash(&mut hasher);
    event.note.hash(&mut hasher);
    for part in [
        &regarding.api_version,
        &regarding.kind,
        &regarding.namespace,
        &regarding.name,
        &regarding.uid,
    ] {
        part.hash(&mut hasher);
    }
    if let Some(related) = &event.secondary {
        related.uid.hash(&mut hasher);
        related.name.hash(&mut hasher);
    }
    hasher.finish()
}

/// Drops entries past the series window, at most once per [`SWEEP_INTERVAL`].
fn sweep(cache: &mut Cache, now: Timestamp) {
    let due = cache
        .last_sweep
        .is_none_or(|at| now.duration_since(at).unsigned_abs() >= SWEEP_INTERVAL);
    if due {
        let oldest = now.as_second() - SERIES_WINDOW.as_secs();
        cache.entries.retain(|_, c| c.last_observed > oldest);
        cache.last_sweep = Some(now);
    }
}
