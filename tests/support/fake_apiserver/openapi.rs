//! OpenAPI as far as kubectl uses it: the `/openapi/v3` index and one document per group
//! version (paths with their PATCH content types and the `fieldValidation` parameter, from
//! which kubectl decides between server-side validation and strategic/merge patches; schemas
//! tagged with `x-kubernetes-group-version-kind`, a CRD's own `openAPIV3Schema` for custom
//! resources), and a `/openapi/v2` document without definitions for clients that only read v2.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::{Map, Value, json};

use super::registry::ResourceDef;

/// `apis/crawl.example.com/v1alpha1` or `api/v1`: the key of a group version in the index.
pub fn gv_key(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// The definition name the API server gives a kind: `com.example.crawl.v1alpha1.Proxy` for a
/// custom resource (the group reversed), `io.k8s.api.core.v1.Secret` for a built-in one.
fn schema_name(def: &ResourceDef) -> String {
    if def.is_custom() {
        let reversed: Vec<&str> = def.group.split('.').rev().collect();
        format!("{}.{}.{}", reversed.join("."), def.version, def.kind)
    } else if def.group == "apiextensions.k8s.io" {
        format!(
            "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.{}.{}",
            def.version, def.kind
        )
    } else {
        let package = def
            .group
            .split('.')
            .next()
            .filter(|g| !g.is_empty())
            .unwrap_or("core");
        format!("io.k8s.api.{package}.{}.{}", def.version, def.kind)
    }
}

fn gvk(def: &ResourceDef) -> Value {
    json!({"group": def.group, "kind": def.kind, "version": def.version})
}

const OBJECT_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";
const PATCH: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.Patch";
const STATUS: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.Status";

fn reference(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn query(name: &str, description: &str) -> Value {
    json!({"name": name, "in": "query", "description": description, "schema": {"type": "string", "uniqueItems": true}})
}

fn ok(schema: &str) -> Value {
    json!({"200": {"description": "OK", "content": {"application/json": {"schema": reference(schema)}}}})
}

/// The operations on one object path (the object or its `/status`).
fn object_operations(def: &ResourceDef, schema: &str, status: bool) -> Value {
    let mut patch_types = vec!["application/json-patch+json", "application/merge-patch+json"];
    if def.strategic_merge {
        patch_types.push("application/strategic-merge-patch+json");
    }
    patch_types.push("application/apply-patch+yaml");
    let content: Map<String, Value> = patch_types
        .iter()
        .map(|t| ((*t).to_owned(), json!({"schema": reference(PATCH)})))
        .collect();
    let suffix = if status { "Status" } else { "" };
    let operation = |verb: &str, action: &str, extra: Value| {
        let mut op = json!({
            "operationId": format!("{verb}{}{}{suffix}", def.group.replace('.', "_"), def.kind),
            "responses": ok(schema),
            "x-kubernetes-action": action,
            "x-kubernetes-group-version-kind": gvk(def),
        });
        if let (Some(op), Some(extra)) = (op.as_object_mut(), extra.as_object()) {
            op.extend(extra.clone());
        }
        op
    };
    let mut ops = json!({
        "get": operation("read", "get", json!({})),
        "put": operation("replace", "put", json!({
            "parameters": [query("dryRun", ""), query("fieldManager", ""), query("fieldValidation", "")],
            "requestBody": {"content": {"application/json": {"schema": reference(schema)}}},
        })),
        "patch": operation("patch", "patch", json!({
            "parameters": [
                query("dryRun", ""),
                query("fieldManager", ""),
                query(
                    "fieldValidation",
                    "fieldValidation instructs the server on how to handle objects in the request containing unknown or duplicate fields.",
                ),
                {"name": "force", "in": "query", "schema": {"type": "boolean", "uniqueItems": true}},
            ],
            "requestBody": {"content": content},
        })),
    });
    if !status {
        ops["delete"] = operation("delete", "delete", json!({"responses": ok(STATUS)}));
    }
    ops
}

fn collection_operations(def: &ResourceDef, schema: &str) -> Value {
    json!({
        "get": {
            "operationId": format!("list{}{}", def.group.replace('.', "_"), def.kind),
            "responses": ok(&format!("{schema}List")),
            "x-kubernetes-action": "list",
            "x-kubernetes-group-version-kind": gvk(def),
        },
        "post": {
            "operationId": format!("create{}{}", def.group.replace('.', "_"), def.kind),
            "parameters": [query("dryRun", ""), query("fieldManager", ""), query("fieldValidation", "")],
            "requestBody": {"content": {"application/json": {"schema": reference(schema)}}},
            "responses": ok(schema),
            "x-kubernetes-action": "post",
            "x-kubernetes-group-version-kind": gvk(def),
        },
    })
}

/// A kind's schema: a CRD's `openAPIV3Schema` with `apiVersion`, `kind` and `metadata`
/// added as the API server publishes it; built-in kinds accept any fields (their real
/// schemas are not reproduced).
fn kind_schema(def: &ResourceDef) -> Value {
    let mut schema = def
        .schema
        .clone()
        .unwrap_or_else(|| json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}));
    if let Some(properties) = schema
        .as_object_mut()
        .map(|s| s.entry("properties").or_insert_with(|| json!({})))
        .and_then(Value::as_object_mut)
    {
        properties.insert("apiVersion".into(), json!({"type": "string"}));
        properties.insert("kind".into(), json!({"type": "string"}));
        properties.insert("metadata".into(), json!({"allOf": [reference(OBJECT_META)]}));
    }
    schema["type"] = "object".into();
    schema["x-kubernetes-group-version-kind"] = json!([gvk(def)]);
    schema
}

