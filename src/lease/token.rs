//! Signed lease IDs: what lets any process holding the key (the next standalone process, the
//! next leader) recognise a lease it has no record of.
//!
//! A lease ID is `base64url(payload ‖ tag)`: the payload holds the lease's [`LeaseClaim`]
//! (proxy, first fencing token, holder, grant and first expiry, target domain, session key, and a
//! slot hint that spares a lookup), the tag is the first 16 bytes of a MAC over it. An ID whose
//! tag does not verify is treated as unknown. The secret is at least 32 random bytes; every
//! replica must share it (a Secret in cluster mode, a 0600 file in standalone mode).
//!
//! The payload's first byte names the MAC. Format 2 (what [`LeaseSigner::sign`] writes) is
//! BLAKE3 in keyed mode, under a key derived from the secret with BLAKE3's key derivation and
//! this purpose as its context; format 1, which processes before issue 25 wrote, is
//! HMAC-SHA256 under the secret itself, and is still verified, so leases granted before an
//! upgrade are recognised after it. Why format 2 is as strong: BLAKE3's keyed mode is a
//! pseudo-random function with a 256-bit key (its authors claim 128-bit security against every
//! attack, as for HMAC-SHA256's use here), so a tag cut to 16 bytes is forged with probability
//! 2^-128 per try; the derived key is independent of the HMAC key (one-way derivation with a
//! context no other use shares). Why change: signing an acquire's ID was the largest cost of
//! ours on the lease path, about 9,000 instructions with HMAC-SHA256 (three SHA-256
//! compressions for a typical claim) against about a fifth of that for BLAKE3.
//!
//! IDs are encoded and decoded with `base64_simd` (SIMD where the CPU has it): every acquire
//! encodes one and every release decodes its head, and the scalar `base64` crate took about
//! 1,400 instructions a pair for it.
//!
//! Renewals and releases of a lease this process issued skip the HMAC: the store keeps the
//! issued ID with the lease ([`IssuedId`], a cached verdict) and compares the presented ID with
//! it in constant time ([`LeaseSigner::presented`]); see [`IssuedId`] for why that is as strong
//! as verifying the HMAC again.

use std::{io::Write, path::Path};

use base64_simd::URL_SAFE_NO_PAD;
use ring::hmac;
use subtle::ConstantTimeEq;

use super::{LeaseClaim, LeaseHint, LeaseId, ProxyKey};

/// Shortest accepted signing key, in bytes.
pub const MIN_SECRET_LEN: usize = 32;
/// Longest lease ID accepted, in characters (longer ones are not even decoded).
pub const MAX_ID_LEN: usize = 2048;
const TAG_LEN: usize = 16;
/// The payload's first byte: which MAC its tag is.
const FORMAT_HMAC_SHA256: u8 = 1;
/// See [`FORMAT_HMAC_SHA256`]; what new IDs are.
const FORMAT_BLAKE3: u8 = 2;
/// The context of the format-2 key's derivation (never reused for anything else).
const BLAKE3_CONTEXT: &str = "egress-proxies-operator 2026-12-04 lease ID tag";
const NONE: u16 = u16::MAX;

/// Why a key could not be set up or an ID not verified.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The key is too short to be safe.
    #[error("lease signing key must be at least {MIN_SECRET_LEN} bytes")]
    SecretTooShort,
    /// Not a lease ID (wrong length, encoding or layout).
    #[error("malformed lease ID")]
    Malformed,
    /// The tag does not match: not issued with this key, or altered.
    #[error("lease ID signature does not verify")]
    BadSignature,
    /// The key file could not be read or written.
    #[error("lease signing key file {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        cause: std::io::Error,
    },
}

/// Bytes of an ID's fixed-size head: format, hint (shard, slot, generation), first token.
const HEAD_LEN: usize = 1 + 2 + 4 + 4 + 8;
/// What is decoded of a presented ID to read its head: whole base64 groups (4 characters, 3
/// bytes), at least the head, and at least the 38 characters `base64_simd` decodes with SIMD
/// (shorter runs take its scalar path, at about 8 instructions a character). Every ID is longer:
/// the shortest payload (one-character names, no domain or session) and its tag are 84.
const HEAD_CHARS: usize = 40;
const HEAD_GROUPS_LEN: usize = HEAD_CHARS / 4 * 3;
const _: () = assert!(HEAD_GROUPS_LEN >= HEAD_LEN && HEAD_CHARS.is_multiple_of(4));

