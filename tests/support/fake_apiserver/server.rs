//! HTTP: the accept loop, routing of Kubernetes API paths to verbs, request/response
//! encoding, discovery documents, and watch streams.

use std::{
    borrow::Cow,
    collections::HashMap,
    convert::Infallible,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Frame, Incoming},
    header::{ACCEPT, CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::{net::TcpListener, sync::watch, task::JoinSet, time::Instant};

use super::{
    Inner, RequestRecord, Verb, crd, lock, openapi,
    registry::ResourceDef,
    selector::{FieldSelector, LabelSelector},
    status::{self, ApiError},
    store::{Deletion, EventType, ObjKey, PatchBody, StoredEvent, Target, render_line},
    table,
};

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Accepts connections until the task is aborted; aborting drops the `JoinSet`, which
/// aborts every connection (and with them every open watch).
pub async fn serve(listener: TcpListener, inner: Arc<Inner>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let inner = inner.clone();
                    connections.spawn(async move {
                        let service = service_fn(move |req| {
                            let inner = inner.clone();
                            async move { Ok::<_, Infallible>(handle(inner, req).await) }
                        });
                        let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                    });
                }
                // Out of file descriptors or similar: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed_unsync()
}

fn json_response(code: u16, body: Bytes) -> Response<Body> {
    let mut response = Response::new(full(body));
    *response.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn value_response(code: u16, value: &Value) -> Response<Body> {
    json_response(
        code,
        serde_json::to_vec(value)
            .expect("invariant: a serde_json::Value always serializes")
            .into(),
    )
}

fn error_response(error: &ApiError) -> Response<Body> {
    let mut response = value_response(error.code, &error.to_status());
    if error.code == 429 {
        response
            .headers_mut()
            .insert("Retry-After", HeaderValue::from_static("1"));
    }
    response
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(byte) => {
                        out.push(byte);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            other => out.push(other),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(query: &str) -> HashMap<String, String> {
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(key), percent_decode(value))
        })
        .collect()
}

/// A request, decoded.
struct Call<'a> {
    query: HashMap<String, String>,
    content_type: String,
    metadata_only: bool,
    /// `as=Table` was asked for: answer reads with a Table carrying this much of each object.
    table: Option<table::Include>,
    body: Bytes,
    rid: usize,
    def: Arc<ResourceDef>,
    namespace: Option<&'a str>,
    name: Option<&'a str>,
    target: Target,
}

impl Call<'_> {
    fn key(&self) -> ObjKey {
        let ns = if self.def.namespaced {
            self.namespace.unwrap_or_default()
        } else {
            ""
        };
        (ns.to_owned(), self.name.unwrap_or_default().to_owned())
    }

    fn dry_run(&self) -> bool {
        self.query.get("dryRun").is_some_and(|v| v == "All")
    }

    fn json_body(&self) -> Result<Value, ApiError> {
        serde_json::from_slice(&self.body)
            .map_err(|e| ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}")))
    }

    fn label_selector(&self) -> Result<LabelSelector, ApiError> {
        LabelSelector::parse(
            self.query
                .get("labelSelector")
                .map(String::as_str)
                .unwrap_or_default(),
        )
    }

    fn field_selector(&self) -> Result<FieldSelector, ApiError> {
        FieldSelector::parse(
            self.query
                .get("fieldSelector")
                .map(String::as_str)
                .unwrap_or_default(),
            &self.def,
        )
    }
}

/// `PartialObjectMetadata` view of an object, for `as=PartialObjectMetadata` requests.
fn partial(object: &Value) -> Value {
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": object.get("metadata").cloned().unwrap_or_else(|| json!({})),
    })
}

fn object_response(code: u16, object: &Value, metadata_only: bool) -> Response<Body> {
    if metadata_only {
        value_response(code, &partial(object))
    } else {
        value_response(code, object)
    }
}

/// Largest request body kube-apiserver reads.
pub const REQUEST_LIMIT_BYTES: usize = 3 * 1024 * 1024;

