//! [`ProxyKey`]: the name of one Proxy (`namespace/name`), the one key type of the controller,
//! both modes' stores, the lease store, the health engine and the discovery API.

use std::{cmp::Ordering, fmt, str::FromStr, sync::Arc};

/// A Proxy's `namespace/name`. Cheap to clone and hash (one shared string). Ordered by
/// namespace, then name (as `kubectl` lists them; not the joined string's order, in which
/// `a-b/x` would come before `a/x`).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ProxyKey {
    full: Arc<str>,
    /// Byte index of the `/` between namespace and name.
    split: usize,
}

impl ProxyKey {
    /// The key of the Proxy `name` in `namespace`.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            full: Arc::from(format!("{namespace}/{name}")),
            split: namespace.len(),
        }
    }

    /// The namespace part.
    pub fn namespace(&self) -> &str {
        &self.full[..self.split]
    }

    /// The name part.
    pub fn name(&self) -> &str {
        &self.full[self.split + 1..]
    }

    /// `namespace/name`.
    pub fn as_str(&self) -> &str {
        &self.full
    }
}

/// A test's Proxy `name` in the `crawl` namespace, the namespace every unit test uses.
#[cfg(test)]
pub(crate) fn test_key(name: &str) -> ProxyKey {
    ProxyKey::new("crawl", name)
}

impl Ord for ProxyKey {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.namespace(), self.name()).cmp(&(other.namespace(), other.name()))
    }
}

impl PartialOrd for ProxyKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for ProxyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.full)
    }
}

impl fmt::Debug for ProxyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProxyKey({})", self.full)
    }
}

/// A string that is not `namespace/name` with both parts non-empty.
#[derive(Debug, thiserror::Error)]
#[error("malformed proxy key {0:?}: expected namespace/name")]
pub struct MalformedProxyKey(pub String);

impl FromStr for ProxyKey {
    type Err = MalformedProxyKey;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Namespaces cannot contain '/', so the first one separates the parts.
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Self::new(ns, name))
            }
            _ => Err(MalformedProxyKey(s.to_owned())),
        }
    }
}

impl serde::Serialize for ProxyKey {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.full)
    }
}

impl<'de> serde::Deserialize<'de> for ProxyKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