/// The verdict this process caches with a lease it issued: the lease ID exactly as it was
/// handed out.
///
/// Why comparing it is as strong as verifying the HMAC again: the fast path accepts a presented
/// ID only if it is byte for byte the ID this process signed for the lease its head names, and
/// that ID verifies under the HMAC key (this process signed it). So the fast path accepts no ID
/// the full verification refuses. Every ID it does not accept (a forged or altered one, an
/// unknown lease, a lease restored from a checkpoint, which keeps no IDs, or one named by a
/// different ID) goes through the full verification as before. The comparison takes the same
/// time wherever the first difference is ([`IssuedId::matches`]), so probing with guesses
/// learns nothing about the kept ID from timing. The lease's operations still present its latest
/// fencing token: the ID says which lease, never that the caller may act on it now.
///
/// Why the whole ID and not a digest of it: keeping it costs one copy at acquire, and comparing
/// it ~130 bytes; a keyed 128-bit digest cost two SipHash passes on each side (3,400 instructions
/// a pair, measured), and the argument for it needed a pseudo-random function besides the HMAC.
pub struct IssuedId(Box<[u8]>);

impl IssuedId {
    /// Keeps `id`, just issued (or just verified in full) for a lease.
    pub fn new(id: &str) -> Self {
        Self(id.as_bytes().into())
    }

    /// Whether `presented` is this ID, in time that depends on the lengths only: the bytes are
    /// compared eight at a time, every word's difference ORed into one accumulator without a
    /// branch on the data, and only the total is tested (through `subtle`, which keeps the
    /// compiler from turning the test back into early exits). The length of a lease ID is not
    /// secret: it follows from the claim's field lengths.
    #[inline]
    pub fn matches(&self, presented: &[u8]) -> bool {
        let kept = &self.0;
        if kept.len() != presented.len() {
            return false;
        }
        let mut diff = 0u64;
        let (kept_words, kept_tail) = kept.as_chunks::<8>();
        let (presented_words, presented_tail) = presented.as_chunks::<8>();
        for (a, b) in kept_words.iter().zip(presented_words) {
            diff |= u64::from_ne_bytes(*a) ^ u64::from_ne_bytes(*b);
        }
        for (a, b) in kept_tail.iter().zip(presented_tail) {
            diff |= u64::from(a ^ b);
        }
        diff.ct_eq(&0).into()
    }
}

impl IssuedId {
    /// The ID's last `n` characters, to tell a lease apart on the status page: they are tag
    /// bytes (a lease ID ends with its MAC tag), different for every lease, and too few to
    /// present (the whole ID is needed) or to forge the rest of the tag from.
    pub fn tail(&self, n: usize) -> String {
        // The ID is base64url, i.e. ASCII: any byte offset is a character boundary.
        String::from_utf8_lossy(&self.0[self.0.len().saturating_sub(n)..]).into_owned()
    }
}

impl std::fmt::Debug for IssuedId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IssuedId(<redacted>)")
    }
}

/// A lease ID as a renewal or release presents it, before any verification: the lease its head
/// names, and the ID itself, to be compared with the one the store keeps ([`IssuedId`]).
#[derive(Clone, Copy, Debug)]
pub struct PresentedId<'a> {
    pub(crate) hint: LeaseHint,
    pub(crate) first_token: u64,
    pub(crate) text: &'a str,
}

/// Signs lease IDs (format 2) and verifies them (formats 1 and 2) with keys from one secret.
/// `Debug` shows no key material.
#[derive(Clone)]
pub struct LeaseSigner {
    hmac: hmac::Key,
    blake3: [u8; 32],
}

impl std::fmt::Debug for LeaseSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseSigner(<key redacted>)")
    }
}

impl LeaseSigner {
    /// A signer with `secret` as key.
    pub fn new(secret: &[u8]) -> Result<Self, TokenError> {
        if secret.len() < MIN_SECRET_LEN {
            return Err(TokenError::SecretTooShort);
        }
        Ok(Self {
            hmac: hmac::Key::new(hmac::HMAC_SHA256, secret),
            blake3: blake3::derive_key(BLAKE3_CONTEXT, secret),
        })
    }

