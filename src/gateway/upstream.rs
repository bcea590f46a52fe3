//! Keep-alive connections from the gateway to the upstream proxies. A plain HTTP request goes
//! out on an idle connection to its leased proxy when there is one, so the proxy parses a
//! request, not a TCP handshake and a new client, each time (a connection per request cost the
//! Squid behind it more CPU than the request itself: `benches/gateway.sh`). `CONNECT` tunnels
//! keep a connection of their own ([`super::forward::dial`]).
//!
//! The pool is ours, over hyper's HTTP/1 connections: per upstream endpoint, the connections
//! not sending a request. A connection goes back as soon as its answer's head is in; the next
//! request takes one that is ready (its last answer's body done), else dials a new one. Any
//! target goes over any connection to the proxy (requests are in absolute form). hyper-util's
//! pooled client did the same work at several times the cost (a task per request to wait for
//! the connection, its maps hashing the target's authority a byte at a time with SipHash:
//! about 6,000 instructions a request). A replaced instance listens elsewhere, so it gets
//! connections of its own and never one to its predecessor.

use std::{
    sync::Mutex,
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, combinators::UnsyncBoxBody};
use hyper::{
    Request, Response,
    body::{Body, Incoming},
    client::conn::http1::SendRequest,
};

use super::forward::{self, UpstreamError};
use crate::{hashing::FastMap, lease::ProxyInfo, sync::lock};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the pooled connections send: any request body, boxed.
type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// How long an idle connection to an upstream proxy is used again: well under Squid's own
/// `client_idle_pconn_timeout` (2 minutes), so the gateway never sends on a connection the proxy
/// is closing.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections kept per endpoint; one more than the requests in flight to it is all a steady
/// load needs, and a burst's extra ones are closed as they come back.
const MAX_PER_ENDPOINT: usize = 256;

/// Endpoints kept at most. A pool's proxies change endpoints only when instances are replaced;
/// past this many (a long life of replacements) the map starts again, which closes only idle
/// connections.
const MAX_ENDPOINTS: usize = 4096;

/// A connection not sending a request, since when.
struct Parked {
    sender: SendRequest<UpstreamBody>,
    since: Instant,
}

/// The gateway's keep-alive connections to upstream proxies, per endpoint (`host:port`).
pub(super) struct Upstreams {
    connect_timeout: Duration,
    parked: Mutex<FastMap<String, Vec<Parked>>>,
}

impl Upstreams {
    /// No connections yet; new ones must connect within `connect_timeout`.
    pub(super) fn new(connect_timeout: Duration) -> Self {
        Self {
            connect_timeout,
            parked: Mutex::new(FastMap::default()),
        }
    }

