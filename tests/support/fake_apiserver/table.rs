//! Server-side printing: `meta.k8s.io/v1` `Table` answers for `Accept:
//! application/json;as=Table;v=v1;g=meta.k8s.io` (what `kubectl get` asks for), with the
//! columns a CRD declares in `additionalPrinterColumns`, evaluated as the apiextensions
//! table convertor does.

use serde_json::{Value, json};

use super::registry::{PrinterColumn, ResourceDef};

/// Whether the Accept header asks for a Table (kubectl lists `v1` and `v1beta1` first and
/// plain JSON last; the fake answers the `v1` form for either).
pub fn wanted(accept: &str) -> bool {
    accept
        .split(',')
        .any(|media| media.contains("as=Table") && media.contains("g=meta.k8s.io"))
}

/// What a row carries besides its cells (`includeObject`): `None`, `Metadata` (the default)
/// or `Object`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Include {
    None,
    Metadata,
    Object,
}

impl Include {
    pub fn parse(value: Option<&str>) -> Self {
        match value {
            Some("None") => Self::None,
            Some("Object") => Self::Object,
            _ => Self::Metadata,
        }
    }
}

fn column(name: &str, type_: &str, format: &str, description: &str, priority: i64) -> Value {
    json!({"name": name, "type": type_, "format": format, "description": description, "priority": priority})
}

const NAME_DESCRIPTION: &str = "Name must be unique within a namespace. Is required when creating resources, although some resources may allow a client to request the generation of an appropriate name automatically. Name is primarily intended for creation idempotence and configuration definition. Cannot be updated. More info: https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names";

/// The columns: `Name`, then the CRD's printer columns; a CRD without any gets `Age`, a
/// built-in type the default convertor's `Created At` (the real API server has a printer
/// per built-in type; the fake does not).
fn columns(def: &ResourceDef) -> (Vec<Value>, Vec<PrinterColumn>) {
    let mut defs = vec![column("Name", "string", "name", NAME_DESCRIPTION, 0)];
    let printer: Vec<PrinterColumn> = if !def.printer_columns.is_empty() {
        def.printer_columns.clone()
    } else {
        let (name, description) = if def.is_custom() {
            ("Age", "")
        } else {
            (
                "Created At",
                "CreationTimestamp is a timestamp representing the server time when this object was created.",
            )
        };
        vec![PrinterColumn {
            name: name.into(),
            type_: "date".into(),
            format: String::new(),
            description: description.into(),
            priority: 0,
            json_path: ".metadata.creationTimestamp".into(),
        }]
    };
    for c in &printer {
        defs.push(column(&c.name, &c.type_, &c.format, &c.description, c.priority));
    }
    (defs, printer)
}

/// Evaluates the JSONPath forms CRDs use (`.status.phase`, `.spec.ports[0].port`,
/// `.metadata.labels['app']`, `.status.conditions[?(@.type=="Ready")].status`), giving the
/// first result as the API server's table convertor does; anything else (wildcards, ranges,
/// other filter operators) yields nothing, where the API server would evaluate it.
pub fn json_path<'a>(object: &'a Value, path: &str) -> Option<&'a Value> {
    let path = path.trim().trim_start_matches('{').trim_end_matches('}');
    let path = path.strip_prefix('$').unwrap_or(path);
    let mut node = object;
    let mut rest = path;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('.') {
            let end = after.find(['.', '[']).unwrap_or(after.len());
            let key = &after[..end];
            if key.is_empty() {
                return None;
            }
            node = node.get(key)?;
            rest = &after[end..];
        } else if let Some(after) = rest.strip_prefix('[') {
            let end = after.find(']')?;
            let inner = &after[..end];
            let quoted = inner
                .strip_prefix('\'')
                .and_then(|s| s.strip_suffix('\''))
                .or_else(|| inner.strip_prefix('"').and_then(|s| s.strip_suffix('"')));
            node = match (quoted, inner.strip_prefix("?(").and_then(|f| f.strip_suffix(')'))) {
                (Some(key), _) => node.get(key)?,
                (None, Some(filter)) => first_match(node, filter)?,
                (None, None) => node.get(inner.parse::<usize>().ok()?)?,
            };
            rest = &after[end + 1..];
        } else {
            return None;
        }
    }
    Some(node)
}

