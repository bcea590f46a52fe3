//! A loopback OTLP/HTTP collector for tests: accepts `POST /v1/traces` with protobuf bodies
//! (as the operator's exporter sends them), keeps each request raw and decoded, and answers
//! with an empty `ExportTraceServiceResponse`. Stops when dropped.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::{
    collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse},
    common::v1::{AnyValue, KeyValue, any_value::Value},
};
use prost::Message;
use tokio::net::TcpListener;

/// One export request as received.
#[derive(Clone, Debug)]
pub struct Received {
    /// Request path (`/v1/traces`).
    pub path: String,
    /// `content-type` header.
    pub content_type: String,
    /// The body exactly as sent.
    pub raw: Bytes,
    /// The body decoded (empty if it was not a valid protobuf request).
    pub request: ExportTraceServiceRequest,
}

/// One exported span, flattened for assertions.
#[derive(Clone, Debug)]
pub struct Span {
    /// Span name.
    pub name: String,
    /// Span attributes, values rendered as text.
    pub attributes: BTreeMap<String, String>,
    /// Attributes of the resource the span came with (`service.name`...).
    pub resource: BTreeMap<String, String>,
    /// Instrumentation scope name.
    pub scope: String,
    /// Status code (0 unset, 1 ok, 2 error).
    pub status_code: i32,
    /// Span id.
    pub span_id: Vec<u8>,
    /// Parent span id (empty for a root span).
    pub parent_span_id: Vec<u8>,
    /// Events (logs inside the span): name and attributes.
    pub events: Vec<(String, BTreeMap<String, String>)>,
}

/// The collector.
pub struct Collector {
    /// Where it listens.
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    /// Starts a collector on 127.0.0.1, port 0.
    pub async fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind collector");
        let addr = listener.local_addr().expect("collector address");
        let received = Arc::new(Mutex::new(Vec::new()));
        let store = received.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let store = store.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let store = store.clone();
                        async move { Ok::<_, Infallible>(handle(req, &store).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Collector { addr, received, task }
    }

    /// The base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().expect("not poisoned").clone()
    }

    /// Every span so far, in arrival order.
    pub fn spans(&self) -> Vec<Span> {
        let mut spans = Vec::new();
        for received in self.received() {
            for resource_spans in &received.request.resource_spans {
                let resource = resource_spans
                    .resource
                    .as_ref()
                    .map(|r| attributes(&r.attributes))
                    .unwrap_or_default();
                for scope_spans in &resource_spans.scope_spans {
                    let scope = scope_spans
                        .scope
                        .as_ref()
                        .map(|s| s.name.clone())
                        .unwrap_or_default();
                    for span in &scope_spans.spans {
                        spans.push(Span {
                            name: span.name.clone(),
                            attributes: attributes(&span.attributes),
                            resource: resource.clone(),
                            scope: scope.clone(),
                            status_code: span.status.as_ref().map_or(0, |s| s.code),
                            span_id: span.span_id.clone(),
                            parent_span_id: span.parent_span_id.clone(),
                            events: span
                                .events
                                .iter()
                                .map(|e| (e.name.clone(), attributes(&e.attributes)))
                                .collect(),
                        });
                    }
                }
            }
        }
        spans
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(req: Request<hyper::body::Incoming>, store: &Mutex<Vec<Received>>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let content_type = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let Ok(body) = req.into_body().collect().await else {
        return status(StatusCode::BAD_REQUEST);
    };
    let raw = body.to_bytes();
    let request = ExportTraceServiceRequest::decode(raw.clone()).unwrap_or_default();
    store.lock().expect("not poisoned").push(Received {
        path,
        content_type,
        raw,
        request,
    });
    Response::builder()
        .header(hyper::header::CONTENT_TYPE, "application/x-protobuf")
        .body(Full::new(Bytes::from(
            ExportTraceServiceResponse::default().encode_to_vec(),
        )))
        .expect("response")
}

fn status(code: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = code;
    response
}

fn attributes(list: &[KeyValue]) -> BTreeMap<String, String> {
    list.iter()
        .map(|kv| (kv.key.clone(), kv.value.as_ref().map(text).unwrap_or_default()))
        .collect()
}

fn text(value: &AnyValue) -> String {
    match &value.value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}
