//! A minimal HTTP/1.1 client over a real socket, for tests of the operator's servers.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;

/// `GET path` on `addr`; returns the status and the body as text.
pub async fn get(addr: SocketAddr, path: &str) -> (StatusCode, String) {
    request(
        addr,
        Request::get(path)
            .header("host", "localhost")
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await
}

/// Sends `request` on a fresh connection.
pub async fn request(addr: SocketAddr, request: Request<Full<Bytes>>) -> (StatusCode, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let response = sender.send_request(request).await.expect("response");
    let status = response.status();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}
