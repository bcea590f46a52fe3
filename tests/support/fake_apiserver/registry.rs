//! The resources the fake serves and how each behaves where Kubernetes resources differ
//! (scope, status subresource, generation, unconditional updates, delete responses).

use serde_json::Value;

/// One served resource (one group/version/plural).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceDef {
    /// API group, empty for the core group.
    pub group: String,
    /// Served version.
    pub version: String,
    /// Kind, e.g. `Proxy`.
    pub kind: String,
    /// Lowercase plural, the path segment, e.g. `proxies`.
    pub plural: String,
    /// Namespaced (else cluster-scoped).
    pub namespaced: bool,
    /// Has a `/status` subresource: main-resource writes ignore `.status`, `/status` writes
    /// change nothing but `.status`.
    pub status_subresource: bool,
    /// Maintains `metadata.generation` (custom resources, Deployments; not ConfigMaps,
    /// Secrets, Services, Leases, Events).
    pub generation: bool,
    /// A PUT without `metadata.resourceVersion` is accepted (built-in types); custom
    /// resources answer 422 instead.
    pub unconditional_update: bool,
    /// DELETE answers with the deleted object (custom resources, Pods, Services) rather
    /// than a `Status`.
    pub return_deleted_object: bool,
    /// Accepts `application/strategic-merge-patch+json` (built-in types only; custom
    /// resources answer 415).
    pub strategic_merge: bool,
    /// Field selectors accepted besides `metadata.name` and `metadata.namespace`
    /// (dotted JSON paths into the object).
    pub extra_field_selectors: Vec<String>,
    /// Lowercase singular name for discovery (`proxy`); empty: the lowercase kind.
    pub singular: String,
    /// Discovery short names (`px`), which kubectl resolves.
    pub short_names: Vec<String>,
    /// Discovery categories (`all`, `crawl`).
    pub categories: Vec<String>,
    /// A CRD's `additionalPrinterColumns`, for server-side Table printing.
    pub printer_columns: Vec<PrinterColumn>,
    /// A CRD's `openAPIV3Schema`: published in /openapi/v3 and used by `fieldValidation`.
    pub schema: Option<Value>,
    /// Defined by a stored CustomResourceDefinition (else a built-in type).
    pub from_crd: bool,
}

/// One `additionalPrinterColumns` entry of a CRD version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrinterColumn {
    pub name: String,
    /// `string`, `integer`, `number`, `boolean` or `date`.
    pub type_: String,
    pub format: String,
    pub description: String,
    pub priority: i64,
    pub json_path: String,
}

