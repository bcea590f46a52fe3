//! The one reader of a request's `Authorization` and `Proxy-Authorization` headers.

use base64::Engine as _;
use hyper::{HeaderMap, header};

/// What a request presents in its `Authorization` header. The scheme is matched without regard
/// to case (RFC 9110, section 11.1) and the credentials are trimmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Presented {
    /// No `Authorization` header.
    Nothing,
    /// `Bearer <token>` (the token may be empty).
    Bearer(String),
    /// `Basic <base64 of user:password>`: the password (the user name is not looked at: the
    /// token is the password).
    BasicPassword(String),
    /// Another scheme, or a value that can't be read (not visible ASCII, bad base64, no colon).
    Unusable,
}

/// Reads the `Authorization` header of a request.
pub fn presented(headers: &HeaderMap) -> Presented {
    match read_credentials(headers.get(header::AUTHORIZATION)) {
        Credentials::Nothing => Presented::Nothing,
        Credentials::Bearer(token) => Presented::Bearer(token),
        Credentials::Basic { password, .. } => Presented::BasicPassword(password),
        Credentials::Unusable => Presented::Unusable,
    }
}

/// What a request presents in its `Proxy-Authorization` header (the gateway's clients): the
/// same reading as [`presented`]'s, with the Basic user name kept, since it carries the
/// holder and the options there.
#[derive(Clone, PartialEq, Eq)]
pub enum ProxyPresented {
    /// No `Proxy-Authorization` header.
    Nothing,
    /// `Basic <base64 of user:password>`.
    Basic {
        /// The user name, as sent.
        user: String,
        /// The password (the token).
        password: String,
    },
    /// Another scheme, or a value that can't be read.
    Unusable,
}

impl std::fmt::Debug for ProxyPresented {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Nothing => f.write_str("Nothing"),
            Self::Basic { user, .. } => write!(f, "Basic({user:?}, <password redacted>)"),
            Self::Unusable => f.write_str("Unusable"),
        }
    }
}

/// Reads the `Proxy-Authorization` header of a request.
pub fn proxy_presented(headers: &HeaderMap) -> ProxyPresented {
    match read_credentials(headers.get(header::PROXY_AUTHORIZATION)) {
        Credentials::Nothing => ProxyPresented::Nothing,
        Credentials::Basic { user, password } => ProxyPresented::Basic { user, password },
        Credentials::Bearer(_) | Credentials::Unusable => ProxyPresented::Unusable,
    }
}

/// Either header's value, read once: the one parser of credentials.
enum Credentials {
    Nothing,
    Bearer(String),
    Basic { user: String, password: String },
    Unusable,
}

fn read_credentials(value: Option<&hyper::header::HeaderValue>) -> Credentials {
    let Some(value) = value else {
        return Credentials::Nothing;
    };
    let Some((scheme, credentials)) = value.to_str().ok().and_then(|v| v.split_once(' ')) else {
        return Credentials::Unusable;
    };
    let credentials = credentials.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return Credentials::Bearer(credentials.to_owned());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let pair = base64::engine::general_purpose::STANDARD
            .decode(credentials)
            .ok()
            .and_then(|decoded| String::from_utf8(decoded).ok())
            .and_then(|decoded| {
                decoded
                    .split_once(':')
                    .map(|(user, password)| (user.to_owned(), password.to_owned()))
            });
        return pair.map_or(Credentials::Unusable, |(user, password)| Credentials::Basic {
            user,
            password,
        });
    }
    Credentials::Unusable
}
