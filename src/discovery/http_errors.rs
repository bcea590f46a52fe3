//! JSON bodies for the errors hyper answers by itself.
//!
//! A request that does not parse as HTTP/1 (bad request line, bad header, a bad or duplicated
//! `Content-Length`, `Transfer-Encoding` on HTTP/1.0, headers over the buffer limit, a URI too
//! long) never reaches the router: hyper writes a bare `400`, `431` or `414` with an empty body
//! and closes the connection. hyper has no hook to shape that answer, so [`JsonErrors`] wraps
//! the connection's writer and replaces exactly those heads (a 4xx/5xx with
//! `content-length: 0`, which the router never produces: every error it sends has a body) with
//! the API's JSON error. Errors met while reading a body (bad chunking, a body shorter than its
//! `Content-Length`) reach the router as body errors and get their JSON there.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use hyper::rt::{Read, ReadBufCursor, Write};

use super::wire::{ErrorBody, ErrorDetail};

/// The stable code and message of an error hyper answered by itself, by status.
pub(crate) fn code_for(status: u16) -> (&'static str, &'static str) {
    match status {
        431 => (
            "headers_too_large",
            "the request's headers are too large or too many",
        ),
        414 => ("uri_too_long", "the request URI is too long"),
        _ => (
            "malformed_request",
            "malformed HTTP request (request line, header, Content-Length or Transfer-Encoding)",
        ),
    }
}

/// If `head` is a whole response head that hyper wrote for its own parse error, the JSON
/// response to send instead, with its status.
fn replacement(head: &[u8]) -> Option<(u16, Bytes)> {
    // "HTTP/1.1 400 Bad Request\r\n...\r\n\r\n" and nothing after it.
    // Every answer passes here: the status's first digit turns away the router's own first.
    if !matches!(head.get(9), Some(b'4' | b'5'))
        || head.len() < 16
        || !head.starts_with(b"HTTP/1.")
        || !head.ends_with(b"\r\n\r\n")
    {
        return None;
    }
    let status: u16 = std::str::from_utf8(head.get(9..12)?).ok()?.parse().ok()?;
    if status < 400 {
        return None;
    }
    let text = std::str::from_utf8(head).ok()?;
    let mut empty = false;
    let mut date = None;
    for line in text.split("\r\n").skip(1) {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.eq_ignore_ascii_case("content-length") {
            empty = value.trim() == "0";
        } else if name.eq_ignore_ascii_case("date") {
            date = Some(value.trim());
        }
    }
    if !empty {
        return None;
    }
    let (code, message) = code_for(status);
    let body = serde_json::to_string(&ErrorBody {
        error: ErrorDetail {
            code,
            message: message.to_owned(),
        },
    })
    .ok()?;
    let reason = hyper::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    if let Some(date) = date {
        out.push_str("date: ");
        out.push_str(date);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    out.push_str(&body);
    Some((status, Bytes::from(out)))
}

/// A connection whose hyper-generated error responses carry the API's JSON error body.
pub(crate) struct JsonErrors<T> {
    inner: T,
    /// A replacement response not yet fully written.
    pending: Option<Bytes>,
    /// Called with the status of each replaced response (metrics).
    on_replace: Box<dyn Fn(u16) + Send + Sync>,
}

impl<T> JsonErrors<T> {
    pub(crate) fn new(inner: T, on_replace: impl Fn(u16) + Send + Sync + 'static) -> Self {
        Self {
            inner,
            pending: None,
            on_replace: Box::new(on_replace),
        }
    }
}

impl<T: Write + Unpin> JsonErrors<T> {
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(pending) = self.pending.as_mut() {
            if pending.is_empty() {
                self.pending = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, pending))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            let _ = pending.split_to(n);
        }
        Poll::Ready(Ok(()))
    }

    /// Takes `buf` in place of the inner writer if it is one of hyper's own error heads.
    fn substitute(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Option<Poll<io::Result<usize>>> {
        let (status, response) = replacement(buf)?;
        (self.on_replace)(status);
        self.pending = Some(response);
        // hyper sees its head written; the replacement goes out here or on the next flush.
        Some(match self.poll_pending(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(buf.len())),
        })
    }
}

impl<T: Read + Unpin> Read for JsonErrors<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: ReadBufCursor<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for JsonErrors<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if let Some(done) = this.substitute(cx, buf) {
            return done;
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if let Some(first) = bufs.iter().find(|b| !b.is_empty())
            && let Some(done) = this.substitute(cx, first)
        {
            return done;
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::replacement;

    #[test]
    fn only_hypers_empty_error_heads_are_replaced() {
        let hyper_head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Thu, 03 Dec 2026 09:00:00 GMT\r\n\r\n";
        let (status, out) = replacement(hyper_head).expect("replaced");
        assert_eq!(status, 431);
        let text = std::str::from_utf8(&out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(head.contains(&format!("content-length: {}\r\n", body.len())));
        assert!(head.contains("date: Thu, 03 Dec 2026 09:00:00 GMT"));
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["error"]["code"], "headers_too_large");
        // Ours always have a body; success heads and partial writes are left alone.
        assert!(replacement(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 57\r\n\r\n").is_none());
        assert!(replacement(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(replacement(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{}").is_none());
        assert!(replacement(b"ent-length: 0\r\n\r\n").is_none());
    }
}
