//! Routing and error answers: which endpoint a method and path name, and the JSON error
//! (stable code, message, `Retry-After`, `Allow`) every failure becomes.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Method, Response, StatusCode,
    header::{self, HeaderValue},
};

use super::{ErrorBody, ErrorDetail, retry_after_header};
use crate::lease::{LeaseError, token::MAX_ID_LEN};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route<'a> {
    Healthz,
    Readyz,
    Metrics,
    OpenApi,
    Ui,
    List,
    Leases,
    Acquire,
    Renew(&'a str),
    Release(&'a str),
    Outcomes(&'a str),
    Usage,
}

/// The route index of requests no route takes (`metrics::ROUTES`).
pub(super) const OTHER_ROUTE: usize = 8;

impl Route<'_> {
    /// Its index in `metrics::ROUTES` (its metric label).
    pub(super) fn index(self) -> usize {
        match self {
            Route::Healthz => 0,
            Route::Readyz => 1,
            Route::Metrics => 2,
            Route::OpenApi => 3,
            Route::List => 4,
            Route::Acquire => 5,
            Route::Renew(_) => 6,
            Route::Release(_) => 7,
            Route::Ui => 9,
            Route::Leases => 10,
            Route::Outcomes(_) => 11,
            Route::Usage => 12,
        }
    }
}

/// What an endpoint answers: its response, or the error to answer instead.
pub(super) type Answer = Result<Response<Full<Bytes>>, ApiError>;

/// The API's answer to anything that went wrong: status, stable code, message.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    pub(super) code: &'static str,
    pub(super) message: String,
    pub(super) retry_after: Option<Duration>,
    pub(super) allow: Option<&'static str>,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
            allow: None,
        }
    }

    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "malformed_request", message)
    }

    /// A 503 the client should retry in a second: the replica cannot serve this call yet
    /// (not the leader, caches not synced, the journal or authentication unavailable).
    pub(super) fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message).retry(Duration::from_secs(1))
    }

    pub(super) fn retry(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub(super) fn into_response(self) -> Response<Full<Bytes>> {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
            },
        };
        let mut response = json(self.status, &body);
        if let Some(after) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, retry_after_header(after));
        }
        if let Some(allow) = self.allow {
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        response
    }
}

impl From<LeaseError> for ApiError {
    fn from(e: LeaseError) -> Self {
        let status = match &e {
            LeaseError::NotFound | LeaseError::UnknownProxy(_) => StatusCode::NOT_FOUND,
            LeaseError::StaleToken { .. } | LeaseError::Draining => StatusCode::CONFLICT,
            LeaseError::NoProxyAvailable { .. } | LeaseError::RequestInProgress => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            LeaseError::BanNeedsDomain | LeaseError::Invalid(_) => StatusCode::BAD_REQUEST,
        };
        let retry = match &e {
            LeaseError::NoProxyAvailable { retry_after } => Some(*retry_after),
            // The grant it waits for is being made durable: milliseconds.
            LeaseError::RequestInProgress => Some(std::time::Duration::from_secs(1)),
            _ => None,
        };
        let mut err = ApiError::new(status, e.code(), e.to_string());
        err.retry_after = retry;
        err
    }
}

pub(super) fn json<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Full<Bytes>> {
    // Most answers (an acquire's is the largest common one) fit without regrowing.
    let mut bytes = Vec::with_capacity(512);
    serde_json::to_writer(&mut bytes, body).expect("API responses are plain data and always serialize");
    json_bytes(status, bytes)
}

/// A JSON answer from its bytes.
pub(super) fn json_bytes(status: StatusCode, bytes: Vec<u8>) -> Response<Full<Bytes>> {
    // A vector filled to its capacity becomes `Bytes` without a second allocation (one with
    // room to spare gets a shared header allocated); shrinking in place is cheap with mimalloc.
    let mut response = Response::new(Full::new(Bytes::from(bytes.into_boxed_slice())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

pub(super) fn route<'a>(method: &Method, path: &'a str) -> Result<Route<'a>, ApiError> {
    let only = |allowed: &'static str, want: &Method, r: Route<'a>| {
        if method == want {
            Ok(r)
        } else {
            let mut e = ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("use {allowed} on this path"),
            );
            e.allow = Some(allowed);
            Err(e)
        }
    };
    match path {
        "/healthz" => only("GET", &Method::GET, Route::Healthz),
        "/readyz" => only("GET", &Method::GET, Route::Readyz),
        "/metrics" => only("GET", &Method::GET, Route::Metrics),
        "/v1/openapi.json" => only("GET", &Method::GET, Route::OpenApi),
        "/ui" => only("GET", &Method::GET, Route::Ui),
        "/v1/proxies" => only("GET", &Method::GET, Route::List),
        "/v1/usage" => only("GET", &Method::GET, Route::Usage),
        "/v1/leases" if method == Method::GET => Ok(Route::Leases),
        "/v1/leases" => only("GET, POST", &Method::POST, Route::Acquire),
        _ => {
            let not_found = || ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint");
            let rest = path.strip_prefix("/v1/leases/").ok_or_else(not_found)?;
            // From the end: the action is a few bytes, the ID a hundred or more (a forward
            // search for the '/' cost about as much as the rest of the routing).
            let (id, action) = rest.rsplit_once('/').ok_or_else(not_found)?;
            // Unpadded base64url, as every issued ID is (checked 32 bytes at a time: a byte at a
            // time cost more than the rest of the routing).
            let base64url = !id.is_empty()
                && id.len() <= MAX_ID_LEN
                && base64_simd::URL_SAFE_NO_PAD.check(id.as_bytes()).is_ok();
            if !base64url && id.contains('/') {
                // More segments than `/v1/leases/{id}/{action}`: no endpoint, whatever the ID.
                return Err(not_found());
            }
            if !base64url {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "lease_not_found",
                    "lease not found (malformed lease ID)",
                ));
            }
            match action {
                "renew" => only("POST", &Method::POST, Route::Renew(id)),
                "release" => only("POST", &Method::POST, Route::Release(id)),
                "outcomes" => only("POST", &Method::POST, Route::Outcomes(id)),
                _ => Err(not_found()),
            }
        }
    }
}