    /// Sends `request` (absolute form) to `proxy` on a ready connection or a new one, and
    /// returns its answer. A kept connection the proxy closed before the request went out is
    /// tried no further: the request goes on a new one.
    pub(super) async fn send<B>(
        &self,
        proxy: &ProxyInfo,
        request: Request<B>,
    ) -> Result<Response<Incoming>, UpstreamError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let mut request = request.map(|body| body.map_err(Into::into).boxed_unsync());
        if let Some(mut sender) = self.take_ready(proxy) {
            match sender.try_send_request(request).await {
                Ok(response) => {
                    self.park(proxy, sender);
                    return Ok(response);
                }
                Err(mut error) => match error.take_message() {
                    // Not sent: the connection closed while it was parked.
                    Some(unsent) => request = unsent,
                    None => return Err(UpstreamError::Exchange(error.into_error())),
                },
            }
        }
        let mut sender = forward::dial(proxy, self.connect_timeout).await?;
        let response = sender
            .send_request(request)
            .await
            .map_err(UpstreamError::Exchange)?;
        self.park(proxy, sender);
        Ok(response)
    }

    /// A parked connection to `proxy` that can send now; connections that closed or sat idle
    /// too long are dropped on the way.
    fn take_ready(&self, proxy: &ProxyInfo) -> Option<SendRequest<UpstreamBody>> {
        let mut parked = lock(&self.parked);
        let connections = parked.get_mut(proxy.endpoint_text.as_str())?;
        let now = Instant::now();
        let mut context = Context::from_waker(Waker::noop());
        let mut index = connections.len();
        while index > 0 {
            index -= 1;
            if now.duration_since(connections[index].since) > IDLE_TIMEOUT {
                connections.swap_remove(index);
                continue;
            }
            match connections[index].sender.poll_ready(&mut context) {
                Poll::Ready(Ok(())) => return Some(connections.swap_remove(index).sender),
                Poll::Ready(Err(_)) => drop(connections.swap_remove(index)),
                // Its last answer's body is still on its way.
                Poll::Pending => {}
            }
        }
        None
    }

    /// Keeps `sender` for the next request to `proxy` (it is ready once its answer's body is
    /// done).
    fn park(&self, proxy: &ProxyInfo, sender: SendRequest<UpstreamBody>) {
        let parked_now = Parked {
            sender,
            since: Instant::now(),
        };
        let mut parked = lock(&self.parked);
        if let Some(connections) = parked.get_mut(proxy.endpoint_text.as_str()) {
            if connections.len() < MAX_PER_ENDPOINT {
                connections.push(parked_now);
            }
            return;
        }
        if parked.len() >= MAX_ENDPOINTS {
            parked.clear();
        }
        parked.insert(proxy.endpoint_text.clone(), vec![parked_now]);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use http_body_util::{Empty, Full};
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    use super::*;
    use crate::{
        api::{LeasePolicy, ProxyKey},
        lease::LeaseTarget,
        provider::Endpoint,
    };

    /// An upstream proxy on 127.0.0.1:0 that answers every request with the request line it
    /// was sent, then `padding` bytes of `x`; counts the connections it accepted.
    async fn echoing_proxy(padding: usize) -> (ProxyInfo, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let service = hyper::service::service_fn(move |request: Request<Incoming>| async move {
                    let line = format!("{} {}{}", request.method(), request.uri(), "x".repeat(padding));
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
        let (proxy, accepted) = echoing_proxy(0).await;
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
        // One connection to the proxy carries every target's requests.
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_proxy_that_is_gone_is_a_connect_error() {
        let (mut proxy, _) = echoing_proxy(0).await;
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

    /// An upstream proxy that answers one request per connection and then closes it without
    /// saying so (no `Connection: close`): a parked connection dies under the gateway.
    async fn one_shot_proxy() -> (ProxyInfo, Arc<AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut proxy, _) = echoing_proxy(0).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        proxy.endpoint.port = listener.local_addr().unwrap().port();
        proxy.endpoint_text = format!("127.0.0.1:{}", proxy.endpoint.port);
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    let Ok(n @ 1..) = stream.read(&mut buf).await else {
                        break;
                    };
                    head.extend_from_slice(&buf[..n]);
                }
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
            }
        });
        (proxy, accepted)
    }

    #[tokio::test]
    async fn a_kept_connection_the_proxy_closed_is_replaced_by_a_new_one() {
        let (proxy, accepted) = one_shot_proxy().await;
        let upstreams = Upstreams::new(Duration::from_secs(5));
        for n in 0..3 {
            let response = upstreams.send(&proxy, get("http://a.example/")).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body, "ok", "request {n}");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_connection_whose_answer_is_still_being_read_is_not_used_again() {
        // Answers larger than what hyper reads ahead: a connection is busy until its body is read.
        let padding = 4 << 20;
        let (proxy, accepted) = echoing_proxy(padding).await;
        let upstreams = Upstreams::new(Duration::from_secs(5));
        let first = upstreams.send(&proxy, get("http://a.example/1")).await.unwrap();
        let second = upstreams.send(&proxy, get("http://a.example/2")).await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        for (response, target) in [(first, "http://a.example/1"), (second, "http://a.example/2")] {
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body.len(), format!("GET {target}").len() + padding);
        }
        // Both are ready again: a third request dials nothing.
        let third = upstreams.send(&proxy, get("http://a.example/3")).await.unwrap();
        third.into_body().collect().await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }
}
