//! Who may call the discovery API: bearer tokens checked by an [`Authenticator`].
//!
//! - [`StaticTokens`]: a fixed set of tokens, from a file (one per line) or a map name → token
//!   (a Secret's data). Presented tokens are compared by their SHA-256 digest, so lookup time
//!   says nothing about the tokens themselves.
//! - [`TokenReviewAuthenticator`]: Kubernetes service-account (or any API server) tokens,
//!   verified with a `TokenReview`; answers are cached briefly by token digest. An authenticated
//!   user outside the allowed subjects is refused with 403.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use sha2::{Digest, Sha256};

/// Who a caller is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// A name for logs and metrics-free auditing (token name or Kubernetes user name).
    pub name: String,
}

/// Why a caller was not let in.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No token, or one nobody issued: 401.
    #[error("missing or invalid bearer token")]
    Unauthenticated,
    /// A valid token whose subject may not use the API: 403.
    #[error("{0} may not use the discovery API")]
    Forbidden(String),
    /// The verifier could not be asked (API server down): 503.
    #[error("token verification unavailable: {0}")]
    Unavailable(String),
}

/// Checks bearer tokens.
#[async_trait]
pub trait Authenticator: Send + Sync {
    /// The identity behind `token` (the text after `Bearer `).
    async fn authenticate(&self, token: &str) -> Result<Identity, AuthError>;
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// A fixed set of bearer tokens.
#[derive(Clone)]
pub struct StaticTokens {
    by_digest: HashMap<[u8; 32], String>,
}

impl std::fmt::Debug for StaticTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StaticTokens({} tokens)", self.by_digest.len())
    }
}

/// A token file that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("reading token file {path}: {source}")]
pub struct TokenFileError {
    path: String,
    source: std::io::Error,
}

impl StaticTokens {
    /// Tokens from a map name → token (e.g. a Secret's data); empty tokens are skipped.
    pub fn from_map(map: &BTreeMap<String, String>) -> Self {
        Self {
            by_digest: map
                .iter()
                .filter(|(_, token)| !token.trim().is_empty())
                .map(|(name, token)| (digest(token.trim()), name.clone()))
                .collect(),
        }
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
            .map_err(|source| TokenFileError {
                path: path.display().to_string(),
                source,
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
        self.by_digest
            .get(&digest(token))
            .map(|name| Identity { name: name.clone() })
            .ok_or(AuthError::Unauthenticated)
    }
}

/// How long a TokenReview answer is reused.
pub const TOKEN_REVIEW_CACHE_TTL: Duration = Duration::from_secs(30);
const TOKEN_REVIEW_CACHE_MAX: usize = 10_000;

/// A TokenReview answer and when it was given.
type CachedAnswer = (Instant, Result<Identity, AuthError>);

/// Verifies tokens with the Kubernetes TokenReview API.
pub struct TokenReviewAuthenticator {
    client: kube::Client,
    audiences: Vec<String>,
    allowed: Vec<String>,
    cache: Mutex<HashMap<[u8; 32], CachedAnswer>>,
}

impl TokenReviewAuthenticator {
    /// A verifier asking the API server behind `client`. `audiences`: required token audiences
    /// (empty: the API server's default). `allowed_subjects`: user names allowed in, each exact
    /// or ending in `*` as a prefix (e.g. `system:serviceaccount:crawlers:*`); empty allows every
    /// authenticated user.
    pub fn new(client: kube::Client, audiences: Vec<String>, allowed_subjects: Vec<String>) -> Self {
        Self {
            client,
            audiences,
            allowed: allowed_subjects,
            cache: Mutex::new(HashMap::new()),
        }
    }

    fn allowed(&self, user: &str) -> bool {
        self.allowed.is_empty()
            || self
                .allowed
                .iter()
                .any(|pattern| match pattern.strip_suffix('*') {
                    Some(prefix) => user.starts_with(prefix),
                    None => user == pattern,
                })
    }

    async fn review(&self, token: &str) -> Result<Identity, AuthError> {
        let api: kube::Api<TokenReview> = kube::Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: (!self.audiences.is_empty()).then(|| self.audiences.clone()),
            },
            ..TokenReview::default()
        };
        let answer = api
            .create(&kube::api::PostParams::default(), &review)
            .await
            // The error text comes from the API server and never contains the token.
            .map_err(|e| AuthError::Unavailable(e.to_string()))?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(AuthError::Unauthenticated);
        }
        let user = status.user.and_then(|u| u.username).unwrap_or_default();
        if !self.allowed(&user) {
            return Err(AuthError::Forbidden(user));
        }
        Ok(Identity { name: user })
    }
}

#[async_trait]
impl Authenticator for TokenReviewAuthenticator {
    async fn authenticate(&self, token: &str) -> Result<Identity, AuthError> {
        let key = digest(token);
        let now = Instant::now();
        if let Some((at, answer)) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key)
            && now.duration_since(*at) < TOKEN_REVIEW_CACHE_TTL
        {
            return answer.clone();
        }
        let answer = self.review(token).await;
        // Unavailability is not cached: the next request asks again.
        if !matches!(answer, Err(AuthError::Unavailable(_))) {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if cache.len() >= TOKEN_REVIEW_CACHE_MAX {
                cache.retain(|_, (at, _)| now.duration_since(*at) < TOKEN_REVIEW_CACHE_TTL);
                if cache.len() >= TOKEN_REVIEW_CACHE_MAX {
                    cache.clear();
                }
            }
            cache.insert(key, (now, answer.clone()));
        }
        answer
    }
}
