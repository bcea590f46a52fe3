//! The hot request bodies (acquire, renew, release) read without serde when they are in the
//! plain form clients send: an object of known keys, each once, with strings that need no
//! unescaping and whole numbers written as digits. serde_json took about 2,300 instructions for
//! a 60-byte acquire body (its per-string and per-field machinery), a quarter of what the lease
//! API adds to a bare server a pair; this reads the same body in a few hundred.
//!
//! It only ever says less than serde: [`Scan::scan`] returns the value serde_json would decode,
//! or `None` for anything else (an escape, a float, `null`, a key it does not know or sees
//! twice, any syntax error), and the body then goes to serde_json, which decodes it or says
//! what is wrong. A property test holds the two together over generated bodies.

use std::borrow::Cow;

use super::{
    outcomes::OutcomeBody,
    terms::SelectorTerms,
    wire::{AcquireBody, ReleaseBody, RenewBody},
};
use crate::lease::Outcome;

/// A body read by the fast path, when it can be.
pub trait Scan<'a>: Sized {
    /// What serde_json would decode from `text`, or `None` when the fast path declines.
    fn scan(text: &'a str) -> Option<Self>;
}

/// A cursor over a body's text. Every position it stops at is just past an ASCII byte, so
/// slicing the text there stays on character boundaries.
struct Scanner<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scanner<'a> {
    fn new(text: &'a str) -> Self {
        Self { text, at: 0 }
    }

    fn peek(&mut self) -> Option<u8> {
        let bytes = self.text.as_bytes();
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = bytes.get(self.at) {
            self.at += 1;
        }
        bytes.get(self.at).copied()
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// A string without escapes or control characters (serde refuses the latter; the former
    /// it decodes, and so is asked to).
    fn string(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.at;
        let rest = &self.text.as_bytes()[start..];
        let len = rest.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        if rest[len] != b'"' {
            return None;
        }
        self.at = start + len + 1;
        self.text.get(start..start + len)
    }

    /// A whole number written as digits, without a leading zero, that fits in a `u64`.
    fn whole(&mut self) -> Option<u64> {
        self.peek()?;
        let digits = self.text.as_bytes()[self.at..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        let text = &self.text.as_bytes()[self.at..self.at + digits];
        if digits == 0 || (digits > 1 && text[0] == b'0') {
            return None;
        }
        // A fraction or an exponent is serde's to read (`60.0` counts as 60).
        if let Some(b'.' | b'e' | b'E') = self.text.as_bytes().get(self.at + digits) {
            return None;
        }
        let value = text
            .iter()
            .try_fold(0u64, |n, &d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))?;
        self.at += digits;
        Some(value)
    }

    /// An object's members: `member` reads each value after its key.
    fn object(&mut self, mut member: impl FnMut(&'a str, &mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.peek()? == b'}' {
            self.at += 1;
            return Some(());
        }
        loop {
            let key = self.string()?;
            self.eat(b':')?;
            member(key, self)?;
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// Nothing but white space is left.
    fn end(mut self) -> Option<()> {
        self.peek().is_none().then_some(())
    }
}

/// Sets a field seen for the first time (serde refuses a duplicate field).
fn once<T>(field: &mut Option<T>, value: Option<T>) -> Option<()> {
    if field.is_some() {
        return None;
    }
    *field = Some(value?);
    Some(())
}

impl<'a> Scan<'a> for AcquireBody<'a> {
    fn scan(text: &'a str) -> Option<Self> {
        let mut s = Scanner::new(text);
        let (mut selector, mut holder, mut ttl) = (None, None, None);
        let (mut domain, mut session, mut request_id) = (None, None, None);
        s.object(|key, s| match key {
            "selector" => {
                let mut terms = SelectorTerms::default();
                s.object(|attribute, s| {
                    terms.insert(Cow::Borrowed(attribute), Cow::Borrowed(s.string()?));
                    Some(())
                })?;
                once(&mut selector, Some(terms))
            }
            "holder" => once(&mut holder, s.string()),
            "ttlSeconds" => once(&mut ttl, s.whole()),
            "targetDomain" => once(&mut domain, s.string().map(str::to_owned)),
            "sessionKey" => once(&mut session, s.string().map(str::to_owned)),
            "requestId" => once(&mut request_id, s.string().map(str::to_owned)),
            _ => None,
        })?;
        s.end()?;
        Some(AcquireBody {
            selector: selector.unwrap_or_default(),
            holder: Cow::Borrowed(holder?),
            ttl_seconds: ttl,
            target_domain: domain,
            session_key: session,
            request_id,
        })
    }
}

impl Scan<'_> for RenewBody {
    fn scan(text: &str) -> Option<Self> {
        let mut s = Scanner::new(text);
        let (mut token, mut ttl) = (None, None);
        s.object(|key, s| match key {
            "fencingToken" => once(&mut token, s.whole()),
            "ttlSeconds" => once(&mut ttl, s.whole()),
            _ => None,
        })?;
        s.end()?;
        Some(RenewBody {
            fencing_token: token?,
            ttl_seconds: ttl,
        })
    }
}

impl Scan<'_> for ReleaseBody {
    fn scan(text: &str) -> Option<Self> {
        let mut s = Scanner::new(text);
        let (mut token, mut outcome, mut domain) = (None, None, None);
        s.object(|key, s| match key {
            "fencingToken" => once(&mut token, s.whole()),
            "outcome" => once(
                &mut outcome,
                match s.string()? {
                    "ok" => Some(Outcome::Ok),
                    "banned" => Some(Outcome::Banned),
                    "error" => Some(Outcome::Error),
                    _ => None,
                },
            ),
            "targetDomain" => once(&mut domain, s.string().map(str::to_owned)),
            _ => None,
        })?;
        s.end()?;
        Some(ReleaseBody {
            fencing_token: token?,
            outcome: outcome?,
            target_domain: domain,
        })
    }
}

