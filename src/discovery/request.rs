//! What every lease API request goes through: authentication (a connection's last verdict
//! recalled), readiness, the lease journal's health, and its JSON body read and checked.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{StatusCode, body::Body};

use super::{
    AuthError, Identity, RememberedVerdict, StateInner, fast_body::Scan, router::ApiError, wire::RequestBody,
};
use crate::{
    discovery::auth::{Presented, presented},
    lease::{DurableError, DurableLeases, journal::JournalError},
};

pub(super) fn check_ready(s: &StateInner) -> Result<(), ApiError> {
    let r = *s.deps.readiness.borrow();
    if !r.leader {
        let why = "this replica is not the leader; retry (the Service routes to the leader once it is ready)";
        return Err(ApiError::unavailable("not_leader", why));
    }
    if !r.caches_synced {
        return Err(ApiError::unavailable("not_ready", "caches are not synced yet"));
    }
    Ok(())
}

/// The lease operations of this API: durable first when a journal is set.
pub(super) fn leases(s: &StateInner) -> DurableLeases<'_> {
    DurableLeases::new(&s.deps.store, &s.deps.signer, s.journal.get())
}

/// Refuses lease operations while the journal cannot make them durable.
pub(super) fn check_journal(s: &StateInner) -> Result<(), ApiError> {
    match leases(s).failing() {
        Some(error) => Err(journal_unavailable(&error)),
        None => Ok(()),
    }
}

pub(super) fn journal_unavailable(error: &JournalError) -> ApiError {
    ApiError::unavailable(
        "journal_unavailable",
        format!("the lease operation could not be made durable: {error}"),
    )
}

impl From<DurableError> for ApiError {
    fn from(error: DurableError) -> Self {
        match error {
            DurableError::Lease(refused) => refused.into(),
            DurableError::Journal(error) => journal_unavailable(&error),
        }
    }
}

/// Who sent the request, from its bearer token; a connection's last success is recalled from
/// `remembered` rather than looked up again.
pub(super) async fn authenticate(
    s: &StateInner,
    parts: &hyper::http::request::Parts,
    remembered: &RememberedVerdict,
) -> Result<Arc<Identity>, ApiError> {
    if let Some(anonymous) = &s.anonymous {
        return Ok(anonymous.clone());
    }
    // A look along the request's few headers (an API client sends about four to eight; hyper
    // accepts at most 100): `HeaderMap::get` hashes the name first and cost about 130
    // instructions a request. The first value of the first entry of that name, as `get` gives.
    let header = (parts.headers.iter())
        .find_map(|(name, value)| (name == hyper::header::AUTHORIZATION).then_some(value));
    let look_up = async { look_up(s, parts).await.map(Arc::new) };
    remembered.recall_or(&*s.deps.auth, header, look_up).await
}

/// Who the request's bearer token names, looked up.
async fn look_up(s: &StateInner, parts: &hyper::http::request::Parts) -> Result<Identity, ApiError> {
    let unauthenticated = |msg: &str| {
        let mut e = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", msg);
        e.allow = None;
        e
    };
    let token = match presented(&parts.headers) {
        Presented::Nothing => return Err(unauthenticated("missing Authorization: Bearer token")),
        Presented::Bearer(token) if !token.is_empty() => token,
        // The API takes a Bearer token only; the Basic password is the status page's.
        Presented::Bearer(_) | Presented::BasicPassword(_) | Presented::Unusable => {
            return Err(unauthenticated("Authorization must be: Bearer <token>"));
        }
    };
    s.deps.auth.authenticate(&token).await.map_err(|e| match e {
        AuthError::Unauthenticated => unauthenticated("invalid bearer token"),
        AuthError::Forbidden(_) => ApiError::new(StatusCode::FORBIDDEN, "forbidden", e.to_string()),
        AuthError::Unavailable(_) => ApiError::unavailable("auth_unavailable", e.to_string()),
    })
}

/// Reads a request body: 413 over the size limit, 400 when it breaks off.
pub(super) async fn read_body<B>(s: &StateInner, body: B) -> Result<Bytes, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limit = s.deps.config.max_body_bytes;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("request bodies are limited to {limit} bytes"),
        )
    };
    // What `Content-Length` announced, without looking the header up again (hyper did).
    if body.size_hint().lower() > limit as u64 {
        return Err(too_large());
    }
    match body_bytes(body, limit).await {
        Ok(Some(bytes)) => Ok(bytes),
        Ok(None) => Err(too_large()),
        Err(e) => Err(ApiError::bad_request(format!("reading the request body: {e}"))),
    }
}

/// Decodes and validates a request body read by [`read_body`] (its strings may borrow from
/// it): 400 for malformed JSON (saying where) or a value out of range (saying what to fix).
pub(super) fn parse_request<'a, T>(bytes: &'a [u8]) -> Result<T, ApiError>
where
    T: RequestBody + serde::Deserialize<'a> + Scan<'a>,
{
    // The fast path for the plain form clients send ([`Scan`], which checks the UTF-8 of what
    // it reads itself), else the plain serde parser (from text checked once: the byte-slice
    // reader checks every string again); the path-tracking one only to say where a malformed
    // body went wrong (it costs about as much as the parse itself).
    // serde's derive also reads a struct from an array of its fields in order: the API's
    // bodies are objects only.
    if bytes.trim_ascii_start().first().is_some_and(|b| *b != b'{') {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    let parsed = T::scan(bytes).or_else(|| {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| serde_json::from_str(text).ok())
    });
    let value: T = match parsed {
        Some(value) => value,
        None => decode_with_path(bytes)?,
    };
    value.validate().map_err(ApiError::bad_request)?;
    Ok(value)
}

/// A request body's bytes, or `None` when it is longer than `limit`. A body that arrives as
/// one frame (a small request with `Content-Length`: nearly every request here) is passed on
/// as it is, without the buffer list and the copy that collecting it builds.
async fn body_bytes<B>(
    body: B,
    limit: usize,
) -> Result<Option<Bytes>, Box<dyn std::error::Error + Send + Sync>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut body = std::pin::pin!(body);
    let mut first = Bytes::new();
    let mut more: Option<bytes::BytesMut> = None;
    while !body.is_end_stream() {
        let Some(frame) = body.frame().await else { break };
        // Trailers carry nothing the API reads.
        let Ok(data) = frame.map_err(Into::into)?.into_data() else {
            continue;
        };
        let held = more.as_ref().map_or(first.len(), |m| m.len());
        if held + data.len() > limit {
            return Ok(None);
        }
        match &mut more {
            None if first.is_empty() => first = data,
            None => {
                let mut joined = bytes::BytesMut::with_capacity(held + data.len());
                joined.extend_from_slice(&first);
                joined.extend_from_slice(&data);
                more = Some(joined);
            }
            Some(joined) => joined.extend_from_slice(&data),
        }
    }
    Ok(Some(more.map_or(first, bytes::BytesMut::freeze)))
}

/// Decodes a body the plain parser refused, to say where it went wrong.
fn decode_with_path<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        // `?` is the path of a value never reached (the body ended first).
        if path == "." || path == "?" || path.is_empty() {
            ApiError::bad_request(format!("invalid JSON body: {inner}"))
        } else {
            ApiError::bad_request(format!("invalid JSON body at {path}: {inner}"))
        }
    })?;
    // Trailing bytes after the object are as malformed as a broken object.
    de.end()
        .map_err(|_| ApiError::bad_request("invalid JSON body: trailing characters after the object"))?;
    Ok(value)
}
