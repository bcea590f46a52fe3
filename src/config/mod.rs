//! The providers config (`--providers-config FILE`): the named provider instances a Proxy's
//! `spec.provider` can select, each with its type's settings.
//!
//! ```yaml
//! providers:
//!   - name: local
//!     type: local
//!     settings:
//!       stateDir: /var/lib/egress-proxies-operator/local
//! ```
//!
//! Parsing reports every problem at once, each naming the instance and the field, so a user
//! fixes a file in one pass.
//!
//! Also what every file the operator reads at start shares: YAML (or JSON) read with errors that
//! say where in the document ([`from_yaml`]), and the errors of the files that name the file
//! ([`FileError`]: the gateway's rules, the quotas).

mod settings;

use std::{collections::BTreeSet, fmt, path::Path};

use serde::{Deserialize, de::DeserializeOwned};

pub use settings::{
    BootSettings, DomainType, KubernetesSettings, KvmSettings, LocalSettings, NetworkSettings, PortRange,
    ProviderSettings, ServiceType,
};

/// A validated providers config.
#[derive(Clone, Debug, PartialEq)]
pub struct ProvidersConfig {
    /// The instances, in file order; names are unique.
    pub instances: Vec<ProviderInstance>,
}

/// One named provider instance.
#[derive(Clone, Debug, PartialEq)]
pub struct ProviderInstance {
    /// The name `spec.provider` refers to.
    pub name: String,
    /// Type-specific settings; the variant is the provider type.
    pub settings: ProviderSettings,
}

impl ProviderInstance {
    /// The provider type's name, as written in the config (`kvm`, `kvm2`, ...).
    pub fn type_name(&self) -> &'static str {
        self.settings.type_name()
    }
}

/// The provider types this build knows, as written in the config's `type` field.
pub const PROVIDER_TYPES: [&str; 4] = ["kvm", "kvm2", "kubernetes", "local"];

/// Everything wrong with a providers config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read providers config {path}: {cause}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        cause: std::io::Error,
    },
    /// The file is not YAML of the expected shape (`providers:` list of instances).
    #[error("providers config is not valid: {location}{cause}")]
    Syntax {
        /// Where in the document, if known (`providers[2].name: `).
        location: String,
        /// The parser's message.
        cause: serde_norway::Error,
    },
    /// The file parsed, but instances are wrong; one entry per problem.
    #[error("{0}")]
    Invalid(Problems),
}

/// A list of problems, one per line when displayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problems(pub Vec<String>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, problem) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{problem}")?;
        }
        Ok(())
    }
}

/// The file as written, before per-type settings are checked.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a map with a `providers:` list")]
struct RawConfig {
    providers: Vec<RawInstance>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a provider instance: a map of `name`, `type` and `settings`"
)]
struct RawInstance {
    name: String,
    #[serde(rename = "type")]
    type_name: String,
    #[serde(default)]
    settings: Option<serde_norway::Value>,
}

impl ProvidersConfig {
    /// Reads and validates a providers config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
            path: path.display().to_string(),
            cause,
        })?;
        Self::parse(&text)
    }

    /// Validates a providers config given as YAML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = from_yaml(text).map_err(syntax_error)?;
        Self::from_raw(raw)
    }

    /// Validates a providers config given as an already-parsed YAML value (for `check`,
    /// which reads multi-document files).
    pub fn from_value(value: serde_norway::Value) -> Result<Self, ConfigError> {
        let raw: RawConfig = serde_path_to_error::deserialize(value)
            .map_err(located)
            .map_err(syntax_error)?;
        Self::from_raw(raw)
    }

    fn from_raw(raw: RawConfig) -> Result<Self, ConfigError> {
        let mut problems = Vec::new();
        let mut seen = BTreeSet::new();
        let mut instances = Vec::with_capacity(raw.providers.len());
        if raw.providers.is_empty() {
            problems
                .push("providers: the list is empty; configure at least one provider instance".to_owned());
        }
        for (index, raw) in raw.providers.into_iter().enumerate() {
            let at = format!("providers[{index}] ({:?})", raw.name);
            if !is_dns_label(&raw.name) {
                problems.push(format!(
                    "{at}: name must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
                ));
            }
            if !seen.insert(raw.name.clone()) {
                problems.push(format!(
                    "{at}: duplicate name; every provider instance needs its own name"
                ));
            }
            match ProviderSettings::parse(&raw.type_name, raw.settings) {
                Ok(settings) => instances.push(ProviderInstance {
                    name: raw.name,
                    settings,
                }),
                Err(problem) => problems.push(format!("{at}: {problem}")),
            }
        }
        if problems.is_empty() {
            Ok(Self { instances })
        } else {
            Err(ConfigError::Invalid(Problems(problems)))
        }
    }

    /// The instance `spec.provider` names, if configured.
    pub fn instance(&self, name: &str) -> Option<&ProviderInstance> {
        self.instances.iter().find(|i| i.name == name)
    }

    /// Names of all instances, for error messages.
    pub fn names(&self) -> Vec<&str> {
        self.instances.iter().map(|i| i.name.as_str()).collect()
    }
}

