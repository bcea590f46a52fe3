//! The provider registry: provider instances by the name `spec.provider` selects.

use std::{collections::BTreeMap, sync::Arc};

use super::{Provider, SharedProvider};

/// `spec.provider` names no configured instance: a user error on the Proxy, not a crash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no provider instance named {name:?} is configured (configured: {configured})")]
pub struct UnknownProvider {
    /// The name asked for.
    pub name: String,
    /// The configured names, comma-separated.
    pub configured: String,
}

/// Provider instances by name.
#[derive(Clone, Default)]
pub struct ProviderRegistry {
    providers: BTreeMap<String, SharedProvider>,
}

impl ProviderRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a provider under its instance name, replacing any earlier one of that name.
    pub fn insert(&mut self, provider: SharedProvider) {
        self.providers.insert(provider.instance().to_owned(), provider);
    }

    /// Builder form of [`Self::insert`].
    pub fn with(mut self, provider: impl Provider + 'static) -> Self {
        self.insert(Arc::new(provider));
        self
    }

    /// The provider `spec.provider` names.
    pub fn get(&self, name: &str) -> Result<&SharedProvider, UnknownProvider> {
        self.providers.get(name).ok_or_else(|| UnknownProvider {
            name: name.to_owned(),
            configured: self.providers.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    /// Every provider, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &SharedProvider)> {
        self.providers
            .iter()
            .map(|(name, provider)| (name.as_str(), provider))
    }
}
