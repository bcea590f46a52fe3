//! Lease stores filled with many active leases, for checkpoint tests and benchmarks (include
//! from a bench with `#[path = "../tests/support/leases.rs"] mod leases;`).

use std::{collections::BTreeMap, time::Duration};

use egress_proxies_operator::{
    api::{LeasePolicy, ProxyKey},
    lease::{AcquireRequest, Admission, LeaseId, LeaseStore, LeaseStoreConfig, LeaseTarget, Selector},
    provider::Endpoint,
};

/// Leases per proxy in [`filled_store`].
pub const LEASES_PER_PROXY: usize = 10;

/// A lease to renew: its ID and current token.
pub type Held = (LeaseId, u64);

/// A store with `leases` active leases of one hour, [`LEASES_PER_PROXY`] per proxy
/// (`ns-<i % 20>/proxy-<i>`), held by 50 crawlers, every tenth for a target domain.
pub fn filled_store(leases: usize) -> (LeaseStore, Vec<Held>) {
    let store = LeaseStore::new(LeaseStoreConfig::default());
    let proxies = leases.div_ceil(LEASES_PER_PROXY);
    for i in 0..proxies {
        let key = ProxyKey::new(&format!("ns-{}", i % 20), &format!("proxy-{i}"));
        store.upsert_proxy(LeaseTarget {
            key: key.clone(),
            endpoint: Endpoint {
                host: format!("10.0.{}.{}", i / 250, i % 250),
                port: 3128,
            },
            attributes: BTreeMap::from([("region".to_owned(), "eu".to_owned())]).into(),
            policy: LeasePolicy {
                max_concurrent: LEASES_PER_PROXY as i32,
                cooldown_seconds: 0,
                max_ttl_seconds: 3600,
            },
            credentials: None,
        });
        store.set_admission(&key, Admission::Open).expect("just added");
    }
    let selector = store.compile(&Selector::parse("region=eu").expect("a valid selector"));
    let holders: Vec<String> = (0..50).map(|h| format!("crawler-{h}")).collect();
    let mut held = Vec::with_capacity(leases);
    for i in 0..leases {
        let lease = store
            .acquire(&AcquireRequest {
                selector: &selector,
                holder: &holders[i % holders.len()],
                ttl: Duration::from_secs(3600),
                target_domain: (i % 10 == 0).then_some("example.com"),
                session_key: None,
                request_id: None,
            })
            .expect("the store has room for every lease");
        held.push((lease.id, lease.fencing_token));
    }
    (store, held)
}