/// The OpenAPI v3 document of one group version, or None if nothing is served there.
pub fn group_version_document(defs: &[&ResourceDef], group: &str, version: &str) -> Option<Value> {
    let defs: Vec<&&ResourceDef> = defs
        .iter()
        .filter(|d| d.group == group && d.version == version)
        .collect();
    if defs.is_empty() {
        return None;
    }
    let prefix = format!("/{}", gv_key(group, version));
    let mut paths = Map::new();
    let mut schemas = Map::new();
    for def in defs {
        let name = schema_name(def);
        let scope = if def.namespaced {
            format!("{prefix}/namespaces/{{namespace}}/{}", def.plural)
        } else {
            format!("{prefix}/{}", def.plural)
        };
        paths.insert(scope.clone(), collection_operations(def, &name));
        paths.insert(format!("{scope}/{{name}}"), object_operations(def, &name, false));
        if def.status_subresource {
            paths.insert(
                format!("{scope}/{{name}}/status"),
                object_operations(def, &name, true),
            );
        }
        schemas.insert(name.clone(), kind_schema(def));
        schemas.insert(
            format!("{name}List"),
            json!({
                "type": "object",
                "required": ["items"],
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "items": {"type": "array", "items": reference(&name)},
                    "metadata": {"type": "object"},
                },
                "x-kubernetes-group-version-kind": [{"group": def.group, "kind": format!("{}List", def.kind), "version": def.version}],
            }),
        );
    }
    schemas.insert(
        OBJECT_META.into(),
        json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
    );
    schemas.insert(PATCH.into(), json!({"type": "object"}));
    schemas.insert(
        STATUS.into(),
        json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
    );
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0-fake"},
        "paths": paths,
        "components": {"schemas": schemas},
    }))
}

/// `/openapi/v3`: every served group version with a URL whose `hash` changes with its
/// document (clients cache documents by that URL).
pub fn index(defs: &[&ResourceDef]) -> Value {
    let mut keys: Vec<(String, String)> = defs
        .iter()
        .map(|d| (d.group.clone(), d.version.clone()))
        .collect();
    keys.sort();
    keys.dedup();
    let mut paths = Map::new();
    for (group, version) in keys {
        let Some(document) = group_version_document(defs, &group, &version) else {
            continue;
        };
        let mut hasher = DefaultHasher::new();
        document.to_string().hash(&mut hasher);
        let key = gv_key(&group, &version);
        paths.insert(
            key.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{key}?hash={:016X}", hasher.finish())}),
        );
    }
    json!({"paths": paths})
}

/// `/openapi/v2` as JSON: a valid Swagger 2.0 document without paths or definitions, from
/// which clients learn no schema (so they neither validate nor choose strategic merge).
pub fn v2_json() -> Value {
    json!({"swagger": "2.0", "info": {"title": "Kubernetes", "version": "v1.33.0-fake"}, "paths": {}, "definitions": {}})
}

/// The same document in the protobuf encoding (gnostic `openapi_v2.Document`: `swagger` is
/// field 1, `info` field 2 with `title` 1 and `version` 2), which client-go asks for.
pub fn v2_protobuf() -> Vec<u8> {
    fn field(number: u8, bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![(number << 3) | 2, u8::try_from(bytes.len()).expect("short field")];
        out.extend_from_slice(bytes);
        out
    }
    let info = [field(1, b"Kubernetes"), field(2, b"v1.33.0-fake")].concat();
    [field(1, b"2.0"), field(2, &info)].concat()
}