    /// The lease an ID's head names, without verifying anything (so without the HMAC): `None`
    /// if it is not even shaped like a lease ID. The store accepts it only if it is the ID the
    /// store kept for that lease ([`IssuedId`]); otherwise call [`Self::verify`].
    pub fn presented<'a>(&self, id: &'a str) -> Option<PresentedId<'a>> {
        if id.len() > MAX_ID_LEN || id.len() < HEAD_CHARS {
            return None;
        }
        let mut head = [0u8; HEAD_GROUPS_LEN];
        let decoded = URL_SAFE_NO_PAD
            .decode(
                &id.as_bytes()[..HEAD_CHARS],
                base64_simd::Out::from_slice(&mut head),
            )
            .ok()?;
        if decoded.len() != HEAD_GROUPS_LEN {
            return None;
        }
        let (hint, first_token) = read_head(&mut Reader(&head))?;
        Some(PresentedId {
            hint,
            first_token,
            text: id,
        })
    }

    /// 32 fresh random bytes for a new key.
    pub fn generate_secret() -> Vec<u8> {
        let mut secret = vec![0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
            .expect("the system random source is available on every supported platform");
        secret
    }

    /// Reads the key (base64 text) from `path`, or creates the file (mode 0600) with a new one.
    pub fn load_or_create(path: &Path) -> Result<Self, TokenError> {
        let io = |cause| TokenError::Io {
            path: path.display().to_string(),
            cause,
        };
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let secret = base64_simd::STANDARD
                    .decode_to_vec(text.trim())
                    .map_err(|_| TokenError::Malformed)?;
                Self::new(&secret)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let secret = Self::generate_secret();
                let mut options = std::fs::OpenOptions::new();
                options.write(true).create_new(true);
                #[cfg(unix)]
                std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
                let mut file = options.open(path).map_err(io)?;
                writeln!(file, "{}", base64_simd::STANDARD.encode_to_string(&secret)).map_err(io)?;
                file.sync_all().map_err(io)?;
                Self::new(&secret)
            }
            Err(e) => Err(io(e)),
        }
    }

    /// The signed ID of a lease.
    pub fn sign(&self, claim: &LeaseClaim) -> String {
        let key = Some(claim.id.key.as_str());
        let holder = Some(claim.holder.as_str());
        let (domain, session) = (claim.target_domain.as_deref(), claim.session_key.as_deref());
        let strings = [key, holder, domain, session];
        let len = FIXED_LEN + strings.map(put_len).iter().sum::<usize>() + TAG_LEN;
        // On the stack unless the names are long (an allocation less a lease): the payload is
        // only hashed and encoded.
        let mut stack = [0u8; 256];
        let mut heap = Vec::new();
        let buf: &mut [u8] = if len <= stack.len() {
            &mut stack[..len]
        } else {
            heap.resize(len, 0);
            &mut heap
        };
        let mut w = Writer { buf, at: 0 };
        w.put(&[FORMAT_BLAKE3]);
        w.put(&claim.id.hint.shard.to_be_bytes());
        w.put(&claim.id.hint.slot.to_be_bytes());
        w.put(&claim.id.hint.generation.to_be_bytes());
        w.put(&claim.id.first_token.to_be_bytes());
        w.put(&claim.acquired_at_ms.to_be_bytes());
        w.put(&claim.expires_at_ms.to_be_bytes());
        for s in strings {
            w.put_str(s);
        }
        debug_assert_eq!(w.at, len - TAG_LEN, "the payload's length is worked out above");
        let tag = self.tag(&w.buf[..len - TAG_LEN]);
        w.put(&tag);
        URL_SAFE_NO_PAD.encode_to_string(&*w.buf)
    }

    /// The tag of `payload` under the MAC its first byte names.
    fn tag(&self, payload: &[u8]) -> [u8; TAG_LEN] {
        let mut tag = [0u8; TAG_LEN];
        match payload.first() {
            Some(&FORMAT_HMAC_SHA256) => {
                tag.copy_from_slice(&hmac::sign(&self.hmac, payload).as_ref()[..TAG_LEN]);
            }
            _ => tag.copy_from_slice(&blake3::keyed_hash(&self.blake3, payload).as_bytes()[..TAG_LEN]),
        }
        tag
    }

    /// The claim of a lease ID this key signed.
    pub fn verify(&self, id: &str) -> Result<LeaseClaim, TokenError> {
        if id.len() > MAX_ID_LEN {
            return Err(TokenError::Malformed);
        }
        let raw = URL_SAFE_NO_PAD
            .decode_to_vec(id)
            .map_err(|_| TokenError::Malformed)?;
        if raw.len() < TAG_LEN + 1 {
            return Err(TokenError::Malformed);
        }
        let (payload, tag) = raw.split_at(raw.len() - TAG_LEN);
        // An unknown format fails in `decode_claim` after this, as a forged tag would.
        let expected = self.tag(payload);
        // Constant-time comparison of the truncated tag.
        if !bool::from(expected.ct_eq(tag)) {
            return Err(TokenError::BadSignature);
        }
        decode_claim(payload).ok_or(TokenError::Malformed)
    }
}

/// Bytes of a payload before its strings: format, hint, first token, grant and expiry.
const FIXED_LEN: usize = HEAD_LEN + 8 + 8;

/// `s` as a payload holds it: cut at a char boundary below [`NONE`] bytes (the API bounds
/// every field well below).
fn cut(s: &str) -> &str {
    let mut end = s.len().min(NONE as usize - 1);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The bytes [`Writer::put_str`] writes for `s`.
fn put_len(s: Option<&str>) -> usize {
    2 + s.map_or(0, |s| cut(s).len())
}

/// Writes a payload into a buffer of its exact length.
struct Writer<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        self.buf[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        self.at += bytes.len();
    }

    /// A string as its length (two bytes) and bytes, or [`NONE`] for none.
    fn put_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => {
                let s = cut(s);
                self.put(&(s.len() as u16).to_be_bytes());
                self.put(s.as_bytes());
            }
            None => self.put(&NONE.to_be_bytes()),
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<Option<String>> {
        let len = self.u16()?;
        if len == NONE {
            return Some(None);
        }
        let bytes = self.take(len as usize)?;
        Some(Some(std::str::from_utf8(bytes).ok()?.to_owned()))
    }
}

