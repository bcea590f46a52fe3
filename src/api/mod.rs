//! The operator's Kubernetes API: the `Proxy` and `ProviderHealth` custom resources
//! (`crawl.example.com/v1alpha1`) and the rendering of their CRDs.
//!
//! Validation and defaults live in the generated schema and its CEL rules
//! (`x-kubernetes-validations`), so the API server enforces them without a webhook and
//! [`crate::check`] can enforce the very same rules offline.

mod attributes;
mod crd;
mod key;
mod provider_health;
mod proxy;

pub use attributes::Attributes;
pub use crd::{CrdFile, crd_files, render_all};
#[cfg(test)]
pub(crate) use key::test_key;
pub use key::{MalformedProxyKey, ProxyKey};
pub use provider_health::{ProviderHealth, ProviderHealthFields, ProviderHealthStatus};
pub use proxy::{
    CLOUD_INIT_SECRET_LABEL, CloudInit, HealthCheck, LeasePolicy, Placement, Proxy, ProxyAuth,
    ProxyAuthSecretRef, ProxySpec, ProxyStatus, SecretKeyRef,
};

/// API group of every resource this operator defines.
pub const GROUP: &str = "crawl.example.com";
/// The one served and stored version.
pub const VERSION: &str = "v1alpha1";
/// The annotation that asks for a fresh instance of a Proxy (a new address): any value other
/// than the one in `status.lastRecycle` is a request not acted on yet. A value per request
/// (a timestamp, a counter) makes each one recycle once.
pub const RECYCLE_ANNOTATION: &str = "crawl.example.com/recycle";
