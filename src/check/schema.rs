//! The Proxy schema as the API server applies it: structural validation (types, lengths,
//! required fields), strict unknown-field detection, metadata rules, then the CEL rules.

use jsonschema::{Validator as StructuralValidator, error::ValidationErrorKind};
use kube::{
    CustomResourceExt,
    core::cel::{CompiledSchema, Validator as CelValidator, compile_schema},
};
use serde_json::{Map, Value};

use crate::api::Proxy;

/// Fields of `metadata` a manifest may set (ObjectMeta); anything else is unknown.
const OBJECT_META_FIELDS: [&str; 15] = [
    "name",
    "generateName",
    "namespace",
    "labels",
    "annotations",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "ownerReferences",
    "finalizers",
    "managedFields",
    "selfLink",
];

/// Said when a structural error keeps the CEL rules from running (the API server's words).
const RULES_NOT_CHECKED: &str = "some validation rules were not checked because the object was invalid; correct the existing errors to complete validation";

/// The compiled Proxy schema.
pub struct ProxySchema {
    openapi: Value,
    structural: StructuralValidator,
    cel_rules: CompiledSchema,
    cel: CelValidator,
}

impl Default for ProxySchema {
    fn default() -> Self {
        Self::new()
    }
}

impl ProxySchema {
    /// Compiles the schema of the `Proxy` CRD this binary generates.
    pub fn new() -> Self {
        let openapi = openapi_schema();
        let structural = jsonschema::validator_for(&as_json_schema(&openapi))
            .expect("invariant: the generated CRD schema is a valid JSON schema (covered by tests)");
        let cel_rules = compile_schema(&openapi);
        Self {
            openapi,
            structural,
            cel_rules,
            cel: CelValidator::new(),
        }
    }

    /// Every problem of `object` as `(field path, message)`. As the API server does, the CEL
    /// rules run unless a structural error makes their inputs meaningless (a missing required
    /// field, a wrong type, a value not in its enum, a string, list or map too long); then a
    /// problem says some rules were not checked.
    pub fn validate(&self, object: &Value) -> Vec<(String, String)> {
        self.validate_update(object, None)
    }

    /// Like [`Self::validate`], for an update from `old` (runs the `oldSelf` transition rules).
    pub fn validate_update(&self, object: &Value, old: Option<&Value>) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        unknown_fields(&self.openapi, object, "", &mut problems);
        check_metadata(object, &mut problems);
        let mut blocking = false;
        for error in self.structural.iter_errors(object) {
            let path = dotted(error.instance_path().as_str());
            blocking |= matches!(
                error.kind(),
                ValidationErrorKind::Required { .. }
                    | ValidationErrorKind::Type { .. }
                    | ValidationErrorKind::Enum { .. }
                    | ValidationErrorKind::Constant { .. }
                    | ValidationErrorKind::MaxLength { .. }
                    | ValidationErrorKind::MaxItems { .. }
                    | ValidationErrorKind::MaxProperties { .. }
            );
            match error.kind() {
                // Name the missing field itself, as the API server does.
                ValidationErrorKind::Required { property } => {
                    let field = property.as_str().unwrap_or_default();
                    problems.push((join(&path, field), "required: set this field".to_owned()));
                }
                _ => problems.push((path, error.to_string())),
            }
        }
        if blocking {
            problems.push((String::new(), RULES_NOT_CHECKED.to_owned()));
            return problems;
        }
        if let Err(errors) = self.cel.validate_compiled(&self.cel_rules, object, old) {
            for error in errors.iter() {
                problems.push((error.field_path.clone(), error.message.clone()));
            }
        }
        problems
    }
}

fn openapi_schema() -> Value {
    let crd = Proxy::crd();
    let schema = crd
        .spec
        .versions
        .first()
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("invariant: the derived Proxy CRD has an openAPIV3Schema");
    serde_json::to_value(schema).expect("invariant: a CRD schema serializes to JSON")
}

/// OpenAPI v3 marks optional values `nullable: true`; JSON Schema spells that as a type union.
fn as_json_schema(openapi: &Value) -> Value {
    match openapi {
        Value::Object(map) => {
            let mut out = Map::with_capacity(map.len());
            for (key, value) in map {
                out.insert(key.clone(), as_json_schema(value));
            }
            if map.get("nullable") == Some(&Value::Bool(true))
                && let Some(Value::String(ty)) = map.get("type")
            {
                out.insert(
                    "type".to_owned(),
                    Value::Array(vec![Value::String(ty.clone()), "null".into()]),
                );
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(as_json_schema).collect()),
        other => other.clone(),
    }
}

/// Reports fields the schema does not declare, as `kubectl --validate=strict` does.
fn unknown_fields(schema: &Value, value: &Value, path: &str, problems: &mut Vec<(String, String)>) {
    let (Some(object), Some(properties)) = (
        value.as_object(),
        schema.get("properties").and_then(Value::as_object),
    ) else {
        if let (Some(object), Some(values)) = (value.as_object(), schema.get("additionalProperties")) {
            for (key, item) in object {
                unknown_fields(values, item, &join(path, key), problems);
            }
        } else if let (Some(items), Some(item_schema)) = (value.as_array(), schema.get("items")) {
            for (index, item) in items.iter().enumerate() {
                unknown_fields(item_schema, item, &format!("{path}[{index}]"), problems);
            }
        }
        return;
    };
    for (key, item) in object {
        let field = join(path, key);
        match properties.get(key) {
            Some(item_schema) => unknown_fields(item_schema, item, &field, problems),
            // The CRD schema describes spec and status; the envelope is the API server's.
            None if path.is_empty()
                && ["apiVersion", "kind", "metadata", "status"].contains(&key.as_str()) => {}
            None => problems.push((field, format!("unknown field {key:?}"))),
        }
    }
}

fn check_metadata(object: &Value, problems: &mut Vec<(String, String)>) {
    let Some(metadata) = object.get("metadata").and_then(Value::as_object) else {
        problems.push(("metadata".to_owned(), "required: set metadata.name".to_owned()));
        return;
    };
    for key in metadata.keys() {
        if !OBJECT_META_FIELDS.contains(&key.as_str()) {
            problems.push((format!("metadata.{key}"), format!("unknown field {key:?}")));
        }
    }
    match (metadata.get("name"), metadata.get("generateName")) {
        (Some(Value::String(name)), _) if is_dns_subdomain(name) => {}
        (Some(_), _) => problems.push((
            "metadata.name".to_owned(),
            "must be a DNS subdomain: at most 253 lowercase letters, digits, '-' or '.', starting and ending with a letter or digit".to_owned(),
        )),
        (None, Some(_)) => {}
        (None, None) => problems.push(("metadata.name".to_owned(), "required: name the Proxy".to_owned())),
    }
    if let Some(namespace) = metadata.get("namespace")
        && !namespace.as_str().is_some_and(crate::config::is_dns_label)
    {
        problems.push((
            "metadata.namespace".to_owned(),
            "must be a DNS label: at most 63 lowercase letters, digits or '-'".to_owned(),
        ));
    }
}

fn is_dns_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(crate::config::is_dns_label)
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// `/spec/health/0` → `spec.health[0]`.
fn dotted(pointer: &str) -> String {
    let mut out = String::new();
    for segment in pointer.split('/').skip(1) {
        let segment = segment.replace("~1", "/").replace("~0", "~");
        if segment.parse::<usize>().is_ok() {
            out.push_str(&format!("[{segment}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(&segment);
        }
    }
    out
}
