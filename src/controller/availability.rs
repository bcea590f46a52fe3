//! Which providers the provider-health monitor last saw down, and why: the fact `provider_down`
//! every reconcile reads.

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
};

/// Availability of provider instances as the provider-health monitor last saw it. Providers not
/// (yet) probed count as available: a Proxy is never held back on a guess.
#[derive(Clone, Default)]
pub struct ProviderAvailability {
    down: Arc<RwLock<HashMap<String, String>>>,
}

impl ProviderAvailability {
    /// Marks `provider` down with `reason`, or up with `None`.
    pub fn set(&self, provider: &str, down_reason: Option<String>) {
        let mut down = crate::sync::write(&self.down);
        match down_reason {
            Some(reason) => down.insert(provider.to_owned(), reason),
            None => down.remove(provider),
        };
    }

    /// Why `provider` is down, if it is.
    pub fn down_reason(&self, provider: &str) -> Option<String> {
        crate::sync::read(&self.down).get(provider).cloned()
    }
}