async fn handle(inner: Arc<Inner>, req: Request<Incoming>) -> Response<Body> {
    let latency = lock(&inner.hooks).latency;
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = parse_query(req.uri().query().unwrap_or_default());
    let header = |name: hyper::header::HeaderName| {
        req.headers()
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
            .unwrap_or_default()
    };
    let accept = header(ACCEPT).to_owned();
    let metadata_only = accept.contains("as=PartialObjectMetadata");
    let content_type = header(CONTENT_TYPE)
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let body = match req.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => return error_response(&ApiError::bad_request(format!("reading the request body: {e}"))),
    };
    // kube-apiserver's limit on a write's body (3 MiB); objects have smaller limits of their own.
    if body.len() > REQUEST_LIMIT_BYTES {
        return error_response(&ApiError::unknown(
            413,
            format!("Request entity too large: limit is {REQUEST_LIMIT_BYTES}"),
        ));
    }
    // Built-in types' clients (kubectl's typed ones) send protobuf, which the fake does not
    // decode: say so as the API server does for a media type it cannot read.
    if !body.is_empty() && content_type.contains("protobuf") {
        return error_response(&ApiError::unsupported_patch(&["application/json"]));
    }
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    if method == Method::GET {
        match segments.as_slice() {
            ["version"] => return value_response(200, &version()),
            ["api"] | ["apis"] if aggregated_version(&accept).is_some() => {
                let version = aggregated_version(&accept).expect("just checked");
                return aggregated_discovery(&inner, segments[0] == "api", version);
            }
            ["api"] => return value_response(200, &core_versions(&inner)),
            ["apis"] => return value_response(200, &group_list(&inner)),
            ["apis", group] => {
                return match api_group(&inner, group) {
                    Some(group) => value_response(200, &group),
                    None => error_response(&ApiError::unknown_path()),
                };
            }
            ["api", "v1"] => return resource_list(&inner, "", "v1"),
            ["apis", group, version] => return resource_list(&inner, group, version),
            ["openapi", "v2"] => return openapi_v2(&accept),
            ["openapi", "v3"] => return with_defs(&inner, |defs| value_response(200, &openapi::index(defs))),
            ["openapi", "v3", "api", version] => return openapi_v3(&inner, "", version),
            ["openapi", "v3", "apis", group, version] => return openapi_v3(&inner, group, version),
            _ => {}
        }
    }
    let (group, version, rest) = match segments.as_slice() {
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return error_response(&ApiError::unknown_path()),
    };
    let located = {
        let store = lock(&inner.store);
        locate(&store, group, version, rest)
    };
    let Some((rid, def, namespace, name, subresource)) = located else {
        return error_response(&ApiError::unknown_path());
    };
    let target = match subresource {
        None => Target::Main,
        Some("status") if def.status_subresource => Target::Status,
        Some(_) => return error_response(&ApiError::unknown_path()),
    };
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let verb = match (&method, name, watch) {
        (&Method::GET, Some(_), _) => Verb::Get,
        (&Method::GET, None, true) => Verb::Watch,
        (&Method::GET, None, false) => Verb::List,
        (&Method::POST, None, _) if target == Target::Main => Verb::Create,
        (&Method::PUT, Some(_), _) => Verb::Update,
        (&Method::PATCH, Some(_), _) => Verb::Patch,
        (&Method::DELETE, Some(_), _) if target == Target::Main => Verb::Delete,
        (&Method::DELETE, None, _) => Verb::DeleteCollection,
        (method, _, _) => {
            return error_response(&ApiError::method_not_supported(
                &def,
                &method.as_str().to_lowercase(),
            ));
        }
    };
    // TokenReview is a create-only virtual resource: nothing to read, update or delete.
    if def.is_named("tokenreviews.authentication.k8s.io") && verb != Verb::Create {
        let verb = format!("{verb:?}").to_lowercase();
        return error_response(&ApiError::method_not_supported(&def, &verb));
    }
    let mut record = RequestRecord {
        verb,
        group: def.group.clone(),
        resource: def.plural.clone(),
        namespace: namespace.map(str::to_owned),
        name: name.map(str::to_owned),
        subresource: subresource.map(str::to_owned),
        content_type: (verb == Verb::Patch).then(|| content_type.clone()),
        field_manager: query.get("fieldManager").cloned(),
        code: 0,
    };
    let injected = inner.take_injected_failure(&record);
    let table =
        table::wanted(&accept).then(|| table::Include::parse(query.get("includeObject").map(String::as_str)));
    let call = Call {
        query,
        content_type,
        metadata_only,
        table,
        body,
        rid,
        def: def.clone(),
        namespace,
        name,
        target,
    };
    let response = match injected {
        Some(code) => Err(ApiError::injected(code, Some(&*def), name.unwrap_or_default())),
        None => match verb {
            Verb::Get => get(&inner, &call),
            Verb::List => list(&inner, &call),
            Verb::Watch => start_watch(&inner, &call),
            Verb::Create if def.is_named("tokenreviews.authentication.k8s.io") => token_review(&inner, &call),
            Verb::Create => create(&inner, &call),
            Verb::Update => update(&inner, &call),
            Verb::Patch => patch(&inner, &call),
            Verb::Delete => delete(&inner, &call),
            Verb::DeleteCollection => delete_collection(&inner, &call),
        },
    };
    let response = response.unwrap_or_else(|error| error_response(&error));
    if verb.is_write() && response.status().is_success() && def.is_named(crd::CRD_RESOURCE) {
        inner.install_crds();
    }
    record.code = response.status().as_u16();
    lock(&inner.hooks).requests.push(record);
    response
}

type Located<'a> = (
    usize,
    Arc<ResourceDef>,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
);

