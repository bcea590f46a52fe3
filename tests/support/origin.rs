//! A tiny HTTP origin server on loopback and a client that fetches through a proxy, both on
//! real sockets.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

/// An origin server on `127.0.0.1`, port 0: answers every request with `200` and a body
/// naming the path and the peer address it saw. Stops when dropped.
pub struct OriginServer {
    /// Where it listens.
    pub addr: SocketAddr,
    peers: Arc<Mutex<Vec<IpAddr>>>,
    task: tokio::task::JoinHandle<()>,
}

impl OriginServer {
    /// Starts the server.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind origin server");
        let addr = listener.local_addr().expect("local addr");
        let peers = Arc::new(Mutex::new(Vec::new()));
        let seen = peers.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, peer)) = listener.accept().await {
                seen.lock().expect("not poisoned").push(peer.ip());
                tokio::spawn(async move {
                    let Some(head) = read_head(&mut stream).await else {
                        return;
                    };
                    let path = head.split_whitespace().nth(1).unwrap_or("?").to_owned();
                    let body = format!("hello {path} from {}", peer.ip());
                    let response = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(response.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self { addr, peers, task }
    }

    /// The URL of `path` on this server.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Peer addresses of the connections accepted so far.
    pub fn peers(&self) -> Vec<IpAddr> {
        self.peers.lock().expect("not poisoned").clone()
    }
}

impl Drop for OriginServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn read_head(stream: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 || head.len() > 64 * 1024 {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// A response as seen by the client.
#[derive(Debug)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Header block, as received.
    pub head: String,
    /// Body.
    pub body: String,
}

/// Fetches `url` through the HTTP proxy at `proxy`, with basic-auth `credentials` if given.
pub async fn fetch_via_proxy(proxy: SocketAddr, url: &str, credentials: Option<(&str, &str)>) -> Response {
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    let mut request = format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    if let Some((user, password)) = credentials {
        request.push_str(&format!(
            "Proxy-Authorization: Basic {}\r\n",
            base64(format!("{user}:{password}").as_bytes())
        ));
    }
    request.push_str("\r\n");
    let exchange = async {
        let mut stream = TcpStream::connect(proxy).await.expect("connect to the proxy");
        stream.write_all(request.as_bytes()).await.expect("send request");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read response");
        raw
    };
    let raw = tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .expect("the proxy answers within 20 s");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    Response {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

/// Standard base64 with padding (Basic auth).
pub fn base64(bytes: &[u8]) -> String {
    base64::Engine::encode(&base64::engine::general_purpose::STANDARD, bytes)
}
