//! The gateway: one forward HTTP proxy endpoint that takes leases for its clients, so any
//! client that can use a proxy (`curl -x`, Python `requests`, Scrapy's own
//! `HttpProxyMiddleware`) gets a rotating pool without an SDK. Documented in docs/gateway.md.
//!
//! It owns the listener and what happens to one client request: authentication
//! (`Proxy-Authorization: Basic`, the password a discovery API token checked by the API's
//! [`Authenticator`], the user name the holder and options, [`user`]), the lease it uses
//! ([`held`]: taken and ended through [`crate::lease::DurableLeases`], as the API's are, but
//! never journalled; sticky per session), the exchange with the leased upstream proxy
//! ([`forward`]: absolute-form requests on kept-alive connections ([`upstream`]), `CONNECT`
//! tunnels whose bytes go socket to socket with `splice(2)` ([`tunnel`]); a
//! GET, HEAD or CONNECT the proxy gave no answer to is sent once more through another), how
//! often a proxy may be sent to one domain ([`polite`], in the state the lease API shares),
//! what a target's answer does to the lease and the proxy ([`rules`], applied in [`judged`]:
//! by default a 403 or 429 bans the proxy for the target's domain; a rules file adds header,
//! body and latency rules whose action escalates up to recycling the proxy), and what each
//! request did ([`measure`]: recorded once in [`crate::outcomes`], its bytes metered in
//! [`crate::usage`] for its token and holder, whose quotas may refuse it first with 429).
//! Every lease decision stays the lease store's.

mod body;
mod forward;
mod held;
mod judged;
mod measure;
pub mod polite;
pub mod rules;
pub mod tunnel;
mod upstream;
pub mod user;

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Body, Incoming},
    header::{self, HeaderValue},
    http::uri::Scheme,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, sync::watch};
use tracing::{debug, warn};

use self::{
    forward::{GatewayBody, UpstreamError},
    held::{Held, Lent},
    judged::Resend,
    measure::Measure,
    rules::{RecycleRequests, Rules, judge::Judge},
    upstream::Upstreams,
    user::{UserName, Who},
};
use crate::{
    discovery::{
        AuthError, Authenticator,
        auth::{ProxyPresented, RememberedVerdict, proxy_presented},
        retry_after_header,
    },
    health::HealthHandle,
    lease::{LeaseError, LeaseStore, Outcome},
    outcomes::{Ended, Failure, Outcomes},
    politeness::Politeness,
    telemetry::admin::Readiness,
    usage::{QuotaExceeded, Usage},
};

/// The realm of the gateway's `Proxy-Authenticate` challenge.
pub const REALM: &str = "egress-proxies";

/// The header Squid puts on the error pages it makes itself.
const SQUID_ERROR: &str = "x-squid-error";

/// Largest body of a GET or HEAD the gateway keeps to send again on another proxy.
const MAX_RETRY_BODY: usize = 64 * 1024;

/// The gateway's settings.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// TTL of the leases it takes; it renews them while they are used.
    pub lease_ttl: Duration,
    /// A session's lease is released once no request used it for this long.
    pub session_idle: Duration,
    /// How long connecting to an upstream proxy may take.
    pub connect_timeout: Duration,
    /// How long a client may take to send request headers.
    pub header_timeout: Duration,
    /// How long a graceful shutdown waits for open requests and tunnels.
    pub shutdown_grace: Duration,
    /// What a target's answer does to the lease.
    pub rules: Rules,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(60),
            session_idle: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(10),
            rules: Rules::default(),
        }
    }
}

/// What the gateway works with: the discovery API's lease store, authenticator and readiness
/// (neither the lease journal nor the signing key: see [`held`]).
#[derive(Clone)]
pub struct GatewayDeps {
    /// The lease store.
    pub store: LeaseStore,
    /// Checks the token in the client's proxy password.
    pub auth: Arc<dyn Authenticator>,
    /// Requests are refused (503) until this says synced and leader.
    pub readiness: watch::Receiver<Readiness>,
    /// Takes proxies out of rotation for the rules' `outOfRotation` step (`None`: that step
    /// only ends the lease as a ban does).
    pub health: Option<HealthHandle>,
    /// Asks for fresh instances for the rules' `recycle` step (the mode's own path; `None`:
    /// that step only ends the lease as a ban does).
    pub recycle: Option<Arc<dyn RecycleRequests>>,
    /// Where what each request did is recorded.
    pub outcomes: Outcomes,
    /// Usage per token and holder, and the quotas that refuse new work.
    pub usage: Usage,
    /// Politeness per proxy and domain, shared with the lease API.
    pub politeness: Politeness,
}