/// `[namespaces/{ns}/]{plural}[/{name}[/{subresource}]]` → resource and coordinates.
fn locate<'a>(
    store: &super::store::Store,
    group: &str,
    version: &str,
    rest: &[&'a str],
) -> Option<Located<'a>> {
    let namespaced_rid = |plural: &str| {
        store
            .find(group, version, plural)
            .filter(|&rid| store.def(rid).namespaced)
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, plural, ..] if namespaced_rid(plural).is_some() => (Some(*ns), &rest[2..]),
        _ => (None, rest),
    };
    let (plural, name, subresource) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(*name), None),
        [plural, name, sub] => (*plural, Some(*name), Some(*sub)),
        _ => return None,
    };
    let rid = store.find(group, version, plural)?;
    let def = store.def(rid);
    // A namespaced object needs its namespace; a cluster-scoped one has none.
    if (def.namespaced && namespace.is_none() && name.is_some()) || (!def.namespaced && namespace.is_some()) {
        return None;
    }
    Some((rid, def, namespace, name, subresource))
}

fn get(inner: &Inner, call: &Call) -> Result<Response<Body>, ApiError> {
    let object = lock(&inner.store).get(call.rid, &call.key())?;
    if let Some(include) = call.table {
        let rv = object
            .pointer("/metadata/resourceVersion")
            .cloned()
            .unwrap_or_default();
        let metadata = json!({"resourceVersion": rv});
        return Ok(value_response(
            200,
            &table::render(&call.def, &[&object], metadata, include),
        ));
    }
    Ok(object_response(200, &object, call.metadata_only))
}

fn list(inner: &Inner, call: &Call) -> Result<Response<Body>, ApiError> {
    let labels = call.label_selector()?;
    let fields = call.field_selector()?;
    let limit = call.query.get("limit").and_then(|l| l.parse().ok());
    let continue_token = call
        .query
        .get("continue")
        .map(String::as_str)
        .filter(|c| !c.is_empty());
    let filter = |o: &Value| labels.matches(o) && fields.matches(o);
    let mut page = lock(&inner.store).list(call.rid, call.namespace, &filter, limit, continue_token)?;
    if call.def.group.is_empty() && call.def.plural == "events" && page.continue_token.is_none() {
        // One storage, two APIs: `events.k8s.io/v1` Events are core Events too (after the
        // last page of the core ones, converted as the API server converts them).
        let store = lock(&inner.store);
        if let Some(rid) = store.resolve("events.events.k8s.io") {
            page.items.extend(
                store
                    .all(rid, call.namespace)
                    .iter()
                    .map(|e| Arc::new(events_v1_to_core(e)))
                    .filter(|e| filter(e)),
            );
        }
    }
    if let Some(include) = call.table {
        let mut metadata = json!({"resourceVersion": page.rv.to_string()});
        if let Some(token) = &page.continue_token {
            metadata["continue"] = token.clone().into();
        }
        let objects: Vec<&Value> = page.items.iter().map(|o| &**o).collect();
        return Ok(value_response(
            200,
            &table::render(&call.def, &objects, metadata, include),
        ));
    }
    let (kind, api_version) = if call.metadata_only {
        (
            "PartialObjectMetadataList".to_owned(),
            "meta.k8s.io/v1".to_owned(),
        )
    } else {
        (format!("{}List", call.def.kind), call.def.api_version())
    };
    let mut metadata = json!({"resourceVersion": page.rv.to_string()});
    if let Some(token) = &page.continue_token {
        metadata["continue"] = token.clone().into();
    }
    let mut buf = Vec::with_capacity(256 + page.items.len() * 512);
    let head = json!({"kind": kind, "apiVersion": api_version, "metadata": metadata});
    let head = serde_json::to_vec(&head).expect("invariant: a serde_json::Value always serializes");
    buf.extend_from_slice(&head[..head.len() - 1]);
    buf.extend_from_slice(b",\"items\":[");
    for (i, item) in page.items.iter().enumerate() {
        if i > 0 {
            buf.push(b',');
        }
        let written = if call.metadata_only {
            serde_json::to_writer(&mut buf, &partial(item))
        } else {
            serde_json::to_writer(&mut buf, &**item)
        };
        written.expect("invariant: a serde_json::Value always serializes");
    }
    buf.extend_from_slice(b"]}");
    Ok(json_response(200, buf.into()))
}

fn create(inner: &Inner, call: &Call) -> Result<Response<Body>, ApiError> {
    let body = call.json_body()?;
    let warnings = field_validation(call, &body)?;
    let created = lock(&inner.store).create(call.rid, call.namespace, body, call.dry_run(), false)?;
    Ok(warn(
        object_response(201, &created, call.metadata_only),
        &warnings,
    ))
}

