//! Why a reconcile failed, and how long a mode waits before trying that Proxy again.

use std::time::Duration;

use crate::{
    effects::{BackendError, SecretError},
    provider::ProviderError,
};

/// Why a reconcile failed; the category decides how the controller retries.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The object lacks what the API server always sets (uid, namespace): an invariant broke.
    #[error("object is missing {0}")]
    MalformedObject(&'static str),
    /// The stored status can't be read back into a state.
    #[error("unreadable status: {0}")]
    UnreadableStatus(String),
    /// A provider call failed in a way that retrying may fix.
    #[error(transparent)]
    Provider(#[from] ProviderError),
    /// A write failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A referenced Secret could not be read (not a user error).
    #[error(transparent)]
    Secret(SecretError),
}

impl ReconcileError {
    /// A bounded label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            Self::MalformedObject(_) => "MalformedObject",
            Self::UnreadableStatus(_) => "UnreadableStatus",
            Self::Provider(e) => e.category(),
            Self::Backend(BackendError::Conflict(_)) => "Conflict",
            Self::Backend(BackendError::Gone(_)) => "Gone",
            Self::Backend(BackendError::Other(_)) => "BackendError",
            Self::Secret(_) => "SecretUnreadable",
        }
    }
}

/// How long a mode waits before reconciling a Proxy again after `failures` failed reconciles
/// in a row (the backend or the API failed, not a provider: those are rows of the table):
/// 1 s, 2 s, 4 s ... capped at 300 s.
pub fn error_backoff(failures: u32) -> Duration {
    let exponent = failures.saturating_sub(1).min(9);
    Duration::from_secs((1u64 << exponent).min(300))
}
