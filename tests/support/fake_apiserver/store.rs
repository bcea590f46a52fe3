//! The object store: objects by resource and (namespace, name), one cluster-wide
//! resourceVersion counter, a bounded per-resource event history that watches replay from,
//! and the write rules of the API server's generic registry (preconditions, server-owned
//! metadata, generation, status subresource, finalizers and deletionTimestamp).
//!
//! Everything here is synchronous and runs under one mutex: each write is O(log n) in the
//! number of objects of its resource, lists are O(n) in the objects they scan.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    ops::Bound,
    sync::{Arc, OnceLock},
};

use bytes::Bytes;
use serde_json::{Map, Value, json};
use tokio::sync::watch;

use super::{
    patch::{self, at_path, dotted, dropped_paths, leaf_paths, merge_patch, remove_path, strip_nulls},
    registry::ResourceDef,
    status::{ApiError, FieldError, FieldErrorKind, OPTIMISTIC_LOCK_MESSAGE},
};

/// (namespace, name); the namespace is empty for cluster-scoped objects.
pub type ObjKey = (String, String);

/// Validates a create (`old` = None) or an update; any error makes the write a 422.
pub type Validator = Arc<dyn Fn(&Value, Option<&Value>) -> Vec<FieldError> + Send + Sync>;

/// Watch event types as they appear on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One change, kept in the history watches replay from.
pub struct StoredEvent {
    pub rv: u64,
    pub kind: EventType,
    /// The object after the change (for DELETED: its last state, at the delete's RV).
    pub object: Arc<Value>,
    /// The object before the change, so label-selected watches can see it leave or enter.
    pub prev: Option<Arc<Value>>,
    line: OnceLock<Bytes>,
}

impl StoredEvent {
    /// The wire form, serialized once however many watches send it.
    pub fn line(&self) -> &Bytes {
        self.line
            .get_or_init(|| render_line(self.kind.as_str(), &self.object))
    }
}

/// `{"type":..,"object":..}\n`.
pub fn render_line(kind: &str, object: &Value) -> Bytes {
    let mut buf = Vec::with_capacity(512);
    buf.extend_from_slice(b"{\"type\":\"");
    buf.extend_from_slice(kind.as_bytes());
    buf.extend_from_slice(b"\",\"object\":");
    serde_json::to_writer(&mut buf, object).expect("invariant: a serde_json::Value always serializes");
    buf.extend_from_slice(b"}\n");
    Bytes::from(buf)
}

/// Which part of an existing object a write may change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The main resource: with a status subresource, `.status` is kept from the old object.
    Main,
    /// The `/status` subresource: only `.status` changes.
    Status,
    /// Test setup bypassing HTTP: everything but server-owned metadata changes.
    Whole,
}

/// A PATCH body, by content type.
pub enum PatchBody {
    Merge(Value),
    Json(Value),
    Apply {
        config: Value,
        manager: String,
        force: bool,
    },
}

/// What a DELETE did.
pub enum Deletion {
    /// Removed; the object as it was, at the delete's resourceVersion.
    Gone(Arc<Value>),
    /// Finalizers remain: marked with `deletionTimestamp` (or already was).
    Pending(Arc<Value>),
}

/// One page of a list.
pub struct ListPage {
    pub items: Vec<Arc<Value>>,
    pub rv: u64,
    pub continue_token: Option<String>,
}

/// Per-resource state.
pub struct ResourceState {
    pub def: Arc<ResourceDef>,
    objects: BTreeMap<ObjKey, Arc<Value>>,
    history: VecDeque<Arc<StoredEvent>>,
    /// RV of the newest event dropped from `history` (by the bound or by `compact`).
    evicted_rv: u64,
    /// Watches requested from an RV below this answer 410 (set by `compact`).
    compact_rv: u64,
    /// Latest RV written to this resource; watches wait on it.
    pub notify: watch::Sender<u64>,
    /// Server-side apply: the last configuration each (manager, is-status) applied, per object.
    applied: HashMap<ObjKey, BTreeMap<(String, bool), Value>>,
    validator: Option<Validator>,
}

/// All objects, all resources.
pub struct Store {
    pub rv: u64,
    pub resources: Vec<ResourceState>,
    history_limit: usize,
    cluster_ip_seq: u32,
}

fn now() -> String {
    format!("{:.0}", jiff::Timestamp::now())
}

