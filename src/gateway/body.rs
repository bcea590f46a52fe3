//! [`Replayed`]: an upstream answer's body whose first bytes were read ahead for the rules (a
//! body pattern looks at them) and are sent first, unchanged, then the rest as it streams.
//! (The bodies that record the outcome and give the lease back are in [`super::measure`].)

use std::{
    collections::VecDeque,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};

/// An upstream body, its first frames (read ahead) sent first.
pub(super) struct Replayed {
    ahead: VecDeque<Frame<Bytes>>,
    /// The rest; `None` once it ended while reading ahead.
    rest: Option<Incoming>,
    /// The error that ended reading ahead, passed on after the frames read before it.
    error: Option<hyper::Error>,
}

impl Replayed {
    /// `body` as it comes, nothing read ahead.
    pub(super) fn whole(body: Incoming) -> Self {
        Self {
            ahead: VecDeque::new(),
            rest: Some(body),
            error: None,
        }
    }

    /// Reads `body` ahead until `want` bytes of data, its end, an error or `within` is over;
    /// returns what was read (to judge) and the body that sends it all.
    pub(super) async fn read_ahead(mut body: Incoming, want: usize, within: Duration) -> (Bytes, Self) {
        let mut ahead = VecDeque::new();
        let mut seen = BytesMut::new();
        let mut error = None;
        let mut ended = false;
        let reading = async {
            while seen.len() < want {
                match body.frame().await {
                    Some(Ok(frame)) => {
                        if let Some(data) = frame.data_ref() {
                            let room = want - seen.len();
                            seen.extend_from_slice(&data[..data.len().min(room)]);
                        }
                        ahead.push_back(frame);
                    }
                    Some(Err(e)) => {
                        error = Some(e);
                        return;
                    }
                    None => {
                        ended = true;
                        return;
                    }
                }
            }
        };
        // A body that trickles is judged on what came in time (and still passed on whole).
        let _ = tokio::time::timeout(within, reading).await;
        let rest = (!ended && error.is_none()).then_some(body);
        (seen.freeze(), Self { ahead, rest, error })
    }
}

impl Body for Replayed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(frame) = this.ahead.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(error) = this.error.take() {
            return Poll::Ready(Some(Err(error)));
        }
        match &mut this.rest {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_empty() && self.error.is_none() && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let ahead: u64 = self
            .ahead
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        match &self.rest {
            Some(rest) => {
                let hint = rest.size_hint();
                let mut sum = SizeHint::new();
                sum.set_lower(hint.lower() + ahead);
                if let Some(upper) = hint.upper() {
                    sum.set_upper(upper + ahead);
                }
                sum
            }
            None => SizeHint::with_exact(ahead),
        }
    }
}