/// The gateway; cheap to clone.
#[derive(Clone)]
pub struct Gateway {
    held: Arc<Held>,
    upstreams: Arc<Upstreams>,
    config: Arc<GatewayConfig>,
    judge: Arc<Judge>,
    polite: Politeness,
}

impl Gateway {
    /// A gateway over `deps`.
    pub fn new(deps: GatewayDeps, config: GatewayConfig) -> Self {
        let judge = Judge::new(config.rules.clone(), deps.health.clone(), deps.recycle.clone());
        Self {
            polite: deps.politeness.clone(),
            held: Arc::new(Held::new(deps, config.clone())),
            upstreams: Arc::new(Upstreams::new(config.connect_timeout)),
            config: Arc::new(config),
            judge: Arc::new(judge),
        }
    }
}

/// Serves the gateway on `listener` until `shutdown` completes; then stops accepting, waits up
/// to [`GatewayConfig::shutdown_grace`] for open requests and releases every lease it holds.
pub async fn serve(
    listener: TcpListener,
    gateway: Gateway,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let (stop_upkeep, upkeep_stopped) = tokio::sync::oneshot::channel::<()>();
    let upkeep = tokio::spawn(gateway.held.clone().upkeep(async move {
        let _ = upkeep_stopped.await;
    }));
    let drain = crate::net::Drain::default();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(gateway.config.header_timeout)
        .keep_alive(true);
    loop {
        tokio::select! {
            stream = crate::net::accept(&listener, "gateway") => {
                let gateway = gateway.clone();
                // A client sends one Proxy-Authorization on all of a connection's requests.
                let remembered = Arc::new(RememberedVerdict::<Arc<Who>>::default());
                let service = hyper::service::service_fn(move |request| {
                    let gateway = gateway.clone();
                    let remembered = remembered.clone();
                    async move { Ok::<_, Infallible>(gateway.handle(request, &remembered).await) }
                });
                // Upgradeable (CONNECT).
                let conn = drain.watch(builder.serve_connection(TokioIo::new(stream), service).with_upgrades());
                tokio::spawn(async move {
                    if let Err(error) = conn.await {
                        debug!(%error, "gateway connection ended with an error");
                    }
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    if !drain.stop(gateway.config.shutdown_grace).await {
        warn!("gateway connections still open after the shutdown grace period");
    }
    let _ = stop_upkeep.send(());
    let _ = upkeep.await;
    Ok(())
}

/// Why a request was not forwarded: the gateway's own answer, JSON as the API's errors.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    code: &'static str,
    message: String,
    retry_after: Option<Duration>,
}

impl Refusal {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "malformed_request", message)
    }

    fn credentials(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            "proxy_auth_required",
            message,
        )
    }

    fn upstream(proxy: &crate::lease::ProxyInfo, error: &UpstreamError) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_failed",
            format!("the proxy {} ({}): {error}", proxy.key, proxy.endpoint_text),
        )
    }

    fn into_response(self) -> Response<GatewayBody> {
        let body = serde_json::json!({"error": {"code": self.code, "message": self.message}});
        let mut response = Response::new(
            Full::new(Bytes::from(body.to_string()))
                .map_err(|never| match never {})
                .boxed_unsync(),
        );
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(header::VIA, HeaderValue::from_static(forward::VIA));
        if self.status == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
            headers.insert(
                header::PROXY_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"egress-proxies\""),
            );
        }
        if let Some(after) = self.retry_after {
            headers.insert(header::RETRY_AFTER, retry_after_header(after));
        }
        response
    }
}

