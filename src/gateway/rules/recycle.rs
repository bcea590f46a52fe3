//! [`RecycleRequests`]: how a rule's `recycle` step asks the lifecycle for a fresh instance,
//! owned here and implemented by each mode: cluster mode patches the Proxy's recycle
//! annotation ([`crate::api::RECYCLE_ANNOTATION`]) through the API server; standalone mode
//! records the request in its embedded store, where the next reconcile reads it as that
//! annotation. Either way the lifecycle's `recycle_requested` rows act on it, within the pool's
//! budget, and `status.lastRecycle` and the audit keep the value, which names the rule.

use async_trait::async_trait;

use crate::api::ProxyKey;

/// Why a recycle request was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum RecycleError {
    /// The Proxy no longer exists.
    #[error("the Proxy {0} no longer exists")]
    Gone(ProxyKey),
    /// Recording it failed (the API server refused or could not be reached, the mode stopped).
    #[error("recording the recycle request for {key} failed: {reason}")]
    Failed {
        /// The Proxy.
        key: ProxyKey,
        /// Why.
        reason: String,
    },
}

/// Asks the lifecycle for a fresh instance of a Proxy.
#[async_trait]
pub trait RecycleRequests: Send + Sync {
    /// Sets `key`'s recycle request to `value` (a value not acted on yet recycles once).
    async fn request(&self, key: &ProxyKey, value: &str) -> Result<(), RecycleError>;
}

/// The recycle request a rule makes: who asked, and when (so each request is new), e.g.
/// `gateway rule blocked 2026-12-04T16:00:00Z #3`.
pub fn recycle_value(rule: &str, now: jiff::Timestamp, serial: u64) -> String {
    format!(
        "gateway rule {rule} {} #{serial}",
        now.round(jiff::Unit::Second).unwrap_or(now)
    )
}
