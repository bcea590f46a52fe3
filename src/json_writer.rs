//! JSON written by hand where serde's per-field machinery is a real share of the work (the lease
//! API's two answers, the lease journal's records): a string, a string that needs no escaping,
//! an unsigned integer, each byte for byte as serde_json writes it. The callers' tests compare
//! what they write with serde_json's output for the same values.

/// `s` as a JSON string onto `out`: copied as is when nothing in it needs escaping (IDs, URLs,
/// timestamps, proxy keys), else escaped by serde_json.
pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    // No early exit, so the check vectorizes; these strings are short.
    let plain = s
        .bytes()
        .fold(true, |ok, b| ok & (b >= 0x20) & (b != b'"') & (b != b'\\'));
    if plain {
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
    use super::*;

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