/// Why a YAML (or JSON) file read once at start (the gateway's rules, the quotas) was refused;
/// `what` names the kind of file in the message.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file could not be read.
    #[error("reading the {what} {path}: {cause}")]
    Read {
        /// The kind of file (`gateway rules`).
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        cause: std::io::Error,
    },
    /// Not the file's shape (unknown field, wrong type, YAML syntax, too many entries), located
    /// by its path in the document.
    #[error("the {what} {path}: {location}{message}")]
    Syntax {
        /// The kind of file (`gateway rules`).
        what: &'static str,
        /// The file.
        path: String,
        /// `rules[0].match.status: ` (empty at the top level).
        location: String,
        /// What is wrong.
        message: String,
    },
    /// An entry that reads but does not hold together.
    #[error("the {what} {path}: {entry}{field}: {message}")]
    Invalid {
        /// The kind of file (`gateway rules`).
        what: &'static str,
        /// The file.
        path: String,
        /// The entry, and what separates it from the field: `rule "ban" (rules[0]), `,
        /// `politeness[2].`.
        entry: String,
        /// The field to fix, e.g. `match.body` or `escalation[2].seconds`.
        field: String,
        /// What is wrong and what is allowed.
        message: String,
    },
}

impl FileError {
    /// The list `field` of the file `path` has `len` entries, more than `max`.
    pub fn too_many(what: &'static str, path: &str, field: &str, len: usize, max: usize) -> Self {
        FileError::Syntax {
            what,
            path: path.to_owned(),
            location: format!("{field}: "),
            message: format!("{len} entries; at most {max}"),
        }
    }
}

/// Reads the file at `path` and validates its text with `parse`, which gets the path as messages
/// show it.
pub fn load_file<T>(
    what: &'static str,
    path: &Path,
    parse: impl FnOnce(&str, &str) -> Result<T, FileError>,
) -> Result<T, FileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|cause| FileError::Read {
        what,
        path: shown.clone(),
        cause,
    })?;
    parse(&text, &shown)
}

/// `text`, the file `path`'s, read into `T` ([`from_yaml`]); a shape error names the file.
pub fn from_yaml_file<T: DeserializeOwned>(
    what: &'static str,
    text: &str,
    path: &str,
) -> Result<T, FileError> {
    from_yaml(text).map_err(|located| FileError::Syntax {
        what,
        path: path.to_owned(),
        location: located.location,
        message: located.error.to_string(),
    })
}

/// A shape error in a YAML document: where (`providers[2].name: `; empty at the top level) and
/// the parser's error.
#[derive(Debug)]
pub struct Located {
    /// Its path in the document, with `: ` after it, or nothing.
    pub location: String,
    /// What the parser said.
    pub error: serde_norway::Error,
}

/// A YAML (or JSON) document read into `T`: every file the operator reads (the providers
/// config, the gateway's rules, the quotas) names where a shape error is the same way.
pub fn from_yaml<T: DeserializeOwned>(text: &str) -> Result<T, Located> {
    serde_path_to_error::deserialize(serde_norway::Deserializer::from_str(text)).map_err(located)
}

fn located(err: serde_path_to_error::Error<serde_norway::Error>) -> Located {
    let path = err.path().to_string();
    let location = format!("{path}: ");
    // The YAML parser names the path itself where it knows it: said once.
    let location = if path == "." || err.inner().to_string().starts_with(&location) {
        String::new()
    } else {
        location
    };
    Located {
        location,
        error: err.into_inner(),
    }
}

fn syntax_error(Located { location, error }: Located) -> ConfigError {
    ConfigError::Syntax {
        location,
        cause: error,
    }
}

/// Kubernetes DNS-1123 label: what instance names must be, since they become parts of object
/// and domain names.
pub fn is_dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first() != Some(&b'-')
        && bytes.last() != Some(&b'-')
}

#[cfg(test)]
mod tests;