fn new_uid() -> String {
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        fastrand::u32(..),
        fastrand::u16(..),
        fastrand::u16(..0x1000),
        fastrand::u16(0x8000..0xc000),
        fastrand::u64(..1 << 48)
    )
}

fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    meta(obj).and_then(|m| m.get(field)).and_then(Value::as_str)
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    let map = obj
        .as_object_mut()
        .expect("invariant: objects are checked to be JSON objects on entry");
    let entry = map.entry("metadata").or_insert_with(|| Value::Object(Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(Map::new());
    }
    entry
        .as_object_mut()
        .expect("invariant: just made metadata an object")
}

fn finalizers(obj: &Value) -> Vec<&str> {
    meta(obj)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|f| f.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn rv_of(obj: &Value) -> u64 {
    meta_str(obj, "resourceVersion")
        .and_then(|rv| rv.parse().ok())
        .unwrap_or(0)
}

/// Whether `a` and `b` are equal outside the top-level keys in `skip`.
fn equal_except(a: &Value, b: &Value, skip: &[&str]) -> bool {
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return a == b;
    };
    let relevant = |m: &Map<String, Value>| m.iter().filter(|(k, _)| !skip.contains(&k.as_str())).count();
    relevant(a) == relevant(b)
        && a.iter()
            .filter(|(k, _)| !skip.contains(&k.as_str()))
            .all(|(k, v)| b.get(k) == Some(v))
}

