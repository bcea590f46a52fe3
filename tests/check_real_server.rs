//! `check` against the real kube-apiserver, the reference for what the CRD's schema and CEL
//! rules mean: every fixture under `tests/fixtures/invalid/` is refused by the server (a create,
//! or for two documents the create of the first and an update to the second, as kubectl sends
//! them: `fieldValidation=Strict`) naming the field `check` names, and every Proxy under
//! `config/samples/` is accepted by both (a dry-run create).

mod support;

use std::path::{Path, PathBuf};

use egress_proxies_operator::check::{Checker, Report};
use kube::Client;
use serde::Deserialize;
use serde_json::Value;
use support::control_plane::ControlPlane;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("folder exists")
        .map(|entry| entry.expect("readable entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    files
}

fn documents(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).expect("YAML"))
        .filter(|doc| !doc.is_null())
        .collect()
}

/// What the server answered a write: accepted, or refused with the fields it named (from the
/// Status' causes, or the `unknown field "..."` of a strict decoding error) and its message.
#[derive(Debug)]
enum Answer {
    Accepted,
    Refused {
        code: u16,
        fields: Vec<String>,
        message: String,
    },
}

async fn send(
    client: &Client,
    method: &str,
    namespace: &str,
    name: Option<&str>,
    object: &Value,
    dry_run: bool,
) -> Answer {
    let mut path = format!("/apis/crawl.example.com/v1alpha1/namespaces/{namespace}/proxies");
    if let Some(name) = name {
        path.push('/');
        path.push_str(name);
    }
    path.push_str("?fieldValidation=Strict");
    if dry_run {
        path.push_str("&dryRun=All");
    }
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(object).expect("JSON"))
        .expect("a valid request");
    match client.request::<Value>(request).await {
        Ok(_) => Answer::Accepted,
        Err(kube::Error::Api(status)) => {
            let mut fields: Vec<String> = status
                .details
                .as_ref()
                .map(|d| {
                    d.causes
                        .iter()
                        .map(|c| c.field.clone())
                        .filter(|f| !f.is_empty())
                        .collect()
                })
                .unwrap_or_default();
            if let Some(rest) = status.message.split("unknown field \"").nth(1) {
                fields.extend(rest.split('"').next().map(str::to_owned));
            }
            Answer::Refused {
                code: status.code,
                fields,
                message: status.message.clone(),
            }
        }
        Err(other) => panic!("{method} {namespace}/{name:?}: {other}"),
    }
}

/// The field a `check` problem names (`spec.health: ...` → `spec.health`).
fn check_field(problem: &str) -> &str {
    problem.split(": ").next().unwrap_or(problem)
}

/// Whether the server's field and `check`'s field name the same place: equal, or the server
/// names the object a rule sits on and check the same object (`spec.port` vs `spec.port`), or
/// the server's map-key notation (`spec.attributes[a b]`) for check's (`spec.attributes`).
fn same_field(server: &str, check: &str) -> bool {
    let server = server.split('[').next().unwrap_or(server);
    let check = check.split('[').next().unwrap_or(check);
    server == check
}

