//! The fake API server (tests/support/fake_apiserver) against documented Kubernetes API
//! behaviour, through a real `kube::Client` over HTTP. Each test names the behaviour it
//! checks; the references are the Kubernetes API concepts page
//! (kubernetes.io/docs/reference/using-api/api-concepts), the finalizers, server-side apply
//! and custom resource (status subresource) pages, and the API server's error shapes
//! (k8s.io/apimachinery/pkg/api/errors).

mod support;

use std::{
    collections::BTreeMap,
    convert::Infallible,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use egress_proxies_operator::api::{Proxy, ProxyStatus};
use futures::{StreamExt, TryStreamExt};
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::{
    authentication::v1::{TokenReview, TokenReviewSpec},
    coordination::v1::{Lease, LeaseSpec},
    core::v1::{ConfigMap, Secret},
    events::v1::Event as K8sEvent,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams},
    core::{ObjectMeta, PartialObjectMeta, Status},
    runtime::{
        events::{Event, EventType, Recorder, Reporter},
        finalizer::{Event as FinalizerEvent, finalizer},
        watcher::{self, Event as WatcherEvent},
    },
};
use serde_json::{Value, json};
use support::fake_apiserver::{FakeApiServer, FieldError, Options, RequestMatcher, Verb};
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(5);

fn proxy(name: &str) -> Proxy {
    serde_json::from_value(json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": {"provider": "memory"},
    }))
    .expect("a minimal Proxy deserializes")
}

fn config_map(name: &str, labels: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: (!labels.is_empty()).then(|| {
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect()
            }),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("key".to_owned(), "value".to_owned())])),
        ..Default::default()
    }
}

/// The `Status` of a failed call.
fn status_of<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> Status {
    match result {
        Err(kube::Error::Api(status)) => *status,
        other => panic!("expected an API error Status, got {other:?}"),
    }
}

fn rv(meta: &ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .expect("a stored object has a resourceVersion")
        .parse()
        .expect("integer RV")
}

/// A request outside kube's typed API, to see raw status codes and bodies.
async fn raw(
    server: &FakeApiServer,
    method: &str,
    path: &str,
    content_type: &str,
    body: &str,
) -> (u16, Value) {
    let (code, bytes, _) = request(server, method, path, "application/json", content_type, body).await;
    (code, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---------------------------------------------------------------------------------------
// Errors

#[tokio::test]
async fn get_of_a_missing_object_is_a_not_found_status() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    let status = status_of(proxies.get("x").await);
    assert_eq!(status.code, 404);
    assert_eq!(status.reason, "NotFound");
    assert_eq!(status.message, "proxies.crawl.example.com \"x\" not found");

    let (code, body) = raw(
        &server,
        "GET",
        "/apis/crawl.example.com/v1alpha1/namespaces/default/proxies/x",
        "",
        "",
    )
    .await;
    assert_eq!(code, 404);
    assert_eq!(
        body,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "proxies.crawl.example.com \"x\" not found", "reason": "NotFound",
            "details": {"name": "x", "group": "crawl.example.com", "kind": "proxies"}, "code": 404,
        })
    );
    // Core resources have no group in the message or details.
    let (_, body) = raw(&server, "GET", "/api/v1/namespaces/default/configmaps/y", "", "").await;
    assert_eq!(body["message"], "configmaps \"y\" not found");
    assert_eq!(body["details"], json!({"name": "y", "kind": "configmaps"}));
}

#[tokio::test]
async fn a_resource_that_is_not_served_is_a_404_like_a_missing_crd() {
    let server = FakeApiServer::start().await;
    let (code, body) = raw(
        &server,
        "GET",
        "/apis/example.org/v1/namespaces/default/widgets",
        "",
        "",
    )
    .await;
    assert_eq!(code, 404);
    assert_eq!(body["reason"], "NotFound");
    assert_eq!(
        body["message"],
        "the server could not find the requested resource"
    );
}

#[tokio::test]
async fn create_of_an_existing_name_is_already_exists() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    cms.create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    let status = status_of(cms.create(&PostParams::default(), &config_map("a", &[])).await);
    assert_eq!((status.code, status.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(status.message, "configmaps \"a\" already exists");
}

#[tokio::test]
async fn create_fills_server_owned_metadata_and_generate_name() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let mut cm = config_map("", &[]);
    cm.metadata.name = None;
    cm.metadata.generate_name = Some("gen-".into());
    let created = cms.create(&PostParams::default(), &cm).await.unwrap();
    let name = created.name_any();
    assert!(name.starts_with("gen-") && name.len() == 9, "{name}");
    assert_eq!(created.metadata.namespace.as_deref(), Some("default"));
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
    // ConfigMaps do not track generation; custom resources start at 1.
    assert_eq!(created.metadata.generation, None);
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    assert_eq!(
        proxies
            .create(&PostParams::default(), &proxy("p"))
            .await
            .unwrap()
            .metadata
            .generation,
        Some(1)
    );

    // Neither name nor generateName: 422; resourceVersion set on create: rejected.
    cm.metadata.generate_name = None;
    let status = status_of(cms.create(&PostParams::default(), &cm).await);
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert!(
        status
            .message
            .contains("metadata.name: Required value: name or generateName is required")
    );
    let mut with_rv = config_map("with-rv", &[]);
    with_rv.metadata.resource_version = Some("5".into());
    let status = status_of(cms.create(&PostParams::default(), &with_rv).await);
    assert_eq!(
        status.message,
        "resourceVersion should not be set on objects to be created"
    );
}

// ---------------------------------------------------------------------------------------
// resourceVersion, conflicts, generation

#[tokio::test]
async fn resource_version_increases_on_every_write_and_a_stale_replace_conflicts() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let created = cms
        .create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    let mut changed = created.clone();
    changed.data = Some(BTreeMap::from([("key".to_owned(), "other".to_owned())]));
    let replaced = cms.replace("a", &PostParams::default(), &changed).await.unwrap();
    assert!(rv(&replaced.metadata) > rv(&created.metadata));
    assert_eq!(replaced.metadata.uid, created.metadata.uid);

    // `changed` still carries the first resourceVersion: optimistic concurrency says no.
    let status = status_of(cms.replace("a", &PostParams::default(), &changed).await);
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        status.message,
        "Operation cannot be fulfilled on configmaps \"a\": the object has been modified; \
         please apply your changes to the latest version and try again"
    );
    // Built-in types allow an unconditional update (no resourceVersion).
    changed.metadata.resource_version = None;
    cms.replace("a", &PostParams::default(), &changed).await.unwrap();
}

#[tokio::test]
async fn custom_resources_require_a_resource_version_on_replace() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    proxies.create(&PostParams::default(), &proxy("p")).await.unwrap();
    let status = status_of(proxies.replace("p", &PostParams::default(), &proxy("p")).await);
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert!(
        status.message.contains("metadata.resourceVersion: Invalid value"),
        "{}",
        status.message
    );
}

#[tokio::test]
async fn generation_counts_spec_changes_only() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    proxies.create(&PostParams::default(), &proxy("p")).await.unwrap();
    let pp = PatchParams::default();

    let labelled = proxies
        .patch(
            "p",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        labelled.metadata.generation,
        Some(1),
        "metadata changes leave generation alone"
    );

    let status = json!({"status": {"phase": "Healthy", "observedGeneration": 1}});
    let with_status = proxies
        .patch_status("p", &pp, &Patch::Merge(status.clone()))
        .await
        .unwrap();
    assert_eq!(
        with_status.metadata.generation,
        Some(1),
        "status changes leave generation alone"
    );

    let respecced = proxies
        .patch("p", &pp, &Patch::Merge(json!({"spec": {"port": 8080}})))
        .await
        .unwrap();
    assert_eq!(respecced.metadata.generation, Some(2));

    // A write that changes nothing is a no-op: same resourceVersion, no event.
    let again = proxies
        .patch_status("p", &pp, &Patch::Merge(status))
        .await
        .unwrap();
    assert_eq!(
        again.metadata.resource_version,
        respecced.metadata.resource_version
    );
}

