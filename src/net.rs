//! Accepting TCP connections the same way in every server the operator runs (the discovery
//! API, the gateway, the admin server), closing the ones that stall, and draining them when a
//! server stops.

use std::{
    io,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{Notify, futures::OwnedNotified},
};

/// How long a server waits after a failed accept before the next one.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The next connection on `listener`, with Nagle's algorithm off (every answer is one write,
/// small and waited for). A failed accept (out of file descriptors and the like) is logged for
/// `server` and retried after a short pause instead of spinning on the error.
pub async fn accept(listener: &TcpListener, server: &str) -> TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                // Best effort: a socket that refuses the option still serves.
                let _ = stream.set_nodelay(true);
                return stream;
            }
            Err(error) => {
                tracing::warn!(%error, server, "accepting a connection");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// Raises this process's soft limit on open file descriptors to its hard limit, as Go's runtime
/// does at start: a login shell's soft limit is often 1,024 while the hard one allows far more,
/// and every crawler connection, gateway tunnel (six each) and upstream connection takes one.
/// Returns the soft limit before and after (`None`: unlimited). Squids the local provider
/// starts inherit the raised limit, and take more client connections with it (Squid uses what
/// it is given, up to its built-in maximum, and does not raise its own).
pub fn raise_descriptor_limit() -> io::Result<(Option<u64>, Option<u64>)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let before = limit.current;
    // `None` is unlimited: a soft limit already there, or no hard bound to raise it to.
    let raised = match (limit.current, limit.maximum) {
        (Some(soft), Some(hard)) if soft < hard => hard,
        _ => return Ok((before, before)),
    };
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(raised),
            maximum: limit.maximum,
        },
    )?;
    Ok((before, Some(raised)))
}

/// A connection that is closed once it has been quiet too long: the discovery API's defence
/// against clients that open connections and never finish a request (slowloris) or leave them
/// idle.
///
/// Why not hyper's `header_read_timeout`: it arms a fresh timer for every request (an
/// allocation, a timer-wheel insertion and its removal: about 2,000 instructions an
/// acquire->release pair, measured, a twentieth of the whole request). This keeps one timer per
/// connection and re-arms it only when it fires, looking at what happened since: the timer
/// costs nothing per request, and the limit is kept within a factor of two or three.
///
/// When the timer fires (every `limit` while the connection lives):
/// - something was written since it was armed (an answer went out): armed again;
/// - only reads happened (a request is arriving, or being answered): armed once more, so a
///   request that started near the end of a period gets a whole period to be answered;
/// - nothing, or only reads for two periods in a row: the read fails with `TimedOut` and the
///   server drops the connection.
///
/// So an idle connection is closed after `limit` to `2 × limit`, one that trickles bytes
/// without ever completing a request after at most `3 × limit`, and a request that gets its
/// answer within `limit` of its first byte is never cut (as long as the connection's earlier
/// requests did too).
pub struct QuietLimit<T> {
    inner: T,
    limit: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    wrote: bool,
    read: bool,
    /// The last period had reads and no write.
    reading_only: bool,
    /// The timer has been polled since it was last armed, so it holds this task's waker: until
    /// it fires there is no need to poll it again (the connection stays on one task).
    waiting: bool,
}

impl<T> QuietLimit<T> {
    pub fn new(inner: T, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            timer: Box::pin(tokio::time::sleep(limit)),
            wrote: false,
            read: false,
            reading_only: false,
            waiting: false,
        }
    }

    /// Whether the connection has been quiet too long; registers for the timer's next firing
    /// otherwise. Called only when a read would wait.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.waiting && !self.timer.is_elapsed() {
            return false;
        }
        self.waiting = true;
        // Outside the task's budget: a poll refused for the budget would register no waker,
        // and `waiting` would then skip the timer for good.
        while Pin::new(&mut tokio::task::unconstrained(self.timer.as_mut()))
            .poll(cx)
            .is_ready()
        {
            let (wrote, read) = (std::mem::take(&mut self.wrote), std::mem::take(&mut self.read));
            if !wrote && (!read || self.reading_only) {
                return true;
            }
            self.reading_only = !wrote;
            let next = tokio::time::Instant::now() + self.limit;
            self.timer.as_mut().reset(next);
        }
        false
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for QuietLimit<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connection quiet for longer than {:?}", self.limit),
            ))),
            Poll::Pending => Poll::Pending,
            ready => {
                self.read |= buf.filled().len() > before;
                ready
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for QuietLimit<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote |= matches!(written, Poll::Ready(Ok(n)) if n > 0);
        written
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote |= matches!(written, Poll::Ready(Ok(n)) if n > 0);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A connection that can be asked to finish the request it is on and close.
pub trait Graceful: Future {
    /// Asks; the connection must still be polled until it ends.
    fn graceful_shutdown(self: Pin<&mut Self>);
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<I, B, S> Graceful for hyper::server::conn::http1::Connection<I, S>
where
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Error: Into<BoxError>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin,
    B: hyper::body::Body + 'static,
    B::Error: Into<BoxError>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        hyper::server::conn::http1::Connection::graceful_shutdown(self);
    }
}