#[tokio::test]
async fn the_real_server_and_check_refuse_the_same_fixtures_naming_the_same_fields() {
    let plane = ControlPlane::start().await;
    plane.install_crds().await;
    let namespace = plane.namespace("check").await;
    let client = plane.client().await;
    let checker = Checker::new(None);

    let mut differences = Vec::new();
    let fixtures = yaml_files(&repo("tests/fixtures/invalid"));
    assert!(fixtures.len() >= 12, "{fixtures:?}");
    for (n, fixture) in fixtures.iter().enumerate() {
        let text = std::fs::read_to_string(fixture).expect("readable fixture");
        let expected = text
            .lines()
            .next()
            .and_then(|line| line.strip_prefix("# expect: "))
            .expect("a fixture starts with `# expect: <path>: <message>`");
        let mut docs = documents(&text);
        // Each fixture's objects get a name of their own in the test's namespace.
        let name = format!("fixture-{n}");
        for doc in &mut docs {
            doc["metadata"]["namespace"] = namespace.clone().into();
            if doc["metadata"]["name"].is_string() {
                doc["metadata"]["name"] = name.clone().into();
            }
        }
        let answer = match docs.as_slice() {
            [object] => send(&client, "POST", &namespace, None, object, true).await,
            [old, new] => {
                let created = send(&client, "POST", &namespace, None, old, false).await;
                assert!(
                    matches!(created, Answer::Accepted),
                    "{}: the old object must be accepted: {created:?}",
                    fixture.display()
                );
                let stored: Value = client
                    .request(
                        hyper::Request::get(format!(
                            "/apis/crawl.example.com/v1alpha1/namespaces/{namespace}/proxies/{name}"
                        ))
                        .body(Vec::new())
                        .expect("request"),
                    )
                    .await
                    .expect("stored");
                let mut new = new.clone();
                new["metadata"]["resourceVersion"] = stored["metadata"]["resourceVersion"].clone();
                send(&client, "PUT", &namespace, Some(&name), &new, false).await
            }
            other => panic!("{}: {} documents", fixture.display(), other.len()),
        };
        let field = check_field(expected);
        match &answer {
            Answer::Accepted => differences.push(format!(
                "{}: the server ACCEPTED what check refuses ({expected})",
                fixture.display()
            )),
            Answer::Refused {
                code,
                fields,
                message,
            } => {
                println!(
                    "{}: check `{field}`, server {code} {fields:?}: {message}",
                    fixture.file_name().unwrap().to_string_lossy()
                );
                if !fields.iter().any(|f| same_field(f, field)) {
                    differences.push(format!(
                        "{}: check names `{field}`, the server {fields:?} ({message})",
                        fixture.display()
                    ));
                }
            }
        }
    }

    // Every Proxy among the samples is accepted by both.
    let mut samples = 0;
    for file in yaml_files(&repo("config/samples")) {
        let text = std::fs::read_to_string(&file).expect("readable sample");
        for mut doc in documents(&text) {
            if doc["kind"] != "Proxy" {
                continue;
            }
            samples += 1;
            let mut report = Report::default();
            checker.check_text("sample", &serde_norway::to_string(&doc).unwrap(), &mut report);
            assert!(
                report.problems.is_empty(),
                "{}: check: {:?}",
                file.display(),
                report.problems
            );
            doc["metadata"]["namespace"] = namespace.clone().into();
            let answer = send(&client, "POST", &namespace, None, &doc, true).await;
            if !matches!(answer, Answer::Accepted) {
                differences.push(format!(
                    "{}: the server refused a sample: {answer:?}",
                    file.display()
                ));
            }
        }
    }
    assert!(samples >= 5, "only {samples} sample Proxies");
    assert!(
        differences.is_empty(),
        "check and the real server differ:\n{}",
        differences.join("\n")
    );
}

/// A manifest with several problems gets them all in one answer, from the server and from
/// `check` alike: a bad name does not hide what the CEL rules find; a missing required field
/// does (the server does not run the rules then), and both say that some rules were not checked.
#[tokio::test]
async fn several_problems_come_in_one_answer_as_the_server_gives_them() {
    let plane = ControlPlane::start().await;
    plane.install_crds().await;
    let namespace = plane.namespace("several").await;
    let client = plane.client().await;
    let checker = Checker::new(None);
    let proxy = |name: &str, spec: Value| {
        serde_json::json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        })
    };
    let rules_broken = serde_json::json!({
        "provider": "local",
        "lease": {"maxConcurrent": 0, "cooldownSeconds": -5},
        "health": {"url": "ftp://example.com/", "failureThreshold": 0},
    });
    let mut required_missing = rules_broken.clone();
    required_missing["auth"] = serde_json::json!({"secretRef": {}});
    for (case, object) in [
        ("a bad name and broken rules", proxy("Bad_Name", rules_broken)),
        (
            "a required field missing and broken rules",
            proxy("fine", required_missing),
        ),
    ] {
        let Answer::Refused { fields, message, .. } =
            send(&client, "POST", &namespace, None, &object, true).await
        else {
            panic!("{case}: the server accepted it");
        };
        // `<nil>`: the field of the server's "some validation rules were not checked".
        let mut server: Vec<String> = fields
            .iter()
            .filter(|f| *f != "<nil>")
            .map(|f| f.split('[').next().unwrap_or(f).to_owned())
            .collect();
        server.sort();
        server.dedup();
        let mut report = Report::default();
        checker.check_text(
            "several.yaml",
            &serde_norway::to_string(&object).unwrap(),
            &mut report,
        );
        let problems: Vec<String> = report.problems.iter().map(|p| p.to_string()).collect();
        let mut named: Vec<String> = problems
            .iter()
            .map(|p| p.rsplit("): ").next().unwrap_or(p))
            .map(|p| check_field(p).split('[').next().unwrap_or_default().to_owned())
            .filter(|f| f.contains('.'))
            .collect();
        named.sort();
        named.dedup();
        println!("{case}: server {server:?}: {message}\ncheck {problems:#?}");
        assert_eq!(named, server, "{case}: the fields check names");
        let not_checked = |text: &str| text.contains("some validation rules were not checked");
        assert_eq!(
            problems.iter().any(|p| not_checked(p)),
            not_checked(&message),
            "{case}: whether some rules were not checked"
        );
    }
}
