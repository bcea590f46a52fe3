//! The monitoring kit in `config/monitoring/`: the alert rules pass `promtool check rules` and
//! their unit tests (`promtool test rules alerts.test.yaml`: each alert fires on the series
//! the operator exposes, with their real labels), they are the alerts docs/operations.md
//! suggests, and every metric the rules and the Grafana dashboard use is one docs/operations.md
//! lists (which `tests/metrics.rs` checks against a real scrape); the dashboard shows them all.
//!
//! Needs `promtool` (Debian package `prometheus`; scripts/test.sh installs it).

mod support {
    pub mod operations_doc;
}

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

use support::operations_doc::documented_metrics;

fn kit(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/monitoring")
        .join(file)
}

fn promtool(args: &[&str]) {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(kit(""))
        .output()
        .expect("running promtool (Debian package `prometheus`; scripts/test.sh installs it)");
    assert!(
        output.status.success(),
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Every `epo_...` name in `text`, a histogram's series (`_bucket`, `_count`, `_sum`) under the
/// histogram's name when that is the documented one.
fn metric_names(text: &str, documented: &BTreeSet<String>) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("epo_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|base| documented.contains(*base))
            })
            .unwrap_or(name);
        names.insert(base.to_owned());
        rest = &tail[end..];
    }
    names
}

fn read(file: &str) -> String {
    std::fs::read_to_string(kit(file)).unwrap_or_else(|error| panic!("{file}: {error}"))
}

#[test]
fn alert_rules_pass_promtool_and_fire_as_tested() {
    promtool(&["check", "rules", "alerts.yaml"]);
    promtool(&["test", "rules", "alerts.test.yaml"]);
}

#[test]
fn alert_rules_are_the_documented_alerts_on_documented_metrics() {
    let rules = read("alerts.yaml");
    let documented = documented_metrics();
    let used = metric_names(&rules, &documented);
    let unknown: Vec<_> = used.difference(&documented).collect();
    assert!(
        unknown.is_empty(),
        "alerts.yaml uses metrics docs/operations.md does not list: {unknown:?}"
    );

    let alerts: BTreeSet<String> = rules
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
        .map(str::to_owned)
        .collect();
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"))
        .expect("docs/operations.md");
    let section = doc
        .split("## Suggested alerts")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/operations.md has a \"Suggested alerts\" section");
    let suggested: BTreeSet<String> = section
        .lines()
        .filter_map(|line| line.strip_prefix("| "))
        .filter_map(|rest| rest.split_once(" |").map(|(name, _)| name.trim().to_owned()))
        .filter(|name| name != "alert" && !name.starts_with("---"))
        .collect();
    assert_eq!(
        alerts, suggested,
        "alerts.yaml and docs/operations.md's Suggested alerts differ"
    );
}

#[test]
fn dashboard_shows_every_documented_metric_and_nothing_else() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("grafana-dashboard.json")).expect("dashboard JSON");
    let mut exprs = Vec::new();
    let mut stack = vec![&dashboard];
    while let Some(value) = stack.pop() {
        match value {
            serde_json::Value::Object(map) => {
                if let Some(serde_json::Value::String(expr)) = map.get("expr") {
                    exprs.push(expr.as_str());
                }
                stack.extend(map.values());
            }
            serde_json::Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    assert!(!exprs.is_empty(), "the dashboard has no queries");
    let documented = documented_metrics();
    let used = metric_names(&exprs.join("\n"), &documented);
    assert_eq!(
        used, documented,
        "dashboard queries vs docs/operations.md's metrics table"
    );
    assert_eq!(dashboard["uid"], "egress-proxies-operator");
}
