//! Reading the manifests folder: the desired Proxies (validated exactly like `check`) and the
//! Secrets they reference. A file with problems is reported and its Proxies keep their last
//! valid version: a typo never deletes a running proxy.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::{Path, PathBuf},
    time::SystemTime,
};

use k8s_openapi::api::core::v1::Secret;
use serde::Deserialize;
use serde_json::Value;

use crate::{
    api::ProxyKey,
    api::ProxySpec,
    check::{Checker, Problem, Report},
};

/// Namespace of manifests that name none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// One desired Proxy.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredProxy {
    /// The spec (schema defaults are applied when it is deserialized).
    pub spec: ProxySpec,
    /// The spec as written, to notice changes.
    pub spec_json: Value,
    /// The file it came from.
    pub source: PathBuf,
    /// Its `metadata.annotations` (e.g. a recycle request), as written.
    pub annotations: BTreeMap<String, String>,
}

/// What the folder asks for.
#[derive(Debug, Default)]
pub struct Desired {
    /// Valid Proxies by key.
    pub proxies: BTreeMap<ProxyKey, DesiredProxy>,
    /// Secrets by (namespace, name).
    pub secrets: HashMap<(String, String), Secret>,
    /// Files that have problems: their Proxies keep their previous version.
    pub broken_files: BTreeSet<PathBuf>,
    /// The problems, one per line.
    pub problems: Vec<Problem>,
}

/// A cheap fingerprint of the folder (names, sizes, modification times) to skip re-reading
/// unchanged folders.
pub fn fingerprint(dir: &Path) -> Vec<(PathBuf, u64, Option<SystemTime>)> {
    let mut entries: Vec<_> = yaml_files(dir)
        .into_iter()
        .map(|path| {
            let meta = std::fs::metadata(&path).ok();
            let len = meta.as_ref().map_or(0, |m| m.len());
            let modified = meta.and_then(|m| m.modified().ok());
            (path, len, modified)
        })
        .collect();
    entries.sort();
    entries
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    files
}

/// Reads every `*.yaml` in `dir`.
pub fn scan(dir: &Path, checker: &Checker) -> Desired {
    let mut desired = Desired::default();
    for file in yaml_files(dir) {
        let mut report = Report::default();
        checker.check_file(&file, &mut report);
        if !report.problems.is_empty() {
            desired.broken_files.insert(file.clone());
            desired.problems.extend(report.problems);
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&file) else {
            desired.broken_files.insert(file.clone());
            continue;
        };
        for document in serde_norway::Deserializer::from_str(&text) {
            let Ok(value) = Value::deserialize(document) else {
                continue;
            };
            let namespace = value
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or(DEFAULT_NAMESPACE)
                .to_owned();
            let name = value
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            match value.get("kind").and_then(Value::as_str) {
                Some("Proxy") => {
                    let spec_json = value.get("spec").cloned().unwrap_or(Value::Null);
                    let annotations = (value.pointer("/metadata/annotations"))
                        .and_then(|a| serde_json::from_value(a.clone()).ok())
                        .unwrap_or_default();
                    // `check` passed, so the spec deserializes; defaults come from serde.
                    if let Ok(spec) = serde_json::from_value::<ProxySpec>(spec_json.clone()) {
                        desired.proxies.insert(
                            ProxyKey::new(&namespace, &name),
                            DesiredProxy {
                                spec,
                                spec_json,
                                source: file.clone(),
                                annotations,
                            },
                        );
                    }
                }
                Some("Secret") => {
                    if let Ok(secret) = serde_json::from_value::<Secret>(value) {
                        desired.secrets.insert((namespace, name), secret);
                    }
                }
                _ => {}
            }
        }
    }
    desired
}