// ---------------------------------------------------------------------------------------
// Status subresource

#[tokio::test]
async fn the_status_subresource_isolates_status_from_spec_both_ways() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    let mut created = proxies.create(&PostParams::default(), &proxy("p")).await.unwrap();
    assert!(created.status.is_none());

    // Main resource: the status in the body is ignored, the spec change is kept.
    created.spec.port = 8080;
    created.status = Some(ProxyStatus {
        phase: Some("Healthy".into()),
        ..Default::default()
    });
    let replaced = proxies
        .replace("p", &PostParams::default(), &created)
        .await
        .unwrap();
    assert_eq!(replaced.spec.port, 8080);
    assert!(
        replaced.status.is_none(),
        "main-resource PUT must not change status"
    );

    // Status subresource: the spec in the body is ignored, the status is kept.
    let mut for_status = replaced.clone();
    for_status.spec.port = 9999;
    for_status.status = Some(ProxyStatus {
        phase: Some("Healthy".into()),
        ..Default::default()
    });
    let after = proxies
        .replace_status("p", &PostParams::default(), &for_status)
        .await
        .unwrap();
    assert_eq!(after.spec.port, 8080, "status PUT must not change spec");
    assert_eq!(after.status.and_then(|s| s.phase).as_deref(), Some("Healthy"));
    assert_eq!(after.metadata.generation, Some(2));

    // Merge patches obey the same split.
    let patched = proxies
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Gone"}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.status.and_then(|s| s.phase).as_deref(), Some("Healthy"));
    let patched = proxies
        .patch_status(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"port": 1}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.spec.port, 8080);
}

// ---------------------------------------------------------------------------------------
// Finalizers and deletion

#[tokio::test]
async fn finalizers_hold_a_deleted_object_until_they_are_removed() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    let mut p = proxy("p");
    p.metadata.finalizers = Some(vec!["crawl.example.com/cleanup".into()]);
    let created = proxies.create(&PostParams::default(), &p).await.unwrap();
    let mut events = proxies
        .watch(&WatchParams::default(), &created.resource_version().unwrap())
        .await
        .unwrap()
        .boxed();

    let deleted = proxies.delete("p", &DeleteParams::default()).await.unwrap();
    let marked = deleted
        .left()
        .expect("a custom resource DELETE answers with the object");
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert_eq!(
        marked.metadata.generation,
        Some(2),
        "setting deletionTimestamp bumps generation"
    );
    let still_there = proxies.get("p").await.unwrap();
    assert!(still_there.metadata.deletion_timestamp.is_some());
    match next_event(&mut events).await {
        WatchEvent::Modified(o) => assert!(o.metadata.deletion_timestamp.is_some()),
        other => panic!("expected MODIFIED with deletionTimestamp, got {other:?}"),
    }

    // Adding a finalizer while deleting is forbidden.
    let add = Patch::Merge(json!({"metadata": {"finalizers": ["crawl.example.com/cleanup", "other"]}}));
    let status = status_of(proxies.patch("p", &PatchParams::default(), &add).await);
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        status.message,
        "Proxy.crawl.example.com \"p\" is invalid: metadata.finalizers: Forbidden: no new finalizers can be \
         added if the object is being deleted, found new finalizers []string{\"other\"}"
    );

    // Removing the last finalizer completes the deletion.
    let clear = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    proxies.patch("p", &PatchParams::default(), &clear).await.unwrap();
    assert_eq!(status_of(proxies.get("p").await).code, 404);
    let mut saw_delete = false;
    while let Ok(Ok(Some(event))) = timeout(Duration::from_millis(500), events.try_next()).await {
        if let WatchEvent::Deleted(o) = event {
            assert_eq!(o.name_any(), "p");
            saw_delete = true;
            break;
        }
    }
    assert!(saw_delete, "the watch must see DELETED");
}

#[tokio::test]
async fn delete_without_finalizers_answers_a_status_or_the_object_per_resource() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    cms.create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    let status = cms
        .delete("a", &DeleteParams::default())
        .await
        .unwrap()
        .right()
        .expect("ConfigMaps answer a Status");
    assert_eq!(status.details.map(|d| d.name), Some("a".into()));
    assert_eq!(status_of(cms.get("a").await).code, 404);
    assert_eq!(
        status_of(cms.delete("a", &DeleteParams::default()).await).code,
        404
    );

    // A precondition on the UID that does not match is a conflict.
    let created = cms
        .create(&PostParams::default(), &config_map("b", &[]))
        .await
        .unwrap();
    let status = status_of(
        cms.delete(
            "b",
            &DeleteParams::default().preconditions(kube::api::Preconditions {
                uid: Some("not-the-uid".into()),
                resource_version: None,
            }),
        )
        .await,
    );
    assert_eq!(status.code, 409);
    assert!(
        status
            .message
            .contains("Precondition failed: UID in precondition: not-the-uid")
    );
    assert!(cms.get("b").await.is_ok());
    drop(created);
}

#[tokio::test]
async fn kube_runtime_finalizer_helper_adds_and_removes_its_finalizer() {
    // kube-runtime's helper adds with `test /metadata/finalizers null` + `add`, and removes
    // with `test` + `remove` JSON patches: this is the JSON patch behaviour it relies on.
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    const NAME: &str = "crawl.example.com/cleanup";
    let created = proxies.create(&PostParams::default(), &proxy("p")).await.unwrap();
    finalizer(&proxies, NAME, Arc::new(created), |_| async {
        Ok::<_, Infallible>(kube::runtime::controller::Action::await_change())
    })
    .await
    .unwrap();
    let with_finalizer = proxies.get("p").await.unwrap();
    assert_eq!(with_finalizer.finalizers(), [NAME.to_owned()]);

    proxies.delete("p", &DeleteParams::default()).await.unwrap();
    let deleting = proxies.get("p").await.unwrap();
    let cleaned = Arc::new(AtomicBool::new(false));
    let flag = cleaned.clone();
    finalizer(&proxies, NAME, Arc::new(deleting), |event| async move {
        if let FinalizerEvent::Cleanup(_) = event {
            flag.store(true, Ordering::SeqCst);
        }
        Ok::<_, Infallible>(kube::runtime::controller::Action::await_change())
    })
    .await
    .unwrap();
    assert!(cleaned.load(Ordering::SeqCst));
    assert_eq!(
        status_of(proxies.get("p").await).code,
        404,
        "removing the finalizer completes the delete"
    );
}

// ---------------------------------------------------------------------------------------
// Patches

#[tokio::test]
async fn merge_patch_follows_rfc_7386_and_honours_a_resource_version_precondition() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let created = cms
        .create(
            &PostParams::default(),
            &config_map("a", &[("keep", "1"), ("drop", "1")]),
        )
        .await
        .unwrap();
    let patch = json!({"metadata": {"labels": {"drop": null, "new": "2"}}, "data": {"other": "x"}});
    let patched = cms
        .patch("a", &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
    let labels: Vec<_> = patched.labels().iter().map(|(k, v)| format!("{k}={v}")).collect();
    assert_eq!(labels, ["keep=1", "new=2"]);
    assert_eq!(patched.data.unwrap().len(), 2, "objects merge key by key");

    let stale = json!({"metadata": {"resourceVersion": created.resource_version()}, "data": {"x": "y"}});
    let status = status_of(
        cms.patch("a", &PatchParams::default(), &Patch::Merge(stale))
            .await,
    );
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
}

