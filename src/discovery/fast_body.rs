//! The hot request bodies (acquire, renew, release) read without serde when they are in the
//! plain form clients send: an object of known keys, each once, with strings that need no
//! unescaping and whole numbers written as digits. serde_json took about 2,300 instructions for
//! a 60-byte acquire body (its per-string and per-field machinery), a quarter of what the lease
//! API adds to a bare server a pair; this reads the same body in a few hundred.
//!
//! It only ever says less than serde: [`Scan::scan`] returns the value serde_json would decode,
//! or `None` for anything else (an escape, a float, `null`, a key it does not know or sees
//! twice, any syntax error, bytes that are not UTF-8), and the body then goes to serde_json,
//! which decodes it or says what is wrong. A property test holds the two together over
//! generated bodies.
//!
//! It reads bytes, not text: outside strings it accepts ASCII punctuation, digits and white
//! space only, keys must be one of its own ASCII names, and each string value it returns is
//! checked to be UTF-8 on its own, so it accepts no body that is not UTF-8, without a pass over
//! the whole body first (that pass cost about 150 instructions a body). Strings are searched
//! for their end eight bytes at a time.

use std::borrow::Cow;

use super::{
    terms::SelectorTerms,
    wire::{AcquireBody, OutcomeBody, ReleaseBody, RenewBody},
};
use crate::{json_writer::plain_len, lease::Outcome};

/// A body read by the fast path, when it can be.
pub trait Scan<'a>: Sized {
    /// What serde_json would decode from `body`, or `None` when the fast path declines.
    fn scan(body: &'a [u8]) -> Option<Self>;
}

/// A cursor over a body's bytes.
struct Scanner<'a> {
    bytes: &'a [u8],
    at: usize,
}

/// `bytes` as text if they are UTF-8. Most strings of a body are short and ASCII, which is
/// checked here in a few instructions where `str::from_utf8` took about 50 a string.
#[inline]
fn utf8(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() {
        // SAFETY: every byte is below 0x80, and a run of ASCII bytes is valid UTF-8.
        Some(unsafe { std::str::from_utf8_unchecked(bytes) })
    } else {
        std::str::from_utf8(bytes).ok()
    }
}

/// Eight ASCII digits (the first in the lowest byte) as their number, or `None` if any byte is
/// not a digit: three multiplications instead of eight steps (the well-known SWAR
/// conversion; a fencing token has 16 to 19 digits).
#[inline]
fn eight_digits(word: u64) -> Option<u64> {
    // A byte is a digit iff its high nibble is 3 and adding 6 does not carry out of its low
    // nibble (0x3a..0x3f would).
    let digits = word & 0xf0f0_f0f0_f0f0_f0f0 == 0x3030_3030_3030_3030
        && word.wrapping_add(0x0606_0606_0606_0606) & 0xf0f0_f0f0_f0f0_f0f0 == 0x3030_3030_3030_3030;
    if !digits {
        return None;
    }
    let v = word - 0x3030_3030_3030_3030;
    // Pairs of digits, then fours, then the eight.
    let v = v.wrapping_mul(10).wrapping_add(v >> 8);
    const MASK: u64 = 0x0000_00ff_0000_00ff;
    let v = (v & MASK)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add(((v >> 16) & MASK).wrapping_mul(1 + (10_000 << 32)))
        >> 32;
    Some(v)
}

