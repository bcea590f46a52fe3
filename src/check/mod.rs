//! Offline validation (`egress-proxies-operator check FILE...`): Proxy manifests against the
//! generated CRD schema (types, lengths, unknown fields), a metadata check and the CRD's CEL
//! rules — the rules an API server with strict field validation applies to a create, without
//! what only a cluster knows (namespaces, admission, label syntax) — and providers configs.
//!
//! Every problem is reported, one line each, with the file, the object and the field path.

mod schema;

use std::{fmt, path::Path};

use serde::Deserialize;
use serde_json::Value;

use crate::config::{ConfigError, ProvidersConfig};

pub use schema::ProxySchema;

/// One problem found in one document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The file (or source name) the document came from.
    pub source: String,
    /// 1-based index of the YAML document in the file.
    pub document: usize,
    /// What the document is (`Proxy default/web-1`, `providers config`), for the reader.
    pub object: String,
    /// Field path (`spec.health.timeoutSeconds`), empty for whole-document problems.
    pub path: String,
    /// What is wrong and, where possible, what to do about it.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: document {} ({})", self.source, self.document, self.object)?;
        if !self.path.is_empty() {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// The result of checking some files.
#[derive(Debug, Default)]
pub struct Report {
    /// Documents that were validated.
    pub documents: usize,
    /// Everything wrong with them.
    pub problems: Vec<Problem>,
}

/// Validates manifests and providers configs. Build it once; it compiles the schema and CEL
/// rules up front.
pub struct Checker {
    schema: ProxySchema,
    providers: Option<ProvidersConfig>,
}

impl Checker {
    /// A checker; with `providers`, every Proxy's `spec.provider` must name one of its instances.
    pub fn new(providers: Option<ProvidersConfig>) -> Self {
        Self {
            schema: ProxySchema::new(),
            providers,
        }
    }

    /// Checks one file; I/O errors become problems so one unreadable file doesn't hide the rest.
    pub fn check_file(&self, path: &Path, report: &mut Report) {
        let source = path.display().to_string();
        match std::fs::read_to_string(path) {
            Ok(text) => self.check_text(&source, &text, report),
            Err(err) => report.problems.push(Problem {
                source,
                document: 0,
                object: "file".to_owned(),
                path: String::new(),
                message: format!("cannot read: {err}"),
            }),
        }
    }

    /// Checks every YAML document in `text`.
    pub fn check_text(&self, source: &str, text: &str, report: &mut Report) {
        for (index, document) in serde_norway::Deserializer::from_str(text).enumerate() {
            let number = index + 1;
            let problem = |object: &str, path: String, message: String| Problem {
                source: source.to_owned(),
                document: number,
                object: object.to_owned(),
                path,
                message,
            };
            let value = match Value::deserialize(document) {
                Ok(Value::Null) => continue,
                Ok(value) => value,
                Err(err) => {
                    report
                        .problems
                        .push(problem("YAML", String::new(), err.to_string()));
                    // A syntax error leaves the parser unable to find later documents.
                    return;
                }
            };
            report.documents += 1;
            match classify(&value) {
                Document::Proxy => {
                    let object = proxy_label(&value);
                    for (path, message) in self.check_proxy(&value) {
                        report.problems.push(problem(&object, path, message));
                    }
                }
                Document::Secret => {
                    let object = format!("Secret {}", proxy_label(&value).trim_start_matches("Proxy "));
                    for (path, message) in check_secret(&value) {
                        report.problems.push(problem(&object, path, message));
                    }
                }
                Document::ProvidersConfig => {
                    for message in check_providers_config(&value) {
                        report.problems.push(problem("providers config", String::new(), message));
                    }
                }
                Document::Other(what) => report.problems.push(problem(
                    &what,
                    String::new(),
                    "unsupported document: check validates Proxy manifests (crawl.example.com/v1alpha1), the Secrets they reference (v1) and providers configs (a top-level `providers:` list)".to_owned(),
                )),
            }
        }
    }

    /// Problems of one Proxy object as `(field path, message)` pairs.
    pub fn check_proxy(&self, object: &Value) -> Vec<(String, String)> {
        let mut problems = self.schema.validate(object);
        if problems.is_empty()
            && let Some(providers) = &self.providers
            && let Some(name) = object.pointer("/spec/provider").and_then(Value::as_str)
            && providers.instance(name).is_none()
        {
            problems.push((
                "spec.provider".to_owned(),
                format!(
                    "no provider instance named {name:?} in the providers config (configured: {})",
                    providers.names().join(", ")
                ),
            ));
        }
        problems
    }
}

enum Document {
    Proxy,
    /// A Secret a Proxy references (standalone mode reads them from the manifests folder).
    Secret,
    ProvidersConfig,
    Other(String),
}

fn classify(value: &Value) -> Document {
    let api_version = value.get("apiVersion").and_then(Value::as_str);
    let kind = value.get("kind").and_then(Value::as_str);
    match (api_version, kind) {
        (Some(v), Some("Proxy")) if v == format!("{}/{}", crate::api::GROUP, crate::api::VERSION) => {
            Document::Proxy
        }
        (Some("v1"), Some("Secret")) => Document::Secret,
        (None, None) if value.get("providers").is_some() => Document::ProvidersConfig,
        (api_version, kind) => Document::Other(format!(
            "{} {}",
            api_version.unwrap_or("<no apiVersion>"),
            kind.unwrap_or("<no kind>")
        )),
    }
}

fn proxy_label(value: &Value) -> String {
    let name = value
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("<no name>");
    match value.pointer("/metadata/namespace").and_then(Value::as_str) {
        Some(namespace) => format!("Proxy {namespace}/{name}"),
        None => format!("Proxy {name}"),
    }
}

/// The parts of a Secret the operator reads: a name, and string-valued `data`/`stringData`.
fn check_secret(value: &Value) -> Vec<(String, String)> {
    let mut problems = Vec::new();
    if value
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        problems.push(("metadata.name".to_owned(), "required: name the Secret".to_owned()));
    }
    for field in ["data", "stringData"] {
        match value.get(field) {
            None => {}
            Some(Value::Object(map)) => {
                for (key, item) in map {
                    if !item.is_string() {
                        problems.push((format!("{field}.{key}"), "must be a string".to_owned()));
                    }
                }
            }
            Some(_) => problems.push((field.to_owned(), "must be a map of strings".to_owned())),
        }
    }
    problems
}

fn check_providers_config(value: &Value) -> Vec<String> {
    let yaml = match serde_norway::to_value(value) {
        Ok(yaml) => yaml,
        Err(err) => return vec![err.to_string()],
    };
    match ProvidersConfig::from_value(yaml) {
        Ok(_) => Vec::new(),
        Err(ConfigError::Invalid(problems)) => problems.0,
        Err(err) => vec![err.to_string()],
    }
}

#[cfg(test)]
mod tests;