#[tokio::test]
async fn json_patch_with_a_failing_test_is_a_422_and_changes_nothing() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let created = cms
        .create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/data/key", "value": "not-the-value"},
        {"op": "replace", "path": "/data/key", "value": "changed"},
    ]))
    .unwrap();
    let status = status_of(
        cms.patch("a", &PatchParams::default(), &Patch::Json::<()>(patch))
            .await,
    );
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        status.message,
        "the server rejected our request due to an error in our request"
    );
    assert_eq!(
        cms.get("a").await.unwrap().metadata.resource_version,
        created.metadata.resource_version
    );

    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/data/key", "value": "value"},
        {"op": "add", "path": "/data/second", "value": "2"},
        {"op": "remove", "path": "/data/key"},
    ]))
    .unwrap();
    let patched = cms
        .patch("a", &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .unwrap();
    assert_eq!(
        patched.data.unwrap(),
        BTreeMap::from([("second".to_owned(), "2".to_owned())])
    );
}

#[tokio::test]
async fn server_side_apply_creates_updates_removes_dropped_fields_and_reports_conflicts() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let config = |data: Value| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}, "data": data});
    let pp = PatchParams::apply("operator");

    let created = cms
        .patch("a", &pp, &Patch::Apply(config(json!({"one": "1", "two": "2"}))))
        .await
        .unwrap();
    assert_eq!(
        created.data.as_ref().map(BTreeMap::len),
        Some(2),
        "apply creates a missing object"
    );

    // Fields the same manager applied before and omits now are removed.
    let updated = cms
        .patch("a", &pp, &Patch::Apply(config(json!({"one": "1"}))))
        .await
        .unwrap();
    assert_eq!(
        updated.data.unwrap(),
        BTreeMap::from([("one".to_owned(), "1".to_owned())])
    );

    // Another manager setting the same field to another value conflicts unless forced.
    let other = PatchParams::apply("someone-else");
    let status = status_of(
        cms.patch("a", &other, &Patch::Apply(config(json!({"one": "9"}))))
            .await,
    );
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        status.message,
        "Apply failed with 1 conflict: conflict with \"operator\" using v1: .data.one"
    );
    let forced = cms
        .patch("a", &other.force(), &Patch::Apply(config(json!({"one": "9"}))))
        .await
        .unwrap();
    assert_eq!(forced.data.unwrap()["one"], "9");

    // Apply without a field manager is refused (raw: kube validates it client-side).
    let (code, body) = raw(
        &server,
        "PATCH",
        "/api/v1/namespaces/default/configmaps/a",
        "application/apply-patch+yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\n",
    )
    .await;
    assert_eq!(code, 422);
    assert_eq!(
        body["message"],
        "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch"
    );
    // YAML bodies are accepted.
    let (code, body) = raw(
        &server,
        "PATCH",
        "/api/v1/namespaces/default/configmaps/b?fieldManager=yaml",
        "application/apply-patch+yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: b\ndata:\n  k: v\n",
    )
    .await;
    assert_eq!((code, &body["data"]["k"]), (201, &json!("v")));
}

#[tokio::test]
async fn strategic_merge_patch_is_unsupported_on_custom_resources() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    proxies.create(&PostParams::default(), &proxy("p")).await.unwrap();
    let patch = Patch::Strategic(json!({"spec": {"port": 1}}));
    let status = status_of(proxies.patch("p", &PatchParams::default(), &patch).await);
    assert_eq!(
        (status.code, status.reason.as_str()),
        (415, "UnsupportedMediaType")
    );
    // Built-in types take it (approximated as a merge patch).
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    cms.create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    let patched = cms
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Strategic(json!({"data": {"b": "c"}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.data.unwrap().len(), 2);
}

// ---------------------------------------------------------------------------------------
// Lists and selectors

async fn names(cms: &Api<ConfigMap>, selector: &str) -> Vec<String> {
    cms.list(&ListParams::default().labels(selector))
        .await
        .unwrap()
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect()
}

#[tokio::test]
async fn label_selectors_support_equality_and_set_based_requirements() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    for (name, labels) in [
        ("eu-prod", vec![("region", "eu"), ("tier", "prod")]),
        ("us-prod", vec![("region", "us"), ("tier", "prod")]),
        ("eu-dev", vec![("region", "eu"), ("tier", "dev")]),
        ("bare", vec![]),
    ] {
        cms.create(&PostParams::default(), &config_map(name, &labels))
            .await
            .unwrap();
    }
    assert_eq!(names(&cms, "region=eu").await, ["eu-dev", "eu-prod"]);
    assert_eq!(names(&cms, "region==eu,tier=prod").await, ["eu-prod"]);
    // `!=` and `notin` also select objects without the label.
    assert_eq!(names(&cms, "region!=eu").await, ["bare", "us-prod"]);
    assert_eq!(
        names(&cms, "tier notin (dev)").await,
        ["bare", "eu-prod", "us-prod"]
    );
    assert_eq!(
        names(&cms, "region in (eu, us),tier in (prod)").await,
        ["eu-prod", "us-prod"]
    );
    assert_eq!(names(&cms, "tier").await, ["eu-dev", "eu-prod", "us-prod"]);
    assert_eq!(names(&cms, "!tier").await, ["bare"]);
    let status = status_of(cms.list(&ListParams::default().labels("region in eu")).await);
    assert_eq!((status.code, status.reason.as_str()), (400, "BadRequest"));

    let by_name = cms
        .list(&ListParams::default().fields("metadata.name=bare"))
        .await
        .unwrap();
    assert_eq!(by_name.items.len(), 1);
    let status = status_of(cms.list(&ListParams::default().fields("data.key=value")).await);
    assert_eq!(status.code, 400);
}

#[tokio::test]
async fn lists_paginate_with_limit_and_continue_and_scope_to_a_namespace() {
    let server = FakeApiServer::start().await;
    let client = server.client();
    let default: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let other: Api<ConfigMap> = Api::namespaced(client.clone(), "other");
    for i in 0..5 {
        default
            .create(&PostParams::default(), &config_map(&format!("cm-{i}"), &[]))
            .await
            .unwrap();
    }
    other
        .create(&PostParams::default(), &config_map("elsewhere", &[]))
        .await
        .unwrap();

    let first = default.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(first.items.len(), 2);
    let token = first.metadata.continue_.clone().expect("more pages");
    let second = default
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    let third = default
        .list(
            &ListParams::default()
                .limit(2)
                .continue_token(&second.metadata.continue_.clone().unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(third.items.len(), 1);
    assert!(third.metadata.continue_.is_none());
    assert_eq!(third.metadata.resource_version, first.metadata.resource_version);
    let all: Api<ConfigMap> = Api::all(client);
    assert_eq!(all.list(&ListParams::default()).await.unwrap().items.len(), 6);
}

// ---------------------------------------------------------------------------------------
// Watch

/// Polls `stream` on its own task and forwards what it yields.
fn drive<T: Send + 'static>(
    stream: impl futures::Stream<Item = T> + Send + 'static,
) -> tokio::sync::mpsc::UnboundedReceiver<T> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if tx.send(item).is_err() {
                break;
            }
        }
    });
    rx
}

/// The next watch event other than a BOOKMARK (kube asks for bookmarks by default), within
/// `WAIT` in all.
async fn next_event<K: Clone + std::fmt::Debug>(
    stream: &mut (impl futures::Stream<Item = Result<WatchEvent<K>, kube::Error>> + Unpin),
) -> WatchEvent<K> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let event = tokio::time::timeout_at(deadline, stream.next())
            .await
            .expect("a watch event in time")
            .expect("the stream is open")
            .expect("a decodable event");
        if !matches!(event, WatchEvent::Bookmark(_)) {
            return event;
        }
    }
}

