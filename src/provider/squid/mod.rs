//! Squid as every provider runs it: the one `squid.conf` writer ([`Conf`]), the one
//! password-file line Squid's `basic_ncsa_auth` reads ([`password_line`], SHA-512-crypt through
//! the `sha-crypt` crate), and the one rule for what proxy credentials and outgoing addresses a
//! Squid can carry ([`Prepared::for_request`], with a typed [`SquidError`]). Pure: no I/O; the
//! providers put the text where their Squid reads it (a cloud-init seed, a ConfigMap and
//! Secret, files in an instance folder).
//!
//! The providers differ only in where Squid runs, and [`Conf`] names each difference as a
//! field: a VM or a Pod runs one Squid in Debian's layout ([`debian`]) with the distribution's
//! defaults for pid file and logs, while the `local` provider runs many Squids on one host, each
//! with its own files, a listen address, a fast stop and in-place credential updates.
//!
//! Every provider checks a request here before anything is written, so a user name Squid
//! cannot carry is refused with the same message whichever provider runs the Proxy.

use std::{
    fmt::{self, Write as _},
    net::{IpAddr, SocketAddr},
    path::Path,
};

use sha_crypt::{PasswordHasher, PasswordVerifier, ShaCrypt};

use super::{Credentials, InstanceRequest, ProviderError};

/// Realm Squid names in its 407 challenge.
pub const AUTH_REALM: &str = "egress-proxy";

/// The longest user name: Squid's `MAX_LOGIN_SZ`; a longer one is cut off before the helper
/// sees it, so it could never match.
pub const MAX_USER_NAME: usize = 128;

/// The user-name rule, as every refusal states it.
pub const USER_NAME_RULE: &str = "a Squid user name is 1 to 128 printable ASCII characters \
     ('!' to '~': no spaces, no line breaks, nothing beyond ASCII), without ':' and not starting with '#'";

/// Debian's layout, which the VM guests and the Squid images of the `kubernetes` provider share.
pub mod debian {
    /// Where Squid reads its config.
    pub const CONF_PATH: &str = "/etc/squid/squid.conf";
    /// Where our config points the basic-auth helper at its passwords.
    pub const PASSWD_PATH: &str = "/etc/squid/passwd";
    /// The basic-auth helper for htpasswd-style files.
    pub const AUTH_HELPER: &str = "/usr/lib/squid/basic_ncsa_auth";
}

/// Why a request cannot be turned into a Squid config and password file. Every message says
/// what to change; none contains the password, nor more of the user name (half a secret) than
/// the one character at fault.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SquidError {
    /// The user name is empty.
    #[error("the proxy user name is empty; {USER_NAME_RULE}")]
    EmptyUserName,
    /// The user name is longer than [`MAX_USER_NAME`] bytes.
    #[error("the proxy user name is {length} bytes long; {USER_NAME_RULE}")]
    UserNameTooLong {
        /// Its length in bytes.
        length: usize,
    },
    /// The user name has a character outside `!`..=`~`, or a `:`.
    #[error("character {position} of the proxy user name is {character:?}; {USER_NAME_RULE}")]
    UserNameCharacter {
        /// 1-based position of the first such character.
        position: usize,
        /// The character (a `:`, a space, a line break, a non-ASCII letter).
        character: char,
    },
    /// The user name starts with `#`: `basic_ncsa_auth` skips such lines as comments.
    #[error(
        "the proxy user name starts with '#', which Squid's password file reads as a comment; {USER_NAME_RULE}"
    )]
    UserNameComment,
    /// The password has a control character.
    #[error(
        "the proxy password contains a control character (often a line break at its end, from the \
         file the Secret was made from); remove it: crawlers would have to send it too"
    )]
    PasswordControlCharacter,
    /// `placement.outgoingAddress` is not an IP address.
    #[error("placement.outgoingAddress {0:?} is not an IP address (Squid's tcp_outgoing_address takes one)")]
    OutgoingAddress(String),
    /// The password could not be hashed (an operator bug: the parameters are fixed).
    #[error("cannot hash the proxy password: {0}")]
    Hash(String),
}

impl From<SquidError> for ProviderError {
    fn from(err: SquidError) -> Self {
        match err {
            // Hashing with fixed parameters does not fail for any input: not the Proxy's fault.
            SquidError::Hash(_) => ProviderError::Backend(err.to_string()),
            // The Proxy's credentials or placement: nothing changes until the Proxy (or its
            // Secret) does, so the controller records CreateRejected and waits.
            _ => ProviderError::Rejected(err.to_string()),
        }
    }
}

