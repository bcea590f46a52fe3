//! Support code shared by integration tests (and benches, through `#[path]`).
//!
//! Each module is self-contained; include this folder with `mod support;` from a test.
//! The items at this level are real parts for integration tests: Squid on loopback, and a
//! loopback HTTP/HTTPS target. Every service binds 127.0.0.1, is started by the test that needs
//! it and is stopped by a guard's Drop in every outcome.

#![allow(dead_code)] // Each test binary uses a different part of the support code.

pub mod cluster_app;
pub mod control_plane;
pub mod leases;
pub mod ports;
pub mod process;
pub mod run_process;
pub mod standalone;
pub mod wait;

use std::os::unix::process::CommandExt;
use std::{
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_rustls::rustls;

pub use ports::free_port;
#[allow(unused_imports)] // As with dead code: each test binary waits with some of them.
pub use wait::{eventually, wait_until};

/// A real Squid on 127.0.0.1, killed (with its process group) on Drop.
pub struct Squid {
    pub port: u16,
    require_auth: bool,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Squid {
    /// Starts Squid allowing loopback clients everywhere except URL paths starting with
    /// `/forbidden`, which it denies (403).
    pub async fn start() -> Squid {
        Self::start_with(false).await
    }

    /// Like [`Squid::start`], but every request must carry proxy credentials (any user name
    /// and password: Squid's fake basic-auth helper checks that they are there and well formed).
    pub async fn start_with_auth() -> Squid {
        Self::start_with(true).await
    }

    async fn start_with(require_auth: bool) -> Squid {
        let dir = tempfile::tempdir().expect("temp dir");
        // Started as root, Squid drops to user `proxy`: let it write its logs and pid here.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .expect("chmod squid dir");
        let mut squid = Squid {
            port: 0,
            require_auth,
            dir,
            child: None,
        };
        for attempt in 0..5 {
            squid.port = free_port();
            if squid.spawn().await {
                return squid;
            }
            eprintln!("squid did not come up on port {} (attempt {attempt})", squid.port);
        }
        panic!(
            "squid did not start; see {}",
            squid.dir.path().join("cache.log").display()
        );
    }

    fn config(&self) -> String {
        let d = self.dir.path().display();
        let (auth, allow) = if self.require_auth {
            (
                "auth_param basic program /usr/lib/squid/basic_fake_auth\n\
                 auth_param basic children 1 startup=1 idle=1\n\
                 acl authed proxy_auth REQUIRED\n",
                "http_access allow localnet authed\n",
            )
        } else {
            ("", "http_access allow localnet\n")
        };
        format!(
            "http_port 127.0.0.1:{port}\n\
             visible_hostname epo-test\n\
             pid_filename {d}/squid.pid\n\
             cache_log {d}/cache.log\n\
             access_log stdio:{d}/access.log\n\
             coredump_dir {d}\n\
             cache deny all\n\
             cache_mem 8 MB\n\
             shutdown_lifetime 1 seconds\n\
             dns_v4_first on\n\
             {auth}\
             acl localnet src 127.0.0.0/8\n\
             acl forbidden urlpath_regex ^/forbidden\n\
             http_access deny forbidden\n\
             {allow}\
             http_access deny all\n",
            port = self.port
        )
    }

    async fn spawn(&mut self) -> bool {
        let conf = self.dir.path().join("squid.conf");
        std::fs::write(&conf, self.config()).expect("write squid.conf");
        let out = std::fs::File::create(self.dir.path().join("squid.out")).expect("squid.out");
        let child = Command::new("squid")
            .arg("-N")
            // Shared-memory names of its own: Squids starting at once under the default
            // service name race for them and one dies (`shm_open(...): File exists`).
            .arg("-n")
            .arg(self.service_name())
            .arg("-f")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup"))
            .stderr(out)
            .process_group(0)
            .spawn()
            .expect("spawning squid (is the squid package installed?)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(_)) = child.try_wait()
            {
                self.child = None;
                return false;
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.stop();
        false
    }

    /// Kills Squid; its port refuses connections afterwards.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The whole group: Squid may have helper processes.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.kill();
            let _ = child.wait();
            process::remove_squid_segments(&self.service_name());
        }
    }

    /// Its Squid service name (`-n`): shared-memory names of its own.
    fn service_name(&self) -> String {
        format!("epotest{}", self.port)
    }

    /// Starts Squid again on the same port.
    pub async fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.spawn().await {
            assert!(
                Instant::now() < deadline,
                "squid did not restart on port {}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Squid's folder (logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Squid {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A loopback target: `/ip` answers the client's address, `/slow` answers after 3 s,
/// `/status/500` answers 500, anything else 204. Serves HTTP and HTTPS (self-signed for
/// 127.0.0.1). Stops on Drop.
pub struct Origin {
    pub http: SocketAddr,
    pub https: SocketAddr,
    pub roots: Arc<rustls::RootCertStore>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

async fn origin_answer(
    peer: SocketAddr,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_owned();
    let mut response = Response::new(Full::new(Bytes::new()));
    match path.as_str() {
        "/ip" => *response.body_mut() = Full::new(Bytes::from(format!("{{\"origin\":\"{}\"}}", peer.ip()))),
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            *response.body_mut() = Full::new(Bytes::from("slow"));
        }
        "/status/500" => *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR,
        _ => *response.status_mut() = StatusCode::NO_CONTENT,
    }
    Ok(response)
}

impl Origin {
    pub async fn start() -> Origin {
        let certified =
            rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("self-signed cert");
        let cert_der = certified.cert.der().clone();
        let key_der = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert_der.clone()).expect("add root");
        let server_config =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("protocol versions")
                .with_no_client_auth()
                .with_single_cert(vec![cert_der], key_der)
                .expect("server cert");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config));

        let http_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind http");
        let https_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind https");
        let http = http_listener.local_addr().unwrap();
        let https = https_listener.local_addr().unwrap();
        let plain = tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = http_listener.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| origin_answer(peer, req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let tls = tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = https_listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(stream).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |req| origin_answer(peer, req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Origin {
            http,
            https,
            roots: Arc::new(roots),
            tasks: vec![plain, tls],
        }
    }

    pub fn http_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    pub fn https_url(&self, path: &str) -> String {
        format!("https://{}{path}", self.https)
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A folder path inside the crate (for docs).
pub fn crate_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}