impl<I, B, S> Graceful for hyper::server::conn::http1::UpgradeableConnection<I, S>
where
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Error: Into<BoxError>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Into<BoxError>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        hyper::server::conn::http1::UpgradeableConnection::graceful_shutdown(self);
    }
}

/// A server's open connections, drained when it stops: each is asked to finish the request it
/// is on and close, and [`Drain::stop`] waits for them up to a grace period.
///
/// Why not hyper-util's `GracefulShutdown` (or a `select!` on a watch channel): both poll the
/// stop signal on every poll of every connection, about 500 instructions a request. Here a
/// connection polls it once, to leave its waker with it, and afterwards reads a flag; the
/// signal's wake-up makes it look.
pub struct Drain {
    signal: Arc<Signal>,
    /// Every watched connection holds a clone; `stop` waits until none is left.
    open: tokio::sync::mpsc::Sender<()>,
    all_closed: tokio::sync::mpsc::Receiver<()>,
}

struct Signal {
    stopping: AtomicBool,
    notify: Arc<Notify>,
}

impl Default for Drain {
    fn default() -> Self {
        let (open, all_closed) = tokio::sync::mpsc::channel(1);
        Self {
            signal: Arc::new(Signal {
                stopping: AtomicBool::new(false),
                notify: Arc::new(Notify::new()),
            }),
            open,
            all_closed,
        }
    }
}

impl Drain {
    /// `conn`, asked to finish once the drain stops.
    pub fn watch<C: Graceful>(&self, conn: C) -> Drained<C> {
        Drained {
            conn: Box::pin(conn),
            signal: self.signal.clone(),
            registered: None,
            asked: false,
            _open: self.open.clone(),
        }
    }

    /// Asks every connection to finish and waits up to `grace` for all of them to end; `false`
    /// if some were still open then.
    pub async fn stop(self, grace: Duration) -> bool {
        let Self {
            signal,
            open,
            mut all_closed,
        } = self;
        // The flag before the wake-up: a connection woken, or registering late, sees it.
        signal.stopping.store(true, Ordering::SeqCst);
        signal.notify.notify_waiters();
        drop(open);
        tokio::time::timeout(grace, all_closed.recv()).await.is_ok()
    }
}

/// A connection watched by a [`Drain`].
pub struct Drained<C> {
    conn: Pin<Box<C>>,
    signal: Arc<Signal>,
    /// Polled once: it holds this task's waker, which the drain's stop wakes.
    registered: Option<Pin<Box<OwnedNotified>>>,
    asked: bool,
    _open: tokio::sync::mpsc::Sender<()>,
}

