//! One probe: fetch the health URL through the proxy, over a fresh connection.
//!
//! Plain `http://` URLs go to the proxy as an absolute-form request; `https://` URLs open a
//! `CONNECT` tunnel, then TLS, then an origin-form request inside it. The connection's I/O
//! future is polled together with the request, never spawned, so dropping a timed-out probe
//! closes its socket at once.

use std::{net::IpAddr, sync::Arc, time::Duration};

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{
    Method, Request, StatusCode, Uri,
    client::conn::http1,
    header::{CONNECTION, HOST, HeaderValue, PROXY_AUTHORIZATION, USER_AGENT},
};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};
use tokio_rustls::{TlsConnector, rustls};

use super::{HealthError, HealthTarget};
use crate::provider::Credentials;

const AGENT: &str = concat!("egress-proxies-operator-health/", env!("CARGO_PKG_VERSION"));

/// Why a probe failed. Messages name the step, never the URL or credentials.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The health URL is not an `http(s)://host[:port]/...` URL.
    #[error("health URL is not a valid http:// or https:// URL")]
    BadUrl,
    /// The whole probe took longer than the timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// No TCP connection to the proxy.
    #[error("connecting to the proxy: {0}")]
    Connect(std::io::Error),
    /// The proxy's HTTP conversation broke off.
    #[error("talking to the proxy: {0}")]
    Http(String),
    /// The proxy refused the tunnel or the request (e.g. 403 from an ACL, 407 bad credentials).
    #[error("the proxy answered {0}")]
    ProxyStatus(StatusCode),
    /// TLS with the target failed.
    #[error("TLS with the target: {0}")]
    Tls(String),
    /// The target (through the proxy) answered with a non-2xx status.
    #[error("the target answered {0}")]
    TargetStatus(StatusCode),
    /// The response body did not contain the expected egress address.
    #[error("the response does not show the expected egress address {0}")]
    WrongEgress(IpAddr),
}

/// The platform's trust roots (empty, with a warning, if none can be read).
pub(super) fn platform_roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for error in &found.errors {
        tracing::warn!(%error, "reading platform trust roots");
    }
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        tracing::warn!("no platform trust roots: https:// health checks will fail");
    }
    roots
}

pub(super) fn tls_connector(roots: Arc<rustls::RootCertStore>) -> Result<TlsConnector, HealthError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| HealthError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

fn basic(credentials: &Credentials) -> Option<HeaderValue> {
    let raw = format!("{}:{}", credentials.username, credentials.password);
    let mut value = HeaderValue::from_str(&format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    ))
    .ok()?;
    value.set_sensitive(true);
    Some(value)
}

struct Target {
    https: bool,
    host: String,
    authority: String,
    path: String,
}

fn parse_url(url: &str) -> Result<Target, ProbeError> {
    let uri: Uri = url.parse().map_err(|_| ProbeError::BadUrl)?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(ProbeError::BadUrl),
    };
    let authority = uri.authority().ok_or(ProbeError::BadUrl)?;
    if authority.as_str().contains('@') {
        // Credentials in the URL would end up in requests and errors.
        return Err(ProbeError::BadUrl);
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
    let host_for_authority = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.clone()
    };
    Ok(Target {
        https,
        host,
        authority: format!("{host_for_authority}:{port}"),
        path: uri.path_and_query().map_or("/", |p| p.as_str()).to_owned(),
    })
}

/// Runs one probe within the target's timeout.
pub(super) async fn probe(
    target: &HealthTarget,
    tls: &TlsConnector,
    max_body: usize,
) -> Result<(), ProbeError> {
    tokio::time::timeout(target.timeout, probe_inner(target, tls, max_body))
        .await
        .map_err(|_| ProbeError::Timeout(target.timeout))?
}

async fn probe_inner(target: &HealthTarget, tls: &TlsConnector, max_body: usize) -> Result<(), ProbeError> {
    let url = parse_url(&target.url)?;
    let auth = target.credentials.as_ref().and_then(basic);
    let stream = TcpStream::connect((target.endpoint.host.as_str(), target.endpoint.port))
        .await
        .map_err(ProbeError::Connect)?;
    // Nagle would hold the small request back for no gain.
    let _ = stream.set_nodelay(true);
    let body = if url.https {
        let tunnel = connect_tunnel(stream, &url.authority, auth).await?;
        let name =
            rustls::pki_types::ServerName::try_from(url.host.clone()).map_err(|_| ProbeError::BadUrl)?;
        let tls_stream = tls
            .connect(name, TokioIo::new(tunnel))
            .await
            .map_err(|e| ProbeError::Tls(e.to_string()))?;
        let request = Request::get(url.path.as_str())
            .header(HOST, url.authority.as_str())
            .header(USER_AGENT, AGENT)
            .header(CONNECTION, "close")
            .body(Empty::<Bytes>::new())
            .map_err(|_| ProbeError::BadUrl)?;
        fetch(tls_stream, request, max_body, false).await?
    } else {
        let mut request = Request::get(target.url.as_str())
            .header(HOST, url.authority.as_str())
            .header(USER_AGENT, AGENT)
            .header(CONNECTION, "close");
        if let Some(auth) = auth {
            request = request.header(PROXY_AUTHORIZATION, auth);
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|_| ProbeError::BadUrl)?;
        fetch(stream, request, max_body, true).await?
    };
    match target.expected_egress {
        Some(ip) if !String::from_utf8_lossy(&body).contains(&ip.to_string()) => {
            Err(ProbeError::WrongEgress(ip))
        }
        _ => Ok(()),
    }
}