impl From<QuotaExceeded> for Refusal {
    fn from(over: QuotaExceeded) -> Self {
        let mut refusal = Self::new(StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", over.to_string());
        refusal.retry_after = Some(Duration::from_millis(over.retry_after_ms).max(Duration::from_secs(1)));
        refusal
    }
}

impl From<LeaseError> for Refusal {
    fn from(refused: LeaseError) -> Self {
        let status = match &refused {
            LeaseError::NoProxyAvailable { .. } | LeaseError::RequestInProgress => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            LeaseError::Invalid(_) | LeaseError::BanNeedsDomain => StatusCode::BAD_REQUEST,
            _ => StatusCode::BAD_GATEWAY,
        };
        let mut refusal = Self::new(status, refused.code(), refused.to_string());
        if let LeaseError::NoProxyAvailable { retry_after } = refused {
            refusal.retry_after = Some(retry_after);
        }
        refusal
    }
}

/// The domain a request targets, as lease requests and bans take it (`None` for a host that
/// is no host name, such as an IPv6 literal: no domain ban applies to it).
fn target_domain(host: &str) -> Option<&str> {
    let valid = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
    valid.then_some(host)
}

impl Gateway {
    async fn handle(
        &self,
        request: Request<Incoming>,
        remembered: &RememberedVerdict<Arc<Who>>,
    ) -> Response<GatewayBody> {
        match self.answer(request, remembered).await {
            Ok(response) => response,
            Err(refusal) => refusal.into_response(),
        }
    }

