//! Who may call the discovery API: bearer tokens checked by an [`Authenticator`].
//!
//! - [`StaticTokens`]: a fixed set of tokens, from a file (one per line) or a map name → token
//!   (a Secret's data). Presented tokens are looked up by a keyed hash ([`digest`]), so lookup
//!   time says nothing about the tokens themselves.
//! - [`ReloadingTokens`]: static tokens re-read from a [`TokenSource`] (a [`TokenFile`] or a
//!   [`TokenSecret`]) every few seconds, so rotating them needs no restart.
//! - [`TokenReviewAuthenticator`]: Kubernetes service-account (or any API server) tokens,
//!   verified with a `TokenReview` for the configured audiences; answers are cached briefly by
//!   token digest. An authenticated user outside the allowed subjects is refused with 403.
//! - [`AnyOf`]: several of these, the first that knows the token decides.
//! - [`NoAuthentication`]: the explicit opt-out; every request is let in without a token.
//!
//! [`presented`] is the one reader of a request's `Authorization` header, for the API (which
//! takes a Bearer token) and the status page (which also takes the token as a Basic password,
//! what a browser can send); [`proxy_presented`] reads `Proxy-Authorization` for the gateway
//! with the same parser, keeping the Basic user name.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, RwLock, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use async_trait::async_trait;
use base64::Engine as _;
use hyper::{HeaderMap, header};
use k8s_openapi::api::{
    authentication::v1::{TokenReview, TokenReviewSpec},
    core::v1::Secret,
};
use tracing::{info, warn};

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

    /// The identity of every request when no token is required at all (only
    /// [`NoAuthentication`]); `None`: a bearer token is required.
    fn anonymous(&self) -> Option<Identity> {
        None
    }

    /// A number that changes whenever the verdict on some token may have changed (a token set
    /// reloaded); `None`: a verdict may change at any time (TokenReview), so none is
    /// remembered ([`RememberedVerdict`]).
    fn verdict_generation(&self) -> Option<u64> {
        None
    }
}

/// The last verdict a keep-alive connection's requests got, so that the same `Authorization`
/// header is not decoded and looked up again on every request: a crawler sends one token on
/// all of its requests. Only a success is remembered, with the authenticator's
/// [`Authenticator::verdict_generation`] read before the lookup, and it is recalled only for
/// the byte-for-byte same header while that generation holds; a reload in between makes the
/// next request look the token up again. The comparison is against a header this same
/// connection sent and had accepted, so its timing tells the sender nothing it did not know.
/// The header is kept as a copy: a parsed `HeaderValue` shares the connection's read buffer,
/// and keeping one would make hyper allocate a new buffer for every later request.
/// What is remembered is the API's [`Identity`], or what the gateway makes of a
/// `Proxy-Authorization` header (the identity and the parsed user name), each behind an `Arc`:
/// a recall is a reference count, not a copy of the name (which cost an allocation and a free
/// a request).
#[derive(Debug)]
pub struct RememberedVerdict<T = Arc<Identity>>(Mutex<Option<Verdict<T>>>);

impl<T> Default for RememberedVerdict<T> {
    fn default() -> Self {
        Self(Mutex::new(None))
    }
}

/// A remembered verdict: the header's bytes, the generation it was given under, the identity.
#[derive(Debug)]
struct Verdict<T> {
    header: Box<[u8]>,
    generation: u64,
    identity: T,
}

impl<T: Clone> RememberedVerdict<T> {
    /// What `header` was found to be by this connection's last request with it, while `auth`'s
    /// verdicts hold; else what `check` finds, remembered when it succeeds and `auth` lets its
    /// verdicts be kept.
    pub async fn recall_or<E>(
        &self,
        auth: &dyn Authenticator,
        header: Option<&header::HeaderValue>,
        check: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        // Read before the check runs, so that a reload during it is never remembered as current.
        let generation = auth.verdict_generation();
        if let (Some(generation), Some(header)) = (generation, header)
            && let Some(kept) = self.recall(header, generation)
        {
            return Ok(kept);
        }
        let found = check.await?;
        if let (Some(generation), Some(header)) = (generation, header) {
            self.remember(header, generation, found.clone());
        }
        Ok(found)
    }

