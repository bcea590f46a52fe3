//! Patch mechanics on JSON documents: JSON merge patch (RFC 7386), JSON patch (RFC 6902,
//! with the quirks of the `evanphx/json-patch` v4 library the API server uses), and the
//! server-side-apply approximation (merge plus removal of fields the same manager applied
//! before and no longer applies).

use serde_json::{Map, Value};

use super::status::ApiError;

/// RFC 7386: objects merge recursively, `null` removes a key, anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(map) = target else {
        unreachable!("just made an object")
    };
    for (key, value) in patch {
        if value.is_null() {
            map.remove(key);
        } else {
            merge_patch(map.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// A JSON pointer (RFC 6901) split into unescaped tokens.
fn pointer(path: &str) -> Result<Vec<String>, ApiError> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(ApiError::generic_unprocessable());
    };
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn array_index(token: &str, len: usize, allow_end: bool) -> Option<usize> {
    if allow_end && token == "-" {
        return Some(len);
    }
    if token.starts_with('+') || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    let index: usize = token.parse().ok()?;
    let limit = if allow_end { len } else { len.saturating_sub(1) };
    (index <= limit && (allow_end || len > 0)).then_some(index)
}

/// The container holding the last token of `path`, and that token.
fn parent<'a>(doc: &'a mut Value, tokens: &[String]) -> Option<(&'a mut Value, String)> {
    let (last, init) = tokens.split_last()?;
    let mut node = doc;
    for token in init {
        node = match node {
            Value::Object(map) => map.get_mut(token)?,
            Value::Array(items) => {
                let index = array_index(token, items.len(), false)?;
                items.get_mut(index)?
            }
            _ => return None,
        };
    }
    Some((node, last.clone()))
}

fn get<'a>(doc: &'a Value, tokens: &[String]) -> Option<&'a Value> {
    let mut node = doc;
    for token in tokens {
        node = match node {
            Value::Object(map) => map.get(token)?,
            Value::Array(items) => items.get(array_index(token, items.len(), false)?)?,
            _ => return None,
        };
    }
    Some(node)
}

fn add(doc: &mut Value, tokens: &[String], value: Value) -> Result<(), ApiError> {
    if tokens.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (container, key) = parent(doc, tokens).ok_or_else(ApiError::generic_unprocessable)?;
    match container {
        Value::Object(map) => {
            map.insert(key, value);
            Ok(())
        }
        Value::Array(items) => {
            let index = array_index(&key, items.len(), true).ok_or_else(ApiError::generic_unprocessable)?;
            items.insert(index, value);
            Ok(())
        }
        _ => Err(ApiError::generic_unprocessable()),
    }
}

fn remove(doc: &mut Value, tokens: &[String]) -> Result<Value, ApiError> {
    let (container, key) = parent(doc, tokens).ok_or_else(ApiError::generic_unprocessable)?;
    match container {
        Value::Object(map) => map.remove(&key).ok_or_else(ApiError::generic_unprocessable),
        Value::Array(items) => {
            let index = array_index(&key, items.len(), false).ok_or_else(ApiError::generic_unprocessable)?;
            Ok(items.remove(index))
        }
        _ => Err(ApiError::generic_unprocessable()),
    }
}

/// Applies an RFC 6902 patch document. A malformed document is a 400; an operation that
/// does not apply (missing path, failed `test`) is the API server's generic 422.
///
/// As in `evanphx/json-patch` v4, `test` with a `null` value succeeds on a missing key
/// whose parent exists: kube-runtime's finalizer helper relies on it
/// (`test /metadata/finalizers null` before adding the first finalizer).
pub fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let Value::Array(ops) = patch else {
        return Err(ApiError::bad_request(
            "json: cannot unmarshal object into Go value of type jsonpatch.Patch",
        ));
    };
    for op in ops {
        let name = op.get("op").and_then(Value::as_str).unwrap_or_default();
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad_request("json patch operation is missing \"path\""))?;
        let tokens = pointer(path)?;
        match name {
            "add" => {
                let value = op.get("value").cloned().unwrap_or(Value::Null);
                add(doc, &tokens, value)?;
            }
            "remove" => {
                remove(doc, &tokens)?;
            }
            "replace" => {
                let value = op.get("value").cloned().unwrap_or(Value::Null);
                if get(doc, &tokens).is_none() {
                    return Err(ApiError::generic_unprocessable());
                }
                if tokens.is_empty() {
                    *doc = value;
                } else {
                    let (container, key) =
                        parent(doc, &tokens).ok_or_else(ApiError::generic_unprocessable)?;
                    match container {
                        Value::Object(map) => {
                            map.insert(key, value);
                        }
                        Value::Array(items) => {
                            let index = array_index(&key, items.len(), false)
                                .ok_or_else(ApiError::generic_unprocessable)?;
                            items[index] = value;
                        }
                        _ => return Err(ApiError::generic_unprocessable()),
                    }
                }
            }
            "move" | "copy" => {
                let from = op
                    .get("from")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad_request("json patch operation is missing \"from\""))?;
                let from = pointer(from)?;
                let value = if name == "move" {
                    remove(doc, &from)?
                } else {
                    get(doc, &from)
                        .cloned()
                        .ok_or_else(ApiError::generic_unprocessable)?
                };
                add(doc, &tokens, value)?;
            }
            "test" => {
                let want = op.get("value").unwrap_or(&Value::Null);
                let passed = match get(doc, &tokens) {
                    Some(actual) => actual == want,
                    // A missing key tests equal to null if its container exists.
                    None => {
                        want.is_null()
                            && (tokens.len() <= 1
                                || get(doc, &tokens[..tokens.len() - 1]).is_some_and(Value::is_object))
                    }
                };
                if !passed {
                    return Err(ApiError::generic_unprocessable());
                }
            }
            other => {
                return Err(ApiError::bad_request(format!("Unexpected kind: {other}")));
            }
        }
    }
    Ok(())
}

/// Removes `null`s from an applied configuration: in server-side apply they set nothing.
pub fn strip_nulls(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(strip_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

/// Every leaf path (non-object value, or empty object) of `value`.
pub fn leaf_paths(value: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (key, child) in map {
                prefix.push(key.clone());
                leaf_paths(child, prefix, out);
                prefix.pop();
            }
        }
        _ => out.push(prefix.clone()),
    }
}

/// The value at a path of object keys.
pub fn at_path<'a>(value: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(value, |node, key| node.get(key))
}

/// Removes the value at a path of object keys (and nothing else).
pub fn remove_path(value: &mut Value, path: &[String]) {
    let Some((last, init)) = path.split_last() else {
        return;
    };
    let mut node = value;
    for key in init {
        match node.get_mut(key) {
            Some(child) => node = child,
            None => return,
        }
    }
    if let Value::Object(map) = node {
        map.remove(last);
    }
}

/// Paths of `previous` (an earlier applied configuration) that `current` no longer sets.
pub fn dropped_paths(previous: &Value, current: &Value) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut prefix = Vec::new();
    collect_dropped(previous, current, &mut prefix, &mut out);
    out
}

fn collect_dropped(previous: &Value, current: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let Value::Object(previous) = previous else { return };
    for (key, before) in previous {
        prefix.push(key.clone());
        match current.get(key) {
            None => out.push(prefix.clone()),
            Some(now) if before.is_object() && now.is_object() => collect_dropped(before, now, prefix, out),
            Some(_) => {}
        }
        prefix.pop();
    }
}

/// Renders a path as server-side apply reports it: `.spec.port`.
pub fn dotted(path: &[String]) -> String {
    path.iter().map(|p| format!(".{p}")).collect()
}
