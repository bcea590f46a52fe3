//! JSON written by hand where serde's per-field machinery is a real share of the work (the lease
//! API's two answers, the lease journal's records): a string, a string that needs no escaping,
//! an unsigned integer, each byte for byte as serde_json writes it. The callers' tests compare
//! what they write with serde_json's output for the same values.

const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);

/// The high bit of each byte of `word` below `n` (at most 0x80), exact up to the lowest
/// flagged byte (a borrow may flag bytes above it, never below).
#[inline]
fn below(word: u64, n: u8) -> u64 {
    word.wrapping_sub(ONES * u64::from(n)) & !word & HIGHS
}

/// How many of `bytes`' first bytes a JSON string holds as they are: up to the first quote,
/// backslash or control byte (what serde_json escapes), or all of them. Eight bytes at a time
/// (a byte at a time cost about 5 instructions a byte; a URL's check was about 200): the
/// lease API's body reader finds a string's end with it, and [`put_str`] whether to escape.
#[inline]
pub(crate) fn plain_len(bytes: &[u8]) -> usize {
    let mut at = 0;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        // Little-endian, so the lowest flagged byte is the first in the text.
        let word = u64::from_le_bytes(word);
        // Flags bytes equal to `"` or `\` (zero after the XOR) and those below 0x20. The
        // lowest flag of the OR is exact: each term's lowest flag is.
        let found = below(word ^ (ONES * u64::from(b'"')), 1)
            | below(word ^ (ONES * u64::from(b'\\')), 1)
            | below(word, 0x20);
        if found != 0 {
            return at + (found.trailing_zeros() / 8) as usize;
        }
        at += 8;
    }
    at + bytes[at..]
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .unwrap_or(bytes.len() - at)
}

/// `s` as a JSON string onto `out`: copied as is when nothing in it needs escaping (IDs, URLs,
/// timestamps, proxy keys), else escaped by serde_json.
pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    if plain_len(s.as_bytes()) == s.len() {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, s).expect("a string always serializes");
    }
}

/// `s` as a JSON string onto `out`, for strings that never need escaping (base64url lease IDs:
/// the signer's, or a presented one that verified; outcome names): spares even the check.
pub(crate) fn put_plain(out: &mut Vec<u8>, s: &str) {
    debug_assert!(
        s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\'),
        "{s:?} needs escaping"
    );
    out.reserve(s.len() + 2);
    out.push(b'"');
    out.extend_from_slice(s.as_bytes());
    out.push(b'"');
}

/// `n` in decimal (itoa: two digits a step, as serde_json writes integers).
pub(crate) fn put_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The plain run found eight bytes at a time ends at the first quote, backslash or
        /// control byte, as a byte at a time finds it.
        #[test]
        fn the_plain_run_is_found_as_a_byte_at_a_time_finds_it(
            bytes in prop::collection::vec(
                prop_oneof![Just(b'"'), Just(b'\\'), 0u8..0x21, 0x7eu8..=0xff, any::<u8>()],
                0..40,
            ),
        ) {
            let naive = bytes.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20);
            prop_assert_eq!(plain_len(&bytes), naive.unwrap_or(bytes.len()));
        }
    }

    #[test]
    fn strings_and_integers_are_what_serde_json_writes() {
        for s in [
            "",
            "plain",
            "quote\"d",
            "back\\slash",
            "ctl\u{1}\n\t",
            "é✓",
            "\u{7f}",
        ] {
            let mut fast = Vec::new();
            put_str(&mut fast, s);
            assert_eq!(fast, serde_json::to_vec(s).unwrap(), "{s:?}");
        }
        let mut fast = Vec::new();
        put_plain(&mut fast, "AAEC-_xyz09");
        assert_eq!(fast, b"\"AAEC-_xyz09\"");
        for n in [0, 1, 9, 10, 99, 100, u64::MAX] {
            let mut fast = Vec::new();
            put_u64(&mut fast, n);
            assert_eq!(String::from_utf8(fast).unwrap(), n.to_string());
        }
    }
}
