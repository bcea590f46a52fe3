//! Blocking HTTP on real loopback sockets for the real-VM tests, which wait on guests with
//! plain threads: an origin server that records the requests it gets (a guest reaches it
//! through its proxy as `10.0.2.2:PORT`), and a client for one request, direct or through a
//! proxy, with every read and write under a timeout.
//!
//! Include with `mod support { pub mod blocking_http; }`.

#![allow(dead_code)] // Each test binary uses a different part of the support code.

use std::{
    io::{self, BufRead, BufReader, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

/// One request an [`Origin`] received: its request line and headers.
#[derive(Clone, Debug)]
pub struct Seen {
    /// The path of the request line (`/health`).
    pub path: String,
    /// Header names (lowercase) and values, in order.
    pub headers: Vec<(String, String)>,
}

impl Seen {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// An HTTP server on 127.0.0.1 (port 0) answering every request with 200 and the body
/// `<body> <path>`, recording what it got. Stopped on drop.
pub struct Origin {
    /// The port it listens on.
    pub port: u16,
    body: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Origin {
    /// Starts the server; `body` starts every response body.
    pub fn start(body: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::spawn({
            let seen = Arc::clone(&seen);
            let stop = Arc::clone(&stop);
            let body = body.to_owned();
            move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    // One connection at a time is plenty for probes and a few fetches; a slow
                    // client cannot hold the server longer than its read timeout.
                    let _ = serve(stream, &body, &seen);
                }
            }
        });
        Self {
            port,
            body: body.to_owned(),
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// The body the server answers `path` with.
    pub fn body_for(&self, path: &str) -> String {
        format!("{} {path}", self.body)
    }

    /// The requests received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

fn serve(mut stream: TcpStream, body: &str, seen: &Mutex<Vec<Seen>>) -> io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    if reader.read_line(&mut request_line)? == 0 {
        // Opened and closed without a request (a proxy's spare connection): nothing was asked.
        return Ok(());
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("?").to_owned();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
        if let Some((key, value)) = line.split_once(':') {
            headers.push((key.trim().to_ascii_lowercase(), value.trim().to_owned()));
        }
    }
    let body = format!("{body} {path}");
    seen.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Seen { path, headers });
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.shutdown(Shutdown::Write)
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A response as the client read it.
#[derive(Debug)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Header names and values, in order.
    pub headers: Vec<(String, String)>,
    /// The body, as text.
    pub body: String,
}

impl Response {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// Sends one request (`Connection: close`) to `server` and reads the whole response. `target`
/// is the request target: a path, or an absolute URL when `server` is a proxy.
pub fn request(
    server: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, String)],
    body: &str,
) -> io::Result<Response> {
    let mut stream = TcpStream::connect_timeout(&server, Duration::from_secs(3))?;
    stream.set_read_timeout(Some(Duration::from_secs(15)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let host = target
        .strip_prefix("http://")
        .and_then(|rest| rest.split('/').next())
        .map_or_else(|| server.to_string(), str::to_owned);
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("incomplete response ({} bytes)", raw.len()),
        ));
    };
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("bad status line in {head:?}")))?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(key, value)| (key.trim().to_owned(), value.trim().to_owned()))
        .collect();
    Ok(Response {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// `GET url` (absolute form) through the HTTP proxy at `proxy`, with basic-auth credentials
/// (`user`, `password`) if given.
pub fn get_through_proxy(
    proxy: SocketAddr,
    url: &str,
    credentials: Option<(&str, &str)>,
) -> io::Result<Response> {
    let headers: Vec<(&str, String)> = credentials
        .map(|(user, password)| {
            (
                "Proxy-Authorization",
                format!("Basic {}", base64(format!("{user}:{password}").as_bytes())),
            )
        })
        .into_iter()
        .collect();
    request(proxy, "GET", url, &headers, "")
}

/// Standard base64 with padding (Basic auth).
pub fn base64(bytes: &[u8]) -> String {
    base64::Engine::encode(&base64::engine::general_purpose::STANDARD, bytes)
}

/// Decodes `%XX` escapes (the userinfo of a proxy URL).
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(byte) = text
                .get(i + 1..i + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
        {
            out.push(byte);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn percent_decoding_matches_rfc_3986() {
    assert_eq!(percent_decode("a%3Ab%40c%2"), "a:b@c%2");
}