/// Checks `credentials` against the one rule: [`USER_NAME_RULE`] for the user name, no
/// control characters in the password.
pub fn check_credentials(credentials: &Credentials) -> Result<(), SquidError> {
    let user = &credentials.username;
    if user.is_empty() {
        return Err(SquidError::EmptyUserName);
    }
    if let Some((index, character)) = user
        .chars()
        .enumerate()
        .find(|(_, c)| !c.is_ascii_graphic() || *c == ':')
    {
        return Err(SquidError::UserNameCharacter {
            position: index + 1,
            character,
        });
    }
    if user.len() > MAX_USER_NAME {
        return Err(SquidError::UserNameTooLong { length: user.len() });
    }
    if user.starts_with('#') {
        return Err(SquidError::UserNameComment);
    }
    if credentials.password.chars().any(char::is_control) {
        return Err(SquidError::PasswordControlCharacter);
    }
    Ok(())
}

/// The password file's one line for `credentials`: `user:$6$salt$hash\n`, the htpasswd-style
/// format `basic_ncsa_auth` reads (through glibc's `crypt`). Checks the credentials first.
pub fn password_line(credentials: &Credentials) -> Result<String, SquidError> {
    check_credentials(credentials)?;
    // The salt only has to differ between hashes; it is no secret.
    let salt: [u8; 12] = std::array::from_fn(|_| fastrand::u8(..));
    let hash = ShaCrypt::SHA512
        .hash_password_with_salt(credentials.password.as_bytes(), &salt)
        .map_err(|err| SquidError::Hash(err.to_string()))?;
    Ok(format!("{}:{hash}\n", credentials.username))
}

/// Whether the password file's `line` ([`password_line`]'s format) takes `credentials`: the
/// same user name, and a hash of the same password.
pub fn password_line_accepts(line: &str, credentials: &Credentials) -> bool {
    line.trim_end_matches('\n')
        .split_once(':')
        .is_some_and(|(user, hash)| {
            user == credentials.username
                && ShaCrypt::SHA512
                    .verify_password(credentials.password.as_bytes(), hash)
                    .is_ok()
        })
}

/// What a request asks of Squid, checked: every provider makes this before it writes anything.
#[derive(Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Source address of outgoing connections (`placement.outgoingAddress`).
    pub outgoing: Option<IpAddr>,
    /// The password file's content, when the Proxy has credentials.
    pub password_line: Option<String>,
}

impl fmt::Debug for Prepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The line holds a hash of the password: not for logs.
        f.debug_struct("Prepared")
            .field("outgoing", &self.outgoing)
            .field(
                "password_line",
                &self.password_line.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl Prepared {
    /// Checks `request`'s credentials ([`check_credentials`]) and outgoing address and makes
    /// the password line.
    pub fn for_request(request: &InstanceRequest) -> Result<Self, SquidError> {
        let outgoing = request
            .placement
            .outgoing_address
            .as_deref()
            .map(|text| {
                text.parse::<IpAddr>()
                    .map_err(|_| SquidError::OutgoingAddress(text.to_owned()))
            })
            .transpose()?;
        let password_line = request.credentials.as_ref().map(password_line).transpose()?;
        Ok(Self {
            outgoing,
            password_line,
        })
    }
}

/// Where Squid listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listen {
    /// Every address of its own machine (a VM guest, a Pod).
    Port(u16),
    /// One address of a host it shares (`local`).
    Address(SocketAddr),
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Port(port) => write!(f, "{port}"),
            // `SocketAddr` brackets IPv6 addresses, as Squid wants them.
            Self::Address(address) => write!(f, "{address}"),
        }
    }
}

/// Basic authentication against a password file of [`password_line`]s.
#[derive(Clone, Copy, Debug)]
pub struct Auth<'a> {
    /// The helper program (`basic_ncsa_auth`).
    pub helper: &'a Path,
    /// The password file the helper reads.
    pub passwords: &'a Path,
    /// The password file is rewritten in place (`local`'s `update_credentials`): few helper
    /// processes per Squid, and Squid caches a check for a minute only, so old credentials stop
    /// working within a minute. Without it Squid's defaults hold (the file never changes: new
    /// credentials come with a new instance).
    pub updated_in_place: bool,
}

/// Squid's own files, for a Squid that shares its host with others (`local`): each has its
/// own pid file, logs and core dump folder, and nothing host-wide (netdb, pinger, log rotation)
/// is used. A VM or a Pod runs one Squid and keeps the distribution's defaults.
#[derive(Clone, Copy, Debug)]
pub struct OwnFiles<'a> {
    /// `pid_filename`.
    pub pid: &'a Path,
    /// `cache_log`.
    pub cache_log: &'a Path,
    /// `access_log`; `None` writes none.
    pub access_log: Option<&'a Path>,
    /// `coredump_dir`.
    pub coredump_dir: &'a Path,
}

