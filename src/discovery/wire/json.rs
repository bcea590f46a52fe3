//! The two answers of every lease's life are written by hand: serde's per-field machinery, string
//! escaping of IDs that need none and re-serializing the same proxy for every lease were about a
//! tenth of a request's cost. Tests check they are byte for byte what serde_json makes of the
//! types of [`super`] (which stay the contract's schemas).

use super::{AcquireResponse, ProxyJson, ReleaseResponse};
use crate::{
    json_writer::{put_plain, put_str, put_u64},
    lease::ProxyInfo,
};

/// The proxy's JSON in an acquire answer ([`ProxyJson::from_info`]), rendered once per proxy
/// configuration and kept with its info.
pub(crate) fn proxy_json(info: &ProxyInfo) -> &str {
    info.rendered(|info| {
        serde_json::to_string(&ProxyJson::from_info(info)).expect("a proxy's JSON always serializes")
    })
}

impl AcquireResponse<'_> {
    /// The answer's JSON, as `serde_json` writes it, with `proxy` given as its JSON
    /// ([`proxy_json`]).
    pub(crate) fn write_json(&self, proxy: &str, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"leaseId\":");
        put_plain(out, &self.lease_id);
        out.extend_from_slice(b",\"fencingToken\":");
        put_u64(out, self.fencing_token);
        out.extend_from_slice(b",\"proxyUrl\":");
        put_str(out, self.proxy_url);
        out.extend_from_slice(b",\"proxy\":");
        out.extend_from_slice(proxy.as_bytes());
        out.extend_from_slice(b",\"acquiredAt\":\"");
        self.acquired_at.write(out);
        out.extend_from_slice(b"\",\"expiresAt\":\"");
        self.expires_at.write(out);
        out.push(b'"');
        out.extend_from_slice(b",\"ttlSeconds\":");
        put_u64(out, self.ttl_seconds);
        if let Some(not_before) = &self.not_before {
            out.extend_from_slice(b",\"notBefore\":");
            put_plain(out, not_before);
        }
        out.push(b'}');
    }
}

impl ReleaseResponse<'_> {
    /// How long [`Self::write_json`]'s JSON is: a buffer of exactly that capacity becomes the
    /// answer's `Bytes` without being shrunk (a reallocation) first.
    pub(crate) fn json_len(&self) -> usize {
        let released = if self.released { "true" } else { "false" };
        r#"{"leaseId":"","released":,"outcome":""}"#.len()
            + self.lease_id.len()
            + released.len()
            + self.outcome.as_str().len()
    }

    /// The answer's JSON, as `serde_json` writes it.
    pub(crate) fn write_json(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"leaseId\":");
        put_plain(out, self.lease_id);
        out.extend_from_slice(b",\"released\":");
        out.extend_from_slice(if self.released { b"true" } else { b"false" });
        out.extend_from_slice(b",\"outcome\":");
        put_plain(out, self.outcome.as_str());
        out.push(b'}');
    }
}

#[cfg(test)]
mod fast_json_tests {

    use super::*;
    use crate::{
        api::LeasePolicy,
        api::ProxyKey,
        lease::{LeaseTarget, Outcome, Rfc3339},
        provider::Endpoint,
    };

    fn info(name: &str, attributes: &[(&str, &str)]) -> ProxyInfo {
        ProxyInfo::new(&LeaseTarget {
            key: ProxyKey::new("crawl", name),
            endpoint: Endpoint {
                host: "10.0.0.7".into(),
                port: 3128,
            },
            attributes: attributes
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            policy: LeasePolicy {
                max_concurrent: 1,
                cooldown_seconds: 0,
                max_ttl_seconds: 60,
            },
            credentials: None,
        })
    }

    #[test]
    fn hand_written_answers_are_what_serde_json_writes() {
        let plain = info("p1", &[("region", "eu"), ("tier", "dc")]);
        let odd = info(
            "p2",
            &[("quote\"d", "back\\slash"), ("ctl", "a\u{1}b\n"), ("uni", "é✓")],
        );
        for (info, id, url, not_before) in [
            (&plain, "AAEC-_xyz09", "http://10.0.0.7:3128", None),
            // Lease IDs are base64url: written without the escaping check.
            (&odd, "Zm9v-YmFy_", "http://u:p%40@10.0.0.7:3128", None),
            (&odd, "", "ü", Some("2026-05-28T10:00:01.25Z")),
        ] {
            let acquired = AcquireResponse {
                lease_id: id.to_owned(),
                fencing_token: 3_649_891_200_000_032,
                proxy_url: url,
                proxy: ProxyJson::from_info(info),
                // 2026-05-28T10:00:00Z and 10:01:00.5Z.
                acquired_at: Rfc3339(1_779_962_400_000),
                expires_at: Rfc3339(1_779_962_460_500),
                ttl_seconds: 0,
                not_before: not_before.map(str::to_owned),
            };
            let mut fast = Vec::new();
            acquired.write_json(proxy_json(info), &mut fast);
            assert_eq!(
                String::from_utf8(fast).unwrap(),
                serde_json::to_string(&acquired).unwrap()
            );
            for (outcome, released) in [
                (Outcome::Ok, true),
                (Outcome::Banned, true),
                (Outcome::Error, true),
                (Outcome::Ok, false),
            ] {
                let released = ReleaseResponse {
                    lease_id: id,
                    released,
                    outcome,
                };
                let mut fast = Vec::new();
                released.write_json(&mut fast);
                assert_eq!(fast.len(), released.json_len());
                assert_eq!(
                    String::from_utf8(fast).unwrap(),
                    serde_json::to_string(&released).unwrap()
                );
            }
        }
    }
}