fn valid_dns_subdomain(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

const DNS_SUBDOMAIN_MESSAGE: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

fn base64(data: &[u8]) -> String {
    base64::Engine::encode(&base64::engine::general_purpose::STANDARD, data)
}

impl Store {
    pub fn new(defs: Vec<ResourceDef>, history_limit: usize) -> Self {
        let mut store = Self {
            rv: 1,
            resources: Vec::new(),
            history_limit: history_limit.max(1),
            cluster_ip_seq: 0,
        };
        for def in defs {
            store.register(def);
        }
        store
    }

    /// Adds (or replaces the definition of) a resource.
    pub fn register(&mut self, def: ResourceDef) {
        if let Some(existing) = self.find(&def.group, &def.version, &def.plural) {
            self.resources[existing].def = Arc::new(def);
            return;
        }
        self.resources.push(ResourceState {
            def: Arc::new(def),
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            evicted_rv: 0,
            compact_rv: 0,
            notify: watch::channel(self.rv).0,
            applied: HashMap::new(),
            validator: None,
        });
    }

    pub fn set_validator(&mut self, rid: usize, validator: Validator) {
        self.resources[rid].validator = Some(validator);
    }

    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<usize> {
        self.resources
            .iter()
            .position(|r| r.def.group == group && r.def.version == version && r.def.plural == plural)
    }

    /// Resolves `plural` or `plural.group` (a bare plural prefers the core group).
    pub fn resolve(&self, name: &str) -> Option<usize> {
        let named: Vec<usize> = (0..self.resources.len())
            .filter(|&i| self.resources[i].def.is_named(name))
            .collect();
        if let Some(&exact) = named.iter().find(|&&i| self.resources[i].def.qualified() == name) {
            return Some(exact);
        }
        named
            .iter()
            .copied()
            .find(|&i| self.resources[i].def.group.is_empty())
            .or_else(|| named.first().copied())
    }

    pub fn def(&self, rid: usize) -> Arc<ResourceDef> {
        self.resources[rid].def.clone()
    }

    pub fn get(&self, rid: usize, key: &ObjKey) -> Result<Arc<Value>, ApiError> {
        let rs = &self.resources[rid];
        rs.objects
            .get(key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&rs.def, &key.1))
    }

    /// Objects of `rid` in `namespace` (all namespaces when None), in key order, from `after`.
    fn scan<'a>(
        &'a self,
        rid: usize,
        namespace: Option<&'a str>,
        after: Option<ObjKey>,
    ) -> impl Iterator<Item = (&'a ObjKey, &'a Arc<Value>)> + 'a {
        let rs = &self.resources[rid];
        let lower = match (after, namespace) {
            (Some(key), _) => Bound::Excluded(key),
            (None, Some(ns)) => Bound::Included((ns.to_owned(), String::new())),
            (None, None) => Bound::Unbounded,
        };
        rs.objects
            .range((lower, Bound::Unbounded))
            .take_while(move |(key, _)| namespace.is_none_or(|ns| key.0 == ns))
    }

    /// A page of matching objects. Continue tokens carry the first page's RV, which every
    /// page reports; later pages read the current state (see docs/testing.md).
    pub fn list(
        &self,
        rid: usize,
        namespace: Option<&str>,
        filter: &dyn Fn(&Value) -> bool,
        limit: Option<usize>,
        continue_token: Option<&str>,
    ) -> Result<ListPage, ApiError> {
        let (rv, after) = match continue_token {
            None => (self.rv, None),
            Some(token) => {
                let mut parts = token.splitn(3, '/');
                let parsed = (parts.next(), parts.next(), parts.next());
                let (Some(rv), Some(ns), Some(name)) = parsed else {
                    return Err(ApiError::bad_request(format!(
                        "continue key is not valid: {token}"
                    )));
                };
                let rv: u64 = rv
                    .parse()
                    .map_err(|_| ApiError::bad_request(format!("continue key is not valid: {token}")))?;
                let rs = &self.resources[rid];
                if rv < rs.evicted_rv.max(rs.compact_rv) {
                    return Err(ApiError::expired(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter.",
                    ));
                }
                (rv, Some((ns.to_owned(), name.to_owned())))
            }
        };
        let limit = limit.filter(|&l| l > 0).unwrap_or(usize::MAX);
        let mut items = Vec::new();
        let mut continue_token = None;
        let mut last_key: Option<&ObjKey> = None;
        for (key, obj) in self.scan(rid, namespace, after) {
            if !filter(obj) {
                continue;
            }
            if items.len() == limit {
                // There is at least one more match: the next page starts after the last item.
                if let Some((ns, name)) = last_key {
                    continue_token = Some(format!("{rv}/{ns}/{name}"));
                }
                break;
            }
            items.push(obj.clone());
            last_key = Some(key);
        }
        Ok(ListPage {
            items,
            rv,
            continue_token,
        })
    }

    /// Current matching objects and the RV they are current at (for synthetic ADDED events).
    pub fn snapshot(&self, rid: usize, namespace: Option<&str>) -> (Vec<Arc<Value>>, u64) {
        (
            self.scan(rid, namespace, None).map(|(_, o)| o.clone()).collect(),
            self.rv,
        )
    }

    /// Events of `rid` after `after`, and the RV up to which the caller has now seen all.
    /// `fresh` marks a new watch request, which also honours the compaction point.
    pub fn events_after(
        &self,
        rid: usize,
        after: u64,
        fresh: bool,
    ) -> Result<(Vec<Arc<StoredEvent>>, u64), ApiError> {
        let rs = &self.resources[rid];
        let floor = if fresh {
            rs.evicted_rv.max(rs.compact_rv)
        } else {
            rs.evicted_rv
        };
        if after < floor {
            return Err(ApiError::expired(format!(
                "too old resource version: {after} ({floor})"
            )));
        }
        let start = rs.history.partition_point(|e| e.rv <= after);
        Ok((rs.history.range(start..).cloned().collect(), self.rv))
    }

    /// Makes every resourceVersion handed out so far too old to watch from.
    pub fn compact(&mut self) {
        self.rv += 1;
        for rs in &mut self.resources {
            if let Some(last) = rs.history.back() {
                rs.evicted_rv = rs.evicted_rv.max(last.rv);
            }
            rs.history.clear();
            rs.compact_rv = self.rv;
        }
    }

    fn push_event(&mut self, rid: usize, kind: EventType, object: Arc<Value>, prev: Option<Arc<Value>>) {
        let rv = self.rv;
        let limit = self.history_limit;
        let rs = &mut self.resources[rid];
        rs.history.push_back(Arc::new(StoredEvent {
            rv,
            kind,
            object,
            prev,
            line: OnceLock::new(),
        }));
        while rs.history.len() > limit {
            if let Some(evicted) = rs.history.pop_front() {
                rs.evicted_rv = evicted.rv;
            }
        }
        rs.notify.send_replace(rv);
    }

    fn validate(&self, rid: usize, new: &Value, old: Option<&Value>) -> Result<(), ApiError> {
        let rs = &self.resources[rid];
        check_size(&rs.def, new)?;
        let Some(validator) = &rs.validator else {
            return Ok(());
        };
        let errors = validator(new, old);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ApiError::invalid(
                &rs.def,
                meta_str(new, "name").unwrap_or_default(),
                &errors,
            ))
        }
    }

    /// Defaulting the API server does for the built-in types the fake serves.
    fn normalize(&mut self, def: &ResourceDef, obj: &mut Value, creating: bool) {
        match (def.group.as_str(), def.plural.as_str()) {
            ("", "secrets") => {
                if obj.get("type").is_none() {
                    obj["type"] = "Opaque".into();
                }
                // stringData is write-only: merged into data, base64-encoded.
                if let Some(Value::Object(string_data)) =
                    obj.as_object_mut().and_then(|o| o.remove("stringData"))
                {
                    if !obj.get("data").is_some_and(Value::is_object) {
                        obj["data"] = json!({});
                    }
                    for (key, value) in string_data {
                        obj["data"][key] = base64(value.as_str().unwrap_or_default().as_bytes()).into();
                    }
                }
            }
            ("", "services") if creating => {
                if !obj.get("spec").is_some_and(Value::is_object) {
                    obj["spec"] = json!({});
                }
                let spec = &mut obj["spec"];
                if spec.get("type").is_none() {
                    spec["type"] = "ClusterIP".into();
                }
                if spec.get("sessionAffinity").is_none() {
                    spec["sessionAffinity"] = "None".into();
                }
                if spec["type"] != "ExternalName" && spec.get("clusterIP").is_none() {
                    self.cluster_ip_seq += 1;
                    let n = self.cluster_ip_seq;
                    let ip = format!("10.96.{}.{}", (n >> 8) & 255, n & 255);
                    spec["clusterIP"] = ip.clone().into();
                    spec["clusterIPs"] = json!([ip]);
                }
                if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
                    for port in ports {
                        if port.get("protocol").is_none() {
                            port["protocol"] = "TCP".into();
                        }
                        if port.get("targetPort").is_none()
                            && let Some(p) = port.get("port").cloned()
                        {
                            port["targetPort"] = p;
                        }
                    }
                }
            }
            ("", "pods") if creating && obj.pointer("/status/phase").is_none() => {
                obj["status"] = json!({"phase": "Pending"});
            }
            ("", "namespaces") if creating => {
                obj["status"] = json!({"phase": "Active"});
            }
            ("apps", "deployments")
                if creating
                    && obj.get("spec").is_some_and(Value::is_object)
                    && obj.pointer("/spec/replicas").is_none() =>
            {
                obj["spec"]["replicas"] = 1.into();
            }
            _ => {}
        }
    }

    /// POST: creates `obj` in `namespace`. `direct` (test setup) keeps `.status`.
    pub fn create(
        &mut self,
        rid: usize,
        namespace: Option<&str>,
        mut obj: Value,
        dry_run: bool,
        direct: bool,
    ) -> Result<Arc<Value>, ApiError> {
        let def = self.def(rid);
        if !obj.is_object() {
            return Err(ApiError::bad_request("Object 'Kind' is missing in request body"));
        }
        obj["apiVersion"] = def.api_version().into();
        obj["kind"] = def.kind.clone().into();
        let metadata = meta_mut(&mut obj);
        if metadata
            .get("resourceVersion")
            .and_then(Value::as_str)
            .is_some_and(|rv| !rv.is_empty())
        {
            return Err(ApiError::unknown(
                500,
                "resourceVersion should not be set on objects to be created",
            ));
        }
        // Namespace: the request's, which the object may only repeat.
        if def.namespaced {
            let ns = namespace.unwrap_or_default();
            match metadata.get("namespace").and_then(Value::as_str) {
                Some(given) if !given.is_empty() && given != ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => {
                    metadata.insert("namespace".into(), ns.into());
                }
            }
        } else {
            metadata.remove("namespace");
        }
        let ns = if def.namespaced {
            namespace.unwrap_or_default().to_owned()
        } else {
            String::new()
        };
        let name = match metadata
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            Some(name) => name.to_owned(),
            None => match metadata
                .get("generateName")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
            {
                Some(prefix) => {
                    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
                    let objects = &self.resources[rid].objects;
                    let mut candidate;
                    loop {
                        let suffix: String = (0..5)
                            .map(|_| ALPHABET[fastrand::usize(..ALPHABET.len())] as char)
                            .collect();
                        candidate = format!("{prefix}{suffix}");
                        if !objects.contains_key(&(ns.clone(), candidate.clone())) {
                            break;
                        }
                    }
                    candidate
                }
                None => {
                    return Err(ApiError::invalid(
                        &def,
                        "",
                        &[FieldError::required(
                            "metadata.name",
                            "name or generateName is required",
                        )],
                    ));
                }
            },
        };
        if !valid_dns_subdomain(&name) {
            return Err(ApiError::invalid(
                &def,
                &name,
                &[FieldError::invalid(
                    "metadata.name",
                    Value::String(name.clone()),
                    DNS_SUBDOMAIN_MESSAGE,
                )],
            ));
        }
        let metadata = meta_mut(&mut obj);
        metadata.insert("name".into(), name.clone().into());
        metadata.insert("uid".into(), new_uid().into());
        metadata.insert("creationTimestamp".into(), now().into());
        for server_owned in [
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "managedFields",
            "selfLink",
        ] {
            metadata.remove(server_owned);
        }
        if def.generation {
            metadata.insert("generation".into(), 1.into());
        } else {
            metadata.remove("generation");
        }
        if def.status_subresource && !direct {
            // Create cannot set status where status is a subresource.
            obj.as_object_mut().expect("checked above").remove("status");
        }
        self.normalize(&def, &mut obj, true);
        let key = (ns, name.clone());
        if self.resources[rid].objects.contains_key(&key) {
            return Err(ApiError::already_exists(&def, &name));
        }
        if !direct {
            self.validate(rid, &obj, None)?;
        }
        if dry_run {
            return Ok(Arc::new(obj));
        }
        self.rv += 1;
        meta_mut(&mut obj).insert("resourceVersion".into(), self.rv.to_string().into());
        let obj = Arc::new(obj);
        self.resources[rid].objects.insert(key, obj.clone());
        self.push_event(rid, EventType::Added, obj.clone(), None);
        Ok(obj)
    }

    /// PUT (and the tail of every PATCH): replaces `key` with `new` under the rules of
    /// `target`. `require_rv`: a PUT to a resource without unconditional updates.
    pub fn update(
        &mut self,
        rid: usize,
        key: &ObjKey,
        new: Value,
        target: Target,
        dry_run: bool,
        require_rv: bool,
    ) -> Result<Arc<Value>, ApiError> {
        let old = self.get(rid, key)?;
        self.update_from(rid, key, &old, new, target, dry_run, require_rv)
    }

    #[allow(clippy::too_many_arguments)]
    fn update_from(
        &mut self,
        rid: usize,
        key: &ObjKey,
        old: &Arc<Value>,
        mut new: Value,
        target: Target,
        dry_run: bool,
        require_rv: bool,
    ) -> Result<Arc<Value>, ApiError> {
        let def = self.def(rid);
        let name = &key.1;
        if !new.is_object() {
            return Err(ApiError::bad_request("Object 'Kind' is missing in request body"));
        }
        let old_rv = rv_of(old);
        match meta_str(&new, "resourceVersion").filter(|rv| !rv.is_empty()) {
            Some(rv) if rv.parse::<u64>().ok() != Some(old_rv) => {
                return Err(ApiError::conflict(&def, name, OPTIMISTIC_LOCK_MESSAGE));
            }
            Some(_) => {}
            None if require_rv && !def.unconditional_update => {
                return Err(ApiError::invalid(
                    &def,
                    name,
                    &[FieldError::invalid(
                        "metadata.resourceVersion",
                        json!("0x0"),
                        "must be specified for an update",
                    )],
                ));
            }
            None => {}
        }
        if let Some(given) = meta_str(&new, "name")
            && given != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({given}) does not match the name on the URL ({name})"
            )));
        }
        if def.namespaced
            && let Some(given) = meta_str(&new, "namespace")
            && !given.is_empty()
            && given != key.0
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let old_uid = meta_str(old, "uid").unwrap_or_default();
        if let Some(given) = meta_str(&new, "uid")
            && !given.is_empty()
            && given != old_uid
        {
            return Err(ApiError::conflict(
                &def,
                name,
                &format!("Precondition failed: UID in precondition: {given}, UID in object meta: {old_uid}"),
            ));
        }

        let mut result = match target {
            Target::Status => {
                let mut result = (**old).clone();
                match new.get_mut("status").map(Value::take) {
                    Some(status) => result["status"] = status,
                    None => {
                        result
                            .as_object_mut()
                            .expect("stored objects are objects")
                            .remove("status");
                    }
                }
                result
            }
            Target::Main | Target::Whole => {
                let old_meta = meta(old).cloned().unwrap_or_default();
                let metadata = meta_mut(&mut new);
                for owned in [
                    "uid",
                    "creationTimestamp",
                    "deletionTimestamp",
                    "deletionGracePeriodSeconds",
                    "generation",
                    "name",
                    "namespace",
                ] {
                    match old_meta.get(owned) {
                        Some(value) => metadata.insert(owned.into(), value.clone()),
                        None => metadata.remove(owned),
                    };
                }
                metadata.remove("managedFields");
                metadata.remove("selfLink");
                if target == Target::Main && def.status_subresource {
                    match old.get("status") {
                        Some(status) => new["status"] = status.clone(),
                        None => {
                            new.as_object_mut().expect("checked above").remove("status");
                        }
                    }
                }
                new
            }
        };
        result["apiVersion"] = def.api_version().into();
        result["kind"] = def.kind.clone().into();
        meta_mut(&mut result).insert("resourceVersion".into(), old_rv.to_string().into());

        let deleting = meta(old).is_some_and(|m| m.contains_key("deletionTimestamp"));
        if deleting {
            let before = finalizers(old);
            let added: Vec<&str> = finalizers(&result)
                .into_iter()
                .filter(|f| !before.contains(f))
                .collect();
            if !added.is_empty() {
                let list = added
                    .iter()
                    .map(|f| format!("\"{f}\""))
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(ApiError::invalid(
                    &def,
                    name,
                    &[FieldError::forbidden(
                        "metadata.finalizers",
                        format!(
                            "no new finalizers can be added if the object is being deleted, found new finalizers []string{{{list}}}"
                        ),
                    )],
                ));
            }
        }
        if target != Target::Status {
            self.normalize(&def, &mut result, false);
        }
        if target != Target::Whole {
            self.validate(rid, &result, Some(old))?;
        }
        if def.generation && target != Target::Status {
            let skip: &[&str] = if def.status_subresource {
                &["metadata", "status"]
            } else {
                &["metadata"]
            };
            if !equal_except(old, &result, skip) {
                let generation = meta(old)
                    .and_then(|m| m.get("generation"))
                    .and_then(Value::as_i64)
                    .unwrap_or(0);
                meta_mut(&mut result).insert("generation".into(), (generation + 1).into());
            }
        }
        if result == **old {
            // A no-op write changes nothing: same resourceVersion, no watch event.
            return Ok(old.clone());
        }
        if dry_run {
            return Ok(Arc::new(result));
        }
        self.rv += 1;
        meta_mut(&mut result).insert("resourceVersion".into(), self.rv.to_string().into());
        let result = Arc::new(result);
        self.resources[rid].objects.insert(key.clone(), result.clone());
        self.push_event(rid, EventType::Modified, result.clone(), Some(old.clone()));
        if deleting && finalizers(&result).is_empty() {
            self.remove(rid, key, &result);
        }
        Ok(result)
    }

    fn remove(&mut self, rid: usize, key: &ObjKey, current: &Arc<Value>) -> Arc<Value> {
        self.rv += 1;
        let mut gone = (**current).clone();
        meta_mut(&mut gone).insert("resourceVersion".into(), self.rv.to_string().into());
        let gone = Arc::new(gone);
        let rs = &mut self.resources[rid];
        rs.objects.remove(key);
        rs.applied.remove(key);
        self.push_event(rid, EventType::Deleted, gone.clone(), Some(current.clone()));
        gone
    }

    /// DELETE with optional `preconditions` (uid, resourceVersion).
    pub fn delete(
        &mut self,
        rid: usize,
        key: &ObjKey,
        precondition_uid: Option<&str>,
        precondition_rv: Option<&str>,
        dry_run: bool,
    ) -> Result<Deletion, ApiError> {
        let def = self.def(rid);
        let current = self.get(rid, key)?;
        let uid = meta_str(&current, "uid").unwrap_or_default();
        if let Some(want) = precondition_uid
            && want != uid
        {
            return Err(ApiError::conflict(
                &def,
                &key.1,
                &format!("Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"),
            ));
        }
        let rv = meta_str(&current, "resourceVersion").unwrap_or_default();
        if let Some(want) = precondition_rv
            && want != rv
        {
            return Err(ApiError::conflict(
                &def,
                &key.1,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in object meta: {rv}"
                ),
            ));
        }
        if finalizers(&current).is_empty() {
            if dry_run {
                return Ok(Deletion::Gone(current));
            }
            return Ok(Deletion::Gone(self.remove(rid, key, &current)));
        }
        if meta(&current).is_some_and(|m| m.contains_key("deletionTimestamp")) {
            return Ok(Deletion::Pending(current));
        }
        let mut marked = (*current).clone();
        let metadata = meta_mut(&mut marked);
        metadata.insert("deletionTimestamp".into(), now().into());
        metadata.insert("deletionGracePeriodSeconds".into(), 0.into());
        if let Some(generation) = metadata
            .get("generation")
            .and_then(Value::as_i64)
            .filter(|g| *g > 0)
        {
            // Setting deletionTimestamp counts as a spec change (rest.BeforeDelete).
            metadata.insert("generation".into(), (generation + 1).into());
        }
        if dry_run {
            return Ok(Deletion::Pending(Arc::new(marked)));
        }
        self.rv += 1;
        meta_mut(&mut marked).insert("resourceVersion".into(), self.rv.to_string().into());
        let marked = Arc::new(marked);
        self.resources[rid].objects.insert(key.clone(), marked.clone());
        self.push_event(rid, EventType::Modified, marked.clone(), Some(current));
        Ok(Deletion::Pending(marked))
    }

    /// PATCH. Returns the object and whether it was created (apply only).
    pub fn patch(
        &mut self,
        rid: usize,
        key: &ObjKey,
        body: PatchBody,
        target: Target,
        dry_run: bool,
    ) -> Result<(Arc<Value>, bool), ApiError> {
        let def = self.def(rid);
        let existing = self.resources[rid].objects.get(key).cloned();
        match (existing, body) {
            (
                None,
                PatchBody::Apply {
                    mut config, manager, ..
                },
            ) if target == Target::Main => {
                strip_nulls(&mut config);
                if let Some(given) = meta_str(&config, "name")
                    && given != key.1
                {
                    return Err(ApiError::bad_request(format!(
                        "the name of the object ({given}) does not match the name on the URL ({})",
                        key.1
                    )));
                }
                meta_mut(&mut config).insert("name".into(), key.1.clone().into());
                meta_mut(&mut config).remove("resourceVersion");
                let namespace = def.namespaced.then_some(key.0.as_str());
                let created = self.create(rid, namespace, config.clone(), dry_run, false)?;
                if !dry_run {
                    self.remember_applied(rid, key, manager, false, config);
                }
                Ok((created, true))
            }
            (None, _) => Err(ApiError::not_found(&def, &key.1)),
            (Some(old), PatchBody::Merge(patch)) => {
                let mut doc = (*old).clone();
                merge_patch(&mut doc, &patch);
                Ok((
                    self.update_from(rid, key, &old, doc, target, dry_run, false)?,
                    false,
                ))
            }
            (Some(old), PatchBody::Json(patch)) => {
                let mut doc = (*old).clone();
                patch::json_patch(&mut doc, &patch)?;
                Ok((
                    self.update_from(rid, key, &old, doc, target, dry_run, false)?,
                    false,
                ))
            }
            (
                Some(old),
                PatchBody::Apply {
                    mut config,
                    manager,
                    force,
                },
            ) => {
                strip_nulls(&mut config);
                let is_status = target == Target::Status;
                self.check_apply_conflicts(rid, key, &config, &manager, is_status, force)?;
                let mut doc = (*old).clone();
                merge_patch(&mut doc, &config);
                let previous = self.resources[rid]
                    .applied
                    .get(key)
                    .and_then(|m| m.get(&(manager.clone(), is_status)))
                    .cloned();
                if let Some(previous) = previous {
                    for path in dropped_paths(&previous, &config) {
                        if !self.co_owned(rid, key, &manager, is_status, &path) {
                            remove_path(&mut doc, &path);
                        }
                    }
                }
                let result = self.update_from(rid, key, &old, doc, target, dry_run, false)?;
                if !dry_run && self.resources[rid].objects.contains_key(key) {
                    meta_mut(&mut config).remove("resourceVersion");
                    self.remember_applied(rid, key, manager, is_status, config);
                }
                Ok((result, false))
            }
        }
    }

    fn remember_applied(
        &mut self,
        rid: usize,
        key: &ObjKey,
        manager: String,
        is_status: bool,
        config: Value,
    ) {
        self.resources[rid]
            .applied
            .entry(key.clone())
            .or_default()
            .insert((manager, is_status), config);
    }

    /// Whether a manager other than `manager` applied `path` too (so it stays).
    fn co_owned(&self, rid: usize, key: &ObjKey, manager: &str, is_status: bool, path: &[String]) -> bool {
        self.resources[rid].applied.get(key).is_some_and(|configs| {
            configs.iter().any(|((m, s), config)| {
                (m.as_str() != manager || *s != is_status) && at_path(config, path).is_some()
            })
        })
    }

    /// Apply-vs-apply conflicts: a field another manager applied with a different value.
    /// With `force` the other manager gives the field up.
    fn check_apply_conflicts(
        &mut self,
        rid: usize,
        key: &ObjKey,
        config: &Value,
        manager: &str,
        is_status: bool,
        force: bool,
    ) -> Result<(), ApiError> {
        let def = self.def(rid);
        let Some(configs) = self.resources[rid].applied.get_mut(key) else {
            return Ok(());
        };
        let mut leaves = Vec::new();
        leaf_paths(config, &mut Vec::new(), &mut leaves);
        let ignored = |path: &[String]| {
            matches!(path.first().map(String::as_str), Some("apiVersion" | "kind"))
                || (path.first().map(String::as_str) == Some("metadata")
                    && matches!(
                        path.get(1).map(String::as_str),
                        Some("name" | "namespace" | "resourceVersion")
                    ))
        };
        let mut conflicts: Vec<(String, String)> = Vec::new();
        for ((other, other_status), other_config) in configs.iter_mut() {
            if other.as_str() == manager && *other_status == is_status {
                continue;
            }
            for path in leaves.iter().filter(|p| !ignored(p)) {
                let (Some(theirs), Some(ours)) = (at_path(other_config, path), at_path(config, path)) else {
                    continue;
                };
                if theirs != ours {
                    if force {
                        remove_path(other_config, path);
                    } else {
                        conflicts.push((other.clone(), dotted(path)));
                    }
                }
            }
        }
        if conflicts.is_empty() {
            return Ok(());
        }
        let api_version = def.api_version();
        let message = match conflicts.as_slice() {
            [(other, path)] => {
                format!("Apply failed with 1 conflict: conflict with \"{other}\" using {api_version}: {path}")
            }
            many => {
                let lines: Vec<String> = many
                    .iter()
                    .map(|(other, path)| format!("conflict with \"{other}\" using {api_version}: {path}"))
                    .collect();
                format!("Apply failed with {} conflicts: {}", many.len(), lines.join("\n"))
            }
        };
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|(other, path)| {
                json!({"reason": "FieldManagerConflict", "message": format!("conflict with \"{other}\""), "field": path})
            })
            .collect();
        Err(ApiError {
            code: 409,
            reason: "Conflict",
            message,
            details: Some(json!({"causes": causes})),
        })
    }

    /// All objects of `rid` in `namespace` (all namespaces when None).
    pub fn all(&self, rid: usize, namespace: Option<&str>) -> Vec<Arc<Value>> {
        self.scan(rid, namespace, None).map(|(_, o)| o.clone()).collect()
    }
}