/// The head every lease ID starts with: the format, where the lease sits, its first token.
fn read_head(r: &mut Reader<'_>) -> Option<(LeaseHint, u64)> {
    if !matches!(r.take(1)?, [FORMAT_HMAC_SHA256 | FORMAT_BLAKE3]) {
        return None;
    }
    let hint = LeaseHint {
        shard: r.u16()?,
        slot: r.u32()?,
        generation: r.u32()?,
    };
    Some((hint, r.u64()?))
}

fn decode_claim(payload: &[u8]) -> Option<LeaseClaim> {
    let mut r = Reader(payload);
    let (hint, first_token) = read_head(&mut r)?;
    let acquired_at_ms = r.u64()?;
    let expires_at_ms = r.u64()?;
    let key: ProxyKey = r.str()??.parse().ok()?;
    let holder = r.str()??;
    let target_domain = r.str()?;
    let session_key = r.str()?;
    if !r.0.is_empty() {
        return None;
    }
    Some(LeaseClaim {
        id: LeaseId {
            key,
            first_token,
            hint,
        },
        holder,
        acquired_at_ms,
        expires_at_ms,
        target_domain,
        session_key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(holder: &str, domain: Option<&str>, session: Option<&str>) -> LeaseClaim {
        LeaseClaim {
            id: LeaseId {
                key: ProxyKey::new("ns", "proxy"),
                first_token: 0x0102_0304_0506_0708,
                hint: LeaseHint {
                    shard: 7,
                    slot: 70_000,
                    generation: 3,
                },
            },
            holder: holder.to_owned(),
            acquired_at_ms: 1_700_000_000_000,
            expires_at_ms: 1_700_000_060_000,
            target_domain: domain.map(Into::into),
            session_key: session.map(Into::into),
        }
    }

    /// Lease IDs outlive the process that signed them (a restart or a new leader reinstates
    /// leases from them), so the layout is pinned by a known answer rather than by a second
    /// encoder that would change with the first.
    #[test]
    fn a_lease_id_is_signed_as_it_always_was() {
        let signer = LeaseSigner::new(&[5u8; 32]).unwrap();
        let id = signer.sign(&claim("crawler-ü", Some("shop.example"), Some("s")));
        // 0x02 (BLAKE3), shard 7, slot 70,000, generation 3, first token, granted, expires,
        // then each string as a u16 length and its bytes, then the 16-byte tag.
        assert_eq!(
            id,
            "AgAHAAERcAAAAAMBAgMEBQYHCAAAAYvP5WgAAAABi8_mUmAACG5zL3Byb3h5AApjcmF3bGVyLcO8AAxzaG9wLmV4YW1wbGUAAXOqx-Gt7CZXMIczLM3u79QU"
        );
        assert_eq!(
            signer.verify(&id).unwrap(),
            claim("crawler-ü", Some("shop.example"), Some("s"))
        );
    }

    /// Short claims (signed on the stack), long ones (on the heap) and one cut inside a
    /// character: the tag covers the payload, and the decoder reads back the claim, its
    /// strings cut at a character boundary where they must be.
    #[test]
    fn claims_of_every_length_read_back_as_signed() {
        let signer = LeaseSigner::new(&[5u8; 32]).unwrap();
        let long = "h".repeat(300);
        // Over the 65,534 bytes a string keeps, cut inside a two-byte character.
        let over = format!("{}é", "h".repeat(65_533));
        let cut_back = "h".repeat(65_533);
        for (holder, domain, session, read_back) in [
            ("h", None, None, "h"),
            ("crawler-ü", Some("shop.example"), Some("s"), "crawler-ü"),
            (&long[..150], Some("d.example"), None, &long[..150]),
            (&long, None, Some("session"), &long),
            (&over, None, None, &cut_back),
        ] {
            let id = signer.sign(&claim(holder, domain, session));
            let raw = URL_SAFE_NO_PAD.decode_to_vec(&id).unwrap();
            let (payload, tag) = raw.split_at(raw.len() - TAG_LEN);
            assert_eq!(tag, signer.tag(payload), "{}", holder.len());
            assert_eq!(
                decode_claim(payload),
                Some(claim(read_back, domain, session)),
                "{}",
                holder.len()
            );
            if id.len() <= MAX_ID_LEN {
                assert_eq!(signer.verify(&id).unwrap(), claim(holder, domain, session));
            }
        }
    }
}
