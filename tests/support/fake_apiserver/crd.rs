//! CustomResourceDefinitions: a stored CRD object makes its resource served with the names,
//! scope, status subresource, printer columns and schema it declares (what `kubectl apply -f
//! crd.yaml` does to a real API server), and the schema answers `fieldValidation`.

use serde_json::{Value, json};

use super::{registry::ResourceDef, store::Store};

/// The resource CustomResourceDefinitions are stored as.
pub const CRD_RESOURCE: &str = "customresourcedefinitions.apiextensions.k8s.io";

/// Serves what `crd` defines and marks it established, as the apiextensions controllers
/// do shortly after a CRD is written. Objects already stored for the resource stay.
pub fn install(store: &mut Store, crd: &Value) {
    let defs = ResourceDef::from_crd(crd);
    if defs.is_empty() {
        return;
    }
    for def in defs {
        store.register(def);
    }
    let Some(rid) = store.resolve(CRD_RESOURCE) else {
        return;
    };
    let Some(name) = crd.pointer("/metadata/name").and_then(Value::as_str) else {
        return;
    };
    let key = (String::new(), name.to_owned());
    let Ok(current) = store.get(rid, &key) else {
        return;
    };
    let now = current
        .pointer("/metadata/creationTimestamp")
        .cloned()
        .unwrap_or(Value::Null);
    let condition = |type_: &str, reason: &str, message: &str| json!({"type": type_, "status": "True", "lastTransitionTime": now, "reason": reason, "message": message});
    let stored: Vec<Value> = crd
        .pointer("/spec/versions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|v| v.get("storage").and_then(Value::as_bool) == Some(true))
        .filter_map(|v| v.get("name").cloned())
        .collect();
    let mut updated = (*current).clone();
    updated["status"] = json!({
        "acceptedNames": crd.pointer("/spec/names").cloned().unwrap_or_else(|| json!({})),
        "conditions": [
            condition("NamesAccepted", "NoConflicts", "no conflicts found"),
            condition("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        ],
        "storedVersions": stored,
    });
    // Installing again writes the same status: a no-op in the store (no new resourceVersion).
    // A status the store refuses would only leave the CRD unestablished, which nothing here
    // waits for.
    let _ = store.update(rid, &key, updated, super::store::Target::Status, false, false);
}

/// The fields of `object` its schema does not declare, as dotted paths (`spec.colour`),
/// which `fieldValidation=Strict` refuses and `Warn` reports. `apiVersion`, `kind` and
/// `metadata` are always known (the API server checks metadata against ObjectMeta).
pub fn unknown_fields(schema: &Value, object: &Value) -> Vec<String> {
    let mut found = Vec::new();
    if let Some(map) = object.as_object() {
        for (key, value) in map {
            if matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                continue;
            }
            walk(schema, key, value, key, &mut found);
        }
    }
    found
}

fn walk(schema: &Value, key: &str, value: &Value, path: &str, found: &mut Vec<String>) {
    let Some(field) = schema.pointer(&format!(
        "/properties/{}",
        key.replace('~', "~0").replace('/', "~1")
    )) else {
        let open = schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
        match schema.get("additionalProperties") {
            Some(Value::Object(extra)) => check(&Value::Object(extra.clone()), value, path, found),
            Some(Value::Bool(true)) => {}
            _ if open => {}
            _ => found.push(path.to_owned()),
        }
        return;
    };
    check(field, value, path, found);
}

fn check(schema: &Value, value: &Value, path: &str, found: &mut Vec<String>) {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
        return;
    }
    match value {
        Value::Object(map)
            if schema.get("properties").is_some() || schema.get("additionalProperties").is_some() =>
        {
            for (key, inner) in map {
                walk(schema, key, inner, &format!("{path}.{key}"), found);
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    check(item_schema, item, &format!("{path}[{i}]"), found);
                }
            }
        }
        _ => {}
    }
}
