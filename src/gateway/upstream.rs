//! Keep-alive connections from the gateway to the upstream proxies. A plain HTTP request goes
//! out on an idle connection to its leased proxy when there is one, so the proxy parses a
//! request, not a TCP handshake and a new client, each time (a connection per request cost the
//! Squid behind it more CPU than the request itself: `benches/gateway.sh`). `CONNECT` tunnels
//! keep a connection of their own ([`super::forward::send`]).
//!
//! The pooling is hyper-util's client: one per upstream endpoint, whose connector always dials
//! that proxy and marks the connection as proxied, so the client sends requests in absolute form
//! and keeps idle connections per target authority. A replaced instance listens elsewhere, so it
//! gets a fresh client and never a connection to its predecessor.

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};
use hyper::{
    Request, Response, Uri,
    body::{Body, Incoming},
};
use hyper_util::{
    client::legacy::{
        Client,
        connect::{Connected, Connection},
    },
    rt::{TokioExecutor, TokioIo, TokioTimer},
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};

use super::forward::UpstreamError;
use crate::{hashing::FastMap, lease::ProxyInfo};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the pooled clients send: any request body, boxed.
type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// How long an idle connection to an upstream proxy is kept: well under Squid's own
/// `client_idle_pconn_timeout` (2 minutes), so the gateway closes first and never sends on a
/// connection the proxy is closing.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Clients kept at most. A pool's proxies change endpoints only when instances are replaced;
/// past this many (a long life of replacements) the map starts again, which closes only idle
/// connections.
const MAX_CLIENTS: usize = 4096;

/// The gateway's keep-alive connections to upstream proxies, per endpoint; cheap to share.
pub(super) struct Upstreams {
    connect_timeout: Duration,
    clients: Mutex<FastMap<(String, u16), Client<ToProxy, UpstreamBody>>>,
}

impl Upstreams {
    /// No connections yet; new ones must connect within `connect_timeout`.
    pub(super) fn new(connect_timeout: Duration) -> Self {
        Self {
            connect_timeout,
            clients: Mutex::new(FastMap::default()),
        }
    }

    /// Sends `request` (absolute form) to `proxy` on an idle connection or a new one, and
    /// returns its answer.
    pub(super) async fn send<B>(
        &self,
        proxy: &ProxyInfo,
        request: Request<B>,
    ) -> Result<Response<Incoming>, UpstreamError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let client = self.client(proxy);
        let request = request.map(|body| body.map_err(Into::into).boxed_unsync());
        client.request(request).await.map_err(|error| {
            match std::error::Error::source(&error).and_then(|s| s.downcast_ref::<DialError>()) {
                Some(DialError::Timeout(after)) => UpstreamError::ConnectTimeout(*after),
                Some(DialError::Io(io)) => UpstreamError::Connect(io::Error::new(io.kind(), io.to_string())),
                None => UpstreamError::Pooled(error),
            }
        })
    }

    fn client(&self, proxy: &ProxyInfo) -> Client<ToProxy, UpstreamBody> {
        let endpoint = (proxy.endpoint.host.clone(), proxy.endpoint.port);
        // A poisoned lock only means another request panicked mid-insert; the map is still whole.
        let mut clients = self
            .clients
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(client) = clients.get(&endpoint) {
            return client.clone();
        }
        if clients.len() >= MAX_CLIENTS {
            clients.clear();
        }
        let connector = ToProxy {
            endpoint: Arc::new(endpoint.clone()),
            timeout: self.connect_timeout,
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            // The gateway already sets Host from the client's request.
            .set_host(false)
            .build(connector);
        clients.insert(endpoint, client.clone());
        client
    }
}

/// Why a connection to an upstream proxy could not be made.
#[derive(Debug, thiserror::Error)]
enum DialError {
    #[error("could not connect: {0}")]
    Io(io::Error),
    #[error("no connection within {0:?}")]
    Timeout(Duration),
}

/// The connector of one upstream's client: every connection goes to that proxy, whatever the
/// request's target.
#[derive(Clone)]
struct ToProxy {
    endpoint: Arc<(String, u16)>,
    timeout: Duration,
}

impl tower_service::Service<Uri> for ToProxy {
    type Response = TokioIo<Proxied>;
    type Error = DialError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, DialError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), DialError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _target: Uri) -> Self::Future {
        let (endpoint, timeout) = (self.endpoint.clone(), self.timeout);
        Box::pin(async move {
            let (host, port) = (endpoint.0.as_str(), endpoint.1);
            let stream = tokio::time::timeout(timeout, TcpStream::connect((host, port)))
                .await
                .map_err(|_| DialError::Timeout(timeout))?
                .map_err(DialError::Io)?;
            let _ = stream.set_nodelay(true);
            Ok(TokioIo::new(Proxied(stream)))
        })
    }
}

/// A connection to a forward proxy: the client sends it requests in absolute form.
struct Proxied(TcpStream);

impl Connection for Proxied {
    fn connected(&self) -> Connected {
        self.0.connected().proxy(true)
    }
}

impl AsyncRead for Proxied {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Proxied {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{Empty, Full};
    use tokio::net::TcpListener;

    use super::*;
    use crate::{
        api::{LeasePolicy, ProxyKey},
        lease::LeaseTarget,
        provider::Endpoint,
    };

    /// An upstream proxy on 127.0.0.1:0 that answers every request with the request line it
    /// was sent; counts the connections it accepted.
    async fn echoing_proxy() -> (ProxyInfo, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let service = hyper::service::service_fn(|request: Request<Incoming>| async move {
                    let line = format!("{} {}", request.method(), request.uri());
                    Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(line))))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        let proxy = ProxyInfo::new(&LeaseTarget {
            key: ProxyKey::new("crawl", "p1"),
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port,
            },
            attributes: Default::default(),
            policy: LeasePolicy::default(),
            credentials: None,
        });
        (proxy, accepted)
    }

    fn get(url: &str) -> Request<Empty<Bytes>> {
        Request::get(url).body(Empty::new()).unwrap()
    }

    #[tokio::test]
    async fn requests_in_absolute_form_share_one_kept_alive_connection() {
        let (proxy, accepted) = echoing_proxy().await;
        let upstreams = Upstreams::new(Duration::from_secs(5));
        for (n, target) in [
            "http://a.example/x",
            "http://b.example:8080/y?q=1",
            "http://a.example/z",
        ]
        .into_iter()
        .enumerate()
        {
            let response = upstreams.send(&proxy, get(target)).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body, format!("GET {target}"), "request {n}");
        }
        // One connection per target authority, each used again: a.example's twice.
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_proxy_that_is_gone_is_a_connect_error() {
        let (mut proxy, _) = echoing_proxy().await;
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        proxy.endpoint.port = port;
        let error = Upstreams::new(Duration::from_secs(5))
            .send(&proxy, get("http://a.example/"))
            .await
            .unwrap_err();
        assert!(matches!(error, UpstreamError::Connect(_)), "{error:?}");
    }
}
