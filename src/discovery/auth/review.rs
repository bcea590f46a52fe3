//! Kubernetes tokens verified with a `TokenReview`, answers cached briefly by token digest.

use super::{AuthError, Authenticator, Identity, digest};
use std::{
    collections::HashMap,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use async_trait::async_trait;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use tracing::{info, warn};

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