#[tokio::test]
async fn watch_replays_every_event_after_the_given_resource_version() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let a = cms
        .create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    cms.create(&PostParams::default(), &config_map("b", &[]))
        .await
        .unwrap();
    cms.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "v"}})),
    )
    .await
    .unwrap();
    cms.delete("b", &DeleteParams::default()).await.unwrap();

    let mut stream = cms
        .watch(&WatchParams::default(), &a.resource_version().unwrap())
        .await
        .unwrap()
        .boxed();
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(match next_event(&mut stream).await {
            WatchEvent::Added(o) => format!("ADDED {}", o.name_any()),
            WatchEvent::Modified(o) => format!("MODIFIED {}", o.name_any()),
            WatchEvent::Deleted(o) => format!("DELETED {}", o.name_any()),
            other => format!("{other:?}"),
        });
    }
    assert_eq!(seen, ["ADDED b", "MODIFIED a", "DELETED b"]);

    // resourceVersion "0": synthetic ADDED events for what exists, then live events.
    let mut from_zero = cms.watch(&WatchParams::default(), "0").await.unwrap().boxed();
    assert!(matches!(next_event(&mut from_zero).await, WatchEvent::Added(o) if o.name_any() == "a"));
    cms.create(&PostParams::default(), &config_map("c", &[]))
        .await
        .unwrap();
    assert!(matches!(next_event(&mut from_zero).await, WatchEvent::Added(o) if o.name_any() == "c"));
}

#[tokio::test]
async fn a_label_selected_watch_sees_objects_enter_and_leave_the_selection() {
    let server = FakeApiServer::start().await;
    let secrets: Api<Secret> = Api::default_namespaced(server.client());
    let created = secrets
        .create(
            &PostParams::default(),
            &Secret {
                metadata: ObjectMeta {
                    name: Some("s".into()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let wp = WatchParams::default().labels("crawl.example.com/cloud-init=true");
    let mut stream = secrets
        .watch(&wp, &created.resource_version().unwrap())
        .await
        .unwrap()
        .boxed();
    let label = |on: bool| {
        let value = if on { json!("true") } else { Value::Null };
        Patch::Merge(json!({"metadata": {"labels": {"crawl.example.com/cloud-init": value}}}))
    };
    secrets
        .patch("s", &PatchParams::default(), &label(true))
        .await
        .unwrap();
    assert!(matches!(next_event(&mut stream).await, WatchEvent::Added(o) if o.name_any() == "s"));
    secrets
        .patch(
            "s",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"k": "v"}})),
        )
        .await
        .unwrap();
    match next_event(&mut stream).await {
        WatchEvent::Modified(o) => assert_eq!(o.data.unwrap()["k"].0, b"v", "stringData is stored as data"),
        other => panic!("expected MODIFIED, got {other:?}"),
    }
    let unlabelled = secrets
        .patch("s", &PatchParams::default(), &label(false))
        .await
        .unwrap();
    match next_event(&mut stream).await {
        WatchEvent::Deleted(o) => assert_eq!(o.resource_version(), unlabelled.resource_version()),
        other => panic!("expected DELETED when the object stops matching, got {other:?}"),
    }
}