/// `fieldValidation` against a CRD's schema: fields it does not declare are refused with
/// `Strict`, reported in `Warning` headers with `Warn` (the API server's default) and
/// let through with `Ignore`. Types without a schema (built-ins) are not checked.
fn field_validation(call: &Call, body: &Value) -> Result<Vec<String>, ApiError> {
    let Some(schema) = call.def.schema.as_ref() else {
        return Ok(Vec::new());
    };
    let mode = call
        .query
        .get("fieldValidation")
        .map(String::as_str)
        .unwrap_or("Warn");
    match mode {
        "Strict" | "Warn" | "Ignore" => {}
        other => {
            return Err(ApiError::bad_request(format!(
                "fieldValidation parameter unsupported: {other}"
            )));
        }
    }
    if mode == "Ignore" {
        return Ok(Vec::new());
    }
    let unknown = crd::unknown_fields(schema, body);
    if unknown.is_empty() {
        return Ok(Vec::new());
    }
    let found: Vec<String> = unknown.iter().map(|f| format!("unknown field \"{f}\"")).collect();
    if mode == "Strict" {
        let kind = &call.def.kind;
        return Err(ApiError::bad_request(format!(
            "{kind} in version \"{}\" cannot be handled as a {kind}: strict decoding error: {}",
            call.def.version,
            found.join(", ")
        )));
    }
    Ok(found)
}

/// Adds one `Warning: 299 - "..."` header per warning, as the API server sends them.
fn warn(mut response: Response<Body>, warnings: &[String]) -> Response<Body> {
    for warning in warnings {
        let text = format!("299 - {}", serde_json::Value::String(warning.clone()));
        if let Ok(value) = HeaderValue::from_str(&text) {
            response.headers_mut().append("Warning", value);
        }
    }
    response
}

/// A TokenReview as the API server answers it: the token must be one a test added, and when
/// the review names audiences the token must hold one of them (the default audience is the
/// API server's own). `status.audiences` is the intersection, as kube-apiserver reports it.
/// Nothing is stored.
fn token_review(inner: &Inner, call: &Call) -> Result<Response<Body>, ApiError> {
    let mut review = call.json_body()?;
    let token = review
        .pointer("/spec/token")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let requested: Vec<String> = match review.pointer("/spec/audiences").and_then(Value::as_array) {
        Some(list) if !list.is_empty() => list.iter().filter_map(Value::as_str).map(str::to_owned).collect(),
        _ => vec![super::API_SERVER_AUDIENCE.to_owned()],
    };
    let known = lock(&inner.hooks).tokens.get(token).cloned();
    let status = match known {
        None => json!({"authenticated": false, "error": "invalid bearer token"}),
        Some(identity) => {
            let shared: Vec<&String> = requested
                .iter()
                .filter(|a| identity.audiences.contains(a))
                .collect();
            if shared.is_empty() {
                json!({
                    "authenticated": false,
                    "error": "[invalid bearer token, token audiences is invalid for the target audiences]",
                })
            } else {
                json!({
                    "authenticated": true,
                    "user": {"username": identity.username, "uid": "uid-of-".to_owned() + &identity.username},
                    "audiences": shared,
                })
            }
        }
    };
    review["status"] = status;
    review["metadata"] = json!({"creationTimestamp": null});
    Ok(value_response(201, &review))
}

fn update(inner: &Inner, call: &Call) -> Result<Response<Body>, ApiError> {
    let body = call.json_body()?;
    let warnings = field_validation(call, &body)?;
    let updated =
        lock(&inner.store).update(call.rid, &call.key(), body, call.target, call.dry_run(), true)?;
    Ok(warn(
        object_response(200, &updated, call.metadata_only),
        &warnings,
    ))
}

/// Drops strategic-merge directives (`$patch`, `$retainKeys`, `$setElementOrder/...`),
/// which the merge-patch approximation cannot honour.
fn strip_directives(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|k, _| !k.starts_with('$'));
            map.values_mut().for_each(strip_directives);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_directives),
        _ => {}
    }
}

fn patch_options_invalid(error: status::FieldError) -> ApiError {
    ApiError::invalid_kind(
        "PatchOptions.meta.k8s.io",
        "meta.k8s.io",
        "PatchOptions",
        "",
        &[error],
    )
}

