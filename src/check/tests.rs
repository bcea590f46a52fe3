use serde_json::json;

use super::*;

fn proxy(spec: Value) -> Value {
    json!({
        "apiVersion": "crawl.example.com/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "p", "namespace": "crawl"},
        "spec": spec,
    })
}

/// What a checker without a cluster reports about `text`, read as the file `path`.
fn check(path: &str, text: &str) -> Report {
    let mut report = Report::default();
    Checker::new(None).check_text(path, text, &mut report);
    report
}

#[test]
fn defaults_apply_before_cel_rules() {
    let schema = ProxySchema::new();
    // The default interval is 30s, so a 29s timeout passes and a 30s one fails.
    assert!(
        schema
            .validate(&proxy(
                json!({"provider": "local", "health": {"timeoutSeconds": 29}})
            ))
            .is_empty()
    );
    let problems = schema.validate(&proxy(
        json!({"provider": "local", "health": {"timeoutSeconds": 30}}),
    ));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].0, "spec.health");
}

#[test]
fn provider_may_stay_but_not_change_on_update() {
    let schema = ProxySchema::new();
    let old = proxy(json!({"provider": "a"}));
    assert!(
        schema
            .validate_update(&proxy(json!({"provider": "a", "port": 8080})), Some(&old))
            .is_empty()
    );
    let problems = schema.validate_update(&proxy(json!({"provider": "b"})), Some(&old));
    assert_eq!(
        problems,
        [(
            "spec.provider".to_owned(),
            "is immutable: delete the Proxy and create a new one to move it to another provider".to_owned()
        )]
    );
}

#[test]
fn attribute_keys_follow_label_key_syntax() {
    let schema = ProxySchema::new();
    for good in ["region", "crawl.example.com/pool", "a", "A_b.c-9"] {
        assert!(
            schema
                .validate(&proxy(json!({"provider": "l", "attributes": {good: "x"}})))
                .is_empty(),
            "{good}"
        );
    }
    let too_long = "k".repeat(64);
    for bad in ["-x", "x-", "a b", "", "/x", too_long.as_str()] {
        assert_eq!(
            schema
                .validate(&proxy(json!({"provider": "l", "attributes": {bad: "x"}})))
                .len(),
            1,
            "{bad:?}"
        );
    }
}

#[test]
fn unknown_fields_are_reported_at_every_level() {
    let schema = ProxySchema::new();
    let mut object = proxy(json!({"provider": "l", "health": {"url": "http://x/", "retries": 3}}));
    object["metadata"]["labelz"] = json!({});
    object["extra"] = json!(1);
    let mut paths: Vec<String> = schema
        .validate(&object)
        .into_iter()
        .map(|(path, _)| path)
        .collect();
    paths.sort();
    assert_eq!(paths, ["extra", "metadata.labelz", "spec.health.retries"]);
}

#[test]
fn a_yaml_syntax_error_is_one_problem_not_a_panic() {
    let report = check("broken.yaml", "apiVersion: [unclosed\n");
    assert_eq!(report.problems.len(), 1);
    assert_eq!(report.problems[0].object, "YAML");
}

#[test]
fn other_kinds_are_reported_as_unsupported() {
    let report = check("x.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: s}\n");
    assert_eq!(report.problems.len(), 1);
    assert_eq!(report.problems[0].object, "v1 ConfigMap");
}

#[test]
fn secrets_are_checked_for_what_the_operator_reads() {
    let report = check(
        "s.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata: {name: ok}\nstringData: {user-data: x}\n---\napiVersion: v1\nkind: Secret\nmetadata: {name: bad}\nstringData: {user-data: [1]}\n",
    );
    let lines: Vec<String> = report.problems.iter().map(ToString::to_string).collect();
    assert_eq!(
        lines,
        ["s.yaml: document 2 (Secret bad): stringData.user-data: must be a string"]
    );
}
