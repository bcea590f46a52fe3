//! The store's clock: wall-clock milliseconds since the Unix epoch, or a manual clock for tests.
//!
//! Lease expiries and cooldowns are wall-clock times because they are persisted and must mean
//! the same thing to the next process (or the next leader).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// Where the store reads the time from.
#[derive(Clone, Debug, Default)]
pub enum Clock {
    /// The system's wall clock.
    #[default]
    System,
    /// A clock that moves only when told to (tests, scenario replays).
    Manual(Arc<AtomicU64>),
}

impl Clock {
    /// A manual clock starting at `start_ms` milliseconds since the epoch.
    pub fn manual(start_ms: u64) -> Self {
        Self::Manual(Arc::new(AtomicU64::new(start_ms)))
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> u64 {
        match self {
            Clock::System => coarse_now_ms(),
            Clock::Manual(ms) => ms.load(Ordering::Relaxed),
        }
    }

    /// Moves a manual clock forward; no effect on the system clock.
    pub fn advance(&self, by: Duration) {
        if let Clock::Manual(ms) = self {
            ms.fetch_add(by.as_millis() as u64, Ordering::Relaxed);
        }
    }
}

/// The coarse wall clock (a few ms resolution, read without a system call on Linux): lease
/// times are seconds long, and the full-resolution clock costs more than a whole acquire.
#[cfg(target_os = "linux")]
fn coarse_now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is given; the clock id is valid on Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
        ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
    } else {
        precise_now_ms()
    }
}

#[cfg(not(target_os = "linux"))]
fn coarse_now_ms() -> u64 {
    precise_now_ms()
}

fn precise_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// From here (the year 8307) on, [`rfc3339`] asks jiff, whose range ends late in the year 9999 at
/// a bound of its own: no lease time gets there, but the answer stays jiff's.
const FAST_RFC3339_LIMIT_MS: u64 = 200_000_000_000_000;

/// Milliseconds since the epoch as an RFC 3339 timestamp in UTC, exactly as jiff's
/// `Timestamp` displays it (`2026-12-04T05:06:07Z`, fractional seconds only when not zero,
/// without trailing zeros), or empty past jiff's range (late in the year 9999). Written by hand: every
/// acquire shows two and every renewal one, and jiff's general formatter cost 1,600 instructions a
/// pair (the test compares the two).
pub fn rfc3339(ms: u64) -> String {
    let mut out = Vec::with_capacity(24);
    write_rfc3339(ms, &mut out);
    // Only ASCII digits and separators (or jiff's text) were written: the check always passes.
    String::from_utf8(out).unwrap_or_default()
}

/// "00" to "99", each two bytes.
const DIGIT_PAIRS: &[u8; 200] = b"\
    0001020304050607080910111213141516171819\
    2021222324252627282930313233343536373839\
    4041424344454647484950515253545556575859\
    6061626364656667686970717273747576777879\
    8081828384858687888990919293949596979899";

/// [`rfc3339`] written onto `out` (no string of its own: answers write their times this way).
fn write_rfc3339(ms: u64, out: &mut Vec<u8>) {
    if ms >= FAST_RFC3339_LIMIT_MS {
        // As before: beyond i64 wraps, as the old `as` cast did.
        if let Ok(t) = jiff::Timestamp::from_millisecond(ms as i64) {
            out.extend_from_slice(t.to_string().as_bytes());
        }
        return;
    }
    let (secs, milli) = (ms / 1000, (ms % 1000) as u32);
    let mut text = [0u8; 24];
    text[..19].copy_from_slice(&seconds_text(secs));
    // Two digits at a time from a table: half the divisions of one digit at a time.
    let i = (milli % 100) as usize * 2;
    text[21..23].copy_from_slice(&DIGIT_PAIRS[i..i + 2]);
    text[20] = b'0' + (milli / 100) as u8;
    text[19] = b'.';
    let end = match milli {
        0 => 19,
        m if m % 100 == 0 => 21,
        m if m % 10 == 0 => 22,
        _ => 23,
    };
    text[end] = b'Z';
    out.extend_from_slice(&text[..=end]);
}