impl<'a> Scanner<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    /// The next byte that is not JSON white space, not consumed.
    #[inline(always)]
    fn peek(&mut self) -> Option<u8> {
        loop {
            let b = *self.bytes.get(self.at)?;
            if !matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(b);
            }
            self.at += 1;
        }
    }

    #[inline(always)]
    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// A string's raw bytes, without escapes or control characters (serde refuses the latter;
    /// the former it decodes, and so is asked to). Not checked to be UTF-8: a key is compared
    /// with ASCII names, a value goes through [`Self::text`].
    #[inline(always)]
    fn string(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.at;
        let rest = self.bytes.get(start..)?;
        let len = plain_len(rest);
        if *rest.get(len)? != b'"' {
            return None;
        }
        self.at = start + len + 1;
        Some(&rest[..len])
    }

    /// A string value as text: [`Self::string`] that is UTF-8 (serde refuses any other).
    #[inline]
    fn text(&mut self) -> Option<&'a str> {
        utf8(self.string()?)
    }

    /// A whole number written as digits, without a leading zero, that fits in a `u64`.
    fn whole(&mut self) -> Option<u64> {
        self.peek()?;
        let rest = self.bytes.get(self.at..)?;
        let mut value = 0u64;
        let mut digits = 0;
        // Eight at a time while the number stays below 10^16 (no overflow possible), then
        // one at a time.
        while digits < 16
            && let Some(chunk) = rest.get(digits..digits + 8)
        {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            let Some(eight) = eight_digits(u64::from_le_bytes(word)) else {
                break;
            };
            value = value * 100_000_000 + eight;
            digits += 8;
        }
        for &b in &rest[digits..] {
            let d = b.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            // Nineteen digits always fit in a u64; only longer numbers are checked.
            value = if digits < 19 {
                value * 10 + u64::from(d)
            } else {
                value.checked_mul(10)?.checked_add(u64::from(d))?
            };
            digits += 1;
        }
        if digits == 0 || (digits > 1 && rest[0] == b'0') {
            return None;
        }
        // A fraction or an exponent is serde's to read (`60.0` counts as 60).
        if let Some(b'.' | b'e' | b'E') = rest.get(digits) {
            return None;
        }
        self.at += digits;
        Some(value)
    }

    /// An object's members: `member` reads each value after its key.
    #[inline]
    fn object(&mut self, mut member: impl FnMut(&'a [u8], &mut Self) -> Option<()>) -> Option<()> {
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
    fn scan(body: &'a [u8]) -> Option<Self> {
        let mut s = Scanner::new(body);
        let (mut selector, mut holder, mut ttl) = (None, None, None);
        let (mut domain, mut session, mut request_id) = (None, None, None);
        s.object(|key, s| match key {
            b"selector" => {
                let mut terms = SelectorTerms::default();
                s.object(|attribute, s| {
                    let attribute = utf8(attribute)?;
                    terms.insert(Cow::Borrowed(attribute), Cow::Borrowed(s.text()?));
                    Some(())
                })?;
                once(&mut selector, Some(terms))
            }
            b"holder" => once(&mut holder, s.text()),
            b"ttlSeconds" => once(&mut ttl, s.whole()),
            b"targetDomain" => once(&mut domain, s.text().map(str::to_owned)),
            b"sessionKey" => once(&mut session, s.text().map(str::to_owned)),
            b"requestId" => once(&mut request_id, s.text().map(str::to_owned)),
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
    fn scan(body: &[u8]) -> Option<Self> {
        let mut s = Scanner::new(body);
        let (mut token, mut ttl) = (None, None);
        s.object(|key, s| match key {
            b"fencingToken" => once(&mut token, s.whole()),
            b"ttlSeconds" => once(&mut ttl, s.whole()),
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
    fn scan(body: &[u8]) -> Option<Self> {
        let mut s = Scanner::new(body);
        let (mut token, mut outcome, mut domain) = (None, None, None);
        s.object(|key, s| match key {
            b"fencingToken" => once(&mut token, s.whole()),
            b"outcome" => once(
                &mut outcome,
                match s.string()? {
                    b"ok" => Some(Outcome::Ok),
                    b"banned" => Some(Outcome::Banned),
                    b"error" => Some(Outcome::Error),
                    _ => None,
                },
            ),
            b"targetDomain" => once(&mut domain, s.text().map(str::to_owned)),
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
    fn scan(_: &[u8]) -> Option<Self> {
        None
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// `Debug` of what each path decodes: the fast path may decline, never differ.
    fn agree<'a, T>(body: &'a [u8]) -> Result<(), TestCaseError>
    where
        T: Scan<'a> + serde::Deserialize<'a> + std::fmt::Debug,
    {
        if let Some(fast) = T::scan(body) {
            let text = String::from_utf8_lossy(body);
            let slow = serde_json::from_slice::<T>(body);
            prop_assert!(slow.is_ok(), "fast path read {text:?}, serde refused: {slow:?}");
            prop_assert_eq!(format!("{fast:?}"), format!("{:?}", slow.unwrap()), "{}", text);
        }
        Ok(())
    }

    #[test]
    fn the_plain_bodies_clients_send_take_the_fast_path() {
        let acquire = r#"{"holder":"bench","selector":{"tier":"dc"},"ttlSeconds":60}"#;
        assert!(AcquireBody::scan(acquire.as_bytes()).is_some());
        let release = ReleaseBody::scan(br#"{"fencingToken":3649891200000032,"outcome":"ok"}"#);
        assert_eq!(release.map(|r| r.fencing_token), Some(3_649_891_200_000_032));
        assert!(RenewBody::scan(b" {\n \"fencingToken\" : 17 } ").is_some());
        // The clients' own: the Python client writes `", "` and `": "` between members.
        let python =
            r#"{"holder": "c1", "selector": {"region": "eu", "tier": "dc"}, "targetDomain": "example.com"}"#;
        let body = AcquireBody::scan(python.as_bytes()).expect("fast path");
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
            assert!(AcquireBody::scan(declined.as_bytes()).is_none(), "{declined}");
        }
        assert!(ReleaseBody::scan(br#"{"fencingToken":1,"outcome":"meh"}"#).is_none());
        assert!(ReleaseBody::scan(br#"{"fencingToken":1}"#).is_none());
        // Bytes that are not UTF-8, in a value or a selector's attribute name (serde refuses
        // both).
        for declined in [
            &b"{\"holder\":\"a\xff\"}"[..],
            b"{\"holder\":\"a\",\"selector\":{\"t\xc3\":\"dc\"}}",
            b"{\"holder\":\"a\",\"selector\":{\"tier\":\"\xed\xa0\x80\"}}",
        ] {
            assert!(AcquireBody::scan(declined).is_none(), "{declined:?}");
            assert!(serde_json::from_slice::<AcquireBody<'_>>(declined).is_err());
        }
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
            any::<u64>().prop_map(|n| n.to_string()),
            "[0-9]{7,24}",
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
            agree::<AcquireBody<'_>>(text.as_bytes())?;
            agree::<RenewBody>(text.as_bytes())?;
            agree::<ReleaseBody>(text.as_bytes())?;
        }

        /// The same with one byte of the body replaced by any byte (most often one that
        /// breaks its UTF-8).
        #[test]
        fn a_body_with_any_byte_changed_is_read_as_serde_reads_it_or_declined(
            text in body(),
            at in any::<prop::sample::Index>(),
            byte in prop_oneof![0x80u8..=0xff, any::<u8>()],
        ) {
            let mut bytes = text.into_bytes();
            let at = at.index(bytes.len());
            bytes[at] = byte;
            agree::<AcquireBody<'_>>(&bytes)?;
            agree::<RenewBody>(&bytes)?;
            agree::<ReleaseBody>(&bytes)?;
        }

        /// Eight digits read at once are read as one at a time reads them; anything else is
        /// refused.
        #[test]
        fn eight_digits_at_once_are_read_as_one_at_a_time(
            bytes in prop::array::uniform8(prop_oneof![b'0'..=b'9', b'0'..=b'9', any::<u8>()]),
        ) {
            let naive = bytes
                .iter()
                .try_fold(0u64, |n, &b| b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0')));
            prop_assert_eq!(eight_digits(u64::from_le_bytes(bytes)), naive);
        }

    }
}