fn patch(inner: &Inner, call: &Call) -> Result<Response<Body>, ApiError> {
    const MERGE: &str = "application/merge-patch+json";
    const JSON: &str = "application/json-patch+json";
    const STRATEGIC: &str = "application/strategic-merge-patch+json";
    const APPLY: &str = "application/apply-patch+yaml";
    let accepted: &[&str] = if call.def.strategic_merge {
        &[JSON, MERGE, STRATEGIC, APPLY]
    } else {
        &[JSON, MERGE, APPLY]
    };
    if !accepted.contains(&call.content_type.as_str()) {
        return Err(ApiError::unsupported_patch(accepted));
    }
    let apply = call.content_type == APPLY;
    let force = call.query.get("force").map(String::as_str);
    let manager = call.query.get("fieldManager").cloned().unwrap_or_default();
    if !apply && force.is_some() {
        return Err(patch_options_invalid(status::FieldError::forbidden(
            "force",
            "may not be specified for non-apply patch",
        )));
    }
    if apply && manager.is_empty() {
        return Err(patch_options_invalid(status::FieldError::required(
            "fieldManager",
            "is required for apply patch",
        )));
    }
    let body = if apply {
        let config: Value = match serde_json::from_slice(&call.body) {
            Ok(config) => config,
            Err(_) => serde_norway::from_slice(&call.body)
                .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?,
        };
        if !config.is_object() {
            return Err(ApiError::bad_request(
                "error decoding YAML: the applied configuration is not an object",
            ));
        }
        let api_version = config
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if api_version != call.def.api_version() {
            return Err(ApiError::bad_request(format!(
                "Incorrect version specified in apply patch. Specified patch version: {api_version}, expected: {}",
                call.def.api_version()
            )));
        }
        let kind = config.get("kind").and_then(Value::as_str).unwrap_or_default();
        if kind != call.def.kind {
            return Err(ApiError::bad_request(format!(
                "Incorrect kind specified in apply patch. Specified patch kind: {kind}, expected: {}",
                call.def.kind
            )));
        }
        PatchBody::Apply {
            config,
            manager,
            force: force == Some("true"),
        }
    } else {
        let mut patch: Value = serde_json::from_slice(&call.body)
            .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
        match call.content_type.as_str() {
            JSON => PatchBody::Json(patch),
            STRATEGIC => {
                strip_directives(&mut patch);
                PatchBody::Merge(patch)
            }
            _ => PatchBody::Merge(patch),
        }
    };
    let warnings = match &body {
        PatchBody::Apply { config, .. } | PatchBody::Merge(config) => field_validation(call, config)?,
        PatchBody::Json(_) => Vec::new(),
    };
    let (object, created) =
        lock(&inner.store).patch(call.rid, &call.key(), body, call.target, call.dry_run())?;
    Ok(warn(
        object_response(if created { 201 } else { 200 }, &object, call.metadata_only),
        &warnings,
    ))
}

fn delete(inner: &Inner, call: &Call) -> Result<Response<Body>, ApiError> {
    let options: Value = if call.body.is_empty() {
        json!({})
    } else {
        call.json_body()?
    };
    let precondition = |field: &str| {
        options
            .pointer(&format!("/preconditions/{field}"))
            .and_then(Value::as_str)
    };
    let dry_run = call.dry_run()
        || options
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|d| d.iter().any(|v| v == "All"));
    let key = call.key();
    let deletion = lock(&inner.store).delete(
        call.rid,
        &key,
        precondition("uid"),
        precondition("resourceVersion"),
        dry_run,
    )?;
    Ok(match deletion {
        Deletion::Gone(object) if !call.def.return_deleted_object => {
            let uid = object
                .pointer("/metadata/uid")
                .and_then(Value::as_str)
                .unwrap_or_default();
            value_response(200, &status::delete_success(&call.def, &key.1, uid))
        }
        Deletion::Gone(object) | Deletion::Pending(object) => {
            object_response(200, &object, call.metadata_only)
        }
    })
}

fn delete_collection(inner: &Inner, call: &Call) -> Result<Response<Body>, ApiError> {
    let labels = call.label_selector()?;
    let fields = call.field_selector()?;
    let dry_run = call.dry_run();
    let mut store = lock(&inner.store);
    let matching: Vec<Arc<Value>> = store
        .all(call.rid, call.namespace)
        .into_iter()
        .filter(|o| labels.matches(o) && fields.matches(o))
        .collect();
    let mut items = Vec::with_capacity(matching.len());
    for object in matching {
        let ns = object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let name = object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let key = (ns.to_owned(), name.to_owned());
        match store.delete(call.rid, &key, None, None, dry_run)? {
            Deletion::Gone(o) | Deletion::Pending(o) => items.push((*o).clone()),
        }
    }
    let list = json!({
        "kind": format!("{}List", call.def.kind),
        "apiVersion": call.def.api_version(),
        "metadata": {"resourceVersion": store.rv.to_string()},
        "items": items,
    });
    Ok(value_response(200, &list))
}

// ---------------------------------------------------------------------------------------
// Watch

/// Which objects one watch sees.
struct WatchFilter {
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
}

impl WatchFilter {
    fn matches(&self, object: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| object.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns))
            && self.labels.matches(object)
            && self.fields.matches(object)
    }
}

/// Counts open watches for [`super::FakeApiServer::open_watches`].
struct OpenWatch(Arc<Inner>);

