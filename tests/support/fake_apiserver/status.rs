//! `metav1.Status` error bodies, shaped and worded as the Kubernetes API server
//! (k8s.io/apimachinery/pkg/api/errors) builds them, so clients that match on
//! `reason`, `code` or message text behave as against a real cluster.

use serde_json::{Map, Value, json};

use super::registry::ResourceDef;

/// Text of the optimistic-lock failure (`OptimisticLockErrorMsg` in the API server).
pub const OPTIMISTIC_LOCK_MESSAGE: &str =
    "the object has been modified; please apply your changes to the latest version and try again";

/// One field-level problem of an `Invalid` (422) error, rendered as `field.Error` does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted field path, e.g. `metadata.finalizers`.
    pub field: String,
    /// What kind of problem it is.
    pub kind: FieldErrorKind,
    /// Explanation after the kind, e.g. `must be between 1 and 100`.
    pub detail: String,
}

/// The `field.ErrorType`s a fake needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FieldErrorKind {
    /// `Required value`.
    Required,
    /// `Invalid value: <value>`; the value is rendered as JSON.
    Invalid(Value),
    /// `Forbidden`.
    Forbidden,
    /// `Too long: <detail>` (e.g. a ConfigMap's data past 1 MiB).
    TooLong,
}

impl FieldError {
    /// A field error of kind `Invalid` with the offending value.
    pub fn invalid(field: impl Into<String>, value: Value, detail: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            kind: FieldErrorKind::Invalid(value),
            detail: detail.into(),
        }
    }

    /// A field error of kind `Required`.
    pub fn required(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            kind: FieldErrorKind::Required,
            detail: detail.into(),
        }
    }

    /// A field error of kind `Forbidden`.
    pub fn forbidden(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            kind: FieldErrorKind::Forbidden,
            detail: detail.into(),
        }
    }

    fn cause_type(&self) -> &'static str {
        match self.kind {
            FieldErrorKind::Required => "FieldValueRequired",
            FieldErrorKind::Invalid(_) => "FieldValueInvalid",
            FieldErrorKind::Forbidden => "FieldValueForbidden",
            FieldErrorKind::TooLong => "FieldValueTooLong",
        }
    }

    /// `ErrorBody()`: the error without the field path.
    fn body(&self) -> String {
        let mut text = match &self.kind {
            FieldErrorKind::Required => "Required value".to_owned(),
            FieldErrorKind::Invalid(value) => format!("Invalid value: {value}"),
            FieldErrorKind::Forbidden => "Forbidden".to_owned(),
            FieldErrorKind::TooLong => "Too long".to_owned(),
        };
        if !self.detail.is_empty() {
            text.push_str(": ");
            text.push_str(&self.detail);
        }
        text
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.body())
    }
}

/// A failed request: HTTP code plus the `Status` body sent with it.
#[derive(Clone, Debug)]
pub struct ApiError {
    /// HTTP status code, also the Status `code`.
    pub code: u16,
    /// Status `reason` (`NotFound`, `Conflict`...); empty for `StatusReasonUnknown`.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
    /// Status `details`, when the API server sets them.
    pub details: Option<Value>,
}

fn details(def: &ResourceDef, name: &str) -> Value {
    let mut map = Map::new();
    if !name.is_empty() {
        map.insert("name".into(), name.into());
    }
    if !def.group.is_empty() {
        map.insert("group".into(), def.group.clone().into());
    }
    map.insert("kind".into(), def.plural.clone().into());
    Value::Object(map)
}

impl ApiError {
    /// `NewNotFound`: `proxies.crawl.example.com "x" not found`.
    pub fn not_found(def: &ResourceDef, name: &str) -> Self {
        Self {
            code: 404,
            reason: "NotFound",
            message: format!("{} \"{name}\" not found", def.qualified()),
            details: Some(details(def, name)),
        }
    }

    /// The 404 for a path no resource is served at (e.g. a CRD that is not installed).
    pub fn unknown_path() -> Self {
        Self {
            code: 404,
            reason: "NotFound",
            message: "the server could not find the requested resource".into(),
            details: Some(json!({})),
        }
    }

    /// `NewAlreadyExists`.
    pub fn already_exists(def: &ResourceDef, name: &str) -> Self {
        Self {
            code: 409,
            reason: "AlreadyExists",
            message: format!("{} \"{name}\" already exists", def.qualified()),
            details: Some(details(def, name)),
        }
    }

