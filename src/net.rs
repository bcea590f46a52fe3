//! Accepting TCP connections the same way in every server the operator runs (the discovery
//! API, the gateway, the admin server).

use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

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