    async fn answer(
        &self,
        request: Request<Incoming>,
        remembered: &RememberedVerdict<Arc<Who>>,
    ) -> Result<Response<GatewayBody>, Refusal> {
        if !self.held.deps().readiness.borrow().is_ready() {
            let mut refusal = Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_ready",
                "the operator is not ready (starting, or not the leader)",
            );
            refusal.retry_after = Some(Duration::from_secs(1));
            return Err(refusal);
        }
        // No proxy request at all (e.g. a browser pointed at this address): the hint comes
        // before a login prompt that no password would get past.
        if request.method() != Method::CONNECT && request.uri().authority().is_none() {
            return Err(Refusal::bad_request(
                "the gateway is a forward proxy: send requests in absolute form (GET http://host/path), \
                 as a client configured with this proxy does (curl -x, HTTP_PROXY)",
            ));
        }
        let who = self.authenticate(request.headers(), remembered).await?;
        if request.method() == Method::CONNECT {
            return self.tunnel(request, &who).await;
        }
        let uri = request.uri();
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(Refusal::bad_request(
                "only http:// URLs are forwarded as requests; https:// goes through a CONNECT tunnel",
            ));
        }
        self.admit(&who)?;
        let host = uri.host().unwrap_or_default().to_owned();
        let domain = target_domain(&host);
        let retryable = matches!(*request.method(), Method::GET | Method::HEAD);
        let (parts, body) = request.into_parts();
        if !retryable {
            let lent = self.polite(self.held.take(&who, domain).await?, domain).await?;
            let sent = body.size_hint().exact().unwrap_or(0);
            let measure = self.measure(&lent, &who, &host, sent);
            let upstream = forward::upstream_request(&parts, body, lent.proxy());
            return match self.upstreams.send(lent.proxy(), upstream).await {
                Ok(response) => Ok(self.answered(lent, response, domain, measure, None).await),
                Err(error) => {
                    measure.failed(error.failure());
                    let refusal = Refusal::upstream(lent.proxy(), &error);
                    lent.end(Outcome::Error).await;
                    Err(refusal)
                }
            };
        }
        // Kept, to be sent again on another proxy if the first one died.
        let body = Limited::new(body, MAX_RETRY_BODY)
            .collect()
            .await
            .map_err(|e| Refusal::bad_request(format!("reading the request body: {e}")))?
            .to_bytes();
        let (lent, response, measure) = self
            .send_retried(&who, domain, &host, body.len() as u64, |proxy| {
                Some(forward::upstream_request(&parts, Full::new(body.clone()), proxy))
            })
            .await?;
        let again = Resend {
            who: &who,
            parts: &parts,
            body: &body,
        };
        Ok(self.answered(lent, response, domain, measure, Some(again)).await)
    }

    /// Sends what `request` makes for a proxy through a lease for `who`, and if that proxy
    /// gives no answer (refused, reset before answering), once more through another one, taken
    /// while the dead one is still held so that the store chooses another: for what may be
    /// sent twice (GET, HEAD, CONNECT). The dead proxy's lease ends with outcome `error`.
    async fn send_retried<B>(
        &self,
        who: &Who,
        domain: Option<&str>,
        host: &str,
        bytes_sent: u64,
        request: impl Fn(&crate::lease::ProxyInfo) -> Option<Request<B>>,
    ) -> Result<(Lent, Response<Incoming>, Measure), Refusal>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut lent = self.polite(self.held.take(who, domain).await?, domain).await?;
        let mut retried = false;
        loop {
            let upstream =
                request(lent.proxy()).ok_or_else(|| Refusal::bad_request("CONNECT needs host:port"))?;
            let measure = self.measure(&lent, who, host, bytes_sent);
            let error = match self.exchange(lent.proxy(), upstream).await {
                Ok(response) => return Ok((lent, response, measure)),
                Err(error) => error,
            };
            measure.failed(error.failure());
            let mut refusal = Refusal::upstream(lent.proxy(), &error);
            if retried {
                lent.end(Outcome::Error).await;
                return Err(refusal);
            }
            retried = true;
            warn!(proxy = %lent.proxy().key, %error, "upstream proxy failed; trying another once");
            let second = self.held.take_loose(who, domain, Some(&lent.proxy().key)).await;
            lent.end(Outcome::Error).await;
            let second = match second {
                Ok(second) => self.polite(second, domain).await.ok(),
                Err(_) => None,
            };
            match second {
                Some(second) => lent = second,
                None => {
                    refusal.message.push_str("; no other proxy was free to try");
                    return Err(refusal);
                }
            }
        }
    }

    /// What a request of `who` through `lent`'s proxy to `host` does, measured from now.
    fn measure(&self, lent: &Lent, who: &Who, host: &str, bytes_sent: u64) -> Measure {
        let deps = self.held.deps();
        Measure::start(&deps.outcomes, &deps.store, lent.proxy(), host, bytes_sent).metered(&deps.usage, who)
    }

    /// Counts one request of `who`, or refuses it (429) when its token is over a quota.
    fn admit(&self, who: &Who) -> Result<(), Refusal> {
        let deps = self.held.deps();
        Ok(deps.usage.admit(&who.token, &who.holder, deps.store.now_ms())?)
    }

    /// Sends `request` to `proxy`: a `CONNECT` on a connection of its own, anything else on a
    /// kept-alive one.
    async fn exchange<B>(
        &self,
        proxy: &crate::lease::ProxyInfo,
        request: Request<B>,
    ) -> Result<Response<Incoming>, UpstreamError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        if request.method() == Method::CONNECT {
            // A connection of its own: after the answer it carries the tunnel.
            let mut sender = forward::dial(proxy, self.config.connect_timeout).await?;
            sender
                .send_request(request)
                .await
                .map_err(UpstreamError::Exchange)
        } else {
            self.upstreams.send(proxy, request).await
        }
    }

    /// `CONNECT host:port`: a tunnel through the leased proxy, spliced both ways; the lease is
    /// held until either side closes.
    async fn tunnel(
        &self,
        mut request: Request<Incoming>,
        who: &Who,
    ) -> Result<Response<GatewayBody>, Refusal> {
        let Some(authority) = request.uri().authority().cloned() else {
            return Err(Refusal::bad_request("CONNECT needs host:port"));
        };
        self.admit(who)?;
        let domain = target_domain(authority.host());
        let (lent, response, measure) = self
            .send_retried(who, domain, authority.host(), 0, |proxy| {
                forward::connect_request(authority.as_str(), proxy)
            })
            .await?;
        if !response.status().is_success() {
            // The proxy's own refusal (not the target's): passed on, and no ban.
            let (head, body) = response.into_parts();
            let refused = Ended::Failed(Failure::ProxyError);
            let body = measure.answered(body, refused, false, Some(lent));
            return Ok(Response::from_parts(
                forward::client_head(head),
                body.boxed_unsync(),
            ));
        }
        let client_side = hyper::upgrade::on(&mut request);
        let upstream_side = match hyper::upgrade::on(response).await {
            Ok(upgraded) => upgraded,
            Err(error) => {
                measure.failed(Failure::Reset);
                let refusal = Refusal::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_failed",
                    format!("the proxy {} opened no tunnel: {error}", lent.proxy().key),
                );
                lent.end(Outcome::Error).await;
                return Err(refusal);
            }
        };
        let opened = measure.opened();
        tokio::spawn(async move {
            match client_side.await {
                Ok(client) => {
                    let spliced = tunnel::relay(client, upstream_side).await;
                    if let Err(error) = &spliced {
                        debug!(%error, "gateway tunnel ended with an error");
                    }
                    opened.closed(&spliced);
                }
                Err(error) => debug!(%error, "the client's side of a tunnel never opened"),
            }
            // The tunnel is closed: the lease goes back.
            drop(lent);
        });
        Ok(forward::tunnel_open())
    }

    /// Who the request is for: its token checked, its user name read; what the connection's
    /// last request with the same header was found to be, while the tokens are unchanged
    /// (see [`RememberedVerdict`]: decoding, hashing and looking up the token and parsing the
    /// user name were about 3,000 of the ~60,000 instructions of a request through the gateway).
    async fn authenticate(
        &self,
        headers: &hyper::HeaderMap,
        remembered: &RememberedVerdict<Arc<Who>>,
    ) -> Result<Arc<Who>, Refusal> {
        let header = headers.get(header::PROXY_AUTHORIZATION);
        remembered
            .recall_or(&*self.held.deps().auth, header, self.identify(headers))
            .await
    }

    /// Who the request's `Proxy-Authorization` names: its token looked up, its user name parsed.
    async fn identify(&self, headers: &hyper::HeaderMap) -> Result<Arc<Who>, Refusal> {
        let auth = &self.held.deps().auth;
        let (user, password) = match proxy_presented(headers) {
            ProxyPresented::Basic { user, password } => (user, password),
            ProxyPresented::Nothing if let Some(anonymous) = auth.anonymous() => {
                let name = UserName::parse("anonymous").map_err(|e| Refusal::bad_request(e.to_string()))?;
                return Ok(Arc::new(Who {
                    token: anonymous.name.into(),
                    name,
                }));
            }
            ProxyPresented::Nothing => {
                return Err(Refusal::credentials(
                    "proxy credentials required: the user name is the holder (e.g. crawler-1;session=abc), \
                     the password a discovery API token",
                ));
            }
            ProxyPresented::Unusable => {
                return Err(Refusal::credentials(
                    "Proxy-Authorization must be Basic credentials: the user name is the holder, the password a discovery API token",
                ));
            }
        };
        let identity = match auth.anonymous() {
            Some(anonymous) => anonymous,
            None => auth.authenticate(&password).await.map_err(|e| match e {
                AuthError::Unauthenticated => {
                    Refusal::credentials("invalid token: the proxy password must be a discovery API token")
                }
                AuthError::Forbidden(_) => Refusal::new(StatusCode::FORBIDDEN, "forbidden", e.to_string()),
                AuthError::Unavailable(_) => {
                    let mut refusal =
                        Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "auth_unavailable", e.to_string());
                    refusal.retry_after = Some(Duration::from_secs(1));
                    refusal
                }
            })?,
        };
        let name = UserName::parse(&user)
            .map_err(|e| Refusal::new(StatusCode::BAD_REQUEST, "bad_user_name", e.to_string()))?;
        Ok(Arc::new(Who {
            token: identity.name.into(),
            name,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_domains_are_host_names() {
        assert_eq!(target_domain("shop.example"), Some("shop.example"));
        assert_eq!(target_domain("127.0.0.1"), Some("127.0.0.1"));
        assert_eq!(target_domain("::1"), None);
        assert_eq!(target_domain(""), None);
    }

    /// `Retry-After` is whole seconds: rounded up, as the discovery API does, so a client that
    /// waits what it says never asks before a proxy can be free (1.9 s left is 2, not 1).
    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        for (left, header) in [
            (Duration::from_millis(1_900), "2"),
            (Duration::from_millis(5_000), "5"),
            (Duration::from_nanos(5_000_000_001), "6"),
            (Duration::from_millis(1), "1"),
            (Duration::ZERO, "1"),
        ] {
            let refusal = Refusal::from(LeaseError::NoProxyAvailable { retry_after: left });
            let response = refusal.into_response();
            assert_eq!(response.headers()[header::RETRY_AFTER], header, "{left:?} left");
        }
    }
}