    /// `NewConflict` with an explanation (`OPTIMISTIC_LOCK_MESSAGE` for a stale resourceVersion).
    pub fn conflict(def: &ResourceDef, name: &str, why: &str) -> Self {
        Self {
            code: 409,
            reason: "Conflict",
            message: format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                def.qualified()
            ),
            details: Some(details(def, name)),
        }
    }

    /// `NewInvalid` for an object of `def`'s kind.
    pub fn invalid(def: &ResourceDef, name: &str, errors: &[FieldError]) -> Self {
        Self::invalid_kind(&def.group_kind(), &def.group, &def.kind, name, errors)
    }

    /// `NewInvalid` for any group/kind (e.g. `PatchOptions.meta.k8s.io`).
    pub fn invalid_kind(
        group_kind: &str,
        group: &str,
        kind: &str,
        name: &str,
        errors: &[FieldError],
    ) -> Self {
        let aggregate = match errors {
            [one] => one.to_string(),
            many => format!(
                "[{}]",
                many.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let causes: Vec<Value> = errors
            .iter()
            .map(|e| json!({"reason": e.cause_type(), "message": e.body(), "field": e.field}))
            .collect();
        let mut detail = Map::new();
        if !name.is_empty() {
            detail.insert("name".into(), name.into());
        }
        if !group.is_empty() {
            detail.insert("group".into(), group.into());
        }
        detail.insert("kind".into(), kind.into());
        detail.insert("causes".into(), causes.into());
        Self {
            code: 422,
            reason: "Invalid",
            message: format!("{group_kind} \"{name}\" is invalid: {aggregate}"),
            details: Some(Value::Object(detail)),
        }
    }

    /// `NewGenericServerResponse(422, ...)`: what a failed JSON patch operation returns; the
    /// API server drops the patch library's own message.
    pub fn generic_unprocessable() -> Self {
        Self {
            code: 422,
            reason: "Invalid",
            message: "the server rejected our request due to an error in our request".into(),
            details: Some(json!({})),
        }
    }

    /// `NewBadRequest`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            code: 400,
            reason: "BadRequest",
            message: message.into(),
            details: None,
        }
    }

    /// `NewResourceExpired`: the watch (or continue token) is older than the history kept.
    pub fn expired(message: impl Into<String>) -> Self {
        Self {
            code: 410,
            reason: "Expired",
            message: message.into(),
            details: None,
        }
    }

    /// `NewInternalError`.
    pub fn internal(message: &str) -> Self {
        Self {
            code: 500,
            reason: "InternalError",
            message: format!("Internal error occurred: {message}"),
            details: Some(json!({"causes": [{"message": message}]})),
        }
    }

    /// A plain error the API server reports with `StatusReasonUnknown` (e.g. storage errors).
    pub fn unknown(code: u16, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: "",
            message: message.into(),
            details: None,
        }
    }

    /// `NewMethodNotSupported`.
    pub fn method_not_supported(def: &ResourceDef, action: &str) -> Self {
        Self {
            code: 405,
            reason: "MethodNotAllowed",
            message: format!(
                "{action} is not supported on resources of kind \"{}\"",
                def.qualified()
            ),
            details: Some(json!({"group": def.group, "kind": def.plural})),
        }
    }

    /// `NewUnsupportedMediaTypeError` for a PATCH content type the resource does not take.
    pub fn unsupported_patch(accepted: &[&str]) -> Self {
        Self {
            code: 415,
            reason: "UnsupportedMediaType",
            message: format!(
                "the body of the request was in an unknown format - accepted media types include: {}",
                accepted.join(", ")
            ),
            details: None,
        }
    }

    /// The Status body for an error injected by a test for `def`/`name`, shaped like what
    /// the API server returns with that code.
    pub fn injected(code: u16, def: Option<&ResourceDef>, name: &str) -> Self {
        match (code, def) {
            (404, Some(def)) => Self::not_found(def, name),
            (409, Some(def)) => Self::conflict(def, name, OPTIMISTIC_LOCK_MESSAGE),
            (410, _) => Self::expired("too old resource version: injected"),
            (429, _) => Self {
                code,
                reason: "TooManyRequests",
                message: "Too many requests: injected failure".into(),
                details: Some(json!({"retryAfterSeconds": 1})),
            },
            (500, _) => Self::internal("injected failure"),
            (503, _) => Self {
                code,
                reason: "ServiceUnavailable",
                message: "injected failure".into(),
                details: None,
            },
            (504, _) => Self {
                code,
                reason: "Timeout",
                message: "Timeout: injected failure".into(),
                details: None,
            },
            (400, _) => Self::bad_request("injected failure"),
            _ => Self::unknown(code, "injected failure"),
        }
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "code": self.code,
        });
        if !self.reason.is_empty() {
            status["reason"] = self.reason.into();
        }
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
    }
}

/// The `Status` a delete returns for resources that do not return the deleted object.
pub fn delete_success(def: &ResourceDef, name: &str, uid: &str) -> Value {
    let mut details = details(def, name);
    details["uid"] = uid.into();
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    })
}
