//! Static bearer tokens, and the same re-read from a file or a Secret so rotating them needs
//! no restart.

use super::{AuthError, Authenticator, Identity, digest};
use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::{
        Arc, RwLock, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Secret;
use tracing::{info, warn};

/// A fixed set of bearer tokens.
#[derive(Clone, PartialEq, Eq)]
pub struct StaticTokens {
    pub(super) by_digest: HashMap<[u8; 16], String>,
}

impl std::fmt::Debug for StaticTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StaticTokens({} tokens)", self.by_digest.len())
    }
}

/// A token file that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("reading token file {path}: {cause}")]
pub struct TokenFileError {
    path: String,
    cause: std::io::Error,
}

impl StaticTokens {
    /// Tokens from a map name → value (e.g. a Secret's data). Each value holds one token, or
    /// several in the format of [`StaticTokens::parse`]; identities are the key, or `key-N`
    /// (N = line number) for a value of several lines. Empty values are skipped.
    pub fn from_map(map: &BTreeMap<String, String>) -> Self {
        let mut by_digest = HashMap::new();
        for (name, value) in map {
            let lines: Vec<(usize, &str)> = value
                .lines()
                .enumerate()
                .map(|(i, line)| (i, line.trim()))
                .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
                .collect();
            let single = lines.len() == 1;
            for (i, token) in lines {
                let identity = if single {
                    name.clone()
                } else {
                    format!("{name}-{}", i + 1)
                };
                by_digest.insert(digest(token), identity);
            }
        }
        Self { by_digest }
    }

    /// Tokens from text: one per line; blank lines and lines starting with `#` are skipped.
    /// Identities are `token-N` (N = line number).
    pub fn parse(text: &str) -> Self {
        Self {
            by_digest: text
                .lines()
                .enumerate()
                .map(|(i, line)| (i, line.trim()))
                .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
                .map(|(i, token)| (digest(token), format!("token-{}", i + 1)))
                .collect(),
        }
    }

    /// Tokens from a file in the format of [`StaticTokens::parse`].
    pub fn from_file(path: &Path) -> Result<Self, TokenFileError> {
        std::fs::read_to_string(path)
            .map(|text| Self::parse(&text))
            .map_err(|cause| TokenFileError {
                path: path.display().to_string(),
                cause,
            })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether there is no token (then nobody gets in).
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }
}

#[async_trait]
impl Authenticator for StaticTokens {
    async fn authenticate(&self, token: &str) -> Result<Identity, AuthError> {
        self.lookup(token)
    }

    fn verdict_generation(&self) -> Option<u64> {
        // A fixed set: a verdict never changes.
        Some(0)
    }
}

impl StaticTokens {
    pub(super) fn lookup(&self, token: &str) -> Result<Identity, AuthError> {
        self.by_digest
            .get(&digest(token))
            .map(|name| Identity { name: name.clone() })
            .ok_or(AuthError::Unauthenticated)
    }
}

/// Where [`ReloadingTokens`] reads its tokens from.
#[async_trait]
pub trait TokenSource: Send + Sync + 'static {
    /// What it is, for logs (a path or `secret NS/NAME`; never token content).
    fn describe(&self) -> String;
    /// The tokens as they are now.
    async fn load(&self) -> Result<StaticTokens, TokenSourceError>;
}

/// Tokens could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TokenSourceError {
    /// The token file.
    #[error(transparent)]
    File(#[from] TokenFileError),
    /// The Secret could not be read.
    #[error("reading Secret {namespace}/{name}: {message}")]
    Secret {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// What the API server said (never Secret content).
        message: String,
    },
}

/// A token file in the format of [`StaticTokens::parse`] (a mounted Secret's key works: the
/// kubelet swaps its content atomically).
#[derive(Clone, Debug)]
pub struct TokenFile(pub PathBuf);

#[async_trait]
impl TokenSource for TokenFile {
    fn describe(&self) -> String {
        self.0.display().to_string()
    }

    async fn load(&self) -> Result<StaticTokens, TokenSourceError> {
        let path = self.0.clone();
        let read = tokio::task::spawn_blocking(move || StaticTokens::from_file(&path)).await;
        match read {
            Ok(tokens) => Ok(tokens?),
            // Only a panic in the read itself gets here.
            Err(join) => Err(TokenFileError {
                path: self.describe(),
                cause: std::io::Error::other(join.to_string()),
            }
            .into()),
        }
    }
}

