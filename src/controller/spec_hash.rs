//! The spec hash: what decides whether the running instance must be replaced.
//!
//! It covers the placement, the *resolved* cloud-init content and the effective port, and nothing
//! else: attributes, lease limits and health settings change in place and must never churn
//! instances. The encoding is canonical (fixed field order, length-prefixed values, a version
//! tag), so the hash is stable across releases unless the version tag changes on purpose.

use sha2::{Digest, Sha256};

use crate::api::{Placement, ProxySpec};

/// Bump when the encoding changes; every instance would then be replaced once.
const ENCODING_VERSION: &str = "epo-spec-hash-v1";

/// The inputs of the hash, resolved (the cloud-init Secret already read).
#[derive(Clone, Copy, Debug)]
pub struct HashInputs<'a> {
    /// `spec.placement`.
    pub placement: &'a Placement,
    /// The cloud-init user-data content, if the Proxy references a Secret.
    pub cloud_init: Option<&'a str>,
    /// The effective port (the default applied).
    pub port: i32,
}

/// The spec hash of `spec` with its cloud-init Secret's content resolved to `cloud_init`.
///
/// The spec is destructured without `..`: a new field fails to compile here until someone decides
/// whether it changes what runs.
pub fn for_spec(spec: &ProxySpec, cloud_init: Option<&str>) -> String {
    let ProxySpec {
        provider: _,
        placement,
        cloud_init: _,
        port,
        attributes: _,
        lease: _,
        health: _,
        auth: _,
    } = spec;
    spec_hash(HashInputs {
        placement,
        cloud_init,
        port: *port,
    })
}

/// The hex SHA-256 of the canonical encoding of `inputs`.
pub fn spec_hash(inputs: HashInputs<'_>) -> String {
    let Placement {
        host,
        zone,
        address,
        outgoing_address,
    } = inputs.placement;
    let mut hasher = Sha256::new();
    field(&mut hasher, "version", Some(ENCODING_VERSION));
    field(&mut hasher, "placement.host", host.as_deref());
    field(&mut hasher, "placement.zone", zone.as_deref());
    field(&mut hasher, "placement.address", address.as_deref());
    field(
        &mut hasher,
        "placement.outgoingAddress",
        outgoing_address.as_deref(),
    );
    field(&mut hasher, "cloudInit", inputs.cloud_init);
    field(&mut hasher, "port", Some(&inputs.port.to_string()));
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// `name` and `value` length-prefixed, so no two different inputs encode alike (an absent value
/// differs from an empty one).
fn field(hasher: &mut Sha256, name: &str, value: Option<&str>) {
    hasher.update(name.len().to_le_bytes());
    hasher.update(name.as_bytes());
    match value {
        None => hasher.update([0u8]),
        Some(value) => {
            hasher.update([1u8]);
            hasher.update(value.len().to_le_bytes());
            hasher.update(value.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::api::{CloudInit, HealthCheck, LeasePolicy, ProxyAuth, SecretKeyRef};

    fn base() -> ProxySpec {
        serde_json::from_value(serde_json::json!({
            "provider": "kvm2-rack2",
            "placement": {"zone": "rack2"},
            "cloudInit": {"secretRef": {"name": "squid-cloud-init"}},
            "attributes": {"region": "eu"},
        }))
        .expect("valid spec")
    }

    const CONTENT: &str = "#cloud-config\npackages: [squid]\n";

    /// Each case: a description, a change to the spec, the Secret content, and whether the hash
    /// must change.
    #[test]
    fn only_placement_port_and_secret_content_change_the_hash() {
        type Mutation = fn(&mut ProxySpec);
        let cases: Vec<(&str, Mutation, &str, bool)> = vec![
            (
                "placement zone",
                |s| s.placement.zone = Some("rack3".into()),
                CONTENT,
                true,
            ),
            (
                "placement host",
                |s| s.placement.host = Some("hv07".into()),
                CONTENT,
                true,
            ),
            (
                "placement address",
                |s| s.placement.address = Some("192.0.2.9".into()),
                CONTENT,
                true,
            ),
            (
                "outgoing address",
                |s| s.placement.outgoing_address = Some("192.0.2.10".into()),
                CONTENT,
                true,
            ),
            ("port", |s| s.port = 8080, CONTENT, true),
            (
                "secret content rotated",
                |_| {},
                "#cloud-config\npackages: [squid, curl]\n",
                true,
            ),
            (
                "attributes",
                |s| s.attributes = BTreeMap::from([("region".into(), "us".into())]),
                CONTENT,
                false,
            ),
            (
                "lease limits",
                |s| {
                    s.lease = LeasePolicy {
                        max_concurrent: 9,
                        cooldown_seconds: 60,
                        max_ttl_seconds: 60,
                    }
                },
                CONTENT,
                false,
            ),
            (
                "health settings",
                |s| {
                    s.health = HealthCheck {
                        interval_seconds: 5,
                        timeout_seconds: 1,
                        ..HealthCheck::default()
                    }
                },
                CONTENT,
                false,
            ),
            (
                "auth secret",
                |s| {
                    s.auth = Some(ProxyAuth {
                        secret_ref: crate::api::ProxyAuthSecretRef { name: "creds".into() },
                    })
                },
                CONTENT,
                false,
            ),
            // Renaming the Secret with the same content runs the same thing.
            (
                "secret renamed, same content",
                |s| {
                    s.cloud_init = Some(CloudInit {
                        secret_ref: SecretKeyRef {
                            name: "other".into(),
                            key: None,
                        },
                    })
                },
                CONTENT,
                false,
            ),
            ("nothing", |_| {}, CONTENT, false),
        ];
        let before = for_spec(&base(), Some(CONTENT));
        for (what, mutate, content, changes) in cases {
            let mut spec = base();
            mutate(&mut spec);
            let after = for_spec(&spec, Some(content));
            assert_eq!(
                after != before,
                changes,
                "{what}: hash change expected = {changes}"
            );
        }
    }

    #[test]
    fn absent_and_empty_values_differ_and_the_hash_is_stable() {
        let spec = base();
        assert_ne!(for_spec(&spec, None), for_spec(&spec, Some("")));
        // A fixed value: a change of encoding must be deliberate (bump ENCODING_VERSION).
        assert_eq!(for_spec(&spec, Some(CONTENT)).len(), 64);
        assert_eq!(for_spec(&spec, Some(CONTENT)), for_spec(&base(), Some(CONTENT)));
    }
}