#[tokio::test]
async fn watches_get_bookmarks_and_end_cleanly_at_their_timeout() {
    let options = Options {
        bookmark_interval: Duration::from_millis(50),
        ..Options::default()
    };
    let server = FakeApiServer::start_with(options).await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let a = cms
        .create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    let wp = WatchParams::default().timeout(1);
    let mut stream = cms
        .watch(&wp, &a.resource_version().unwrap())
        .await
        .unwrap()
        .boxed();
    match timeout(WAIT, stream.next()).await.unwrap().unwrap().unwrap() {
        WatchEvent::Bookmark(bookmark) => {
            assert_eq!(bookmark.metadata.resource_version, a.resource_version().unwrap())
        }
        other => panic!("expected a BOOKMARK, got {other:?}"),
    }
    // Without allowWatchBookmarks there are none; the stream ends at timeoutSeconds.
    let mut quiet = cms
        .watch(
            &WatchParams::default().disable_bookmarks().timeout(1),
            &a.resource_version().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    let started = tokio::time::Instant::now();
    assert!(
        timeout(WAIT, quiet.next()).await.unwrap().is_none(),
        "no events, then a clean end"
    );
    assert!(started.elapsed() >= Duration::from_millis(900));
}

#[tokio::test]
async fn a_watch_from_a_compacted_resource_version_gets_410_expired() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let a = cms
        .create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    server.compact();
    let mut stream = cms
        .watch(&WatchParams::default(), &a.resource_version().unwrap())
        .await
        .unwrap()
        .boxed();
    match next_event(&mut stream).await {
        WatchEvent::Error(status) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            assert!(
                status
                    .message
                    .starts_with(&format!("too old resource version: {}", rv(&a.metadata)))
            );
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
    assert!(
        timeout(WAIT, stream.next()).await.unwrap().is_none(),
        "the stream ends after the error"
    );
    // A fresh list's resourceVersion can be watched from.
    let list = cms.list(&ListParams::default()).await.unwrap();
    let mut fresh = cms
        .watch(&WatchParams::default(), &list.metadata.resource_version.unwrap())
        .await
        .unwrap()
        .boxed();
    cms.create(&PostParams::default(), &config_map("b", &[]))
        .await
        .unwrap();
    assert!(matches!(next_event(&mut fresh).await, WatchEvent::Added(o) if o.name_any() == "b"));
}

#[tokio::test]
async fn the_history_bound_expires_old_resource_versions_too() {
    let options = Options {
        history_limit: 2,
        ..Options::default()
    };
    let server = FakeApiServer::start_with(options).await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    let a = cms
        .create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    for name in ["b", "c", "d"] {
        cms.create(&PostParams::default(), &config_map(name, &[]))
            .await
            .unwrap();
    }
    let mut stream = cms
        .watch(&WatchParams::default(), &a.resource_version().unwrap())
        .await
        .unwrap()
        .boxed();
    assert!(matches!(next_event(&mut stream).await, WatchEvent::Error(s) if s.code == 410));
}

#[tokio::test]
async fn kube_watcher_relists_after_410_and_keeps_delivering() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    cms.create(&PostParams::default(), &config_map("before", &[]))
        .await
        .unwrap();
    // Driven by its own task, as a controller drives it: the watcher only watches when polled.
    let mut events = drive(watcher::watcher(cms.clone(), watcher::Config::default()));
    let mut next = async || {
        timeout(WAIT, events.recv())
            .await
            .expect("a watcher event in time")
            .expect("open")
    };
    assert!(matches!(next().await, Ok(WatcherEvent::Init)));
    assert!(matches!(next().await, Ok(WatcherEvent::InitApply(o)) if o.name_any() == "before"));
    assert!(matches!(next().await, Ok(WatcherEvent::InitDone)));
    eventually("the watcher's watch to open", || server.open_watches() == 1).await;

    server.compact();
    server.expire_watches();
    cms.create(&PostParams::default(), &config_map("after", &[]))
        .await
        .unwrap();

    match next().await {
        Err(watcher::Error::WatchError(status)) => assert_eq!(status.code, 410),
        other => panic!("expected the 410 to surface, got {other:?}"),
    }
    assert!(matches!(next().await, Ok(WatcherEvent::Init)));
    let mut relisted = Vec::new();
    loop {
        match next().await {
            Ok(WatcherEvent::InitApply(o)) => relisted.push(o.name_any()),
            Ok(WatcherEvent::InitDone) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(relisted, ["after", "before"]);
    cms.create(&PostParams::default(), &config_map("later", &[]))
        .await
        .unwrap();
    assert!(matches!(next().await, Ok(WatcherEvent::Apply(o)) if o.name_any() == "later"));
    let lists = server.requests().iter().filter(|r| r.verb == Verb::List).count();
    assert_eq!(lists, 2, "one initial list and one relist");
}

#[tokio::test]
async fn streaming_lists_end_their_initial_events_with_an_annotated_bookmark() {
    let server = FakeApiServer::start().await;
    let cms: Api<ConfigMap> = Api::default_namespaced(server.client());
    cms.create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    let mut events = watcher::watcher(cms.clone(), watcher::Config::default().streaming_lists()).boxed();
    let mut next = async || {
        timeout(WAIT, events.next())
            .await
            .expect("in time")
            .expect("open")
            .expect("no error")
    };
    assert!(matches!(next().await, WatcherEvent::Init));
    assert!(matches!(next().await, WatcherEvent::InitApply(o) if o.name_any() == "a"));
    assert!(matches!(next().await, WatcherEvent::InitDone));
    cms.create(&PostParams::default(), &config_map("b", &[]))
        .await
        .unwrap();
    assert!(matches!(next().await, WatcherEvent::Apply(o) if o.name_any() == "b"));
    assert_eq!(
        server.requests().iter().filter(|r| r.verb == Verb::List).count(),
        0
    );
}

#[tokio::test]
async fn metadata_only_watches_get_partial_object_metadata() {
    let server = FakeApiServer::start().await;
    let client = server.client();
    let secrets: Api<Secret> = Api::default_namespaced(client.clone());
    let mut secret = Secret::default();
    secret.metadata.name = Some("s".into());
    secret.metadata.labels = Some(BTreeMap::from([(
        "crawl.example.com/cloud-init".into(),
        "true".into(),
    )]));
    secrets.create(&PostParams::default(), &secret).await.unwrap();
    let config = watcher::Config::default().labels("crawl.example.com/cloud-init=true");
    let metadata: Api<PartialObjectMeta<Secret>> = Api::default_namespaced(client);
    let mut events = watcher::watcher(metadata, config).boxed();
    let mut names = Vec::new();
    while names.is_empty() {
        match timeout(WAIT, events.next()).await.unwrap().unwrap().unwrap() {
            WatcherEvent::InitApply(meta) => names.push(meta.name_any()),
            WatcherEvent::Init => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(names, ["s"]);
}

// ---------------------------------------------------------------------------------------
// Hooks

#[tokio::test]
async fn fail_next_injects_a_conflict_that_a_retry_loop_observes() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    proxies.create(&PostParams::default(), &proxy("p")).await.unwrap();
    server.fail_next(
        RequestMatcher::any()
            .verb(Verb::Patch)
            .resource("proxies")
            .subresource("status"),
        1,
        409,
    );

    let mut attempts = 0;
    let patched = loop {
        attempts += 1;
        let patch = Patch::Merge(json!({"status": {"phase": "Provisioning"}}));
        match proxies.patch_status("p", &PatchParams::default(), &patch).await {
            Err(kube::Error::Api(status)) if status.reason == "Conflict" => continue,
            other => break other.unwrap(),
        }
    };
    assert_eq!(attempts, 2);
    assert_eq!(patched.status.unwrap().phase.as_deref(), Some("Provisioning"));
    let codes: Vec<u16> = server.writes().iter().map(|w| w.code).collect();
    assert_eq!(codes, [201, 409, 200]);

    // A 500 is returned as is (kube only retries 429/503/504).
    server.fail_next(RequestMatcher::any().verb(Verb::Get).name("p"), 1, 500);
    let status = status_of(proxies.get("p").await);
    assert_eq!((status.code, status.reason.as_str()), (500, "InternalError"));
    assert!(proxies.get("p").await.is_ok());

    // An outage ends early when the same matcher is set to zero failures.
    let leases = RequestMatcher::any().resource("leases");
    server.fail_next(leases.clone(), 1_000, 500);
    let lease_api: Api<Lease> = Api::default_namespaced(server.client());
    assert_eq!(status_of(lease_api.get("l").await).code, 500);
    assert_eq!(status_of(lease_api.get("l").await).code, 500);
    server.fail_next(leases, 0, 500);
    assert_eq!(status_of(lease_api.get("l").await).code, 404);
}

#[tokio::test]
async fn write_counters_count_exactly_the_writes_made() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    proxies.create(&PostParams::default(), &proxy("p")).await.unwrap();
    proxies.get("p").await.unwrap();
    proxies.list(&ListParams::default()).await.unwrap();
    proxies
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .unwrap();
    proxies
        .patch_status(
            "p",
            &PatchParams::apply("op"),
            &Patch::Apply(json!({
                "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy", "status": {"phase": "Pending"}
            })),
        )
        .await
        .unwrap();
    proxies.delete("p", &DeleteParams::default()).await.unwrap();

    let writes: Vec<(Verb, Option<String>, Option<String>)> = server
        .writes()
        .into_iter()
        .map(|w| (w.verb, w.name, w.subresource))
        .collect();
    assert_eq!(
        writes,
        [
            (Verb::Create, None, None),
            (Verb::Patch, Some("p".into()), None),
            (Verb::Patch, Some("p".into()), Some("status".into())),
            (Verb::Delete, Some("p".into()), None),
        ]
    );
    assert_eq!(server.requests().len(), 6);
    let apply = &server.writes()[2];
    assert_eq!(
        apply.content_type.as_deref(),
        Some("application/apply-patch+yaml")
    );
    assert_eq!(apply.field_manager.as_deref(), Some("op"));
}

#[tokio::test]
async fn direct_store_access_is_visible_over_http_and_to_watches() {
    let server = FakeApiServer::start().await;
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    let mut stream = proxies.watch(&WatchParams::default(), "0").await.unwrap().boxed();
    let stored = server.put_json(
        "proxies",
        json!({"metadata": {"name": "p"}, "spec": {"provider": "memory"}, "status": {"phase": "Healthy"}}),
    );
    assert_eq!(stored["metadata"]["generation"], 1);
    assert!(matches!(next_event(&mut stream).await, WatchEvent::Added(p) if p.status.is_some()));
    let got = proxies.get("p").await.unwrap();
    assert_eq!(got.status.unwrap().phase.as_deref(), Some("Healthy"));
    assert_eq!(
        server.get_json("proxies", Some("default"), "p").unwrap()["spec"]["provider"],
        "memory"
    );
    assert!(server.delete_json("proxies", Some("default"), "p"));
    assert!(matches!(next_event(&mut stream).await, WatchEvent::Deleted(_)));
    assert!(server.get_json("proxies", Some("default"), "p").is_none());
}

#[tokio::test]
async fn a_validator_hook_turns_crd_schema_problems_into_422_invalid() {
    let server = FakeApiServer::start().await;
    let schema = Mutex::new(egress_proxies_operator::check::ProxySchema::new());
    server.set_validator("proxies.crawl.example.com", move |object, old| {
        let problems = schema.lock().unwrap().validate_update(object, old);
        problems
            .into_iter()
            .map(|(path, message)| {
                let pointer = format!("/{}", path.replace('.', "/"));
                FieldError::invalid(
                    path,
                    object.pointer(&pointer).cloned().unwrap_or(Value::Null),
                    message,
                )
            })
            .collect()
    });
    let proxies: Api<Proxy> = Api::default_namespaced(server.client());
    let mut bad = proxy("p");
    bad.spec.port = 70000;
    let status = status_of(proxies.create(&PostParams::default(), &bad).await);
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert!(
        status
            .message
            .starts_with("Proxy.crawl.example.com \"p\" is invalid: spec.port"),
        "{}",
        status.message
    );
    proxies.create(&PostParams::default(), &proxy("p")).await.unwrap();
}

// ---------------------------------------------------------------------------------------
// What the controller uses from kube-runtime: Events and Leases

#[tokio::test]
async fn the_kube_runtime_event_recorder_creates_then_patches_a_series() {
    let server = FakeApiServer::start().await;
    let client = server.client();
    let cms: Api<ConfigMap> = Api::default_namespaced(client.clone());
    let cm = cms
        .create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "egress-proxies-operator".into(),
            instance: Some("test".into()),
        },
    );
    let event = Event {
        type_: EventType::Normal,
        reason: "Provisioned".into(),
        note: Some("instance created".into()),
        action: "Provision".into(),
        secondary: None,
    };
    recorder.publish(&event, &cm.object_ref(&())).await.unwrap();
    recorder.publish(&event, &cm.object_ref(&())).await.unwrap();

    let events: Api<K8sEvent> = Api::default_namespaced(client);
    let listed = events.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].reason.as_deref(), Some("Provisioned"));
    assert_eq!(listed[0].series.as_ref().map(|s| s.count), Some(2));
    let writes: Vec<(Verb, String)> = server.writes().into_iter().map(|w| (w.verb, w.group)).collect();
    assert_eq!(
        writes[1..],
        [
            (Verb::Create, "events.k8s.io".into()),
            (Verb::Patch, "events.k8s.io".into())
        ]
    );
}

