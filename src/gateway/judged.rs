//! A target's answer after the rules had their say ([`super::rules`]): passed on unchanged
//! (its first bytes read ahead when a body pattern needs them), its lease ended as the verdict
//! says, a proxy-wide step carried out off the request's path, and a GET or HEAD whose answer
//! matched sent once more through another proxy when the rule retries.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, body::Incoming, http::request::Parts};
use tracing::{info, warn};

use super::{
    Gateway, SQUID_ERROR,
    body::Replayed,
    forward::{self, GatewayBody},
    held::Lent,
    measure::Measure,
    rules::{Seen, judge::LeaseEnd},
    user::Who,
};
use crate::{
    api::ProxyKey,
    lease::Outcome,
    outcomes::{Ended, Failure},
};

/// How long the gateway waits for the body bytes a body pattern looks at; a body that comes
/// slower is judged on what came (and passed on whole all the same).
const READ_AHEAD_WITHIN: Duration = Duration::from_secs(5);

/// What a request needs to be sent again through another proxy (a GET or HEAD, its body kept).
pub(super) struct Resend<'a> {
    pub who: &'a Who,
    pub parts: &'a Parts,
    pub body: &'a Bytes,
}

/// An answer judged: what the client gets unless it is sent again.
struct Judged {
    answer: Response<GatewayBody>,
    /// A rule wants the request sent again through another proxy than this one.
    resend_avoiding: Option<ProxyKey>,
}

impl Gateway {
    /// The client's answer from the target's `response` through `lent`'s proxy, after the
    /// rules had their say, its outcome recorded by `measure` when its body is done; with
    /// `resend`, a matching answer of a rule that retries is replaced by another proxy's.
    pub(super) async fn answered(
        &self,
        lent: Lent,
        response: Response<Incoming>,
        domain: Option<&str>,
        measure: Measure,
        resend: Option<Resend<'_>>,
    ) -> Response<GatewayBody> {
        let first = self.judged(lent, response, domain, measure).await;
        let (Some(again), Some(avoid)) = (resend, &first.resend_avoiding) else {
            return first.answer;
        };
        // Taken while the first is still held (its answer keeps it), so the store chooses
        // another; with none free, the first answer is passed on.
        let Ok(second) = self.held.take_loose(again.who, domain, Some(avoid)).await else {
            return first.answer;
        };
        let Ok(second) = self.polite(second, domain).await else {
            return first.answer;
        };
        let upstream = forward::upstream_request(again.parts, Full::new(again.body.clone()), second.proxy());
        let host = again.parts.uri.host().unwrap_or_default();
        let measure = self.measure(&second, again.who, host, again.body.len() as u64);
        match self.upstreams.send(second.proxy(), upstream).await {
            // The first answer is dropped unsent: its lease goes back and its outcome is
            // recorded as its head said.
            Ok(response) => self.judged(second, response, domain, measure).await.answer,
            Err(error) => {
                measure.failed(error.failure());
                warn!(proxy = %second.proxy().key, %error, "resending a matched request failed; the first answer is passed on");
                second.end(Outcome::Error).await;
                first.answer
            }
        }
    }

    /// Judges one answer: reads ahead what a body pattern needs, asks the rules, ends the
    /// lease as the verdict says (or leaves it to the answer's body) and starts a proxy-wide
    /// step. The rules see the latency `measure` has seen until the head came.
    async fn judged(
        &self,
        lent: Lent,
        response: Response<Incoming>,
        domain: Option<&str>,
        measure: Measure,
    ) -> Judged {
        let latency = measure.elapsed();
        let (head, body) = response.into_parts();
        let status = head.status;
        // Squid marks the error pages it makes itself: those are the proxy's answer (access
        // denied, target unreachable), not the target's, and no rule judges them.
        if head.headers.contains_key(SQUID_ERROR) {
            let refused = Ended::Failed(Failure::ProxyError);
            let body = measure.answered(Replayed::whole(body), refused, false, Some(lent));
            return Judged {
                answer: Response::from_parts(forward::client_head(head), body.boxed_unsync()),
                resend_avoiding: None,
            };
        }
        let mut seen = Seen {
            status: head.status,
            headers: &head.headers,
            latency,
            body: None,
        };
        let wanted = self.judge.body_wanted(lent.proxy(), &seen);
        let (ahead, body) = if wanted > 0 {
            Replayed::read_ahead(body, wanted, READ_AHEAD_WITHIN).await
        } else {
            (Bytes::new(), Replayed::whole(body))
        };
        if wanted > 0 {
            seen.body = Some(&ahead);
        }
        let store = &self.held.deps().store;
        let Some(verdict) = self.judge.decide(lent.proxy(), domain, &seen, || store.now_ms()) else {
            // The common case: the lease is given back when the answer's body is done or
            // dropped.
            let body = measure.answered(body, Ended::Status(status.as_u16()), false, Some(lent));
            return Judged {
                answer: Response::from_parts(forward::client_head(head), body.boxed_unsync()),
                resend_avoiding: None,
            };
        };
        let proxy = lent.proxy().clone();
        info!(
            proxy = %proxy.key,
            domain = domain.unwrap_or_default(),
            status = status.as_u16(),
            rule = %verdict.rule,
            step = verdict.action.as_str(),
            matches_for_domain = verdict.counts.domain,
            matches_for_proxy = verdict.counts.proxy,
            "a gateway rule matched the target's answer"
        );
        if verdict.action.proxy_wide() {
            let (judge, proxy, verdict) = (self.judge.clone(), proxy.clone(), verdict.clone());
            let now = store.now_ms();
            tokio::spawn(async move { judge.enforce(&proxy, &verdict, now).await });
        }
        let lent = match (verdict.lease, domain) {
            // A session on it moves to another proxy at its next request.
            (LeaseEnd::Banned(time), Some(_)) => {
                lent.end_banning(Outcome::Banned, time).await;
                None
            }
            // Without a domain there is nothing to ban for.
            _ => Some(lent),
        };
        // The lease, if the verdict left it, is given back when the answer's body is done or
        // dropped.
        let banned = lent.is_none();
        let answer = Response::from_parts(
            forward::client_head(head),
            measure
                .answered(body, Ended::Status(status.as_u16()), banned, lent)
                .boxed_unsync(),
        );
        Judged {
            answer,
            resend_avoiding: verdict.resend.then(|| proxy.key.clone()),
        }
    }
}
