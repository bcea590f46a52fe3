//! The spec hash: what decides whether the running instance must be replaced.
//!
//! It covers the placement, the *resolved* cloud-init content and the effective port, and nothing
//! else: attributes, lease limits and health settings change in place and must never churn
//! instances. The encoding is canonical (fixed field order, length-prefixed values, a version
//! tag), so the hash is stable across releases unless the encoding version changes on purpose.
//!
//! Applied hash strings carry their encoding version, so an upgrade that changes the encoding
//! replaces nothing: an instance stamped under an older version is compared under that version
//! ([`compare`], [`matches()`]) and only a real change of what runs replaces it.
//!
//! - version 1: 64 lowercase hex digits, no prefix (every hash written before versioning);
//! - version N ≥ 2: `vN:` followed by 64 lowercase hex digits.
//!
//! Changing how any version encodes is forbidden (golden tests pin exact values); a new encoding
//! is a new version: add it to [`hash_under`] and make it [`CURRENT_VERSION`].

use sha2::{Digest, Sha256};

use crate::api::{Placement, ProxySpec};

/// The encoding new hashes are written in.
pub const CURRENT_VERSION: u32 = 1;

/// Every version this operator can compute, oldest first.
pub const KNOWN_VERSIONS: &[u32] = &[1];

/// The tag hashed into version 1 (part of its encoding: never change it).
const V1_TAG: &str = "epo-spec-hash-v1";

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

impl<'a> HashInputs<'a> {
    /// The inputs of `spec` with its cloud-init Secret's content resolved to `cloud_init`.
    ///
    /// The spec is destructured without `..`: a new field fails to compile here until someone
    /// decides whether it changes what runs (and, if it does, adds a new encoding version).
    pub fn of(spec: &'a ProxySpec, cloud_init: Option<&'a str>) -> Self {
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
        Self {
            placement,
            cloud_init,
            port: *port,
        }
    }
}

/// The spec hash of `spec` (cloud-init content resolved to `cloud_init`) in the current encoding:
/// what a new or replaced instance is stamped with.
pub fn for_spec(spec: &ProxySpec, cloud_init: Option<&str>) -> String {
    spec_hash(HashInputs::of(spec, cloud_init))
}

/// The hash of `inputs` in the current encoding.
pub fn spec_hash(inputs: HashInputs<'_>) -> String {
    // CURRENT_VERSION is in KNOWN_VERSIONS (a test checks it), so this always computes.
    hash_under(CURRENT_VERSION, inputs).unwrap_or_default()
}

/// The hash of `inputs` in encoding `version`, prefixed as that version writes it; `None` for a
/// version this operator does not know.
pub fn hash_under(version: u32, inputs: HashInputs<'_>) -> Option<String> {
    match version {
        1 => Some(hex(&encode_v1(inputs))),
        _ => None,
    }
}

/// The encoding version of an applied hash string; `None` when it is not a hash string at all.
pub fn version_of(applied: &str) -> Option<u32> {
    let is_digest = |s: &str| s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if is_digest(applied) {
        return Some(1);
    }
    let (version, digest) = applied.strip_prefix('v')?.split_once(':')?;
    let version: u32 = version.parse().ok()?;
    // Version 1 is never prefixed; a "v1:" string is not one this format writes.
    (version >= 2 && is_digest(digest)).then_some(version)
}

/// How an applied hash compares with the desired spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Comparison {
    /// What runs is what the spec asks for (compared under the applied hash's encoding).
    Same,
    /// The spec (or the resolved cloud-init content) changed what must run.
    Changed,
    /// The applied hash is in an encoding this operator does not know (a newer operator wrote it,
    /// i.e. a downgrade) or is not a hash string: it cannot tell. Replacing on this would churn
    /// every instance after a downgrade, so the caller decides (e.g. keep it and report).
    Unknown,
}

/// Compares the hash an instance was stamped with (`applied`) with the desired spec, under the
/// applied hash's own encoding version: an upgrade that changes the encoding replaces nothing.
pub fn compare(applied: &str, spec: &ProxySpec, cloud_init: Option<&str>) -> Comparison {
    let Some(desired) = version_of(applied).and_then(|v| hash_under(v, HashInputs::of(spec, cloud_init)))
    else {
        return Comparison::Unknown;
    };
    if desired == applied {
        Comparison::Same
    } else {
        Comparison::Changed
    }
}

/// Whether the instance stamped with `applied` runs what `spec` asks for ([`compare`] is
/// [`Comparison::Same`]). An unknown encoding is not a match; use [`compare`] to treat it apart.
pub fn matches(applied: &str, spec: &ProxySpec, cloud_init: Option<&str>) -> bool {
    compare(applied, spec, cloud_init) == Comparison::Same
}

