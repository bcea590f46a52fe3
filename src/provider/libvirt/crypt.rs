//! SHA-512-crypt (`$6$`) password hashes for Squid's `basic_ncsa_auth` (through glibc's
//! `crypt`), and base64 for MIME parts. Small enough to keep here rather than add crates.
//!
//! SHA-512-crypt follows Ulrich Drepper's specification ("Unix crypt using SHA-256 and
//! SHA-512"); the tests check it against the specification's vectors.

use sha2::{Digest, Sha512};

/// Rounds of the default, which the hash string then leaves implicit.
const DEFAULT_ROUNDS: usize = 5000;

/// The crypt alphabet.
const CRYPT_ALPHABET: &[u8; 64] = b"./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// The longest salt the scheme uses.
const MAX_SALT: usize = 16;

/// A `$6$salt$hash` string for `password` with a fresh random salt.
pub fn sha512_crypt(password: &str) -> String {
    let salt: String = (0..MAX_SALT)
        .map(|_| CRYPT_ALPHABET[fastrand::usize(..CRYPT_ALPHABET.len())] as char)
        .collect();
    sha512_crypt_with_salt(password.as_bytes(), salt.as_bytes())
}

/// A `$6$salt$hash` string for `password` and `salt` (cut to 16 bytes) at the default rounds.
pub fn sha512_crypt_with_salt(password: &[u8], salt: &[u8]) -> String {
    let salt = &salt[..salt.len().min(MAX_SALT)];
    let digest = |parts: &[&[u8]]| -> [u8; 64] {
        let mut hasher = Sha512::new();
        for part in parts {
            hasher.update(part);
        }
        hasher.finalize().into()
    };

    let b = digest(&[password, salt, password]);
    let mut a = Sha512::new();
    a.update(password);
    a.update(salt);
    let mut remaining = password.len();
    while remaining > 64 {
        a.update(b);
        remaining -= 64;
    }
    a.update(&b[..remaining]);
    let mut length = password.len();
    while length > 0 {
        if length & 1 == 1 {
            a.update(b);
        } else {
            a.update(password);
        }
        length >>= 1;
    }
    let a: [u8; 64] = a.finalize().into();

    let mut dp = Sha512::new();
    for _ in 0..password.len() {
        dp.update(password);
    }
    let dp: [u8; 64] = dp.finalize().into();
    let p_bytes: Vec<u8> = dp.iter().cycle().take(password.len()).copied().collect();

    let mut ds = Sha512::new();
    for _ in 0..16 + usize::from(a[0]) {
        ds.update(salt);
    }
    let ds: [u8; 64] = ds.finalize().into();
    let s_bytes = &ds[..salt.len()];

    let mut c = a;
    for round in 0..DEFAULT_ROUNDS {
        let mut hasher = Sha512::new();
        if round % 2 == 1 {
            hasher.update(&p_bytes);
        } else {
            hasher.update(c);
        }
        if round % 3 != 0 {
            hasher.update(s_bytes);
        }
        if round % 7 != 0 {
            hasher.update(&p_bytes);
        }
        if round % 2 == 1 {
            hasher.update(c);
        } else {
            hasher.update(&p_bytes);
        }
        c = hasher.finalize().into();
    }

    // The scheme's fixed byte order, three bytes to four characters.
    const ORDER: [(usize, usize, usize); 21] = [
        (0, 21, 42),
        (22, 43, 1),
        (44, 2, 23),
        (3, 24, 45),
        (25, 46, 4),
        (47, 5, 26),
        (6, 27, 48),
        (28, 49, 7),
        (50, 8, 29),
        (9, 30, 51),
        (31, 52, 10),
        (53, 11, 32),
        (12, 33, 54),
        (34, 55, 13),
        (56, 14, 35),
        (15, 36, 57),
        (37, 58, 16),
        (59, 17, 38),
        (18, 39, 60),
        (40, 61, 19),
        (62, 20, 41),
    ];
    let mut out = format!("$6${}$", String::from_utf8_lossy(salt));
    let mut push = |value: u32, chars: usize| {
        let mut value = value;
        for _ in 0..chars {
            out.push(CRYPT_ALPHABET[(value & 0x3f) as usize] as char);
            value >>= 6;
        }
    };
    for (b2, b1, b0) in ORDER {
        push(
            (u32::from(c[b2]) << 16) | (u32::from(c[b1]) << 8) | u32::from(c[b0]),
            4,
        );
    }
    push(u32::from(c[63]), 2);
    out
}

/// Standard base64 (RFC 4648, padded), in lines of 76 characters as MIME wants.
pub fn base64_mime(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len() * 4 / 3 + data.len() / 57 * 2 + 4);
    for (index, chunk) in data.chunks(3).enumerate() {
        if index > 0 && index % 19 == 0 {
            out.push_str("\r\n");
        }
        let bytes = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let value = (u32::from(bytes[0]) << 16) | (u32::from(bytes[1]) << 8) | u32::from(bytes[2]);
        for position in 0..4 {
            if position <= chunk.len() {
                out.push(ALPHABET[((value >> (18 - 6 * position)) & 0x3f) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha512_crypt_matches_the_specification_vectors() {
        assert_eq!(
            sha512_crypt_with_salt(b"Hello world!", b"saltstring"),
            "$6$saltstring$svn8UoSVapNtMuq1ukKS4tPQd8iKwSMHWjl/O817G3uBnIFNjnQJuesI68u4OTLiBFdcbYEdFCoEOfaS35inz1"
        );
        // Vectors from glibc's crypt (`openssl passwd -6`, Python's `crypt`): a short salt, and
        // a password longer than one digest with a salt cut to 16 bytes.
        assert_eq!(
            sha512_crypt_with_salt(b"we have a short salt string but not a short password", b"short"),
            "$6$short$qmfj2meTBr5G2EAGIJ4vjX7RpefsD4JzpEyTAeEUJdzdxlBS6pe8gdMHm5zFftaFSj/2p2bjBwyVS9ZhWpLZt."
        );
        assert_eq!(
            sha512_crypt_with_salt(&[b'a'; 200], b"toolongsaltstring"),
            "$6$toolongsaltstrin$9UIdzGVeMlh97nXnR25Th9ESDDJ6S3STGMQ2FbC8Dr8DPdN1HSEnHofussXx6vrCelNQBhV/nU.ePCl4WQcoM/"
        );
    }

    #[test]
    fn fresh_salts_differ_and_have_the_scheme_shape() {
        let first = sha512_crypt("secret");
        let second = sha512_crypt("secret");
        assert_ne!(first, second);
        let parts: Vec<&str> = first.split('$').collect();
        assert_eq!(parts.len(), 4, "{first}");
        assert_eq!(parts[1], "6");
        assert_eq!(parts[2].len(), 16);
        assert_eq!(parts[3].len(), 86);
    }

    #[test]
    fn base64_pads_and_wraps() {
        assert_eq!(base64_mime(b""), "");
        assert_eq!(base64_mime(b"f"), "Zg==");
        assert_eq!(base64_mime(b"fo"), "Zm8=");
        assert_eq!(base64_mime(b"foo"), "Zm9v");
        assert_eq!(base64_mime(b"foobar"), "Zm9vYmFy");
        let long = base64_mime(&[0u8; 120]);
        let lines: Vec<&str> = long.split("\r\n").collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].len(), 76);
        assert_eq!(lines[2], "AAAAAAAA");
    }
}