impl OpenWatch {
    fn new(inner: Arc<Inner>) -> Self {
        inner.open_watches.fetch_add(1, Ordering::SeqCst);
        Self(inner)
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Synthetic ADDED events for the objects present when the watch started.
struct Initial {
    objects: Vec<Arc<Value>>,
    /// `sendInitialEvents=true`: close the initial events with an annotated BOOKMARK.
    end_bookmark: bool,
}

struct WatchStream {
    open: OpenWatch,
    rid: usize,
    def: Arc<ResourceDef>,
    filter: WatchFilter,
    /// Everything up to this RV has been sent (or filtered out).
    cursor: u64,
    /// The first scan checks the compaction point too (a new request from a stale RV).
    fresh: bool,
    initial: Option<Initial>,
    notify: watch::Receiver<u64>,
    expire: watch::Receiver<u64>,
    bookmarks: bool,
    bookmark_interval: Duration,
    bookmark_due: bool,
    next_bookmark: Instant,
    deadline: Instant,
    metadata_only: bool,
    done: bool,
}

impl WatchStream {
    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        let object =
            json!({"kind": self.def.kind, "apiVersion": self.def.api_version(), "metadata": metadata});
        render_line("BOOKMARK", &object)
    }

    fn push(&self, out: &mut Vec<u8>, kind: &str, object: &Value) {
        if self.metadata_only {
            out.extend_from_slice(&render_line(kind, &partial(object)));
        } else {
            out.extend_from_slice(&render_line(kind, object));
        }
    }

    /// What this watch sees of one stored event: as the API server's watch cache does, an
    /// object that starts matching the selector arrives as ADDED, one that stops matching
    /// leaves as DELETED (its previous state at the event's resourceVersion).
    fn render(&self, event: &StoredEvent, out: &mut Vec<u8>) {
        let now = event.kind != EventType::Deleted && self.filter.matches(&event.object);
        let before = match event.kind {
            EventType::Deleted => self.filter.matches(&event.object),
            _ => event.prev.as_deref().is_some_and(|p| self.filter.matches(p)),
        };
        let natural = match event.kind {
            EventType::Added => now,
            EventType::Deleted => before,
            EventType::Modified => now && before,
        };
        if natural {
            if self.metadata_only {
                self.push(out, event.kind.as_str(), &event.object);
            } else {
                out.extend_from_slice(event.line());
            }
        } else if event.kind == EventType::Modified && now {
            self.push(out, "ADDED", &event.object);
        } else if event.kind == EventType::Modified && before {
            let mut gone: Cow<Value> = Cow::Borrowed(event.prev.as_deref().unwrap_or(&event.object));
            gone.to_mut()["metadata"]["resourceVersion"] = event.rv.to_string().into();
            self.push(out, "DELETED", &gone);
        }
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if self.done {
                return None;
            }
            let mut out = Vec::new();
            if let Some(initial) = self.initial.take() {
                for object in initial.objects.iter().filter(|o| self.filter.matches(o)) {
                    self.push(&mut out, "ADDED", object);
                }
                if initial.end_bookmark {
                    out.extend_from_slice(&self.bookmark(self.cursor, true));
                }
            }
            self.notify.borrow_and_update();
            let scanned = lock(&self.open.0.store).events_after(self.rid, self.cursor, self.fresh);
            self.fresh = false;
            match scanned {
                Err(expired) => {
                    // A stale resourceVersion: one ERROR event, then the stream ends.
                    self.done = true;
                    out.extend_from_slice(&render_line("ERROR", &expired.to_status()));
                    return Some(out.into());
                }
                Ok((events, seen)) => {
                    self.cursor = seen;
                    for event in &events {
                        self.render(event, &mut out);
                    }
                }
            }
            if self.bookmark_due {
                self.bookmark_due = false;
                out.extend_from_slice(&self.bookmark(self.cursor, false));
            }
            if !out.is_empty() {
                return Some(out.into());
            }
            tokio::select! {
                changed = self.notify.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                }
                _ = self.expire.changed() => return None,
                _ = tokio::time::sleep_until(self.deadline) => return None,
                _ = tokio::time::sleep_until(self.next_bookmark), if self.bookmarks => {
                    self.next_bookmark = Instant::now() + self.bookmark_interval;
                    self.bookmark_due = true;
                }
            }
        }
    }
}

