//! How the discovery API authenticates callers, for both modes: the options the binary's flags
//! fill in, their validation, and the authenticator chain built from them. Owns no mode: the
//! Kubernetes-backed methods (token Secrets, TokenReview) take a client only when the caller
//! (cluster mode) passes one.

use std::{path::PathBuf, sync::Arc, time::Duration};

use tracing::{info, warn};

use super::AppError;
use crate::discovery::auth::{
    AnyOf, Authenticator, NoAuthentication, ReloadingTokens, TokenFile, TokenReviewAuthenticator, TokenSecret,
};

/// How the discovery API authenticates callers: static tokens (a file, a Secret), Kubernetes
/// TokenReview, or both; no authentication only when `no_auth` says so.
#[derive(Clone, Debug, Default)]
pub struct DiscoveryAuthOptions {
    /// Static tokens file (one per line), re-read every `reload_interval`.
    pub tokens_file: Option<PathBuf>,
    /// Secret in the operator's namespace whose data keys are tokens, re-read every
    /// `reload_interval` (cluster mode only).
    pub tokens_secret: Option<String>,
    /// TokenReview: the audiences a token must hold (cluster mode only; empty: off).
    pub token_review_audiences: Vec<String>,
    /// TokenReview: user names allowed in, exact or a `prefix*` (empty: every authenticated user).
    pub allowed_subjects: Vec<String>,
    /// No authentication at all (the explicit opt-out); excludes every other option.
    pub no_auth: bool,
    /// How often token files and Secrets are re-read.
    pub reload_interval: Duration,
}

/// Default of [`DiscoveryAuthOptions::reload_interval`]: a rotated token works (and the old one
/// stops working) within this long, plus the kubelet's delay for a mounted Secret.
pub const TOKEN_RELOAD_INTERVAL: Duration = Duration::from_secs(2);

impl DiscoveryAuthOptions {
    /// Static tokens from `path`, reloaded every [`TOKEN_RELOAD_INTERVAL`].
    pub fn tokens_file(path: PathBuf) -> Self {
        Self {
            tokens_file: Some(path),
            reload_interval: TOKEN_RELOAD_INTERVAL,
            ..Self::default()
        }
    }

    /// Checks that exactly one choice was made (some methods, or the opt-out) and that each
    /// method fits the mode (`cluster`: Secrets and TokenReview need Kubernetes). Pure, so the
    /// binary checks its flags before connecting anywhere.
    pub fn validate(&self, cluster: bool) -> Result<(), AppError> {
        let misconfigured =
            |why: &str| Err(AppError::Startup(format!("discovery API authentication: {why}")));
        let any_method = self.tokens_file.is_some()
            || self.tokens_secret.is_some()
            || !self.token_review_audiences.is_empty();
        if self.no_auth {
            if any_method || !self.allowed_subjects.is_empty() {
                return misconfigured(
                    "--discovery-no-auth excludes every other --discovery-* authentication flag",
                );
            }
            return Ok(());
        }
        if !any_method {
            return misconfigured(
                "choose --discovery-tokens, --discovery-tokens-secret and/or --discovery-token-review \
                 with --discovery-token-audience (or opt out explicitly with --discovery-no-auth)",
            );
        }
        if self.token_review_audiences.is_empty() && !self.allowed_subjects.is_empty() {
            return misconfigured(
                "--discovery-allowed-subject applies to TokenReview only (add --discovery-token-review)",
            );
        }
        if !cluster && self.tokens_secret.is_some() {
            return misconfigured("--discovery-tokens-secret needs cluster mode");
        }
        if !cluster && !self.token_review_audiences.is_empty() {
            return misconfigured("--discovery-token-review needs cluster mode");
        }
        Ok(())
    }
}

/// The discovery API's authenticator for `options` (see [`DiscoveryAuthOptions::validate`]).
/// `kube`: the client and the operator's namespace, in cluster mode (Secrets and TokenReview
/// need them). Token files and Secrets are read once here (an unreadable one fails the start),
/// then re-read in the background. Logs what is in force, and loudly when nothing is.
pub async fn discovery_authenticator(
    options: &DiscoveryAuthOptions,
    kube: Option<(&kube::Client, &str)>,
) -> Result<Arc<dyn Authenticator>, AppError> {
    options.validate(kube.is_some())?;
    if options.no_auth {
        warn!(
            "discovery API authentication is OFF (--discovery-no-auth): anyone who can reach it can lease proxies"
        );
        return Ok(Arc::new(NoAuthentication));
    }
    let reload = if options.reload_interval.is_zero() {
        TOKEN_RELOAD_INTERVAL
    } else {
        options.reload_interval
    };
    let needs_cluster = |flag: &str| AppError::Startup(format!("{flag} needs cluster mode"));
    let mut chain: Vec<Arc<dyn Authenticator>> = Vec::new();
    if let Some(path) = &options.tokens_file {
        let tokens = ReloadingTokens::start(TokenFile(path.clone()), reload)
            .await
            .map_err(|e| AppError::Startup(e.to_string()))?;
        chain.push(Arc::new(tokens));
    }
    if let Some(name) = &options.tokens_secret {
        let (client, namespace) = kube.ok_or_else(|| needs_cluster("--discovery-tokens-secret"))?;
        let tokens = ReloadingTokens::start(TokenSecret::new(client.clone(), namespace, name), reload)
            .await
            .map_err(|e| AppError::Startup(e.to_string()))?;
        chain.push(Arc::new(tokens));
    }
    if !options.token_review_audiences.is_empty() {
        let (client, _) = kube.ok_or_else(|| needs_cluster("--discovery-token-review"))?;
        info!(
            audiences = ?options.token_review_audiences,
            allowed_subjects = ?options.allowed_subjects,
            "discovery API accepts Kubernetes tokens (TokenReview)"
        );
        chain.push(Arc::new(TokenReviewAuthenticator::new(
            client.clone(),
            options.token_review_audiences.clone(),
            options.allowed_subjects.clone(),
        )));
    }
    Ok(match chain.len() {
        1 => chain.remove(0),
        _ => Arc::new(AnyOf(chain)),
    })
}
