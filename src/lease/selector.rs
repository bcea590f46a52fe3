//! Attribute selectors (`region=eu,tier=dc`) and the interning of `key=value` pairs.
//!
//! Every attribute pair a proxy carries gets a small integer id; the store keeps one LRU list
//! per pair id, and a compiled selector is the sorted list of the ids it requires. Ids are
//! never reused, so the table grows with the number of distinct pairs ever configured (not
//! with requests: compiling a selector never adds a pair).

use std::collections::{BTreeMap, HashMap};

use crate::api::Attributes;

/// Longest selector accepted, in characters.
pub const MAX_SELECTOR_LEN: usize = 2048;
/// Most terms a selector may have.
pub const MAX_SELECTOR_TERMS: usize = 32;

/// A parsed selector: every `key=value` term must match (AND). Empty selects every proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    terms: Vec<(String, String)>,
}

/// A selector string that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectorError {
    /// Longer than [`MAX_SELECTOR_LEN`].
    #[error("selector is longer than {MAX_SELECTOR_LEN} characters")]
    TooLong,
    /// More than [`MAX_SELECTOR_TERMS`] terms.
    #[error("selector has more than {MAX_SELECTOR_TERMS} terms")]
    TooManyTerms,
    /// A term that is not `key=value` with a non-empty key.
    #[error("selector term {0:?} is not key=value")]
    BadTerm(String),
}

/// `t` without the spaces and tabs around it.
fn trim_blank(t: &str) -> &str {
    t.trim_matches([' ', '\t'])
}

impl Selector {
    /// Parses `key=value[,key=value...]`; spaces and tabs around terms, keys and values are
    /// ignored. The OpenAPI contract states this syntax as a pattern (a test compares them).
    pub fn parse(text: &str) -> Result<Self, SelectorError> {
        if text.len() > MAX_SELECTOR_LEN && text.chars().count() > MAX_SELECTOR_LEN {
            return Err(SelectorError::TooLong);
        }
        let mut terms = Vec::new();
        for term in text.split(',').map(trim_blank).filter(|t| !t.is_empty()) {
            let Some((key, value)) = term.split_once('=') else {
                return Err(SelectorError::BadTerm(term.to_owned()));
            };
            let (key, value) = (trim_blank(key), trim_blank(value));
            if key.is_empty() || value.contains('=') {
                return Err(SelectorError::BadTerm(term.to_owned()));
            }
            terms.push((key.to_owned(), value.to_owned()));
            if terms.len() > MAX_SELECTOR_TERMS {
                return Err(SelectorError::TooManyTerms);
            }
        }
        Ok(Self { terms })
    }

    /// A selector from required attributes' `(key, value)` pairs (e.g. a map's entries).
    pub fn from_terms(terms: impl IntoIterator<Item = (impl AsRef<str>, impl AsRef<str>)>) -> Self {
        Self {
            terms: terms
                .into_iter()
                .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
                .collect(),
        }
    }

    /// The `key=value` terms.
    pub fn terms(&self) -> &[(String, String)] {
        &self.terms
    }

    /// Whether `attributes` has every term.
    pub fn matches(&self, attributes: &BTreeMap<String, String>) -> bool {
        self.terms.iter().all(|(k, v)| attributes.get(k) == Some(v))
    }
}

/// A selector resolved to pair ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompiledSelector {
    /// Sorted, deduplicated pair ids; empty selects every proxy.
    Pairs(Vec<u32>),
    /// Two or more sorted pair ids whose combination has an LRU list of its own in the store
    /// (`list`), so an acquire never walks past proxies that match only some terms.
    Indexed {
        /// Sorted, deduplicated pair ids.
        terms: Vec<u32>,
        /// The combination's list id.
        list: u32,
    },
    /// Names a pair no proxy has ever carried, or one key with two values: matches nothing.
    Unsatisfiable,
}

impl CompiledSelector {
    /// Whether a proxy with the sorted pair ids `pairs` matches.
    pub fn matches(&self, pairs: &[u32]) -> bool {
        match self {
            CompiledSelector::Unsatisfiable => false,
            CompiledSelector::Pairs(terms) | CompiledSelector::Indexed { terms, .. } => {
                is_sorted_subset(terms, pairs)
            }
        }
    }
}

/// Whether every id of sorted `terms` is in sorted `pairs` (one merge pass).
pub(crate) fn is_sorted_subset(terms: &[u32], pairs: &[u32]) -> bool {
    let mut it = pairs.iter();
    'terms: for t in terms {
        for p in it.by_ref() {
            if p == t {
                continue 'terms;
            }
            if p > t {
                return false;
            }
        }
        return false;
    }
    true
}

/// The table of attribute pairs.
#[derive(Default, Debug)]
pub(crate) struct Interner {
    ids: HashMap<String, HashMap<String, u32>>,
    next: u32,
}

impl Interner {
    /// The id of `key=value`, allocating one if new.
    pub(crate) fn intern(&mut self, key: &str, value: &str) -> u32 {
        if let Some(id) = self.ids.get(key).and_then(|values| values.get(value)) {
            return *id;
        }
        let id = self.next;
        self.next += 1;
        self.ids
            .entry(key.to_owned())
            .or_default()
            .insert(value.to_owned(), id);
        id
    }

    /// Sorted pair ids of an attribute map, allocating new ones.
    pub(crate) fn intern_all(&mut self, attributes: &Attributes) -> Vec<u32> {
        let mut ids: Vec<u32> = attributes.iter().map(|(k, v)| self.intern(k, v)).collect();
        ids.sort_unstable();
        ids
    }

    /// Resolves a selector without allocating ids.
    pub(crate) fn compile(&self, selector: &Selector) -> CompiledSelector {
        let mut ids = Vec::with_capacity(selector.terms.len());
        let mut keys: Vec<&str> = Vec::with_capacity(selector.terms.len());
        for (k, v) in &selector.terms {
            match self.ids.get(k.as_str()).and_then(|values| values.get(v.as_str())) {
                Some(id) => ids.push(*id),
                None => return CompiledSelector::Unsatisfiable,
            }
            keys.push(k);
        }
        ids.sort_unstable();
        ids.dedup();
        keys.sort_unstable();
        keys.dedup();
        // Distinct pairs but fewer distinct keys: one key asked with two values.
        if keys.len() != ids.len() {
            return CompiledSelector::Unsatisfiable;
        }
        CompiledSelector::Pairs(ids)
    }
}
