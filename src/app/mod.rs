//! The core both modes start: [`start_core`] runs the health engine, the discovery API (with
//! the status page), lease upkeep (reaping, checkpoints), the provider-health monitor and
//! orphan GC, each over the adapters a mode hands it ([`CoreAdapters`]); it returns what the
//! mode's reconcile loop drives ([`Core`]). Also the discovery API's authentication options
//! ([`DiscoveryAuthOptions`], [`discovery_authenticator`]), shared by both modes' flags.
//!
//! Owns: the order in which the shared services start and stop, and the start-up error type.
//! Must not touch: Kubernetes or the state folder. What differs between the modes (where
//! desired state comes from, where checkpoints and provider health go, who the live owners
//! are) arrives as an adapter from [`crate::cluster`] or [`crate::standalone`], which this
//! module never names.

mod auth;
mod core;

pub use auth::{DiscoveryAuthOptions, TOKEN_RELOAD_INTERVAL, discovery_authenticator};
pub use core::{
    Core, CoreAdapters, CoreFlags, CoreMetrics, CoreTasks, GatewayOptions, StatusPageAt, StopSignal,
    start_core,
};

use crate::{config::ConfigError, provider::RegistryError};

/// Why the operator could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The providers config.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Building the providers.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A mode's own start-up failure (standalone mode: the state or manifests folder).
    #[error(transparent)]
    Mode(Box<dyn std::error::Error + Send + Sync>),
    /// Anything else at start-up (bind, key files, engines).
    #[error("{0}")]
    Startup(String),
}