/// The first element of an array for which `@.path == literal` holds (a string in single or
/// double quotes, or a JSON number, boolean or null).
fn first_match<'a>(array: &'a Value, filter: &str) -> Option<&'a Value> {
    let (left, right) = filter.split_once("==")?;
    let path = left.trim().strip_prefix('@')?;
    let right = right.trim();
    let literal = match right
        .strip_prefix('\'')
        .and_then(|r| r.strip_suffix('\''))
        .or_else(|| right.strip_prefix('"').and_then(|r| r.strip_suffix('"')))
    {
        Some(text) => Value::String(text.to_owned()),
        None => serde_json::from_str(right).ok()?,
    };
    array
        .as_array()?
        .iter()
        .find(|item| json_path(item, path) == Some(&literal))
}

/// A cell as the apiextensions table convertor makes it: `string` columns print the value
/// (JSON text for non-strings), the other types keep values of their type and drop the rest.
fn cell(column: &PrinterColumn, object: &Value) -> Value {
    let Some(value) = json_path(object, &column.json_path) else {
        return Value::Null;
    };
    match column.type_.as_str() {
        "string" => match value {
            Value::String(s) => Value::String(s.clone()),
            Value::Null => Value::Null,
            other => Value::String(other.to_string()),
        },
        "integer" => match value {
            Value::Number(n) if n.is_i64() || n.is_u64() => value.clone(),
            Value::Number(n) => match n.as_f64() {
                Some(f) if f.fract() == 0.0 => json!(f as i64),
                _ => Value::Null,
            },
            _ => Value::Null,
        },
        "number" => match value {
            Value::Number(_) => value.clone(),
            _ => Value::Null,
        },
        "boolean" => match value {
            Value::Bool(_) => value.clone(),
            _ => Value::Null,
        },
        // The API server sends a timestamp as its age (`ConvertToHumanReadableDateType`).
        "date" => match value {
            Value::String(text) => match text.parse::<jiff::Timestamp>() {
                Ok(at) => Value::String(human_duration(jiff::Timestamp::now().duration_since(at))),
                Err(_) => Value::String("<invalid>".into()),
            },
            _ => Value::Null,
        },
        _ => Value::Null,
    }
}

/// `duration.HumanDuration` of k8s.io/apimachinery: `42s`, `3m5s`, `2h10m`, `3d4h`.
pub fn human_duration(d: jiff::SignedDuration) -> String {
    let seconds = d.as_secs();
    if seconds < -1 {
        return "<invalid>".into();
    }
    if seconds < 0 {
        return "0s".into();
    }
    if seconds < 120 {
        return format!("{seconds}s");
    }
    let minutes = seconds / 60;
    if minutes < 10 {
        let s = seconds % 60;
        return if s == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{s}s")
        };
    }
    if minutes < 180 {
        return format!("{minutes}m");
    }
    let hours = seconds / 3600;
    if hours < 8 {
        let m = minutes % 60;
        return if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    let days = hours / 24;
    if hours < 24 * 8 {
        let h = hours % 24;
        return if h == 0 {
            format!("{days}d")
        } else {
            format!("{days}d{h}h")
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{days}d");
    }
    let years = days / 365;
    if hours < 24 * 365 * 8 {
        let dy = days % 365;
        return if dy == 0 {
            format!("{years}y")
        } else {
            format!("{years}y{dy}d")
        };
    }
    format!("{years}y")
}

fn row(def: &ResourceDef, printer: &[PrinterColumn], object: &Value, include: Include) -> Value {
    let name = object.pointer("/metadata/name").cloned().unwrap_or(Value::Null);
    let mut cells = vec![name];
    cells.extend(printer.iter().map(|c| cell(c, object)));
    let mut row = json!({"cells": cells});
    match include {
        Include::None => {}
        Include::Metadata => {
            row["object"] = json!({
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": object.get("metadata").cloned().unwrap_or_else(|| json!({})),
            });
        }
        Include::Object => {
            let mut full = object.clone();
            full["apiVersion"] = def.api_version().into();
            full["kind"] = def.kind.clone().into();
            row["object"] = full;
        }
    }
    row
}

/// A Table of `objects`; `metadata` is the list's (resourceVersion, continue).
pub fn render(def: &ResourceDef, objects: &[&Value], metadata: Value, include: Include) -> Value {
    let (column_definitions, printer) = columns(def);
    let rows: Vec<Value> = objects.iter().map(|o| row(def, &printer, o, include)).collect();
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": column_definitions,
        "rows": rows,
    })
}