/// A Secret read through the API; each data key is a token (or several, one per line), in the
/// format of [`StaticTokens::from_map`]. Needs `get` on that Secret.
#[derive(Clone)]
pub struct TokenSecret {
    api: kube::Api<Secret>,
    namespace: String,
    name: String,
}

impl TokenSecret {
    /// The Secret `namespace/name`.
    pub fn new(client: kube::Client, namespace: &str, name: &str) -> Self {
        Self {
            api: kube::Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }
}

#[async_trait]
impl TokenSource for TokenSecret {
    fn describe(&self) -> String {
        format!("secret {}/{}", self.namespace, self.name)
    }

    async fn load(&self) -> Result<StaticTokens, TokenSourceError> {
        let secret = self
            .api
            .get(&self.name)
            .await
            .map_err(|e| TokenSourceError::Secret {
                namespace: self.namespace.clone(),
                name: self.name.clone(),
                message: e.to_string(),
            })?;
        let map: BTreeMap<String, String> = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(key, value)| String::from_utf8(value.0).ok().map(|v| (key, v)))
            .collect();
        Ok(StaticTokens::from_map(&map))
    }
}

/// Static tokens re-read from a [`TokenSource`] every `interval`; a new set replaces the old one
/// at once (new tokens work, removed ones fail). A source that cannot be read keeps the last set
/// read, with one warning per failure streak: a transient read error must not lock every crawler
/// out. The reload task ends when the last clone of this value is dropped.
#[derive(Clone)]
pub struct ReloadingTokens {
    current: Arc<RwLock<Arc<StaticTokens>>>,
    /// Counts the reloads that changed the set ([`Authenticator::verdict_generation`]).
    generation: Arc<AtomicU64>,
}

impl std::fmt::Debug for ReloadingTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReloadingTokens({:?})", self.snapshot())
    }
}

impl ReloadingTokens {
    /// Reads `source` once (an error here is a start-up error) and starts re-reading it every
    /// `interval` in a task of the current runtime.
    pub async fn start(source: impl TokenSource, interval: Duration) -> Result<Self, TokenSourceError> {
        let first = source.load().await?;
        info!(source = %source.describe(), tokens = first.len(), "discovery API tokens loaded");
        if first.is_empty() {
            warn!(source = %source.describe(), "no discovery API token: every token is refused");
        }
        let current = Arc::new(RwLock::new(Arc::new(first)));
        let generation = Arc::new(AtomicU64::new(0));
        tokio::spawn(reload(
            source,
            Arc::downgrade(&current),
            generation.clone(),
            interval,
        ));
        Ok(Self { current, generation })
    }

    /// The tokens in force now.
    pub fn snapshot(&self) -> Arc<StaticTokens> {
        crate::sync::read(&self.current).clone()
    }
}

async fn reload(
    source: impl TokenSource,
    current: Weak<RwLock<Arc<StaticTokens>>>,
    generation: Arc<AtomicU64>,
    interval: Duration,
) {
    let mut failing = false;
    loop {
        tokio::time::sleep(interval).await;
        // Every authenticator using these tokens is gone: nothing to keep fresh.
        let Some(current) = current.upgrade() else {
            return;
        };
        match source.load().await {
            Ok(tokens) => {
                if failing {
                    info!(source = %source.describe(), "discovery API tokens readable again");
                    failing = false;
                }
                let mut slot = crate::sync::write(&current);
                if **slot != tokens {
                    info!(source = %source.describe(), tokens = tokens.len(), "discovery API tokens reloaded");
                    *slot = Arc::new(tokens);
                    // After the swap: a verdict remembered under the old number was looked up
                    // in either set, and is looked up again.
                    generation.fetch_add(1, Ordering::SeqCst);
                }
            }
            Err(err) if !failing => {
                warn!(error = %err, "discovery API tokens unreadable; keeping the last ones read");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

#[async_trait]
impl Authenticator for ReloadingTokens {
    async fn authenticate(&self, token: &str) -> Result<Identity, AuthError> {
        // Looked up under the read lock: no clone of the set per request.
        crate::sync::read(&self.current).lookup(token)
    }

    fn verdict_generation(&self) -> Option<u64> {
        Some(self.generation.load(Ordering::SeqCst))
    }
}