#[tokio::test]
async fn lease_updates_use_optimistic_concurrency_for_leader_election() {
    let server = FakeApiServer::start().await;
    let leases: Api<Lease> = Api::default_namespaced(server.client());
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some("egress-proxies-operator".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("a".into()),
            lease_duration_seconds: Some(15),
            ..Default::default()
        }),
    };
    let current = leases.create(&PostParams::default(), &lease).await.unwrap();
    let take = |holder: &str| {
        let mut next = current.clone();
        next.spec.as_mut().unwrap().holder_identity = Some(holder.into());
        next
    };
    let (first, second) = (take("b"), take("c"));
    leases
        .replace("egress-proxies-operator", &PostParams::default(), &first)
        .await
        .unwrap();
    let status = status_of(
        leases
            .replace("egress-proxies-operator", &PostParams::default(), &second)
            .await,
    );
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    let held = leases.get("egress-proxies-operator").await.unwrap();
    assert_eq!(held.spec.unwrap().holder_identity.as_deref(), Some("b"));
}

#[tokio::test]
async fn version_and_discovery_describe_the_served_resources() {
    let server = FakeApiServer::start().await;
    let client = server.client();
    let version = client.apiserver_version().await.unwrap();
    assert_eq!((version.major.as_str(), version.minor.as_str()), ("1", "33"));
    let discovery = kube::discovery::Discovery::new(client).run().await.unwrap();
    let gvk = kube::api::GroupVersionKind::gvk("crawl.example.com", "v1alpha1", "ProviderHealth");
    let (resource, caps) = discovery
        .resolve_gvk(&gvk)
        .expect("ProviderHealth is discoverable");
    assert_eq!(resource.plural, "providerhealths");
    assert_eq!(caps.scope, kube::discovery::Scope::Cluster);
}

/// TokenReview (authentication.k8s.io/v1): create-only; `status.authenticated` and the user for
/// a known token, `status.audiences` the intersection of the requested audiences and the
/// token's (the API server's own audience when none is requested), unauthenticated without a
/// common audience; nothing is stored, and reading the resource is not supported.
#[tokio::test]
async fn token_review_checks_token_and_audiences_and_stores_nothing() {
    let server = FakeApiServer::start().await;
    server.add_token(
        "sa",
        "system:serviceaccount:crawlers:bot",
        &["discovery", "other"],
    );
    server.add_token("pod-default", "system:serviceaccount:crawlers:pod", &[]);
    let api: Api<TokenReview> = Api::all(server.client());
    let review = |token: &str, audiences: Option<&[&str]>| TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.to_owned()),
            audiences: audiences.map(|a| a.iter().map(|s| (*s).to_owned()).collect()),
        },
        ..TokenReview::default()
    };
    let status = |answer: TokenReview| answer.status.expect("a TokenReview answer has a status");

    let answer = status(
        api.create(
            &PostParams::default(),
            &review("sa", Some(&["discovery", "elsewhere"])),
        )
        .await
        .unwrap(),
    );
    assert_eq!(answer.authenticated, Some(true));
    assert_eq!(
        answer.user.and_then(|u| u.username).as_deref(),
        Some("system:serviceaccount:crawlers:bot")
    );
    assert_eq!(answer.audiences, Some(vec!["discovery".to_owned()]));

    // Wrong audience, and a token for the API server's audience asked without audiences.
    let answer = status(
        api.create(&PostParams::default(), &review("sa", Some(&["elsewhere"])))
            .await
            .unwrap(),
    );
    assert_eq!(answer.authenticated, Some(false));
    assert!(answer.error.is_some());
    let answer = status(
        api.create(&PostParams::default(), &review("pod-default", None))
            .await
            .unwrap(),
    );
    assert_eq!(answer.authenticated, Some(true));
    assert_eq!(
        answer.audiences,
        Some(vec![support::fake_apiserver::API_SERVER_AUDIENCE.to_owned()])
    );
    let answer = status(
        api.create(&PostParams::default(), &review("nobody", None))
            .await
            .unwrap(),
    );
    assert_eq!(answer.authenticated, Some(false));

    let listed = status_of(api.list(&ListParams::default()).await);
    assert_eq!((listed.code, listed.reason.as_str()), (405, "MethodNotAllowed"));
    assert_eq!(
        server
            .requests()
            .iter()
            .filter(|r| r.resource == "tokenreviews" && r.verb == Verb::Create && r.succeeded())
            .count(),
        4
    );
}

// ---------------------------------------------------------------------------------------
// What kubectl needs: CRDs, OpenAPI, Tables, field validation, Events through core v1

/// A request with an Accept header, answering the status, the raw body and the `Warning`
/// headers.
async fn request(
    server: &FakeApiServer,
    method: &str,
    path: &str,
    accept: &str,
    content_type: &str,
    body: &str,
) -> (u16, Bytes, Vec<String>) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let request = hyper::Request::builder()
        .method(method)
        .uri(format!("{}{path}", server.url()))
        .header("accept", accept)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("a valid request");
    let response = client.request(request).await.expect("the fake server answers");
    let code = response.status().as_u16();
    let warnings = response
        .headers()
        .get_all("warning")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("a complete body")
        .to_bytes();
    (code, bytes, warnings)
}

async fn get_value(server: &FakeApiServer, path: &str, accept: &str) -> Value {
    let (code, body, _) = request(server, "GET", path, accept, "", "").await;
    assert_eq!(code, 200, "GET {path}: {}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).expect("JSON")
}

/// The Proxy CRD as `config/crd/bases` has it, stored over HTTP as `kubectl apply` does.
async fn install_proxy_crd(server: &FakeApiServer) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/crd/bases/crawl.example.com_proxies.yaml"
    );
    let crd: Value = serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (code, body, _) = request(
        server,
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        "application/json",
        "application/json",
        &crd.to_string(),
    )
    .await;
    assert_eq!(code, 201, "{}", String::from_utf8_lossy(&body));
}

const TABLE: &str = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";