/// `CONNECT authority` through the proxy; the upgraded connection on 200.
async fn connect_tunnel(
    stream: TcpStream,
    authority: &str,
    auth: Option<HeaderValue>,
) -> Result<hyper::upgrade::Upgraded, ProbeError> {
    let (mut sender, conn) = http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(|e| ProbeError::Http(e.to_string()))?;
    let mut conn = std::pin::pin!(conn.with_upgrades());
    let mut request = Request::builder()
        .method(Method::CONNECT)
        .uri(authority)
        .header(HOST, authority)
        .header(USER_AGENT, AGENT);
    if let Some(auth) = auth {
        request = request.header(PROXY_AUTHORIZATION, auth);
    }
    let request = request
        .body(Empty::<Bytes>::new())
        .map_err(|_| ProbeError::BadUrl)?;
    let mut send = std::pin::pin!(sender.send_request(request));
    // The connection future may finish first, in the very poll that hands the answer over
    // (it ends when it has given its I/O to the upgrade): then the answer is already waiting.
    let (response, conn_done) = tokio::select! {
        r = &mut send => (r.map_err(|e| ProbeError::Http(e.to_string()))?, false),
        r = &mut conn => {
            r.map_err(|e| ProbeError::Http(e.to_string()))?;
            (send.await.map_err(|e| ProbeError::Http(e.to_string()))?, true)
        }
    };
    if !response.status().is_success() {
        return Err(ProbeError::ProxyStatus(response.status()));
    }
    let upgraded = if conn_done {
        hyper::upgrade::on(response).await
    } else {
        let (upgraded, conn_result) = tokio::join!(hyper::upgrade::on(response), conn);
        conn_result.map_err(|e| ProbeError::Http(e.to_string()))?;
        upgraded
    };
    upgraded.map_err(|e| ProbeError::Http(e.to_string()))
}

/// Sends one request over `io` and reads up to `max_body` bytes of a 2xx answer. `via_proxy`:
/// a non-2xx answer that carries the proxy's own error marks is the proxy's, else the target's.
async fn fetch<IO>(
    io: IO,
    request: Request<Empty<Bytes>>,
    max_body: usize,
    via_proxy: bool,
) -> Result<Bytes, ProbeError>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = http1::handshake::<_, Empty<Bytes>>(TokioIo::new(io))
        .await
        .map_err(|e| ProbeError::Http(e.to_string()))?;
    let mut conn = std::pin::pin!(conn);
    let exchange = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| ProbeError::Http(e.to_string()))?;
        let status = response.status();
        if !status.is_success() {
            let from_proxy = via_proxy
                && (status == StatusCode::PROXY_AUTHENTICATION_REQUIRED
                    || response.headers().contains_key("x-squid-error"));
            return Err(if from_proxy {
                ProbeError::ProxyStatus(status)
            } else {
                ProbeError::TargetStatus(status)
            });
        }
        // Only the beginning matters (the egress address); the rest is not read.
        let mut body = response.into_body();
        let mut read = Vec::new();
        while read.len() < max_body {
            match body.frame().await {
                None => break,
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        read.extend_from_slice(data);
                    }
                }
                Some(Err(e)) => return Err(ProbeError::Http(e.to_string())),
            }
        }
        Ok(Bytes::from(read))
    };
    let mut exchange = std::pin::pin!(exchange);
    tokio::select! {
        r = &mut exchange => r,
        // With `Connection: close` the connection may finish in the same poll that hands the
        // answer over; the exchange then still has it (or fails on its own).
        r = &mut conn => match r {
            Ok(()) => exchange.await,
            Err(e) => Err(ProbeError::Http(e.to_string())),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_authority_and_path() {
        let t = parse_url("https://example.com/ip?x=1").unwrap();
        assert!(t.https);
        assert_eq!(
            (t.host.as_str(), t.authority.as_str(), t.path.as_str()),
            ("example.com", "example.com:443", "/ip?x=1")
        );
        let t = parse_url("http://[::1]:8080").unwrap();
        assert_eq!(
            (t.host.as_str(), t.authority.as_str(), t.path.as_str()),
            ("::1", "[::1]:8080", "/")
        );
        for bad in ["ftp://x/", "example.com", "http://user:pw@host/", ""] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }
}