fn start_watch(inner: &Arc<Inner>, call: &Call) -> Result<Response<Body>, ApiError> {
    let labels = call.label_selector()?;
    let fields = call.field_selector()?;
    let rv = call
        .query
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or_default();
    let send_initial = call.query.get("sendInitialEvents").map(|v| v == "true");
    let bookmarks = call.query.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let timeout = call
        .query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|t| *t > 0)
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let namespace = call.namespace.map(str::to_owned);
    let (cursor, initial, notify) = {
        let store = lock(&inner.store);
        let notify = store.resources[call.rid].notify.subscribe();
        match (send_initial, rv) {
            // Unset or "0": start with synthetic ADDED events for what exists now.
            (Some(true), _) | (None, "" | "0") => {
                let (objects, at) = store.snapshot(call.rid, namespace.as_deref());
                let end_bookmark = send_initial == Some(true) && bookmarks;
                (
                    at,
                    Some(Initial {
                        objects,
                        end_bookmark,
                    }),
                    notify,
                )
            }
            (Some(false), "" | "0") => (store.rv, None, notify),
            (_, rv) => {
                let rv = rv.parse::<u64>().map_err(|_| {
                    ApiError::invalid_kind(
                        "ListOptions.meta.k8s.io",
                        "meta.k8s.io",
                        "ListOptions",
                        "",
                        &[status::FieldError::invalid(
                            "resourceVersion",
                            rv.into(),
                            "must be a valid resource version",
                        )],
                    )
                })?;
                (rv, None, notify)
            }
        }
    };
    let interval = inner.bookmark_interval;
    let stream = WatchStream {
        open: OpenWatch::new(inner.clone()),
        rid: call.rid,
        def: call.def.clone(),
        filter: WatchFilter {
            namespace,
            labels,
            fields,
        },
        cursor,
        fresh: true,
        initial,
        notify,
        expire: inner.expire.subscribe(),
        bookmarks,
        bookmark_interval: interval,
        bookmark_due: false,
        next_bookmark: Instant::now() + interval,
        deadline: Instant::now() + timeout,
        metadata_only: call.metadata_only,
        done: false,
    };
    let chunks = futures::stream::unfold(stream, |mut stream| async move {
        let chunk = stream.next_chunk().await?;
        Some((Ok::<_, Infallible>(Frame::data(chunk)), stream))
    });
    let mut response = Response::new(StreamBody::new(chunks).boxed_unsync());
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(response)
}

// ---------------------------------------------------------------------------------------
// Discovery

fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-fake",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn core_versions(inner: &Inner) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": inner.addr.to_string()}],
    })
}

fn api_group(inner: &Inner, group: &str) -> Option<Value> {
    let store = lock(&inner.store);
    let mut versions: Vec<String> = Vec::new();
    for rs in &store.resources {
        if rs.def.group == group && !versions.contains(&rs.def.version) {
            versions.push(rs.def.version.clone());
        }
    }
    let first = versions.first()?.clone();
    let entry = |v: &str| json!({"groupVersion": format!("{group}/{v}"), "version": v});
    Some(json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": versions.iter().map(|v| entry(v)).collect::<Vec<_>>(),
        "preferredVersion": entry(&first),
    }))
}

fn group_list(inner: &Inner) -> Value {
    let mut names: Vec<String> = Vec::new();
    for rs in &lock(&inner.store).resources {
        if !rs.def.group.is_empty() && !names.contains(&rs.def.group) {
            names.push(rs.def.group.clone());
        }
    }
    let groups: Vec<Value> = names.iter().filter_map(|g| api_group(inner, g)).collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// The aggregated discovery version an Accept header asks for (kubectl >= 1.26 and kube's
/// `Discovery::run_aggregated` list `v2`, then `v2beta1`, then plain JSON).
fn aggregated_version(accept: &str) -> Option<&'static str> {
    let asks = |version: &str| {
        accept.split(',').any(|media| {
            let params: Vec<&str> = media.split(';').map(str::trim).collect();
            params.contains(&"g=apidiscovery.k8s.io")
                && params.contains(&"as=APIGroupDiscoveryList")
                && params.contains(&format!("v={version}").as_str())
        })
    };
    ["v2", "v2beta1"].into_iter().find(|v| asks(v))
}