/// Storing a CustomResourceDefinition serves its resource with the names, scope and schema it
/// declares, and marks it Established with its accepted names (as the apiextensions controllers
/// do).
#[tokio::test]
async fn a_stored_crd_is_served_with_its_names_and_established() {
    let server = FakeApiServer::start().await;
    let before = get_value(&server, "/apis/crawl.example.com/v1alpha1", "application/json").await;
    let proxies = |list: &Value| {
        list["resources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "proxies")
            .cloned()
            .unwrap()
    };
    assert!(proxies(&before).get("shortNames").is_none());
    install_proxy_crd(&server).await;
    let after = get_value(&server, "/apis/crawl.example.com/v1alpha1", "application/json").await;
    assert_eq!(proxies(&after)["shortNames"], json!(["px"]));
    assert_eq!(proxies(&after)["categories"], json!(["crawl"]));
    assert_eq!(proxies(&after)["singularName"], "proxy");
    let crd = server
        .get_json("customresourcedefinitions", None, "proxies.crawl.example.com")
        .unwrap();
    let established = crd["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Established")
        .cloned()
        .unwrap();
    assert_eq!(established["status"], "True");
    assert_eq!(crd["status"]["acceptedNames"]["kind"], "Proxy");
}

/// `Accept: ...;as=Table;g=meta.k8s.io` (kubectl get): a `meta.k8s.io/v1` Table whose columns
/// are `Name` then the CRD's `additionalPrinterColumns`, cells evaluated from their JSONPath
/// (a date as its age), rows carrying `PartialObjectMetadata` unless `includeObject` says
/// otherwise; types without printer columns get the default `Created At` column.
#[tokio::test]
async fn tables_are_printed_from_the_crds_printer_columns() {
    let server = FakeApiServer::start().await;
    install_proxy_crd(&server).await;
    server.put_json(
        "proxies",
        json!({
            "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
            "metadata": {"name": "p1", "namespace": "crawl"},
            "spec": {"provider": "local"},
            "status": {"phase": "healthy", "endpoint": "127.0.0.1:3128"},
        }),
    );
    let list_path = "/apis/crawl.example.com/v1alpha1/namespaces/crawl/proxies";
    let table = get_value(&server, list_path, TABLE).await;
    assert_eq!(table["kind"], "Table");
    assert_eq!(table["apiVersion"], "meta.k8s.io/v1");
    let columns: Vec<&str> = table["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(columns, ["Name", "Phase", "Provider", "Endpoint", "Age"]);
    let row = &table["rows"][0];
    assert_eq!(
        row["cells"].as_array().unwrap()[..4],
        [
            json!("p1"),
            json!("healthy"),
            json!("local"),
            json!("127.0.0.1:3128")
        ]
    );
    let age = row["cells"][4].as_str().unwrap();
    assert!(["0s", "1s", "2s"].contains(&age), "{age}");
    assert_eq!(row["object"]["kind"], "PartialObjectMetadata");
    assert_eq!(row["object"]["metadata"]["name"], "p1");
    assert!(table["metadata"]["resourceVersion"].is_string());

    let bare = get_value(&server, &format!("{list_path}?includeObject=None"), TABLE).await;
    assert!(bare["rows"][0].get("object").is_none());
    let full = get_value(&server, &format!("{list_path}/p1?includeObject=Object"), TABLE).await;
    assert_eq!(full["rows"].as_array().unwrap().len(), 1);
    assert_eq!(full["rows"][0]["object"]["status"]["phase"], "healthy");
    // Without the Table media type, the object itself.
    let plain = get_value(&server, &format!("{list_path}/p1"), "application/json").await;
    assert_eq!(plain["kind"], "Proxy");

    let built_in = get_value(&server, "/api/v1/namespaces/default/configmaps", TABLE).await;
    let columns: Vec<&str> = built_in["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(columns, ["Name", "Created At"]);
}

/// Printer columns of every type and the JSONPath forms CRDs use: an index, a quoted key, a
/// filter on a list of conditions, a missing field or unmatched filter (no value), an object
/// in a string column (its JSON), a value of the wrong type for the column (no value).
#[tokio::test]
async fn printer_columns_evaluate_jsonpath_and_column_types() {
    let server = FakeApiServer::start().await;
    let column = |name: &str, type_: &str, path: &str| json!({"name": name, "type": type_, "jsonPath": path});
    server.put_json(
        "customresourcedefinitions",
        json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {
                "group": "example.com", "scope": "Namespaced",
                "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
                "versions": [{
                    "name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
                    "additionalPrinterColumns": [
                        column("Second", "integer", ".spec.sizes[1]"),
                        column("App", "string", ".metadata.labels['app']"),
                        column("Flag", "boolean", ".spec.flag"),
                        column("Ratio", "number", ".spec.ratio"),
                        column("Missing", "string", ".spec.missing"),
                        column("Object", "string", ".spec.object"),
                        column("Mistyped", "integer", ".spec.flag"),
                        column("Ready", "string", r#".status.conditions[?(@.type=="Ready")].status"#),
                        column("Nothing", "string", ".status.conditions[?(@.type=='Gone')].status"),
                    ],
                }],
            },
        }),
    );
    server.put_json(
        "widgets",
        json!({
            "apiVersion": "example.com/v1", "kind": "Widget",
            "metadata": {"name": "w", "labels": {"app": "shop"}},
            "spec": {"sizes": [1, 7], "flag": true, "ratio": 0.5, "object": {"a": 1}},
            "status": {"conditions": [{"type": "Synced", "status": "False"}, {"type": "Ready", "status": "True"}]},
        }),
    );
    let table = get_value(&server, "/apis/example.com/v1/namespaces/default/widgets", TABLE).await;
    assert_eq!(
        table["rows"][0]["cells"],
        json!(["w", 7, "shop", true, 0.5, null, "{\"a\":1}", null, "True", null])
    );
}

/// `/openapi/v3` lists every served group version with a hashed URL; each document has the
/// resource paths with their PATCH content types (strategic merge for built-in types only)
/// and the `fieldValidation` parameter, from which kubectl decides how to validate and patch,
/// and a CRD's schema tagged with its group/version/kind once the CRD is stored. `/openapi/v2`
/// is a document without definitions, in protobuf for client-go.
#[tokio::test]
async fn openapi_documents_tell_kubectl_how_to_patch_and_validate() {
    let server = FakeApiServer::start().await;
    let index = get_value(&server, "/openapi/v3", "application/json").await;
    let url = |index: &Value, key: &str| {
        index["paths"][key]["serverRelativeURL"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let before = url(&index, "apis/crawl.example.com/v1alpha1");
    assert!(before.starts_with("/openapi/v3/apis/crawl.example.com/v1alpha1?hash="));

    let patch_of = |doc: &Value, path: &str| doc["paths"][path]["patch"].clone();
    let core = get_value(&server, &url(&index, "api/v1"), "application/json").await;
    let patch = patch_of(&core, "/api/v1/namespaces/{namespace}/configmaps/{name}");
    assert!(patch["requestBody"]["content"]["application/strategic-merge-patch+json"].is_object());
    assert_eq!(
        patch["x-kubernetes-group-version-kind"],
        json!({"group": "", "kind": "ConfigMap", "version": "v1"})
    );

    install_proxy_crd(&server).await;
    let index = get_value(&server, "/openapi/v3", "application/json").await;
    let after = url(&index, "apis/crawl.example.com/v1alpha1");
    assert_ne!(before, after, "the hash follows the document");
    let doc = get_value(&server, &after, "application/json").await;
    let patch = patch_of(
        &doc,
        "/apis/crawl.example.com/v1alpha1/namespaces/{namespace}/proxies/{name}",
    );
    let content = patch["requestBody"]["content"].as_object().unwrap();
    assert!(content.contains_key("application/merge-patch+json"));
    assert!(!content.contains_key("application/strategic-merge-patch+json"));
    assert!(
        patch["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "fieldValidation" && p["in"] == "query")
    );
    let schema = &doc["components"]["schemas"]["com.example.crawl.v1alpha1.Proxy"];
    assert_eq!(
        schema["x-kubernetes-group-version-kind"],
        json!([{"group": "crawl.example.com", "kind": "Proxy", "version": "v1alpha1"}])
    );
    assert!(schema["properties"]["spec"]["properties"]["provider"].is_object());
    let (code, _, _) = request(
        &server,
        "GET",
        "/openapi/v3/apis/nothing.example.com/v1",
        "application/json",
        "",
        "",
    )
    .await;
    assert_eq!(code, 404);

    let v2 = get_value(&server, "/openapi/v2", "application/json").await;
    assert_eq!(v2["swagger"], "2.0");
    let (code, protobuf, _) = request(
        &server,
        "GET",
        "/openapi/v2",
        "application/com.github.proto-openapi.spec.v2@v1.0+protobuf",
        "",
        "",
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(&protobuf[..5], b"\x0a\x032.0", "field 1 (swagger) = \"2.0\"");
}

/// `fieldValidation` (kube-apiserver >= 1.27) against a CRD's schema: an undeclared field is a
/// 400 with `Strict`, a `Warning` header with `Warn` (also the default), nothing with `Ignore`;
/// an unknown mode is a 400.
#[tokio::test]
async fn field_validation_refuses_warns_or_ignores_undeclared_fields() {
    let server = FakeApiServer::start().await;
    install_proxy_crd(&server).await;
    let body = |name: &str| {
        json!({
            "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
            "metadata": {"name": name},
            "spec": {"provider": "local", "colour": "blue", "health": {"url": "http://x", "shade": 1}},
        })
        .to_string()
    };
    let path = "/apis/crawl.example.com/v1alpha1/namespaces/default/proxies";
    let post = |query: &'static str, name: &'static str| {
        let server = &server;
        let body = body(name);
        async move {
            request(
                server,
                "POST",
                &format!("{path}{query}"),
                "application/json",
                "application/json",
                &body,
            )
            .await
        }
    };
    let (code, answer, _) = post("?fieldValidation=Strict", "a").await;
    assert_eq!(code, 400);
    let status: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(status["reason"], "BadRequest");
    assert_eq!(
        status["message"],
        r#"Proxy in version "v1alpha1" cannot be handled as a Proxy: strict decoding error: unknown field "spec.colour", unknown field "spec.health.shade""#
    );
    assert!(server.get_json("proxies", None, "a").is_none());

    let (code, _, warnings) = post("?fieldValidation=Warn", "b").await;
    assert_eq!(code, 201);
    assert_eq!(
        warnings,
        [
            r#"299 - "unknown field \"spec.colour\"""#,
            r#"299 - "unknown field \"spec.health.shade\"""#
        ]
    );
    let (code, _, warnings) = post("", "c").await;
    assert_eq!((code, warnings.len()), (201, 2), "Warn is the default");
    let (code, _, warnings) = post("?fieldValidation=Ignore", "d").await;
    assert_eq!((code, warnings.len()), (201, 0));
    let (code, _, _) = post("?fieldValidation=Loose", "e").await;
    assert_eq!(code, 400);

    // A merge patch is checked as it is sent.
    let (code, answer, _) = request(
        &server,
        "PATCH",
        &format!("{path}/b?fieldValidation=Strict"),
        "application/json",
        "application/merge-patch+json",
        r#"{"spec":{"port":3129,"portt":1}}"#,
    )
    .await;
    assert_eq!(code, 400, "{}", String::from_utf8_lossy(&answer));
}

/// One Event storage, two APIs: an `events.k8s.io/v1` Event is listed through core `v1`
/// converted (`regarding` → `involvedObject`, `note` → `message`, `reportingController` →
/// `reportingComponent`) and selected by `involvedObject.*` field selectors, as
/// `kubectl describe` lists them.
#[tokio::test]
async fn events_k8s_io_events_are_listed_through_the_core_api() {
    let server = FakeApiServer::start().await;
    let events: Api<K8sEvent> = Api::namespaced(server.client(), "crawl");
    let event: K8sEvent = serde_json::from_value(json!({
        "metadata": {"name": "p1.1"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "regarding": {"kind": "Proxy", "namespace": "crawl", "name": "p1", "uid": "u-1", "apiVersion": "crawl.example.com/v1alpha1"},
        "reason": "Healthy", "note": "it works", "type": "Normal", "action": "Reconcile",
        "reportingController": "egress-proxies-operator", "reportingInstance": "replica-a",
    }))
    .unwrap();
    events.create(&PostParams::default(), &event).await.unwrap();
    let core: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(server.client(), "crawl");
    let selected = core
        .list(
            &ListParams::default()
                .fields("involvedObject.name=p1,involvedObject.kind=Proxy,involvedObject.uid=u-1"),
        )
        .await
        .unwrap();
    assert_eq!(selected.items.len(), 1);
    let seen = &selected.items[0];
    assert_eq!(seen.message.as_deref(), Some("it works"));
    assert_eq!(seen.reason.as_deref(), Some("Healthy"));
    assert_eq!(seen.involved_object.name.as_deref(), Some("p1"));
    assert_eq!(
        seen.reporting_component.as_deref(),
        Some("egress-proxies-operator")
    );
    let other = core
        .list(&ListParams::default().fields("involvedObject.name=p2"))
        .await
        .unwrap();
    assert!(other.items.is_empty());
}

/// kubectl's typed clients send protobuf bodies for built-in types; the fake reads JSON only
/// and says so with a 415, not a JSON parse error.
#[tokio::test]
async fn a_protobuf_body_is_unsupported_media_type() {
    let server = FakeApiServer::start().await;
    let (code, body, _) = request(
        &server,
        "POST",
        "/api/v1/namespaces",
        "application/json",
        "application/vnd.kubernetes.protobuf",
        "k8s\0",
    )
    .await;
    assert_eq!(code, 415);
    let status: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status["reason"], "UnsupportedMediaType");
}

/// Aggregated discovery (kube-apiserver >= 1.26): `/api` and `/apis` asked for
/// `APIGroupDiscoveryList` answer every group, version and resource in one document with that
/// media type, which kube's `Discovery::run_aggregated` (as kubectl) reads; a plain Accept
/// still gets the legacy documents.
#[tokio::test]
async fn aggregated_discovery_lists_every_resource_in_one_document() {
    let server = FakeApiServer::start().await;
    install_proxy_crd(&server).await;
    let discovery = kube::discovery::Discovery::new(server.client())
        .run_aggregated()
        .await
        .unwrap();
    let gvk = kube::api::GroupVersionKind::gvk("crawl.example.com", "v1alpha1", "Proxy");
    let (resource, caps) = discovery.resolve_gvk(&gvk).expect("Proxy is discoverable");
    assert_eq!(resource.plural, "proxies");
    assert_eq!(caps.scope, kube::discovery::Scope::Namespaced);
    assert!(
        caps.subresources
            .iter()
            .any(|(r, _)| r.plural == "proxies/status" || r.plural == "status")
    );
    let secrets = kube::api::GroupVersionKind::gvk("", "v1", "Secret");
    assert!(discovery.resolve_gvk(&secrets).is_some());

    let accept = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json";
    let (code, body, _) = request(&server, "GET", "/apis", accept, "", "").await;
    assert_eq!(code, 200);
    let list: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(list["kind"], "APIGroupDiscoveryList");
    assert_eq!(list["apiVersion"], "apidiscovery.k8s.io/v2");
    let crawl = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["metadata"]["name"] == "crawl.example.com")
        .unwrap();
    let proxies = crawl["versions"][0]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resource"] == "proxies")
        .unwrap();
    assert_eq!(proxies["shortNames"], json!(["px"]));
    assert_eq!(proxies["scope"], "Namespaced");
    let legacy = get_value(&server, "/apis", "application/json").await;
    assert_eq!(legacy["kind"], "APIGroupList");
}
