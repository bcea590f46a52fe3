//! The wire between the gateway and one upstream proxy: the request in absolute form (or a
//! `CONNECT`, on a connection of its own) with the upstream's own credentials, and the headers a
//! proxy removes and adds on the way (RFC 9110, section 7.6). Plain requests go out on kept-alive
//! connections ([`super::upstream`]).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, combinators::UnsyncBoxBody};
use hyper::{
    HeaderMap, Request, Response, StatusCode, Version,
    body::Body,
    client::conn::http1::SendRequest,
    header::{self, HeaderName, HeaderValue},
};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tracing::debug;

use crate::{lease::ProxyInfo, outcomes::Failure};

/// The `Via` entry the gateway adds, both ways.
pub(super) const VIA: &str = "1.1 egress-proxies-gateway";

/// What the gateway's answers carry.
pub(super) type GatewayBody = UnsyncBoxBody<Bytes, hyper::Error>;

/// Why an upstream proxy gave no answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum UpstreamError {
    /// No connection (refused, unreachable).
    #[error("could not connect: {0}")]
    Connect(std::io::Error),
    /// No connection within the connect timeout.
    #[error("no connection within {0:?}")]
    ConnectTimeout(Duration),
    /// Connected, but the exchange failed before an answer (reset, closed).
    #[error("the connection failed before an answer: {0}")]
    Exchange(hyper::Error),
}

impl UpstreamError {
    /// The failure it counts as in the outcome statistics.
    pub(super) fn failure(&self) -> Failure {
        match self {
            UpstreamError::Connect(_) => Failure::Connect,
            UpstreamError::ConnectTimeout(_) => Failure::Timeout,
            UpstreamError::Exchange(error) if error.is_timeout() => Failure::Timeout,
            UpstreamError::Exchange(_) => Failure::Reset,
        }
    }
}

/// Hop-by-hop headers: each connection's own, never forwarded (plus those the `Connection`
/// header names). `Proxy-Authorization` is the client's credentials to the gateway. A static:
/// one array for every use (a const is a new value wherever it is named).
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

/// Strips the hop-by-hop headers from `headers` and adds the gateway's `Via`, in place: most
/// messages carry none but `Connection`, and copying the rest into a new map hashed every name
/// again. `Transfer-Encoding` goes too: hyper frames each side's body itself.
pub(super) fn keep_end_to_end(headers: &mut HeaderMap) {
    let doomed: Vec<HeaderName> = {
        // Names the `Connection` header lists are hop-by-hop too (read once, compared as text).
        let listed: Vec<&str> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect();
        headers
            .keys()
            .filter(|name| {
                HOP_BY_HOP.contains(name)
                    || *name == header::TRANSFER_ENCODING
                    || listed.iter().any(|l| l.eq_ignore_ascii_case(name.as_str()))
            })
            .cloned()
            .collect()
    };
    for name in doomed {
        headers.remove(name);
    }
    headers.append(header::VIA, HeaderValue::from_static(VIA));
}

/// The request to send `proxy` for a client's request (`parts`, `body`): the client's
/// end-to-end headers, a `Host` if it had none, and the proxy's own credentials.
pub(super) fn upstream_request<B>(
    parts: &hyper::http::request::Parts,
    body: B,
    proxy: &ProxyInfo,
) -> Request<B> {
    let mut request = Request::new(body);
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = Version::HTTP_11;
    // A copy (the parts stay whole for a resend), then stripped in place.
    let headers = request.headers_mut();
    headers.clone_from(&parts.headers);
    keep_end_to_end(headers);
    if !headers.contains_key(header::HOST)
        && let Some(host) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    {
        headers.insert(header::HOST, host);
    }
    authorize(headers, proxy);
    request
}

/// A `CONNECT` to `authority` through `proxy`.
pub(super) fn connect_request(authority: &str, proxy: &ProxyInfo) -> Option<Request<Empty<Bytes>>> {
    let host = HeaderValue::from_str(authority).ok()?;
    let mut request = Request::new(Empty::new());
    *request.method_mut() = hyper::Method::CONNECT;
    *request.uri_mut() = authority.parse().ok()?;
    let headers = request.headers_mut();
    headers.insert(header::HOST, host);
    headers.insert(header::VIA, HeaderValue::from_static(VIA));
    authorize(headers, proxy);
    Some(request)
}

fn authorize(headers: &mut HeaderMap, proxy: &ProxyInfo) {
    if let Some(value) = proxy
        .proxy_authorization()
        .and_then(|v| HeaderValue::from_str(v).ok())
    {
        let mut value = value;
        value.set_sensitive(true);
        headers.insert(header::PROXY_AUTHORIZATION, value);
    }
}

/// A new HTTP/1 connection to `proxy` (within `connect_timeout`), its exchange running in a
/// task of its own until the last answer's body and any upgrade are done: a `CONNECT`'s
/// (`Gateway::exchange`) or a kept-alive one's ([`super::upstream::Upstreams`]).
pub(super) async fn dial<B>(
    proxy: &ProxyInfo,
    connect_timeout: Duration,
) -> Result<SendRequest<B>, UpstreamError>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let address = (proxy.endpoint.host.as_str(), proxy.endpoint.port);
    let stream = tokio::time::timeout(connect_timeout, TcpStream::connect(address))
        .await
        .map_err(|_| UpstreamError::ConnectTimeout(connect_timeout))?
        .map_err(UpstreamError::Connect)?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(UpstreamError::Exchange)?;
    tokio::spawn(async move {
        if let Err(error) = conn.with_upgrades().await {
            debug!(%error, "upstream connection ended with an error");
        }
    });
    Ok(sender)
}

/// The head of the client's copy of an upstream answer: its status and end-to-end headers
/// (stripped in place), as HTTP/1.1 and without the upstream connection's extensions.
pub(super) fn client_head(mut head: hyper::http::response::Parts) -> hyper::http::response::Parts {
    keep_end_to_end(&mut head.headers);
    head.version = Version::HTTP_11;
    head.extensions.clear();
    head
}

/// An empty `200` (the answer to a `CONNECT` whose tunnel is open).
pub(super) fn tunnel_open() -> Response<GatewayBody> {
    let mut response = Response::new(empty());
    *response.status_mut() = StatusCode::OK;
    response
        .headers_mut()
        .insert(header::VIA, HeaderValue::from_static(VIA));
    response
}

/// An empty body.
pub(super) fn empty() -> GatewayBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_stay_behind_and_one_via_is_added() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-hop"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("proxy-authorization", "Basic Y3Jhd2xlcjp0b2tlbg=="),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("x-hop", "named by Connection"),
            ("accept", "text/html"),
            ("via", "1.1 earlier-proxy"),
        ] {
            headers.append(name, HeaderValue::from_static(value));
        }
        let mut forwarded = headers;
        keep_end_to_end(&mut forwarded);
        // The order of different names carries no meaning (RFC 9110, 5.3); removing in place
        // may change it.
        let mut names: Vec<&str> = forwarded.keys().map(|n| n.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["accept", "via"], "{forwarded:?}");
        let via: Vec<&str> = forwarded
            .get_all(header::VIA)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(via, ["1.1 earlier-proxy", VIA]);
    }
}