impl ResourceDef {
    /// A built-in style namespaced resource: no status subresource, no generation,
    /// unconditional updates, deletes answer a `Status`.
    pub fn builtin(group: &str, version: &str, kind: &str, plural: &str) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            plural: plural.into(),
            namespaced: true,
            status_subresource: false,
            generation: false,
            unconditional_update: true,
            return_deleted_object: false,
            strategic_merge: true,
            extra_field_selectors: Vec::new(),
            singular: String::new(),
            short_names: Vec::new(),
            categories: Vec::new(),
            printer_columns: Vec::new(),
            schema: None,
            from_crd: false,
        }
    }

    /// A namespaced custom resource (as a CRD defines it): generation, PUT requires a
    /// resourceVersion, deletes return the object, no strategic merge patch.
    pub fn custom(group: &str, version: &str, kind: &str, plural: &str) -> Self {
        Self {
            generation: true,
            unconditional_update: false,
            return_deleted_object: true,
            strategic_merge: false,
            ..Self::builtin(group, version, kind, plural)
        }
    }

    /// Makes it cluster-scoped.
    pub fn cluster_scoped(mut self) -> Self {
        self.namespaced = false;
        self
    }

    /// Gives it a `/status` subresource.
    pub fn with_status(mut self) -> Self {
        self.status_subresource = true;
        self
    }

    /// Makes it maintain `metadata.generation`.
    pub fn with_generation(mut self) -> Self {
        self.generation = true;
        self
    }

    /// Makes DELETE answer with the deleted object.
    pub fn returning_deleted_object(mut self) -> Self {
        self.return_deleted_object = true;
        self
    }

    /// Accepts these field selectors too.
    pub fn with_field_selectors(mut self, fields: &[&str]) -> Self {
        self.extra_field_selectors = fields.iter().map(|f| (*f).to_owned()).collect();
        self
    }

    /// A custom resource (defined by a CRD, or declared like one with [`Self::custom`]) rather
    /// than a built-in type: named, printed and patched as CRDs are.
    pub fn is_custom(&self) -> bool {
        self.from_crd || !self.strategic_merge
    }

    /// Lowercase singular name, as discovery reports it.
    pub fn singular_name(&self) -> String {
        if self.singular.is_empty() {
            self.kind.to_lowercase()
        } else {
            self.singular.clone()
        }
    }

    /// The served versions a CustomResourceDefinition object defines, as kube-apiserver's
    /// apiextensions controller would serve them once the CRD is established.
    pub fn from_crd(crd: &Value) -> Vec<Self> {
        let text = |v: &Value, p: &str| {
            v.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let strings = |v: &Value, p: &str| -> Vec<String> {
            v.pointer(p)
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
                .unwrap_or_default()
        };
        let group = text(crd, "/spec/group");
        let kind = text(crd, "/spec/names/kind");
        let plural = text(crd, "/spec/names/plural");
        let namespaced = text(crd, "/spec/scope") != "Cluster";
        let versions = crd.pointer("/spec/versions").and_then(Value::as_array);
        versions
            .into_iter()
            .flatten()
            .filter(|v| v.get("served").and_then(Value::as_bool) != Some(false))
            .map(|v| {
                let mut def = Self::custom(&group, &text(v, "/name"), &kind, &plural);
                def.namespaced = namespaced;
                def.status_subresource = v.pointer("/subresources/status").is_some();
                def.singular = text(crd, "/spec/names/singular");
                def.short_names = strings(crd, "/spec/names/shortNames");
                def.categories = strings(crd, "/spec/names/categories");
                def.schema = v.pointer("/schema/openAPIV3Schema").cloned();
                def.from_crd = true;
                def.printer_columns = v
                    .get("additionalPrinterColumns")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .map(|c| PrinterColumn {
                        name: text(c, "/name"),
                        type_: text(c, "/type"),
                        format: text(c, "/format"),
                        description: text(c, "/description"),
                        priority: c.get("priority").and_then(Value::as_i64).unwrap_or(0),
                        json_path: text(c, "/jsonPath"),
                    })
                    .collect();
                def
            })
            .collect()
    }

    /// `apiVersion` of its objects: `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `GroupResource.String()`: `secrets`, `proxies.crawl.example.com`.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `GroupKind.String()`: `Secret`, `Proxy.crawl.example.com`.
    pub fn group_kind(&self) -> String {
        if self.group.is_empty() {
            self.kind.clone()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }

    /// Whether `name` (`proxies` or `proxies.crawl.example.com`) designates this resource.
    pub fn is_named(&self, name: &str) -> bool {
        name == self.plural || name == self.qualified()
    }
}

/// What the fake serves before a test registers anything: the core types the operator and
/// its providers touch, Events (both APIs), Leases, Deployments, TokenReviews (create only,
/// answered from [`super::FakeApiServer::add_token`], never stored) and the operator's CRDs.
pub fn default_resources() -> Vec<ResourceDef> {
    let core = |kind: &str, plural: &str| ResourceDef::builtin("", "v1", kind, plural);
    let event_fields = [
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    ];
    vec![
        core("Secret", "secrets").with_field_selectors(&["type"]),
        core("ConfigMap", "configmaps"),
        core("Pod", "pods")
            .with_status()
            .returning_deleted_object()
            .with_field_selectors(&[
                "spec.nodeName",
                "spec.restartPolicy",
                "status.phase",
                "status.podIP",
            ]),
        core("Service", "services")
            .with_status()
            .returning_deleted_object(),
        core("Event", "events").with_field_selectors(&event_fields),
        core("Namespace", "namespaces").cluster_scoped().with_status(),
        core("ServiceAccount", "serviceaccounts"),
        ResourceDef::builtin("events.k8s.io", "v1", "Event", "events").with_field_selectors(&[
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "reason",
            "reportingController",
            "type",
        ]),
        ResourceDef::builtin("coordination.k8s.io", "v1", "Lease", "leases"),
        ResourceDef::builtin("authentication.k8s.io", "v1", "TokenReview", "tokenreviews").cluster_scoped(),
        ResourceDef::builtin(
            "apiextensions.k8s.io",
            "v1",
            "CustomResourceDefinition",
            "customresourcedefinitions",
        )
        .cluster_scoped()
        .with_status()
        .with_generation(),
        ResourceDef::builtin("apps", "v1", "Deployment", "deployments")
            .with_status()
            .with_generation(),
        ResourceDef::custom("crawl.example.com", "v1alpha1", "Proxy", "proxies").with_status(),
        ResourceDef::custom(
            "crawl.example.com",
            "v1alpha1",
            "ProviderHealth",
            "providerhealths",
        )
        .with_status()
        .cluster_scoped(),
    ]
}