/// Aggregated discovery (`apidiscovery.k8s.io` `APIGroupDiscoveryList`): every group with
/// every version and resource in one document, `/api` for the core group, `/apis` for the
/// others.
fn aggregated_discovery(inner: &Inner, core: bool, version: &str) -> Response<Body> {
    let store = lock(&inner.store);
    // Group → version → resources, in the order they are served.
    type Versions = Vec<(String, Vec<Value>)>;
    let mut groups: Vec<(String, Versions)> = Vec::new();
    for rs in store.resources.iter().filter(|r| r.def.group.is_empty() == core) {
        let def = &rs.def;
        let kind = |kind: &str| json!({"group": def.group, "version": def.version, "kind": kind});
        let mut resource = json!({
            "resource": def.plural,
            "responseKind": kind(&def.kind),
            "scope": if def.namespaced { "Namespaced" } else { "Cluster" },
            "singularResource": def.singular_name(),
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        });
        if !def.short_names.is_empty() {
            resource["shortNames"] = json!(def.short_names);
        }
        if !def.categories.is_empty() {
            resource["categories"] = json!(def.categories);
        }
        if def.status_subresource {
            resource["subresources"] = json!([{
                "subresource": "status",
                "responseKind": kind(&def.kind),
                "verbs": ["get", "patch", "update"],
            }]);
        }
        let group = match groups.iter_mut().position(|(name, _)| *name == def.group) {
            Some(i) => &mut groups[i].1,
            None => {
                groups.push((def.group.clone(), Vec::new()));
                &mut groups.last_mut().expect("just pushed").1
            }
        };
        match group.iter_mut().find(|(v, _)| *v == def.version) {
            Some((_, resources)) => resources.push(resource),
            None => group.push((def.version.clone(), vec![resource])),
        }
    }
    let items: Vec<Value> = groups
        .into_iter()
        .map(|(name, versions)| {
            let versions: Vec<Value> = versions
                .into_iter()
                .map(|(version, resources)| json!({"version": version, "resources": resources, "freshness": "Current"}))
                .collect();
            let metadata = if name.is_empty() { json!({}) } else { json!({"name": name}) };
            json!({"metadata": metadata, "versions": versions})
        })
        .collect();
    let list = json!({
        "kind": "APIGroupDiscoveryList",
        "apiVersion": format!("apidiscovery.k8s.io/{version}"),
        "metadata": {},
        "items": items,
    });
    let mut response = value_response(200, &list);
    let content_type = format!("application/json;g=apidiscovery.k8s.io;v={version};as=APIGroupDiscoveryList");
    if let Ok(value) = HeaderValue::from_str(&content_type) {
        response.headers_mut().insert(CONTENT_TYPE, value);
    }
    response
}

fn resource_list(inner: &Inner, group: &str, version: &str) -> Response<Body> {
    let store = lock(&inner.store);
    let mut resources = Vec::new();
    for rs in store
        .resources
        .iter()
        .filter(|r| r.def.group == group && r.def.version == version)
    {
        let def = &rs.def;
        let mut resource = json!({
            "name": def.plural,
            "singularName": def.singular_name(),
            "namespaced": def.namespaced,
            "kind": def.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        });
        if !def.short_names.is_empty() {
            resource["shortNames"] = json!(def.short_names);
        }
        if !def.categories.is_empty() {
            resource["categories"] = json!(def.categories);
        }
        resources.push(resource);
        if def.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", def.plural),
                "singularName": "",
                "namespaced": def.namespaced,
                "kind": def.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return error_response(&ApiError::unknown_path());
    }
    let group_version = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    value_response(
        200,
        &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}),
    )
}

// ---------------------------------------------------------------------------------------
// OpenAPI and Event conversion

fn with_defs(inner: &Inner, f: impl FnOnce(&[&ResourceDef]) -> Response<Body>) -> Response<Body> {
    let defs: Vec<Arc<ResourceDef>> = lock(&inner.store)
        .resources
        .iter()
        .map(|r| r.def.clone())
        .collect();
    let refs: Vec<&ResourceDef> = defs.iter().map(|d| &**d).collect();
    f(&refs)
}

fn openapi_v3(inner: &Inner, group: &str, version: &str) -> Response<Body> {
    with_defs(inner, |defs| {
        match openapi::group_version_document(defs, group, version) {
            Some(document) => value_response(200, &document),
            None => error_response(&ApiError::unknown_path()),
        }
    })
}

/// client-go asks for the protobuf encoding; other clients get JSON.
fn openapi_v2(accept: &str) -> Response<Body> {
    if accept.contains("protobuf") {
        let mut response = Response::new(full(openapi::v2_protobuf()));
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/com.github.proto-openapi.spec.v2.v1.0+protobuf"),
        );
        response
    } else {
        value_response(200, &openapi::v2_json())
    }
}

/// An `events.k8s.io/v1` Event as the core `v1` API shows it (the API server's conversion:
/// `regarding` is `involvedObject`, `note` is `message`, `reportingController` is
/// `reportingComponent`, the `deprecated*` fields lose their prefix).
fn events_v1_to_core(event: &Value) -> Value {
    let mut core = json!({"apiVersion": "v1", "kind": "Event"});
    let renames = [
        ("metadata", "metadata"),
        ("regarding", "involvedObject"),
        ("related", "related"),
        ("note", "message"),
        ("reason", "reason"),
        ("type", "type"),
        ("action", "action"),
        ("eventTime", "eventTime"),
        ("series", "series"),
        ("reportingController", "reportingComponent"),
        ("reportingInstance", "reportingInstance"),
        ("deprecatedSource", "source"),
        ("deprecatedFirstTimestamp", "firstTimestamp"),
        ("deprecatedLastTimestamp", "lastTimestamp"),
        ("deprecatedCount", "count"),
    ];
    for (from, to) in renames {
        if let Some(value) = event.get(from).filter(|v| !v.is_null()) {
            core[to] = value.clone();
        }
    }
    core
}
