//! An acquire body's `selector` object as parsed: its terms borrowed from the request's bytes.
//!
//! A crawler sends the same one or two terms on every acquire. Parsed into a
//! `BTreeMap<String, String>`, they cost an allocation per key, per value and per map node, and
//! the map's comparison and drop, on every request (about 700 instructions of an acquire
//! under callgrind). Here they stay slices of the body (copied only when JSON escapes them),
//! inline for up to two terms.

use std::{borrow::Cow, fmt, marker::PhantomData};

use serde::{
    Deserialize,
    de::{Deserializer, MapAccess, Visitor},
};
use smallvec::SmallVec;

/// The terms, sorted by key; a key given twice keeps its last value, as a JSON object's map
/// would.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SelectorTerms<'a>(SmallVec<[(Cow<'a, str>, Cow<'a, str>); 2]>);

impl<'a> SelectorTerms<'a> {
    /// Terms borrowing `(key, value)` pairs, e.g. a map's entries (a later pair replaces an
    /// earlier one of the same key).
    pub fn from_pairs<K, V>(pairs: impl IntoIterator<Item = (&'a K, &'a V)>) -> Self
    where
        K: AsRef<str> + ?Sized + 'a,
        V: AsRef<str> + ?Sized + 'a,
    {
        let mut terms = Self::default();
        for (key, value) in pairs {
            terms.insert(Cow::Borrowed(key.as_ref()), Cow::Borrowed(value.as_ref()));
        }
        terms
    }

    /// Adds a term; a key given again replaces its value.
    pub(super) fn insert(&mut self, key: Cow<'a, str>, value: Cow<'a, str>) {
        match self.0.binary_search_by(|(k, _)| k.as_ref().cmp(key.as_ref())) {
            Ok(at) => self.0[at].1 = value,
            Err(at) => self.0.insert(at, (key, value)),
        }
    }

    /// How many terms.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none (any proxy matches).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The `(key, value)` pairs, by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_ref(), v.as_ref()))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for SelectorTerms<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Terms<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Terms<'a> {
            type Value = SelectorTerms<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of attribute names to string values")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut terms = SelectorTerms::default();
                while let Some((Text(key), Text(value))) = map.next_entry()? {
                    terms.insert(key, value);
                }
                Ok(terms)
            }
        }
        deserializer.deserialize_map(Terms(PhantomData))
    }
}

/// A JSON string borrowed from the input when it has no escapes (serde's `Cow` alone always
/// copies; `borrow` on a `Cow` field borrows).
#[derive(Deserialize)]
#[serde(transparent)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_borrow_plain_strings_sort_by_key_and_keep_a_repeated_keys_last_value() {
        let body = r#"{"zone":"b","tier":"dc","zone":"a\u0062"}"#;
        let terms: SelectorTerms<'_> = serde_json::from_str(body).unwrap();
        assert_eq!(terms.iter().collect::<Vec<_>>(), [("tier", "dc"), ("zone", "ab")]);
        assert!(
            matches!(terms.0[0].1, Cow::Borrowed(_)),
            "a plain string is not copied"
        );
        assert!(matches!(terms.0[1].1, Cow::Owned(_)), "an escaped one is decoded");
        assert_eq!(terms, SelectorTerms::from_pairs([("zone", "ab"), ("tier", "dc")]));
    }

    #[test]
    fn a_value_that_is_not_a_string_is_refused() {
        let refused = serde_json::from_str::<SelectorTerms<'_>>(r#"{"tier":1}"#).unwrap_err();
        assert!(refused.to_string().contains("expected a string"), "{refused}");
        assert!(serde_json::from_str::<SelectorTerms<'_>>(r#"["tier"]"#).is_err());
    }
}