/// kube-apiserver's limit on a ConfigMap's or Secret's data (values and keys, binary data
/// decoded): 1 MiB.
pub const DATA_LIMIT_BYTES: usize = 1024 * 1024;
/// etcd's default `--max-request-bytes`: an object whose encoding is larger is refused.
pub const OBJECT_LIMIT_BYTES: usize = 1536 * 1024;

/// The size limits of a real cluster: a ConfigMap or Secret whose data passes
/// [`DATA_LIMIT_BYTES`] is Invalid (422, `Too long`), any object whose JSON passes
/// [`OBJECT_LIMIT_BYTES`] fails as etcd fails it (500, `request is too large`).
fn check_size(def: &ResourceDef, new: &Value) -> Result<(), ApiError> {
    if def.group.is_empty() && (def.plural == "configmaps" || def.plural == "secrets") {
        let mut size = 0;
        for (field, decoded) in [("data", def.plural == "secrets"), ("binaryData", true)] {
            if let Some(map) = new.get(field).and_then(Value::as_object) {
                for (key, value) in map {
                    let len = value.as_str().map_or(0, str::len);
                    // Base64 values count as the bytes they decode to.
                    size += key.len() + if decoded { len / 4 * 3 } else { len };
                }
            }
        }
        if size > DATA_LIMIT_BYTES {
            let name = meta_str(new, "name").unwrap_or_default();
            return Err(ApiError::invalid(
                def,
                name,
                &[FieldError {
                    field: "[]".to_owned(),
                    kind: FieldErrorKind::TooLong,
                    detail: format!("must have at most {DATA_LIMIT_BYTES} bytes"),
                }],
            ));
        }
    }
    let encoded = serde_json::to_vec(new).map_or(0, |v| v.len());
    if encoded > OBJECT_LIMIT_BYTES {
        return Err(ApiError::unknown(500, "etcdserver: request is too large"));
    }
    Ok(())
}
