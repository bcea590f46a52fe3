//! [`Attributes`]: a Proxy's free-form labels, as a sorted slice rather than a map. Every cached
//! Proxy carries them, and a `BTreeMap`'s first node alone is ~560 bytes whatever it holds; at
//! 10,000 Proxies that was 5.6 MB of the operator's memory. On the wire and in the schema they
//! are exactly a string map.

use std::{borrow::Cow, collections::BTreeMap};

use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Deserializer, Serialize, Serializer, ser::SerializeMap};

/// String attributes, sorted by key, keys unique.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Attributes(Box<[(String, String)]>);

impl Attributes {
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .ok()
            .map(|i| self.0[i].1.as_str())
    }

    /// Every attribute, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// As a map.
    pub fn to_map(&self) -> BTreeMap<String, String> {
        self.0.iter().cloned().collect()
    }
}

impl From<BTreeMap<String, String>> for Attributes {
    fn from(map: BTreeMap<String, String>) -> Self {
        // A BTreeMap iterates sorted and unique: the invariant holds.
        Attributes(map.into_iter().collect())
    }
}

impl FromIterator<(String, String)> for Attributes {
    /// The last value of a repeated key wins, as in a map.
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        iter.into_iter().collect::<BTreeMap<_, _>>().into()
    }
}

impl Serialize for Attributes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0.iter() {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Attributes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::<String, String>::deserialize(deserializer).map(Attributes::from)
    }
}

impl JsonSchema for Attributes {
    fn inline_schema() -> bool {
        <BTreeMap<String, String> as JsonSchema>::inline_schema()
    }

    fn schema_name() -> Cow<'static, str> {
        <BTreeMap<String, String> as JsonSchema>::schema_name()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        <BTreeMap<String, String> as JsonSchema>::json_schema(generator)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_a_string_map_on_the_wire_and_sorted_inside() {
        let attributes: Attributes = serde_json::from_str(r#"{"tier":"dc","region":"eu"}"#).unwrap();
        assert_eq!(attributes.get("region"), Some("eu"));
        assert_eq!(attributes.get("tier"), Some("dc"));
        assert_eq!(attributes.get("zone"), None);
        assert_eq!(
            attributes.iter().collect::<Vec<_>>(),
            [("region", "eu"), ("tier", "dc")]
        );
        assert_eq!(
            serde_json::to_string(&attributes).unwrap(),
            r#"{"region":"eu","tier":"dc"}"#
        );
        let repeated: Attributes = [("a", "1"), ("a", "2")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        assert_eq!(repeated.len(), 1);
        assert_eq!(repeated.get("a"), Some("2"));
    }
}
