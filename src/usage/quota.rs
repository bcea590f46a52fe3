//! Quotas per token: the `--quotas FILE` (YAML or JSON), checked once at start, and the fixed
//! windows they are counted in. A window is aligned to its period from the Unix epoch (an
//! hour's from the full hour, a day's from 00:00 UTC), so everyone agrees when it resets.

use std::{collections::HashMap, path::Path};

use serde::Deserialize;

use super::{QuotaExceeded, QuotaState};
use crate::{config::FileError, lease::rfc3339};

/// Most quota entries a file may hold.
pub const MAX_QUOTAS: usize = 1_000;
/// Longest period: a year.
const MAX_PERIOD_MS: u64 = 366 * 86_400_000;
/// The file as its errors name it.
const WHAT: &str = "quotas";

/// Why the quotas file was refused.
pub type QuotaError = FileError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotasFile {
    #[serde(default)]
    quotas: Vec<QuotaSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaSpec {
    token: String,
    #[serde(default)]
    requests: Option<u64>,
    #[serde(default)]
    bytes: Option<u64>,
    period: String,
}

/// One quota: a token may use at most `requests` requests and/or `bytes` bytes per period.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quota {
    /// The token's name (its identity name).
    pub token: String,
    /// Requests per window.
    pub requests: Option<u64>,
    /// Bytes per window.
    pub bytes: Option<u64>,
    /// The period as written (`1h`).
    pub period: String,
    /// The period in milliseconds.
    pub period_ms: u64,
}

/// Every quota of the file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Quotas(pub Vec<Quota>);

impl Quotas {
    /// Reads and validates a quotas file.
    pub fn load(path: &Path) -> Result<Self, QuotaError> {
        crate::config::load_file(WHAT, path, Self::parse)
    }

    /// Validates quotas given as YAML (or JSON) text; `path` names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<Self, QuotaError> {
        let file: QuotasFile = crate::config::from_yaml_file(WHAT, text, path)?;
        if file.quotas.len() > MAX_QUOTAS {
            return Err(FileError::too_many(
                WHAT,
                path,
                "quotas",
                file.quotas.len(),
                MAX_QUOTAS,
            ));
        }
        let mut quotas = Vec::with_capacity(file.quotas.len());
        for (index, spec) in file.quotas.into_iter().enumerate() {
            let invalid = |field: &str, message: String| FileError::Invalid {
                what: WHAT,
                path: path.to_owned(),
                entry: format!("quota for token {:?} (quotas[{index}]), ", spec.token),
                field: field.to_owned(),
                message,
            };
            if spec.token.is_empty() || spec.token.len() > 253 {
                return Err(invalid("token", "a token's name, 1-253 characters".to_owned()));
            }
            let period_ms = parse_period(&spec.period).map_err(|m| invalid("period", m))?;
            if spec.requests.is_none() && spec.bytes.is_none() {
                return Err(invalid(
                    "requests",
                    "give requests, bytes or both: a quota without a limit limits nothing".to_owned(),
                ));
            }
            if spec.requests == Some(0) {
                return Err(invalid("requests", "at least 1".to_owned()));
            }
            if spec.bytes == Some(0) {
                return Err(invalid("bytes", "at least 1".to_owned()));
            }
            quotas.push(Quota {
                token: spec.token,
                requests: spec.requests,
                bytes: spec.bytes,
                period: spec.period,
                period_ms,
            });
        }
        Ok(Self(quotas))
    }
}

/// `30s`, `15m`, `1h`, `7d`: 1 s to 366 days.
fn parse_period(text: &str) -> Result<u64, String> {
    let bad = || format!("{text:?} is no period: a number and s, m, h or d (30s, 15m, 1h, 7d), 1s to 366d");
    let unit = match text.chars().last() {
        Some('s') => 1_000,
        Some('m') => 60_000,
        Some('h') => 3_600_000,
        Some('d') => 86_400_000,
        _ => return Err(bad()),
    };
    let digits = &text[..text.len() - 1];
    if digits.is_empty() || digits.len() > 9 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let ms = n * unit;
    if ms == 0 || ms > MAX_PERIOD_MS {
        return Err(bad());
    }
    Ok(ms)
}

/// One quota's current window.
#[derive(Clone, Debug)]
struct Window {
    quota: Quota,
    start_ms: u64,
    requests: u64,
    bytes: u64,
}

impl Window {
    /// Moves to the window `now_ms` is in (a new one starts at zero).
    fn roll(&mut self, now_ms: u64) {
        let start = now_ms - now_ms % self.quota.period_ms;
        if start != self.start_ms {
            self.start_ms = start;
            self.requests = 0;
            self.bytes = 0;
        }
    }

    fn end_ms(&self) -> u64 {
        self.start_ms + self.quota.period_ms
    }
}

/// The windows of every quota, by token (bounded by the file: no eviction).
#[derive(Debug, Default)]
pub(super) struct Windows(HashMap<String, Vec<Window>>);

impl Windows {
    pub(super) fn new(quotas: Quotas) -> Self {
        let mut by_token: HashMap<String, Vec<Window>> = HashMap::new();
        for quota in quotas.0 {
            by_token.entry(quota.token.clone()).or_default().push(Window {
                quota,
                start_ms: 0,
                requests: 0,
                bytes: 0,
            });
        }
        Self(by_token)
    }

    /// Refuses new work for `token` if any of its quotas is used up in its current window
    /// (the one that resets last decides when to come back, so a retry then is admitted).
    pub(super) fn check(&mut self, token: &str, now_ms: u64) -> Result<(), QuotaExceeded> {
        let Some(windows) = self.0.get_mut(token) else {
            return Ok(());
        };
        let mut worst: Option<QuotaExceeded> = None;
        for w in windows.iter_mut() {
            w.roll(now_ms);
            let over = [
                ("requests", w.quota.requests, w.requests),
                ("bytes", w.quota.bytes, w.bytes),
            ]
            .into_iter()
            .find_map(|(what, limit, used)| limit.filter(|l| used >= *l).map(|l| (what, l, used)));
            if let Some((what, limit, used)) = over {
                let retry_after_ms = w.end_ms() - now_ms;
                if worst.as_ref().is_none_or(|e| e.retry_after_ms < retry_after_ms) {
                    worst = Some(QuotaExceeded {
                        token: token.to_owned(),
                        used,
                        limit,
                        what,
                        period: w.quota.period.clone(),
                        resets_at: rfc3339(w.end_ms()),
                        retry_after_ms,
                    });
                }
            }
        }
        worst.map_or(Ok(()), Err)
    }

    /// Counts `requests` and `bytes` in `token`'s windows.
    pub(super) fn add(&mut self, token: &str, requests: u64, bytes: u64, now_ms: u64) {
        for w in self.0.get_mut(token).into_iter().flatten() {
            w.roll(now_ms);
            w.requests = w.requests.saturating_add(requests);
            w.bytes = w.bytes.saturating_add(bytes);
        }
    }

    /// `token`'s quotas as they stand at `now_ms`.
    pub(super) fn states(&self, token: &str, now_ms: u64) -> Vec<QuotaState> {
        (self.0.get(token).into_iter().flatten())
            .map(|w| {
                let mut w = w.clone();
                w.roll(now_ms);
                QuotaState {
                    requests_used: w.requests,
                    bytes_used: w.bytes,
                    resets_at_ms: w.end_ms(),
                    quota: w.quota,
                }
            })
            .collect()
    }

    /// The tokens that have quotas.
    pub(super) fn tokens(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }
}
