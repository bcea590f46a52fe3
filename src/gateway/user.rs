//! The gateway's user name: who holds the leases a request takes and the options it sets,
//! carried in the `Proxy-Authorization` user name so any client that can set proxy
//! credentials (`curl -x http://USER:TOKEN@host:port`, Python `requests`, Scrapy's
//! `HttpProxyMiddleware`) sets them without an SDK.
//!
//! Syntax: `HOLDER[;KEY=VALUE]...`, for example `crawler-1`, `crawler-1;session=abc123` or
//! `crawler-1;session=abc;attr.region=eu`. `;` and `=` are allowed unescaped in a URL's
//! userinfo (RFC 3986 sub-delims), and clients send the user name as written.
//!
//! - `session=KEY`: a sticky session; every request with the same holder, key and target
//!   host goes through one proxy while it stays usable (see docs/gateway.md).
//! - `attr.NAME=VALUE`: a selector term; only proxies whose attribute `NAME` is `VALUE`.
//!
//! The holder, the session key and the selector are checked by the discovery API's own rules
//! for an acquire body ([`AcquireBody`]), so the gateway accepts what the API accepts.

use std::{borrow::Cow, collections::BTreeMap, sync::Arc};

use crate::discovery::{AcquireBody, RequestBody, SelectorTerms};

/// Who a gateway request is for: the token that let it in, named by its identity name (never
/// its value), and what the user name says.
#[derive(Clone, Debug)]
pub struct Who {
    /// The token's identity name (`anonymous` without authentication).
    pub token: Arc<str>,
    /// The user name.
    pub name: UserName,
}

impl std::ops::Deref for Who {
    type Target = UserName;

    fn deref(&self) -> &UserName {
        &self.name
    }
}

/// What a user name says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserName {
    /// The lease holder.
    pub holder: String,
    /// The sticky-session key, if any.
    pub session: Option<String>,
    /// Attribute terms every proxy used must match.
    pub selector: BTreeMap<String, String>,
}

/// What is wrong with a user name, in words that say what to fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UserNameError {
    /// No holder.
    #[error(
        "the proxy user name is empty: give the holder, e.g. crawler-1 or crawler-1;session=abc (the password is the discovery token)"
    )]
    Empty,
    /// An option without `=`.
    #[error("option {0:?} in the proxy user name must be KEY=VALUE, e.g. session=abc or attr.region=eu")]
    NotAPair(String),
    /// An option nobody knows.
    #[error("unknown option {0:?} in the proxy user name: the options are session=KEY and attr.NAME=VALUE")]
    Unknown(String),
    /// An option given twice.
    #[error("option {0:?} appears twice in the proxy user name")]
    Repeated(String),
    /// A value out of the API's bounds.
    #[error("proxy user name: {0}")]
    Invalid(String),
}

impl UserName {
    /// Reads `text` (`HOLDER[;KEY=VALUE]...`).
    pub fn parse(text: &str) -> Result<Self, UserNameError> {
        let mut parts = text.split(';');
        let holder = parts.next().unwrap_or_default().trim();
        if holder.is_empty() {
            return Err(UserNameError::Empty);
        }
        let mut name = UserName {
            holder: holder.to_owned(),
            session: None,
            selector: BTreeMap::new(),
        };
        for option in parts {
            let Some((key, value)) = option.split_once('=') else {
                return Err(UserNameError::NotAPair(option.to_owned()));
            };
            let repeated = || UserNameError::Repeated(key.to_owned());
            if key == "session" {
                if name.session.replace(value.to_owned()).is_some() {
                    return Err(repeated());
                }
            } else if let Some(attribute) = key.strip_prefix("attr.") {
                if name
                    .selector
                    .insert(attribute.to_owned(), value.to_owned())
                    .is_some()
                {
                    return Err(repeated());
                }
            } else {
                return Err(UserNameError::Unknown(key.to_owned()));
            }
        }
        // The API's own bounds for the same fields, so both front doors agree.
        AcquireBody {
            selector: SelectorTerms::from_pairs(&name.selector),
            holder: Cow::Borrowed(&name.holder),
            ttl_seconds: None,
            target_domain: None,
            session_key: name.session.clone(),
            request_id: None,
        }
        .validate()
        .map_err(|why| {
            UserNameError::Invalid(
                why.replace("sessionKey", "session")
                    .replace("selector", "attr.* options"),
            )
        })?;
        Ok(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_session_and_attributes() {
        assert_eq!(
            UserName::parse("crawler-1"),
            Ok(UserName {
                holder: "crawler-1".into(),
                session: None,
                selector: BTreeMap::new(),
            })
        );
        let name = UserName::parse("crawler-1;session=abc123;attr.region=eu;attr.tier=gold").unwrap();
        assert_eq!(name.holder, "crawler-1");
        assert_eq!(name.session.as_deref(), Some("abc123"));
        assert_eq!(
            name.selector,
            BTreeMap::from([
                ("region".to_owned(), "eu".to_owned()),
                ("tier".to_owned(), "gold".to_owned())
            ])
        );
    }

    #[test]
    fn each_mistake_says_what_to_fix() {
        let err = |text: &str| UserName::parse(text).unwrap_err().to_string();
        assert!(err("").contains("give the holder"), "{}", err(""));
        assert!(err(";session=a").contains("give the holder"));
        assert!(err("c;session").contains("must be KEY=VALUE"));
        assert!(err("c;colour=red").contains("the options are session=KEY and attr.NAME=VALUE"));
        assert!(err("c;session=a;session=b").contains("twice"));
        assert!(
            err("c;session=").contains("session must be"),
            "{}",
            err("c;session=")
        );
        assert!(err(&"h".repeat(129)).contains("holder must be"));
    }
}
