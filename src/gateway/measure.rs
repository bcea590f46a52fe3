//! What one forwarded request or tunnel did, recorded in the outcome statistics
//! ([`crate::outcomes`]), and its bytes in the usage of its token and holder ([`crate::usage`]),
//! exactly once, where it is known: a failure to reach the proxy or the
//! target at once, an answer when its body ends (or the client drops it), a tunnel when it
//! closes. And the body the gateway answers with ([`AnswerBody`]: counts the bytes, records the
//! outcome and gives the lease back when done).

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::{held::Lent, user::Who};
use crate::{
    api::ProxyKey,
    lease::{LeaseStore, ProxyInfo},
    outcomes::{Ended, Failure, Outcomes, Seen},
    usage::Usage,
};

/// One request through one proxy, from the moment it is sent.
pub(super) struct Measure {
    outcomes: Outcomes,
    /// Its clock.
    store: LeaseStore,
    proxy: ProxyKey,
    domain: String,
    started: Instant,
    bytes_sent: u64,
    /// Where its bytes are metered, for (token, holder).
    usage: Option<(Usage, Arc<str>, String)>,
}

impl Measure {
    /// A request to `host` through `proxy`, sending `bytes_sent` bytes of body, starts now.
    pub(super) fn start(
        outcomes: &Outcomes,
        store: &LeaseStore,
        proxy: &ProxyInfo,
        host: &str,
        bytes_sent: u64,
    ) -> Self {
        Self {
            outcomes: outcomes.clone(),
            store: store.clone(),
            proxy: proxy.key.clone(),
            domain: host.to_owned(),
            started: Instant::now(),
            bytes_sent,
            usage: None,
        }
    }

    /// Its bytes are also metered in `usage` for `who`'s token and holder.
    pub(super) fn metered(mut self, usage: &Usage, who: &Who) -> Self {
        self.usage = Some((usage.clone(), who.token.clone(), who.holder.clone()));
        self
    }

    fn record(self, ended: Ended, latency: Option<Duration>, bytes_received: u64, banned: bool) {
        let seen = Seen {
            ended,
            latency,
            bytes_received,
            bytes_sent: self.bytes_sent,
            banned,
        };
        let now = self.store.now_ms();
        self.outcomes.record(&self.proxy, &self.domain, &seen, now);
        if let Some((usage, token, holder)) = &self.usage {
            usage.add_bytes(token, holder, self.bytes_sent.saturating_add(bytes_received), now);
        }
    }

    /// Time since it was sent.
    pub(super) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// No answer: it failed with `failure`.
    pub(super) fn failed(self, failure: Failure) {
        self.record(Ended::Failed(failure), None, 0, false);
    }

    /// An answer's head arrived (the latency ends now); its `body` is counted and the outcome
    /// recorded when the body is done, broken or dropped, and `lent` (if the request still holds
    /// its lease) given back when it is done or dropped.
    pub(super) fn answered<B>(
        self,
        body: B,
        ended: Ended,
        banned: bool,
        lent: Option<Lent>,
    ) -> AnswerBody<B> {
        let latency = self.started.elapsed();
        AnswerBody {
            inner: body,
            pending: Some(Pending {
                measure: self,
                ended,
                latency,
                banned,
            }),
            bytes: 0,
            lent,
            ending: None,
        }
    }

    /// The tunnel is open (the latency ends now).
    pub(super) fn opened(self) -> Opened {
        let latency = self.started.elapsed();
        Opened {
            measure: self,
            latency,
        }
    }
}

/// An open tunnel, recorded when it closes.
pub(super) struct Opened {
    measure: Measure,
    latency: Duration,
}

impl Opened {
    /// The tunnel closed: cleanly with (bytes client to target, bytes target to client), or
    /// broken.
    pub(super) fn closed(mut self, result: &std::io::Result<(u64, u64)>) {
        let (ended, received) = match result {
            Ok((sent, received)) => {
                self.measure.bytes_sent = *sent;
                (Ended::Succeeded, *received)
            }
            Err(_) => (Ended::Failed(Failure::Reset), 0),
        };
        self.measure.record(ended, Some(self.latency), received, false);
    }
}

struct Pending {
    measure: Measure,
    ended: Ended,
    latency: Duration,
    banned: bool,
}

/// An answer's body as the gateway passes it on. Its bytes are counted and its outcome
/// recorded when it ends (as its head said), breaks (the proxy died mid-answer:
/// [`Failure::Reset`]) or is dropped (the client went away: as its head said, with the bytes
/// so far). Its lease, if it still has one, goes back when it is done or dropped; when done,
/// the last frame waits until the lease is back (durable too): a client that sends its next
/// request as soon as it has this answer finds the proxy free again.
pub(super) struct AnswerBody<B> {
    inner: B,
    pending: Option<Pending>,
    bytes: u64,
    lent: Option<Lent>,
    /// The lease being given back, and the frame that waits for it (`None`: the end).
    ending: Option<(GivingBack, Option<Frame<Bytes>>)>,
}

/// A lease being given back.
type GivingBack = Pin<Box<dyn Future<Output = ()> + Send>>;

impl<B> AnswerBody<B> {
    fn finish(&mut self, broken: bool) {
        if let Some(p) = self.pending.take() {
            let ended = if broken {
                Ended::Failed(Failure::Reset)
            } else {
                p.ended
            };
            p.measure.record(ended, Some(p.latency), self.bytes, p.banned);
        }
    }
}

impl<B> Drop for AnswerBody<B> {
    fn drop(&mut self) {
        // A lease not given back yet goes back from `Lent`'s own Drop.
        self.finish(false);
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for AnswerBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        if let Some((giving_back, last)) = &mut this.ending {
            std::task::ready!(giving_back.as_mut().poll(cx));
            let last = last.take();
            this.ending = None;
            return Poll::Ready(last.map(Ok));
        }
        let polled = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
        let last = match polled {
            Some(Ok(frame)) => {
                this.bytes += frame.data_ref().map_or(0, |d| d.len() as u64);
                if !this.inner.is_end_stream() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                this.finish(false);
                Some(frame)
            }
            None => {
                this.finish(false);
                None
            }
            // Broken: the body is dropped after this, and the lease goes back from Drop.
            Some(Err(error)) => {
                this.finish(true);
                return Poll::Ready(Some(Err(error)));
            }
        };
        match this.lent.take() {
            Some(lent) => {
                let mut giving_back: GivingBack = Box::pin(lent.give_back());
                match giving_back.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(last.map(Ok)),
                    Poll::Pending => {
                        this.ending = Some((giving_back, last));
                        Poll::Pending
                    }
                }
            }
            None => Poll::Ready(last.map(Ok)),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.lent.is_none() && self.ending.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
