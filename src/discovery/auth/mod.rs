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

mod headers;
mod review;
#[cfg(test)]
mod tests;
mod tokens;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use hyper::header;

pub use self::{
    headers::{Presented, ProxyPresented, presented, proxy_presented},
    review::{TOKEN_REVIEW_CACHE_TTL, TOKEN_REVIEW_TIMEOUT, TokenReviewAuthenticator},
    tokens::{
        ReloadingTokens, StaticTokens, TokenFile, TokenFileError, TokenSecret, TokenSource, TokenSourceError,
    },
};

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