/// Version 1: SHA-256 over length-prefixed (name, optional value) fields in a fixed order.
fn encode_v1(inputs: HashInputs<'_>) -> [u8; 32] {
    let Placement {
        host,
        zone,
        address,
        outgoing_address,
    } = inputs.placement;
    let mut hasher = Sha256::new();
    field(&mut hasher, "version", Some(V1_TAG));
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
    hasher.finalize().into()
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
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

    /// Each case: a description, a change to the spec, and whether the hash must change. The
    /// Secret content is `CONTENT` throughout; its rotation is the one case that changes it.
    #[test]
    fn only_placement_port_and_secret_content_change_the_hash() {
        type Mutation = fn(&mut ProxySpec);
        let cases: Vec<(&str, Mutation, bool)> = vec![
            (
                "placement zone",
                |s| s.placement.zone = Some("rack3".into()),
                true,
            ),
            ("placement host", |s| s.placement.host = Some("hv07".into()), true),
            (
                "placement address",
                |s| s.placement.address = Some("192.0.2.9".into()),
                true,
            ),
            (
                "outgoing address",
                |s| s.placement.outgoing_address = Some("192.0.2.10".into()),
                true,
            ),
            ("port", |s| s.port = 8080, true),
            (
                "attributes",
                |s| s.attributes = BTreeMap::from([("region".into(), "us".into())]).into(),
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
                false,
            ),
            (
                "auth secret",
                |s| {
                    s.auth = Some(ProxyAuth {
                        secret_ref: crate::api::ProxyAuthSecretRef { name: "creds".into() },
                    })
                },
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
                false,
            ),
            ("nothing", |_| {}, false),
        ];
        let before = for_spec(&base(), Some(CONTENT));
        for (what, mutate, changes) in cases {
            let mut spec = base();
            mutate(&mut spec);
            let after = for_spec(&spec, Some(CONTENT));
            assert_eq!(
                after != before,
                changes,
                "{what}: hash change expected = {changes}"
            );
        }
        let rotated = for_spec(&base(), Some("#cloud-config\npackages: [squid, curl]\n"));
        assert_ne!(
            rotated, before,
            "secret content rotated: hash change expected = true"
        );
    }

    #[test]
    fn absent_and_empty_values_differ_and_the_hash_is_stable() {
        let spec = base();
        assert_ne!(for_spec(&spec, None), for_spec(&spec, Some("")));
        assert_eq!(for_spec(&spec, Some(CONTENT)), for_spec(&base(), Some(CONTENT)));
    }

    /// Fixed specs and the exact hashes every released operator stamped for them. A failure here
    /// means an encoding changed: restore it and add a new version instead (see the module docs),
    /// or every instance is replaced on upgrade.
    fn golden() -> Vec<(&'static str, ProxySpec, Option<&'static str>, u32, &'static str)> {
        let spec =
            |json: serde_json::Value| -> ProxySpec { serde_json::from_value(json).expect("valid spec") };
        vec![
            (
                "minimal: no placement, no cloud-init, default port",
                spec(serde_json::json!({"provider": "local"})),
                None,
                1,
                "b4560b878883e059e0495b1f7bc3112f1006c10f8d9c3d4d7eb834879a8a4eff",
            ),
            (
                "zone and cloud-init content",
                base(),
                Some(CONTENT),
                1,
                "dae0a5e4720903f1642d57ce1ec7bef69719fefbb20a2b10fe2d0cf6f007439f",
            ),
            (
                "every placement field and a port",
                spec(serde_json::json!({
                    "provider": "kvm-hv07",
                    "placement": {
                        "host": "hv07",
                        "zone": "rack2",
                        "address": "192.0.2.7",
                        "outgoingAddress": "198.51.100.7",
                    },
                    "port": 8080,
                    "attributes": {"region": "eu", "tier": "gold"},
                })),
                None,
                1,
                "3733e4c8fe96d845db5106eb5975a387ddd6f66be5972d15c85b39e153e987a4",
            ),
            (
                "empty cloud-init content",
                base(),
                Some(""),
                1,
                "5de3d86869981cedfde0a57397df1e31a38dd76ab840c8699eaf511822937960",
            ),
        ]
    }

    #[test]
    fn golden_hashes_are_pinned_per_version() {
        for (what, spec, content, version, expected) in golden() {
            let inputs = HashInputs::of(&spec, content);
            assert_eq!(
                hash_under(version, inputs).as_deref(),
                Some(expected),
                "{what}: v{version} encoding changed"
            );
            assert_eq!(version_of(expected), Some(version), "{what}");
            if version == CURRENT_VERSION {
                assert_eq!(for_spec(&spec, content), expected, "{what}");
            }
        }
    }

    #[test]
    fn applied_hashes_are_compared_under_their_own_version() {
        assert!(KNOWN_VERSIONS.contains(&CURRENT_VERSION));
        for (what, spec, content, _, applied) in golden() {
            assert_eq!(compare(applied, &spec, content), Comparison::Same, "{what}");
            assert!(matches(applied, &spec, content), "{what}");
            let mut moved = spec.clone();
            moved.port += 1;
            assert_eq!(compare(applied, &moved, content), Comparison::Changed, "{what}");
            assert!(!matches(applied, &moved, content), "{what}");
        }
        // Written by a newer operator (a downgrade), or not a hash at all: cannot tell.
        let spec = base();
        let newer = format!("v{}:{}", CURRENT_VERSION + 1, "0".repeat(64));
        for applied in [newer.as_str(), "", "not-a-hash", "v1:abc", &"A".repeat(64)] {
            assert_eq!(
                compare(applied, &spec, Some(CONTENT)),
                Comparison::Unknown,
                "{applied:?}"
            );
            assert!(!matches(applied, &spec, Some(CONTENT)), "{applied:?}");
        }
    }

    #[test]
    fn version_prefixes_parse() {
        let digest = "0123456789abcdef".repeat(4);
        assert_eq!(version_of(&digest), Some(1));
        assert_eq!(version_of(&format!("v2:{digest}")), Some(2));
        assert_eq!(version_of(&format!("v17:{digest}")), Some(17));
        assert_eq!(version_of(&format!("v1:{digest}")), None);
        assert_eq!(version_of(&format!("v2:{}", &digest[1..])), None);
        assert_eq!(version_of(&format!("v2{digest}")), None);
        assert_eq!(version_of(&digest.to_uppercase()), None);
    }
}
