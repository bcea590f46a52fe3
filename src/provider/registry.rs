//! The provider registry: provider instances by the name `spec.provider` selects.

use std::{collections::BTreeMap, sync::Arc};

use super::{
    Installation, Provider, SharedProvider,
    kubernetes::KubernetesProvider,
    kvm::KvmProvider,
    kvm2::Kvm2Provider,
    local::{LocalProvider, LocalSetupError},
};
use crate::config::{ProviderSettings, ProvidersConfig};

/// A providers config that cannot be turned into providers.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A `kubernetes` instance, but no Kubernetes client to build it with (the standalone
    /// mode has none).
    #[error(
        "provider instance {instance:?}: type kubernetes needs a Kubernetes API client, and this \
         mode has none (the standalone mode runs kvm, kvm2 and local providers only)"
    )]
    NoKubeClient {
        /// The instance name.
        instance: String,
    },
    /// A `local` instance's settings cannot work.
    #[error("provider instance {instance:?}: {cause}")]
    Local {
        /// The instance name.
        instance: String,
        /// Why.
        cause: LocalSetupError,
    },
    /// Two `local` instances share a stateDir: each would list and supervise the other's
    /// Squids as its own.
    #[error("provider instances {first:?} and {second:?} share stateDir {state_dir}: give each its own")]
    SharedStateDir {
        /// The earlier instance.
        first: String,
        /// The later instance.
        second: String,
        /// The folder.
        state_dir: String,
    },
}

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

    /// One provider per instance of the providers config, without a Kubernetes client (a
    /// `kubernetes` instance is an error, [`RegistryError::NoKubeClient`]), for the default
    /// [`Installation`] (tools and tests; both modes use [`Self::for_installation`]).
    pub fn from_config(config: &ProvidersConfig) -> Result<Self, RegistryError> {
        Self::for_installation(config, None, &Installation::default())
    }

    /// One provider per instance of the providers config, each stamping, adopting and
    /// collecting as `installation`; `kubernetes` instances talk to the cluster through
    /// `client` (the operator's own client, or one for another cluster).
    pub fn for_installation(
        config: &ProvidersConfig,
        client: Option<kube::Client>,
        installation: &Installation,
    ) -> Result<Self, RegistryError> {
        let mut registry = Self::new();
        let mut state_dirs: BTreeMap<std::path::PathBuf, &str> = BTreeMap::new();
        for instance in &config.instances {
            let name = instance.name.as_str();
            let provider: SharedProvider = match &instance.settings {
                ProviderSettings::Local(settings) => {
                    // Compared as the provider will use them (relative paths made absolute).
                    let state_dir = std::path::absolute(&settings.state_dir)
                        .unwrap_or_else(|_| settings.state_dir.clone());
                    if let Some(first) = state_dirs.insert(state_dir, name) {
                        return Err(RegistryError::SharedStateDir {
                            first: first.to_owned(),
                            second: name.to_owned(),
                            state_dir: settings.state_dir.display().to_string(),
                        });
                    }
                    let local = LocalProvider::for_installation(installation.clone(), name, settings.clone())
                        .map_err(|cause| RegistryError::Local {
                            instance: name.to_owned(),
                            cause,
                        })?;
                    Arc::new(local)
                }
                ProviderSettings::Kvm(settings) => {
                    Arc::new(KvmProvider::new(name, settings.clone()).with_installation(installation.clone()))
                }
                ProviderSettings::Kvm2(settings) => Arc::new(
                    Kvm2Provider::new(name, settings.clone()).with_installation(installation.clone()),
                ),
                #[cfg(feature = "bench-provider")]
                ProviderSettings::BenchMemory => {
                    Arc::new(super::memory::MemoryProvider::new(name).with_installation(installation.clone()))
                }
                ProviderSettings::Kubernetes(settings) => {
                    let Some(client) = &client else {
                        return Err(RegistryError::NoKubeClient {
                            instance: name.to_owned(),
                        });
                    };
                    Arc::new(
                        KubernetesProvider::new(name, settings.clone(), client.clone())
                            .with_installation(installation.clone()),
                    )
                }
            };
            registry.insert(provider);
        }
        Ok(registry)
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