/// Outcome reports are not on the lease path's hot loop: serde reads them.
impl Scan<'_> for OutcomeBody {
    fn scan(_: &str) -> Option<Self> {
        None
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// `Debug` of what each path decodes: the fast path may decline, never differ.
    fn agree<'a, T>(text: &'a str) -> Result<(), TestCaseError>
    where
        T: Scan<'a> + serde::Deserialize<'a> + std::fmt::Debug,
    {
        if let Some(fast) = T::scan(text) {
            let slow = serde_json::from_str::<T>(text);
            prop_assert!(slow.is_ok(), "fast path read {text:?}, serde refused: {slow:?}");
            prop_assert_eq!(format!("{fast:?}"), format!("{:?}", slow.unwrap()), "{}", text);
        }
        Ok(())
    }

    #[test]
    fn the_plain_bodies_clients_send_take_the_fast_path() {
        let acquire = r#"{"holder":"bench","selector":{"tier":"dc"},"ttlSeconds":60}"#;
        assert!(AcquireBody::scan(acquire).is_some());
        assert!(ReleaseBody::scan(r#"{"fencingToken":17,"outcome":"ok"}"#).is_some());
        assert!(RenewBody::scan(" {\n \"fencingToken\" : 17 } ").is_some());
        // The clients' own: the Python client writes `", "` and `": "` between members.
        let python =
            r#"{"holder": "c1", "selector": {"region": "eu", "tier": "dc"}, "targetDomain": "example.com"}"#;
        let body = AcquireBody::scan(python).expect("fast path");
        assert_eq!(
            body.selector.iter().collect::<Vec<_>>(),
            [("region", "eu"), ("tier", "dc")]
        );
        assert_eq!(body.target_domain.as_deref(), Some("example.com"));
    }

    #[test]
    fn anything_unusual_is_left_to_serde() {
        for declined in [
            r#"{"holder":"a\"b"}"#,
            r#"{"holder":"a","holder":"b"}"#,
            r#"{"holder":"a","ttlSeconds":60.0}"#,
            r#"{"holder":"a","ttlSeconds":6e1}"#,
            r#"{"holder":"a","ttlSeconds":060}"#,
            r#"{"holder":"a","ttlSeconds":-1}"#,
            r#"{"holder":"a","ttlSeconds":null}"#,
            r#"{"holder":"a","ttlSeconds":18446744073709551616}"#,
            r#"{"holder":"a","extra":1}"#,
            r#"{"holder":"a"} x"#,
            r#"{"holder":"a",}"#,
            r#"{"selector":{}}"#,
            "{\"holder\":\"a\u{1}\"}",
        ] {
            assert!(AcquireBody::scan(declined).is_none(), "{declined}");
        }
        assert!(ReleaseBody::scan(r#"{"fencingToken":1,"outcome":"meh"}"#).is_none());
        assert!(ReleaseBody::scan(r#"{"fencingToken":1}"#).is_none());
    }

    /// Pieces bodies are made of: members right and wrong, values of every JSON kind, odd
    /// spacing and escapes.
    fn member() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            Just("holder"),
            Just("selector"),
            Just("ttlSeconds"),
            Just("targetDomain"),
            Just("sessionKey"),
            Just("requestId"),
            Just("fencingToken"),
            Just("outcome"),
            Just("other"),
            Just(""),
        ];
        let string = prop_oneof![
            "[a-z.é✓ ]{0,6}".prop_map(|s| format!("\"{s}\"")),
            Just(r#""a\"b""#.to_owned()),
            Just(r#""\u0041""#.to_owned()),
            Just("\"tab\there\"".to_owned()),
            Just(r#""ok""#.to_owned()),
            Just(r#""banned""#.to_owned()),
        ];
        let number = prop_oneof![
            (0u64..100_000).prop_map(|n| n.to_string()),
            Just("0".to_owned()),
            Just("007".to_owned()),
            Just("-3".to_owned()),
            Just("1.0".to_owned()),
            Just("1.5".to_owned()),
            Just("2e2".to_owned()),
            Just("18446744073709551615".to_owned()),
            Just("18446744073709551616".to_owned()),
        ];
        let selector = prop::collection::vec(
            (prop_oneof![Just("tier"), Just("zone"), Just("a")], string.clone()),
            0..3,
        )
        .prop_map(|terms| {
            let inner: Vec<String> = terms.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            format!("{{{}}}", inner.join(","))
        });
        let value = prop_oneof![
            string,
            number,
            selector,
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("[]".to_owned()),
        ];
        let space = prop_oneof![Just(""), Just(" "), Just("\n\t")];
        (key, space.clone(), value, space).prop_map(|(k, s1, v, s2)| format!("{s1}\"{k}\"{s2}:{s1}{v}{s2}"))
    }

    fn body() -> impl Strategy<Value = String> {
        (
            prop::collection::vec(member(), 0..6),
            prop_oneof![Just(""), Just(" "), Just(",")],
        )
            .prop_map(|(members, tail)| format!("{{{}}}{tail}", members.join(",")))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

        #[test]
        fn the_fast_path_reads_what_serde_reads_or_declines(text in body()) {
            agree::<AcquireBody<'_>>(&text)?;
            agree::<RenewBody>(&text)?;
            agree::<ReleaseBody>(&text)?;
        }
    }
}