impl<C: Graceful> Future for Drained<C> {
    type Output = C::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = &mut *self;
        if !this.asked {
            if this.registered.is_none() {
                let mut notified = Box::pin(this.signal.notify.clone().notified_owned());
                // Pending (it only wakes): what counts is that it now holds the waker.
                let _ = notified.as_mut().poll(cx);
                this.registered = Some(notified);
            }
            if this.signal.stopping.load(Ordering::SeqCst) {
                this.conn.as_mut().graceful_shutdown();
                this.asked = true;
                this.registered = None;
            }
        }
        this.conn.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt, DuplexStream},
        time::Instant,
    };

    use super::*;

    const LIMIT: Duration = Duration::from_secs(30);

    /// The server's end wrapped, and the client's end.
    fn connection() -> (QuietLimit<DuplexStream>, DuplexStream) {
        let (server, client) = tokio::io::duplex(1024);
        (QuietLimit::new(server, LIMIT), client)
    }

    /// Reads until the wrapped end fails; how long that took and the error's kind.
    async fn read_until_closed(
        server: &mut (impl AsyncRead + Unpin),
        started: Instant,
    ) -> (Duration, io::ErrorKind) {
        let mut buf = [0u8; 64];
        let closed = async {
            loop {
                match server.read(&mut buf).await {
                    Ok(0) => panic!("the client closed first"),
                    Ok(_) => {}
                    Err(e) => return e.kind(),
                }
            }
        };
        let kind = tokio::time::timeout(10 * LIMIT, closed)
            .await
            .expect("the connection is still open after ten limits");
        (started.elapsed(), kind)
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_closed_after_one_to_two_limits() {
        let (mut server, _client) = connection();
        let (after, kind) = read_until_closed(&mut server, Instant::now()).await;
        assert_eq!(kind, io::ErrorKind::TimedOut);
        assert!(after >= LIMIT && after <= 2 * LIMIT, "closed after {after:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickle_that_never_gets_an_answer_is_closed_within_three_limits() {
        let (mut server, mut client) = connection();
        let started = Instant::now();
        let trickle = tokio::spawn(async move {
            // One byte of a request head every 10 s, forever.
            loop {
                if client.write_all(b"G").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
        });
        let (after, kind) = read_until_closed(&mut server, started).await;
        trickle.abort();
        assert_eq!(kind, io::ErrorKind::TimedOut);
        assert!(after >= 2 * LIMIT && after <= 3 * LIMIT, "closed after {after:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_answered_within_the_limit_stays_open() {
        let (server, mut client) = connection();
        let (mut server_read, mut server_write) = tokio::io::split(server);
        let started = Instant::now();
        // The server answers a request once its blank line has arrived.
        let answering = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            loop {
                match server_read.read(&mut buf).await {
                    Ok(0) => return Ok(started.elapsed()),
                    Ok(2) if &buf[..2] == b"\r\n" => {
                        server_write.write_all(b"answer").await.map_err(|e| e.kind())?
                    }
                    Ok(_) => {}
                    Err(e) => return Err(e.kind()),
                }
            }
        });
        // Ten minutes of requests 25 s apart, each complete 2 s after its first byte; the
        // first starts 1 s before the timer's first firing, which sees only its first part.
        let mut answer = [0u8; 6];
        tokio::time::sleep(Duration::from_secs(29)).await;
        for _ in 0..24 {
            client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            tokio::time::sleep(Duration::from_secs(2)).await;
            client.write_all(b"\r\n").await.unwrap();
            client.read_exact(&mut answer).await.unwrap();
            assert_eq!(&answer, b"answer");
            tokio::time::sleep(Duration::from_secs(23)).await;
        }
        assert!(
            !answering.is_finished(),
            "the server closed a connection that was answered in time"
        );
        drop(client);
        assert!(answering.await.unwrap().is_ok());
    }

    /// A connection that ends when asked, unless it is `stuck`.
    struct Conn {
        asked: Arc<AtomicBool>,
        stuck: bool,
    }

    impl Future for Conn {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            if self.asked.load(Ordering::SeqCst) && !self.stuck {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }
    }

    impl Graceful for Conn {
        fn graceful_shutdown(self: Pin<&mut Self>) {
            self.asked.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_asks_every_connection_to_finish_and_waits_for_them() {
        let drain = Drain::default();
        let asked: Vec<Arc<AtomicBool>> = (0..3).map(|_| Arc::default()).collect();
        let tasks: Vec<_> = asked
            .iter()
            .map(|a| {
                tokio::spawn(drain.watch(Conn {
                    asked: a.clone(),
                    stuck: false,
                }))
            })
            .collect();
        // Two have been polled (and wait for the signal); the last one not yet.
        tokio::task::yield_now().await;
        let late = Arc::new(AtomicBool::new(false));
        let late_task = tokio::spawn(drain.watch(Conn {
            asked: late.clone(),
            stuck: false,
        }));
        assert!(
            drain.stop(Duration::from_secs(10)).await,
            "every connection ended"
        );
        for (a, task) in asked.iter().zip(tasks) {
            assert!(a.load(Ordering::SeqCst));
            assert!(task.is_finished());
        }
        assert!(late.load(Ordering::SeqCst));
        assert!(late_task.is_finished());
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_gives_up_on_a_connection_that_does_not_finish_after_the_grace() {
        let drain = Drain::default();
        let asked = Arc::new(AtomicBool::new(false));
        let stuck = tokio::spawn(drain.watch(Conn {
            asked: asked.clone(),
            stuck: true,
        }));
        tokio::task::yield_now().await;
        let started = Instant::now();
        assert!(!drain.stop(Duration::from_secs(10)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert!(asked.load(Ordering::SeqCst), "it was asked all the same");
        stuck.abort();
    }
}