    /// The identity remembered for `header` under `generation`.
    fn recall(&self, header: &header::HeaderValue, generation: u64) -> Option<T> {
        let remembered = crate::sync::lock(&self.0);
        let kept = remembered.as_ref()?;
        (kept.generation == generation && *kept.header == *header.as_bytes()).then(|| kept.identity.clone())
    }

    /// Remembers that `header` was `identity` under `generation`.
    fn remember(&self, header: &header::HeaderValue, generation: u64, identity: T) {
        *crate::sync::lock(&self.0) = Some(Verdict {
            header: header.as_bytes().into(),
            generation,
            identity,
        });
    }
}

/// What a request presents in its `Authorization` header. The scheme is matched without regard
/// to case (RFC 9110, section 11.1) and the credentials are trimmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Presented {
    /// No `Authorization` header.
    Nothing,
    /// `Bearer <token>` (the token may be empty).
    Bearer(String),
    /// `Basic <base64 of user:password>`: the password (the user name is not looked at: the
    /// token is the password).
    BasicPassword(String),
    /// Another scheme, or a value that can't be read (not visible ASCII, bad base64, no colon).
    Unusable,
}

/// Reads the `Authorization` header of a request.
pub fn presented(headers: &HeaderMap) -> Presented {
    match read_credentials(headers.get(header::AUTHORIZATION)) {
        Credentials::Nothing => Presented::Nothing,
        Credentials::Bearer(token) => Presented::Bearer(token),
        Credentials::Basic { password, .. } => Presented::BasicPassword(password),
        Credentials::Unusable => Presented::Unusable,
    }
}

/// What a request presents in its `Proxy-Authorization` header (the gateway's clients): the
/// same reading as [`presented`]'s, with the Basic user name kept, since it carries the
/// holder and the options there.
#[derive(Clone, PartialEq, Eq)]
pub enum ProxyPresented {
    /// No `Proxy-Authorization` header.
    Nothing,
    /// `Basic <base64 of user:password>`.
    Basic {
        /// The user name, as sent.
        user: String,
        /// The password (the token).
        password: String,
    },
    /// Another scheme, or a value that can't be read.
    Unusable,
}

impl std::fmt::Debug for ProxyPresented {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Nothing => f.write_str("Nothing"),
            Self::Basic { user, .. } => write!(f, "Basic({user:?}, <password redacted>)"),
            Self::Unusable => f.write_str("Unusable"),
        }
    }
}

/// Reads the `Proxy-Authorization` header of a request.
pub fn proxy_presented(headers: &HeaderMap) -> ProxyPresented {
    match read_credentials(headers.get(header::PROXY_AUTHORIZATION)) {
        Credentials::Nothing => ProxyPresented::Nothing,
        Credentials::Basic { user, password } => ProxyPresented::Basic { user, password },
        Credentials::Bearer(_) | Credentials::Unusable => ProxyPresented::Unusable,
    }
}

/// Either header's value, read once: the one parser of credentials.
enum Credentials {
    Nothing,
    Bearer(String),
    Basic { user: String, password: String },
    Unusable,
}

fn read_credentials(value: Option<&hyper::header::HeaderValue>) -> Credentials {
    let Some(value) = value else {
        return Credentials::Nothing;
    };
    let Some((scheme, credentials)) = value.to_str().ok().and_then(|v| v.split_once(' ')) else {
        return Credentials::Unusable;
    };
    let credentials = credentials.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return Credentials::Bearer(credentials.to_owned());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let pair = base64::engine::general_purpose::STANDARD
            .decode(credentials)
            .ok()
            .and_then(|decoded| String::from_utf8(decoded).ok())
            .and_then(|decoded| {
                decoded
                    .split_once(':')
                    .map(|(user, password)| (user.to_owned(), password.to_owned()))
            });
        return pair.map_or(Credentials::Unusable, |(user, password)| Credentials::Basic {
            user,
            password,
        });
    }
    Credentials::Unusable
}