/// One instance's `squid.conf`.
#[derive(Clone, Copy, Debug)]
pub struct Conf<'a> {
    /// The first comment line: who wrote the file and what becomes of edits.
    pub header: &'a str,
    /// The instance name, used as `visible_hostname`.
    pub name: &'a str,
    /// Where Squid listens.
    pub listen: Listen,
    /// Source address of outgoing connections.
    pub outgoing: Option<IpAddr>,
    /// Basic authentication, when the Proxy has credentials; without, every client that
    /// reaches the listen address may use the proxy.
    pub auth: Option<Auth<'a>>,
    /// Squid's own files, when it shares its host; `None` keeps the distribution's defaults.
    pub own_files: Option<OwnFiles<'a>>,
    /// Stop within about a second of SIGTERM (`local` deletes by signal and waits for it);
    /// otherwise Squid's default grace for open connections.
    pub fast_shutdown: bool,
    /// Hide clients and the proxy from the sites crawled (no `X-Forwarded-For`, no `Via`, no
    /// version). The VM and Pod configs have always kept Squid's defaults, which name the
    /// instance in `Via` (their boot tests check for it); `local` hides them.
    pub anonymous: bool,
    /// The user Squid drops to, when started as root.
    pub effective_user: Option<&'a str>,
    /// Operator-supplied directives, placed before the access rules so they can add ACLs.
    pub extra: &'a [String],
}

impl<'a> Conf<'a> {
    /// The config of a machine that runs one Squid (a VM guest, a Pod): Debian's layout and
    /// the distribution's defaults, listening on `port`, with basic authentication against
    /// [`debian::PASSWD_PATH`] when `auth`.
    pub fn debian(header: &'a str, name: &'a str, port: u16, outgoing: Option<IpAddr>, auth: bool) -> Self {
        Self {
            header,
            name,
            listen: Listen::Port(port),
            outgoing,
            auth: auth.then_some(Auth {
                helper: Path::new(debian::AUTH_HELPER),
                passwords: Path::new(debian::PASSWD_PATH),
                updated_in_place: false,
            }),
            own_files: None,
            fast_shutdown: false,
            anonymous: false,
            effective_user: None,
            extra: &[],
        }
    }

    /// The `squid.conf` text.
    pub fn render(&self) -> String {
        let mut conf = String::new();
        let mut line = |text: fmt::Arguments<'_>| {
            // Writing into a String cannot fail.
            let _ = conf.write_fmt(text);
            conf.push('\n');
        };
        line(format_args!("# {}", self.header));
        line(format_args!("http_port {}", self.listen));
        line(format_args!(
            "# Without a fixed host name Squid stalls on DNS lookups that cannot succeed offline."
        ));
        line(format_args!("visible_hostname {}", self.name));
        if let Some(files) = &self.own_files {
            line(format_args!("pid_filename {}", files.pid.display()));
            line(format_args!("cache_log {}", files.cache_log.display()));
            match files.access_log {
                Some(path) => line(format_args!("access_log stdio:{}", path.display())),
                None => line(format_args!("access_log none")),
            }
            line(format_args!("coredump_dir {}", files.coredump_dir.display()));
            // Nothing is shared with other Squids on the host: no netdb file, no ICMP pinger.
            line(format_args!("netdb_filename none"));
            line(format_args!("pinger_enable off"));
            line(format_args!("logfile_rotate 0"));
        }
        // No cache_dir: an egress proxy forwards, it does not cache (and needs no `squid -z`).
        line(format_args!("cache deny all"));
        if self.fast_shutdown {
            line(format_args!("shutdown_lifetime 1 seconds"));
        }
        if self.anonymous {
            line(format_args!("forwarded_for delete"));
            line(format_args!("via off"));
            line(format_args!("httpd_suppress_version_string on"));
        }
        if let Some(user) = self.effective_user {
            line(format_args!("cache_effective_user {user}"));
        }
        if let Some(outgoing) = self.outgoing {
            line(format_args!("tcp_outgoing_address {outgoing}"));
        }
        if let Some(auth) = &self.auth {
            line(format_args!(
                "auth_param basic program {} {}",
                auth.helper.display(),
                auth.passwords.display()
            ));
            line(format_args!("auth_param basic realm {AUTH_REALM}"));
            if auth.updated_in_place {
                line(format_args!("auth_param basic children 4 startup=1 idle=1"));
                line(format_args!("auth_param basic credentialsttl 1 minute"));
            }
        }
        if !self.extra.is_empty() {
            line(format_args!("# extraConfig from the providers config"));
            for extra in self.extra {
                line(format_args!("{extra}"));
            }
        }
        // The cache manager reports on the proxy and its clients: never for crawlers. After
        // the extra directives, so an operator may allow it for a chosen source first.
        line(format_args!("http_access deny manager"));
        if self.auth.is_some() {
            line(format_args!("acl authenticated proxy_auth REQUIRED"));
            line(format_args!("http_access allow authenticated"));
            line(format_args!("http_access deny all"));
        } else {
            // Without credentials every client that reaches the listen address may use the
            // proxy: the listen address is the access control (see docs/providers-existing.md).
            line(format_args!("http_access allow all"));
        }
        conf
    }
}

/// Whether `text` can stand as one token in squid.conf (a path or an address).
pub fn is_config_token(text: &str) -> bool {
    !text.is_empty()
        && !text
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '#')
}

#[cfg(test)]
mod tests;
