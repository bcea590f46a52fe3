//! The page's query string: which page of proxies, filtered how, reloaded how often.

use super::ProxyState;
use crate::api::Attributes;

/// What a request asks of the page: `?page=`, `?limit=`, `?phase=`, `?q=`, `?refresh=`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageQuery {
    /// The page of proxies, from 1.
    pub page: usize,
    /// Proxies per page.
    pub limit: usize,
    /// Only proxies in this phase (`deleting` for those being deleted).
    pub phase: Option<String>,
    /// Only proxies whose `namespace/name`, provider, endpoint or an attribute `key=value`
    /// contains this text (case-insensitive).
    pub q: Option<String>,
    /// Seconds between reloads; 0: none.
    pub refresh: u32,
}

impl PageQuery {
    /// Proxies per page unless `limit` says otherwise.
    pub const DEFAULT_LIMIT: usize = 50;
    /// The most proxies one page shows.
    pub const MAX_LIMIT: usize = 500;
    /// Seconds between reloads unless `refresh` says otherwise.
    pub const DEFAULT_REFRESH: u32 = 10;
    /// The shortest reload interval accepted (each reload renders a page).
    pub const MIN_REFRESH: u32 = 2;

    /// The query of a request's query string.
    pub fn parse(query: Option<&str>) -> Result<Self, QueryError> {
        let mut out = Self::default();
        for (key, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            let number = |max: u64| {
                value.parse::<u64>().ok().filter(|n| *n <= max).ok_or_else(|| {
                    QueryError(format!("{key} must be a whole number up to {max}, not {value:?}"))
                })
            };
            match &*key {
                "page" => {
                    out.page = usize::try_from(number(1_000_000)?).unwrap_or(1).max(1);
                }
                "limit" => {
                    let limit = number(Self::MAX_LIMIT as u64)?;
                    if limit == 0 {
                        return Err(QueryError(format!("limit must be 1-{}", Self::MAX_LIMIT)));
                    }
                    out.limit = usize::try_from(limit).unwrap_or(Self::DEFAULT_LIMIT);
                }
                "phase" => out.phase = Some(value.into_owned()).filter(|p| !p.is_empty()),
                "q" => out.q = Some(value.trim().to_owned()).filter(|q| !q.is_empty()),
                "refresh" => {
                    let secs = u32::try_from(number(3600)?).unwrap_or(Self::DEFAULT_REFRESH);
                    if secs != 0 && secs < Self::MIN_REFRESH {
                        return Err(QueryError(format!(
                            "refresh must be 0 (off) or {}-3600 seconds",
                            Self::MIN_REFRESH
                        )));
                    }
                    out.refresh = secs;
                }
                other => {
                    return Err(QueryError(format!(
                        "unknown query parameter {other:?}: the page knows page, limit, phase, q and refresh"
                    )));
                }
            }
        }
        Ok(out)
    }

    /// This query's string with `page` changed (what a pagination link points at): only the
    /// parameters that differ from the defaults.
    pub fn with_page(&self, page: usize) -> String {
        let mut out = form_urlencoded::Serializer::new(String::new());
        if page != 1 {
            out.append_pair("page", &page.to_string());
        }
        if self.limit != Self::DEFAULT_LIMIT {
            out.append_pair("limit", &self.limit.to_string());
        }
        if let Some(phase) = &self.phase {
            out.append_pair("phase", phase);
        }
        if let Some(q) = &self.q {
            out.append_pair("q", q);
        }
        if self.refresh != Self::DEFAULT_REFRESH {
            out.append_pair("refresh", &self.refresh.to_string());
        }
        let query = out.finish();
        if query.is_empty() {
            "?".to_owned()
        } else {
            format!("?{query}")
        }
    }

    pub(super) fn admits(&self, state: &ProxyState, attributes: Option<&Attributes>) -> bool {
        if let Some(phase) = &self.phase {
            let shown = if state.deleting {
                "deleting"
            } else {
                state.phase.as_str()
            };
            if shown != phase {
                return false;
            }
        }
        let Some(q) = &self.q else { return true };
        let q = q.to_lowercase();
        let has = |text: &str| text.to_lowercase().contains(&q);
        has(&format!("{}/{}", state.namespace, state.name))
            || has(&state.provider)
            || state.endpoint.as_deref().is_some_and(has)
            || attributes.is_some_and(|attributes| attributes.iter().any(|(k, v)| has(&format!("{k}={v}"))))
    }
}

impl Default for PageQuery {
    fn default() -> Self {
        Self {
            page: 1,
            limit: Self::DEFAULT_LIMIT,
            phase: None,
            q: None,
            refresh: Self::DEFAULT_REFRESH,
        }
    }
}

/// A query string the page does not understand (answered 400, saying what to fix).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct QueryError(String);