/// What tokens are looked up (and TokenReview answers cached) by: a 128-bit keyed hash, two
/// domain-separated SipHash-1-3 values under one key drawn from the OS's random source at the
/// first use (std's `RandomState`), never leaving the process.
///
/// Why not SHA-256 (as before issue 25, 10 % of a lease request's instructions): the digest is
/// only compared against an in-memory table, and the property needed is that lookup timing (the
/// table's probing, the byte comparison of digests) says nothing about the stored tokens. A
/// pseudo-random function under a secret key gives that: without the key, an attacker can't
/// relate a guess's digest to a token's, so how far a comparison got tells them nothing.
/// Collision resistance against someone who can compute the function is not needed (no one
/// outside can), and two tokens colliding by chance has probability 2^-128.
fn digest(token: &str) -> [u8; 16] {
    use std::hash::BuildHasher;
    static KEY: std::sync::OnceLock<std::hash::RandomState> = std::sync::OnceLock::new();
    let key = KEY.get_or_init(std::hash::RandomState::new);
    let half = |domain: u8| key.hash_one((domain, token.as_bytes()));
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&half(0).to_le_bytes());
    out[8..].copy_from_slice(&half(1).to_le_bytes());
    out
}

/// A fixed set of bearer tokens.
#[derive(Clone, PartialEq, Eq)]
pub struct StaticTokens {
    by_digest: HashMap<[u8; 16], String>,
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
        self.lookup(token)
    }

    fn verdict_generation(&self) -> Option<u64> {
        // A fixed set: a verdict never changes.
        Some(0)
    }
}

