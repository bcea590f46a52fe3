//! The provider contract suite (tests/support/contract.rs) against every provider this build
//! has: one test per property and provider, so a failure names both.

#[allow(dead_code)]
#[macro_use]
mod support {
    #[macro_use]
    pub mod contract;
    pub mod local;
    pub mod ports;
    pub mod process;
}

/// The in-memory provider. Its state lives in the object, so "reopening" it hands back the
/// same object: `create_after_crash` then checks create-after-a-lost-response.
mod memory {
    use std::sync::Arc;

    use async_trait::async_trait;
    use egress_proxies_operator::provider::{InstanceRequest, Owner, Provider, memory::MemoryProvider};

    use crate::support::contract::{self, ContractBackend};

    pub struct MemoryBackend {
        provider: Arc<MemoryProvider>,
    }

    impl MemoryBackend {
        pub fn new() -> Self {
            Self {
                provider: Arc::new(MemoryProvider::new("memory")),
            }
        }
    }

    #[async_trait]
    impl ContractBackend for MemoryBackend {
        async fn open(&self) -> Arc<dyn Provider> {
            self.provider.clone()
        }

        fn request(&self, owner: &Owner) -> InstanceRequest {
            // Deterministic per owner: the spec hash derives from the UID.
            InstanceRequest {
                spec_hash: format!("spec-{}", owner.uid),
                ..contract::plain_request(owner.clone(), 3128)
            }
        }

        async fn backend_objects(&self, name: &str) -> usize {
            self.provider.names().iter().filter(|n| *n == name).count()
        }
    }

    contract_tests!(MemoryBackend::new());

    /// The whole suite in one go, as `run_contract_suite` callers use it.
    #[tokio::test]
    async fn whole_suite_in_one_go() {
        let backend = MemoryBackend::new();
        contract::run_contract_suite(&backend).await;
        assert!(
            backend.provider.names().is_empty(),
            "the suite deletes what it made"
        );
    }
}

/// The local provider: real Squid processes on 127.0.0.1. The backend fails a test that
/// leaves a Squid running under its state folder.
mod local {
    use crate::support::local::LocalBackend;

    contract_tests!(LocalBackend::new());
}