/// `YYYY-MM-DDTHH:MM:SS` of `secs` seconds since the epoch.
fn format_seconds(secs: u64) -> [u8; 19] {
    let (days, of_day) = (secs / 86_400, (secs % 86_400) as u32);
    let (year, month, day) = civil_from_days(days);
    let mut text = *b"0000-00-00T00:00:00";
    let mut put2 = |at: usize, value: u32| {
        let i = (value % 100) as usize * 2;
        text[at..at + 2].copy_from_slice(&DIGIT_PAIRS[i..i + 2]);
    };
    put2(0, year / 100);
    put2(2, year);
    put2(5, month);
    put2(8, day);
    put2(11, of_day / 3600);
    put2(14, of_day / 60 % 60);
    put2(17, of_day % 60);
    text
}

/// The last two seconds a thread wrote ([`seconds_text`]), and which of them to replace next.
struct Seconds {
    keys: [u64; 2],
    texts: [[u8; 19]; 2],
    next: usize,
}

thread_local! {
    /// An acquire answer shows its grant and its expiry (two seconds, the same for every
    /// acquire of the same second with the same TTL), and formatting one from scratch cost
    /// about 150 instructions. Per thread, so without any synchronisation; each text is a
    /// pure function of its key (`u64::MAX`: none yet; no time written here is that late).
    static SECONDS: std::cell::RefCell<Seconds> = const {
        std::cell::RefCell::new(Seconds {
            keys: [u64::MAX; 2],
            texts: [[0; 19]; 2],
            next: 0,
        })
    };
}

/// [`format_seconds`], from this thread's last two when it is one of them.
fn seconds_text(secs: u64) -> [u8; 19] {
    SECONDS.with(|cell| {
        let mut kept = cell.borrow_mut();
        if let Some(i) = kept.keys.iter().position(|&at| at == secs) {
            return kept.texts[i];
        }
        let text = format_seconds(secs);
        let next = kept.next;
        kept.keys[next] = secs;
        kept.texts[next] = text;
        kept.next = 1 - next;
        text
    })
}

/// A time (milliseconds since the epoch) that an answer shows as RFC 3339 text
/// ([`rfc3339`]), written straight into the answer rather than through a string of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rfc3339(pub u64);

impl Rfc3339 {
    /// The text onto `out`.
    pub fn write(self, out: &mut Vec<u8>) {
        write_rfc3339(self.0, out);
    }
}

impl serde::Serialize for Rfc3339 {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&rfc3339(self.0))
    }
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar (Howard
/// Hinnant's `civil_from_days`, for days on or after the epoch).
fn civil_from_days(days: u64) -> (u32, u32, u32) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = (yoe + era * 400) as u32 + u32::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jiff(ms: u64) -> String {
        jiff::Timestamp::from_millisecond(ms as i64)
            .map(|t| t.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn rfc3339_writes_what_jiff_displays() {
        let mut cases = vec![
            0,
            1,
            10,
            100,
            999,
            1000,
            1500,
            1_250,
            86_399_999,
            86_400_000,
            951_782_400_000,   // 2000-02-29
            951_868_800_000,   // 2000-03-01
            4_107_542_400_000, // 2100-03-01
            1_796_000_000_000,
            FAST_RFC3339_LIMIT_MS - 1,
            FAST_RFC3339_LIMIT_MS,
            253_402_207_200_999,
            253_402_300_799_999,
            u64::MAX,
        ];
        let mut rng = fastrand::Rng::with_seed(25);
        cases.extend((0..100_000).map(|_| rng.u64(..FAST_RFC3339_LIMIT_MS)));
        cases.extend((0..10_000).map(|_| rng.u64(1_700_000_000_000..1_900_000_000_000)));
        for ms in cases {
            assert_eq!(rfc3339(ms), jiff(ms), "{ms} ms");
        }
        // Times alternating between a few seconds, as a thread's answers show them, read
        // back from the seconds kept and not.
        for round in 0..4u64 {
            for ms in [
                1_796_000_000_250,
                1_796_000_060_250,
                1_796_000_000_999,
                1_796_000_120_000,
            ] {
                let ms = ms + round * 1000;
                assert_eq!(rfc3339(ms), jiff(ms), "{ms} ms");
            }
        }
        // What answers write, after whatever came before it.
        let mut out = b"{".to_vec();
        Rfc3339(1_250).write(&mut out);
        assert_eq!(out, b"{1970-01-01T00:00:01.25Z");
        assert_eq!(
            serde_json::to_string(&Rfc3339(1_000)).unwrap(),
            r#""1970-01-01T00:00:01Z""#
        );
    }
}