impl StaticTokens {
    fn lookup(&self, token: &str) -> Result<Identity, AuthError> {
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
                source: std::io::Error::other(join.to_string()),
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

/// Several authenticators, asked in order: the first that knows the token (lets it in or
/// forbids its subject) decides. If none knows it, the caller is unauthenticated, unless one of
/// them could not be asked: then the answer is "unavailable" (503), so an outage of the API
/// server is not reported to a crawler as a bad token.
pub struct AnyOf(pub Vec<Arc<dyn Authenticator>>);

#[async_trait]
impl Authenticator for AnyOf {
    async fn authenticate(&self, token: &str) -> Result<Identity, AuthError> {
        let mut unavailable = None;
        for authenticator in &self.0 {
            match authenticator.authenticate(token).await {
                Err(AuthError::Unauthenticated) => {}
                Err(AuthError::Unavailable(why)) => unavailable = Some(why),
                decided => return decided,
            }
        }
        Err(unavailable.map_or(AuthError::Unauthenticated, AuthError::Unavailable))
    }
}

/// No authentication: the explicit opt-out (`--discovery-no-auth`). Every request is let in, with
/// or without a token, as `anonymous`.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoAuthentication;

#[async_trait]
impl Authenticator for NoAuthentication {
    async fn authenticate(&self, _token: &str) -> Result<Identity, AuthError> {
        Ok(anonymous())
    }

    fn anonymous(&self) -> Option<Identity> {
        Some(anonymous())
    }
}

fn anonymous() -> Identity {
    Identity {
        name: "anonymous".to_owned(),
    }
}

/// How long a TokenReview answer is reused.
pub const TOKEN_REVIEW_CACHE_TTL: Duration = Duration::from_secs(30);
/// How long a request waits for a TokenReview before it is answered 503 `auth_unavailable`:
/// an API server that accepts connections but does not answer must not hang crawlers.
pub const TOKEN_REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
const TOKEN_REVIEW_CACHE_MAX: usize = 10_000;

/// A TokenReview answer and when it was given.
type CachedAnswer = (Instant, Result<Identity, AuthError>);

/// Verifies tokens with the Kubernetes TokenReview API.
pub struct TokenReviewAuthenticator {
    client: kube::Client,
    audiences: Vec<String>,
    allowed: Vec<String>,
    cache: Mutex<HashMap<[u8; 16], CachedAnswer>>,
    /// Whether the last review failed, so an outage is logged once, not per request.
    down: AtomicBool,
    timeout: Duration,
}

impl TokenReviewAuthenticator {
    /// A verifier asking the API server behind `client`. `audiences`: the token must hold one of
    /// them, and the API server must confirm which (empty: the API server's own audience, which
    /// every service-account token of the cluster holds, so give one in production). `allowed_subjects`: user names allowed in, each exact
    /// or ending in `*` as a prefix (e.g. `system:serviceaccount:crawlers:*`); empty allows every
    /// authenticated user.
    pub fn new(client: kube::Client, audiences: Vec<String>, allowed_subjects: Vec<String>) -> Self {
        Self {
            client,
            audiences,
            allowed: allowed_subjects,
            cache: Mutex::new(HashMap::new()),
            down: AtomicBool::new(false),
            timeout: TOKEN_REVIEW_TIMEOUT,
        }
    }

    /// Waits at most `timeout` for each TokenReview (default [`TOKEN_REVIEW_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
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
        let asked = tokio::time::timeout(
            self.timeout,
            api.create(&kube::api::PostParams::default(), &review),
        )
        .await
        .unwrap_or_else(|_| {
            Err(kube::Error::Service(
                format!("no answer within {:?}", self.timeout).into(),
            ))
        });
        let answer = match asked {
            Ok(answer) => {
                if self.down.swap(false, Ordering::Relaxed) {
                    info!("TokenReview answers again");
                }
                answer
            }
            Err(err) => {
                // The error text comes from the API server and never contains the token.
                if !self.down.swap(true, Ordering::Relaxed) {
                    warn!(error = %err, "TokenReview failed: discovery API requests with a token not cached answer 503 auth_unavailable");
                }
                return Err(AuthError::Unavailable(
                    "the Kubernetes API server could not verify the token".to_owned(),
                ));
            }
        };
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(AuthError::Unauthenticated);
        }
        // An API server that ignores spec.audiences (too old to know them) answers without
        // status.audiences: it did not check them, so the token is not accepted.
        if !self.audiences.is_empty()
            && !status
                .audiences
                .iter()
                .flatten()
                .any(|a| self.audiences.contains(a))
        {
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
        if let Some((at, answer)) = crate::sync::lock(&self.cache).get(&key)
            && now.duration_since(*at) < TOKEN_REVIEW_CACHE_TTL
        {
            return answer.clone();
        }
        let answer = self.review(token).await;
        // Unavailability is not cached: the next request asks again.
        if !matches!(answer, Err(AuthError::Unavailable(_))) {
            let mut cache = crate::sync::lock(&self.cache);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Headers holding `name: value` alone.
    fn one_header(name: header::HeaderName, value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name, value.parse().expect("header"));
        headers
    }

    #[test]
    fn the_authorization_header_is_read_once_for_every_scheme() {
        let with = |value: &str| presented(&one_header(header::AUTHORIZATION, value));
        let bearer = |t: &str| Presented::Bearer(t.to_owned());
        assert_eq!(presented(&HeaderMap::new()), Presented::Nothing);
        assert_eq!(with("Bearer abc"), bearer("abc"));
        assert_eq!(with("bearer  abc "), bearer("abc"));
        assert_eq!(
            with("BEARER abc"),
            bearer("abc"),
            "the scheme is case-insensitive"
        );
        assert_eq!(with("Bearer "), bearer(""));
        assert_eq!(with("Bearer"), Presented::Unusable);
        // "ui:tok:en": the password may hold a colon; the user name is not looked at.
        assert_eq!(
            with("Basic dWk6dG9rOmVu"),
            Presented::BasicPassword("tok:en".to_owned())
        );
        assert_eq!(with("Basic !!!"), Presented::Unusable);
        assert_eq!(with("Digest x"), Presented::Unusable);
    }

    #[test]
    fn proxy_authorization_keeps_the_user_name() {
        let with = |value: &str| proxy_presented(&one_header(header::PROXY_AUTHORIZATION, value));
        assert_eq!(proxy_presented(&HeaderMap::new()), ProxyPresented::Nothing);
        // "ui:tok:en"
        assert_eq!(
            with("Basic dWk6dG9rOmVu"),
            ProxyPresented::Basic {
                user: "ui".to_owned(),
                password: "tok:en".to_owned()
            }
        );
        assert_eq!(with("Bearer abc"), ProxyPresented::Unusable);
        assert_eq!(with("Basic !!!"), ProxyPresented::Unusable);
        // Authorization is not Proxy-Authorization.
        assert_eq!(
            proxy_presented(&one_header(header::AUTHORIZATION, "Basic dWk6dG9rOmVu")),
            ProxyPresented::Nothing
        );
    }

    fn name(tokens: &StaticTokens, token: &str) -> Option<String> {
        tokens.by_digest.get(&digest(token)).cloned()
    }

    #[test]
    fn the_keyed_digest_tells_tokens_apart_and_is_stable_within_the_process() {
        // Stable: a re-read file with the same tokens compares equal (no reload churn).
        assert_eq!(StaticTokens::parse("a\nb\n"), StaticTokens::parse("a\nb\n"));
        // Prefixes, extensions and the empty token each get their own digest.
        let tokens = ["", "t", "t1", "t12", "token-a", "token-b", "Token-a"];
        let digests: std::collections::HashSet<[u8; 16]> = tokens.iter().map(|t| digest(t)).collect();
        assert_eq!(digests.len(), tokens.len());
        let file = StaticTokens::parse("t1\n");
        assert_eq!(file.lookup("t1").map(|i| i.name), Ok("token-1".to_owned()));
        assert_eq!(file.lookup("t12"), Err(AuthError::Unauthenticated));
        assert_eq!(file.lookup("t"), Err(AuthError::Unauthenticated));
    }

    #[test]
    fn a_secret_value_holds_one_token_or_one_per_line() {
        let map = BTreeMap::from([
            ("crawler-a".to_owned(), " token-a\n".to_owned()),
            ("fleet".to_owned(), "# two crawlers\nt1\n\nt2\n".to_owned()),
            ("empty".to_owned(), "  \n".to_owned()),
        ]);
        let tokens = StaticTokens::from_map(&map);
        assert_eq!(tokens.len(), 3);
        assert_eq!(name(&tokens, "token-a").as_deref(), Some("crawler-a"));
        assert_eq!(name(&tokens, "t1").as_deref(), Some("fleet-2"));
        assert_eq!(name(&tokens, "t2").as_deref(), Some("fleet-4"));
        assert_eq!(name(&tokens, ""), None);
    }

    /// Answers a fixed result for every token.
    struct Fixed(Result<Identity, AuthError>);

    #[async_trait]
    impl Authenticator for Fixed {
        async fn authenticate(&self, _token: &str) -> Result<Identity, AuthError> {
            self.0.clone()
        }
    }

    fn fixed(answer: Result<Identity, AuthError>) -> Arc<dyn Authenticator> {
        Arc::new(Fixed(answer))
    }

    #[tokio::test]
    async fn any_of_lets_the_first_that_knows_the_token_decide() {
        let ok = || Ok(Identity { name: "a".into() });
        let forbidden = || Err(AuthError::Forbidden("u".into()));
        let unknown = || Err(AuthError::Unauthenticated);
        let down = || Err(AuthError::Unavailable("down".into()));
        let cases = [
            (vec![unknown(), ok()], ok()),
            (vec![ok(), down()], ok()),
            (vec![unknown(), forbidden(), ok()], forbidden()),
            (vec![unknown(), unknown()], unknown()),
            // Nobody knows it and one could not be asked: not "invalid token".
            (vec![down(), unknown()], down()),
            (vec![unknown(), down()], down()),
            (vec![down(), ok()], ok()),
        ];
        for (answers, expected) in cases {
            let chain = AnyOf(answers.clone().into_iter().map(fixed).collect());
            assert_eq!(chain.authenticate("t").await, expected, "{answers:?}");
        }
    }

    #[tokio::test]
    async fn only_the_opt_out_needs_no_token() {
        assert!(NoAuthentication.anonymous().is_some());
        assert!(StaticTokens::parse("t").anonymous().is_none());
        assert!(AnyOf(vec![]).anonymous().is_none());
    }
}
