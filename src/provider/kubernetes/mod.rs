//! The `kubernetes` provider: each proxy is a Squid Pod in the configured namespace, with a
//! ConfigMap holding its `squid.conf`, a Secret holding its password file (only when the
//! Proxy has credentials) and a Service exposing it, all named after the instance.
//!
//! Every object carries the managed-by and provider-instance labels, so a provider instance
//! lists, reads and deletes only what it made, and the owner annotations orphan GC reads.
//! The Pod is the instance: it is created last (a crash leaves no proxy without its config)
//! and it is what `get` and `list` read; the Service only supplies the endpoint.
//!
//! This file owns the provider's operations and its API calls (timeouts, error
//! classification); `objects.rs` renders the objects and reads instances back from them.

mod objects;

use std::{collections::BTreeMap, future::Future, time::Duration};

use async_trait::async_trait;
use k8s_openapi::{
    api::core::v1::{ConfigMap, Pod, Secret, Service},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions},
};
use serde::de::DeserializeOwned;

use self::objects::stamped_installation;
pub use self::objects::{
    CREATED_AT_ANNOTATION, INSTALLATION_CLUSTER_ANNOTATION, INSTALLATION_NAME_ANNOTATION, INSTANCE_LABEL,
    MANAGED_BY, MANAGED_BY_LABEL, OWNER_NAME_ANNOTATION, OWNER_NAMESPACE_ANNOTATION, OWNER_UID_ANNOTATION,
    PROVIDER_INSTANCE_LABEL, SPEC_HASH_ANNOTATION,
};
use super::{
    Credentials, CredentialsCheck, Installation, Instance, InstanceRequest, ProbeReport, Provider,
    ProviderError, squid,
};
use crate::config::{KubernetesSettings, ServiceType};

/// Provider type name.
pub const PROVIDER_TYPE: &str = "kubernetes";

/// Squid pods in one namespace, as one provider instance.
pub struct KubernetesProvider {
    instance: String,
    installation: Installation,
    settings: KubernetesSettings,
    pods: Api<Pod>,
    config_maps: Api<ConfigMap>,
    secrets: Api<Secret>,
    services: Api<Service>,
}

/// The object kinds the provider makes, for error messages (RBAC resource names).
#[derive(Clone, Copy)]
enum Kind {
    Pod,
    ConfigMap,
    Secret,
    Service,
}

impl Kind {
    fn resource(self) -> &'static str {
        match self {
            Self::Pod => "pods",
            Self::ConfigMap => "configmaps",
            Self::Secret => "secrets",
            Self::Service => "services",
        }
    }
}

impl KubernetesProvider {
    /// The provider instance `instance` with `settings`, talking to the cluster through
    /// `client`. Nothing is contacted until the first call.
    pub fn new(instance: &str, settings: KubernetesSettings, client: Client) -> Self {
        let namespace = settings.namespace.as_str();
        Self {
            instance: instance.to_owned(),
            installation: Installation::default(),
            pods: Api::namespaced(client.clone(), namespace),
            config_maps: Api::namespaced(client.clone(), namespace),
            secrets: Api::namespaced(client.clone(), namespace),
            services: Api::namespaced(client, namespace),
            settings,
        }
    }

    /// Stamp `installation` instead of the default one.
    pub fn with_installation(mut self, installation: Installation) -> Self {
        self.installation = installation;
        self
    }

    /// `managed-by` and `provider-instance`: what `list` selects on.
    fn selector(&self) -> String {
        format!(
            "{MANAGED_BY_LABEL}={MANAGED_BY},{PROVIDER_INSTANCE_LABEL}={}",
            self.instance
        )
    }

    fn is_ours(&self, meta: &ObjectMeta) -> bool {
        let labels = meta.labels.as_ref();
        let label = |key: &str| labels.and_then(|l| l.get(key)).map(String::as_str);
        label(MANAGED_BY_LABEL) == Some(MANAGED_BY) && label(PROVIDER_INSTANCE_LABEL) == Some(&self.instance)
    }

    /// Runs one API call under the configured timeout; a timeout is `Unavailable`.
    async fn call<T>(
        &self,
        kind: Kind,
        verb: &str,
        future: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, KubeFailure> {
        let timeout = Duration::from_secs(self.settings.timeout_seconds.max(1));
        match tokio::time::timeout(timeout, future).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => Err(KubeFailure::from_kube(err, kind, verb, &self.settings.namespace)),
            Err(_) => Err(KubeFailure::Other(ProviderError::Unavailable(format!(
                "{verb} {} in namespace {}: no answer from the API server within {}s",
                kind.resource(),
                self.settings.namespace,
                timeout.as_secs()
            )))),
        }
    }

    /// Creates `object`, treating AlreadyExists as done (an earlier or concurrent create).
    async fn create_object<K>(&self, api: &Api<K>, kind: Kind, object: &K) -> Result<(), ProviderError>
    where
        K: kube::Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
    {
        match self
            .call(kind, "create", api.create(&PostParams::default(), object))
            .await
        {
            Ok(_) | Err(KubeFailure::AlreadyExists) => Ok(()),
            Err(other) => Err(other.into_provider_error()),
        }
    }

    /// Deletes `name` of `kind` if it exists and is ours (by label); the UID precondition
    /// keeps a same-named object made meanwhile by someone else safe.
    async fn delete_object<K>(&self, api: &Api<K>, kind: Kind, name: &str) -> Result<(), ProviderError>
    where
        K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
    {
        let object = match self.call(kind, "get", api.get(name)).await {
            Ok(object) => object,
            Err(KubeFailure::NotFound) => return Ok(()),
            Err(other) => return Err(other.into_provider_error()),
        };
        let meta = object.meta();
        let made_elsewhere = if !self.is_ours(meta) {
            Some("another provider instance or nothing of ours")
        } else if self.installation.is_foreign(stamped_installation(meta).as_ref()) {
            Some("another installation")
        } else {
            None
        };
        if let Some(maker) = made_elsewhere {
            // A name this installation chose is taken by someone else's object: left alone.
            tracing::warn!(
                provider = %self.instance,
                resource = kind.resource(),
                name,
                made_by = maker,
                "not deleting an object this installation did not make"
            );
            return Ok(());
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: meta.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.call(kind, "delete", api.delete(name, &params)).await {
            // Conflict: the UID changed, so what we looked at is gone already.
            Ok(_) | Err(KubeFailure::NotFound) | Err(KubeFailure::Conflict) => Ok(()),
            Err(other) => Err(other.into_provider_error()),
        }
    }

    /// The Service of `name`, if it exists and is ours.
    async fn service_of(&self, name: &str) -> Result<Option<Service>, ProviderError> {
        match self.call(Kind::Service, "get", self.services.get(name)).await {
            Ok(service) if self.is_ours(&service.metadata) => Ok(Some(service)),
            Ok(_) | Err(KubeFailure::NotFound) => Ok(None),
            Err(other) => Err(other.into_provider_error()),
        }
    }

    /// The Pod of `name`, if it exists and this provider instance made it (by label), of
    /// whichever installation.
    async fn pod_of(&self, name: &str) -> Result<Option<Pod>, ProviderError> {
        match self.call(Kind::Pod, "get", self.pods.get(name)).await {
            Ok(pod) if self.is_ours(&pod.metadata) => Ok(Some(pod)),
            // Another provider instance's (or someone else's) Pod is not an instance of ours.
            Ok(_) | Err(KubeFailure::NotFound) => Ok(None),
            Err(other) => Err(other.into_provider_error()),
        }
    }

    /// Adds this installation's annotations to `name` of `kind` (absent: nothing to do).
    async fn stamp_object<K>(&self, api: &Api<K>, kind: Kind, name: &str) -> Result<(), ProviderError>
    where
        K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
    {
        let patch = serde_json::json!({"metadata": {"annotations": {
            INSTALLATION_CLUSTER_ANNOTATION: self.installation.cluster_id,
            INSTALLATION_NAME_ANNOTATION: self.installation.name,
        }}});
        match self
            .call(
                kind,
                "patch",
                api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await
        {
            Ok(_) | Err(KubeFailure::NotFound) => Ok(()),
            Err(other) => Err(other.into_provider_error()),
        }
    }

    async fn list_pods(&self) -> Result<Vec<Pod>, ProviderError> {
        let params = ListParams::default().labels(&self.selector());
        self.call(Kind::Pod, "list", self.pods.list(&params))
            .await
            .map(|list| list.items)
            .map_err(KubeFailure::into_provider_error)
    }
}

#[async_trait]
impl Provider for KubernetesProvider {
    fn provider_type(&self) -> &'static str {
        PROVIDER_TYPE
    }

    fn instance(&self) -> &str {
        &self.instance
    }

    fn installation(&self) -> &Installation {
        &self.installation
    }

    async fn create(&self, request: &InstanceRequest) -> Result<Instance, ProviderError> {
        if self.settings.service_type == ServiceType::NodePort && self.settings.node_address.is_none() {
            return Err(ProviderError::Misconfigured(format!(
                "provider instance {:?}: serviceType NodePort needs settings.nodeAddress, the host \
                 crawlers reach node ports on",
                self.instance
            )));
        }
        // Rendered before any call: a request Squid cannot carry is refused before the API
        // server hears of it.
        let objects = self.objects(request, jiff::Timestamp::now())?;
        // The fast path of a repeated create: the Pod exists, nothing else to make.
        if let Some(pod) = self.pod_of(&request.name).await? {
            self.installation
                .refuse_foreign(&request.name, stamped_installation(&pod.metadata).as_ref())?;
            let service = self.service_of(&request.name).await?;
            return Ok(self.instance_of(&pod, service.as_ref()));
        }
        // Config first, Pod last: a crash in between leaves objects that a repeated create
        // completes (AlreadyExists counts as made) and delete removes, never a Pod without
        // its config.
        self.create_object(&self.config_maps, Kind::ConfigMap, &objects.config_map)
            .await?;
        if let Some(secret) = &objects.secret {
            self.create_object(&self.secrets, Kind::Secret, secret).await?;
        }
        self.create_object(&self.services, Kind::Service, &objects.service)
            .await?;
        self.create_object(&self.pods, Kind::Pod, &objects.pod).await?;
        // Read back: a concurrent create may have won, and its Pod (its creation time) is
        // the instance.
        self.get(&request.name).await
    }

    async fn get(&self, name: &str) -> Result<Instance, ProviderError> {
        let pod = match self.pod_of(name).await? {
            // Another installation's Pod is not an instance of this one.
            Some(pod)
                if !self
                    .installation
                    .is_foreign(stamped_installation(&pod.metadata).as_ref()) =>
            {
                pod
            }
            _ => return Err(ProviderError::NotFound(name.to_owned())),
        };
        let service = self.service_of(name).await?;
        Ok(self.instance_of(&pod, service.as_ref()))
    }

    async fn adopt(&self, name: &str) -> Result<Instance, ProviderError> {
        let Some(pod) = self.pod_of(name).await? else {
            return Err(ProviderError::NotFound(name.to_owned()));
        };
        let stamped = stamped_installation(&pod.metadata);
        self.installation.refuse_foreign(name, stamped.as_ref())?;
        if stamped.is_none() {
            // Pod first: it is what `get`, `list` and `delete` judge by. (The password Secret
            // keeps its legacy stamp: the provider may not patch Secrets.)
            self.stamp_object(&self.pods, Kind::Pod, name).await?;
            self.stamp_object(&self.services, Kind::Service, name).await?;
            self.stamp_object(&self.config_maps, Kind::ConfigMap, name)
                .await?;
        }
        self.get(name).await
    }

    /// Checks `credentials` against the hash in the instance's password Secret (which exists
    /// only for an instance made with credentials): read-only, so that after a restart a
    /// Secret rotated meanwhile replaces the Pod and an unchanged one leaves it be.
    async fn check_credentials(
        &self,
        name: &str,
        credentials: Option<&Credentials>,
    ) -> Result<CredentialsCheck, ProviderError> {
        let line = match self.call(Kind::Secret, "get", self.secrets.get(name)).await {
            Ok(secret) if self.is_ours(&secret.metadata) => objects::password_line(&secret),
            Ok(_) | Err(KubeFailure::NotFound) => None,
            Err(other) => return Err(other.into_provider_error()),
        };
        let accepts = match (credentials, line) {
            (None, None) => true,
            (Some(credentials), Some(line)) => squid::password_line_accepts(&line, credentials),
            (None, Some(_)) | (Some(_), None) => false,
        };
        Ok(if accepts {
            CredentialsCheck::Accepts
        } else {
            CredentialsCheck::Differs
        })
    }

    async fn delete(&self, name: &str) -> Result<(), ProviderError> {
        if let Some(pod) = self.pod_of(name).await?
            && self
                .installation
                .is_foreign(stamped_installation(&pod.metadata).as_ref())
        {
            tracing::info!(provider = %self.instance, name, "delete: another installation's instance; left alone");
            return Ok(());
        }
        // Pod first: the proxy stops before its config and Service go.
        self.delete_object(&self.pods, Kind::Pod, name).await?;
        self.delete_object(&self.services, Kind::Service, name).await?;
        self.delete_object(&self.secrets, Kind::Secret, name).await?;
        self.delete_object(&self.config_maps, Kind::ConfigMap, name).await
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        let pods = self.list_pods().await?;
        let params = ListParams::default().labels(&self.selector());
        let services = self
            .call(Kind::Service, "list", self.services.list(&params))
            .await
            .map_err(KubeFailure::into_provider_error)?;
        let by_name: BTreeMap<&str, &Service> = services
            .items
            .iter()
            .filter_map(|s| Some((s.metadata.name.as_deref()?, s)))
            .collect();
        Ok(pods
            .iter()
            .map(|pod| {
                let service = pod.metadata.name.as_deref().and_then(|n| by_name.get(n).copied());
                self.instance_of(pod, service)
            })
            .collect())
    }

    async fn probe(&self) -> Result<ProbeReport, ProviderError> {
        let pods = self.list_pods().await?;
        Ok(ProbeReport {
            instance_count: pods.len(),
            detail: format!(
                "namespace {}, {} service, image {}",
                self.settings.namespace,
                match self.settings.service_type {
                    ServiceType::ClusterIP => "ClusterIP",
                    ServiceType::NodePort => "NodePort",
                    ServiceType::LoadBalancer => "LoadBalancer",
                },
                self.settings.image
            ),
        })
    }
}

/// A failed API call: the outcomes callers branch on, or the provider error for the rest.
enum KubeFailure {
    NotFound,
    AlreadyExists,
    Conflict,
    Other(ProviderError),
}

impl KubeFailure {
    fn from_kube(err: kube::Error, kind: Kind, verb: &str, namespace: &str) -> Self {
        let resource = kind.resource();
        match err {
            kube::Error::Api(status) => match status.code {
                404 => Self::NotFound,
                409 if status.is_already_exists() => Self::AlreadyExists,
                409 => Self::Conflict,
                401 => Self::Other(ProviderError::Misconfigured(format!(
                    "{verb} {resource} in namespace {namespace}: the API server does not accept the \
                     operator's credentials ({})",
                    status.message
                ))),
                // RBAC says "cannot <verb> resource"; admission (a missing ServiceAccount,
                // PodSecurity, a quota) answers 403 too, and then the server's words say why.
                403 if status.message.contains("cannot ") => {
                    Self::Other(ProviderError::Misconfigured(format!(
                        "{verb} {resource} in namespace {namespace} is forbidden: the operator's service \
                     account needs the {verb:?} verb on {resource} there (see \
                     config/rbac/kubernetes_provider_role.yaml)"
                    )))
                }
                403 => Self::Other(ProviderError::Misconfigured(format!(
                    "{verb} {resource} in namespace {namespace} was refused by the API server: {}",
                    status.message
                ))),
                400 | 422 => Self::Other(ProviderError::Misconfigured(format!(
                    "{verb} {resource} in namespace {namespace}: the API server rejected it: {}",
                    status.message
                ))),
                429 | 500.. => Self::Other(ProviderError::Unavailable(format!(
                    "{verb} {resource} in namespace {namespace}: {} ({})",
                    status.message, status.code
                ))),
                code => Self::Other(ProviderError::Backend(format!(
                    "{verb} {resource} in namespace {namespace}: {} ({code})",
                    status.message
                ))),
            },
            // Connection refused or reset, DNS, TLS: the API server cannot be reached.
            err @ (kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::RustlsTls(_)) => {
                Self::Other(ProviderError::Unavailable(format!(
                    "{verb} {resource} in namespace {namespace}: cannot reach the API server: {err}"
                )))
            }
            other => Self::Other(ProviderError::Backend(format!(
                "{verb} {resource} in namespace {namespace}: {other}"
            ))),
        }
    }

    /// The provider error for a failure the caller did not branch on.
    fn into_provider_error(self) -> ProviderError {
        match self {
            Self::NotFound => ProviderError::Backend("unexpected NotFound from the API server".to_owned()),
            Self::AlreadyExists => {
                ProviderError::Backend("unexpected AlreadyExists from the API server".to_owned())
            }
            Self::Conflict => ProviderError::Backend("conflicting concurrent change; retry".to_owned()),
            Self::Other(err) => err,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::{
        fixtures::{assert_user_name_refused, request_with_user as request},
        squid::SquidError,
    };

    /// A provider whose client points at a port nothing listens on: any API call it made
    /// would fail as `Unavailable`, so another outcome shows none was made.
    fn offline_provider() -> KubernetesProvider {
        let config = kube::Config::new("http://127.0.0.1:9".parse().expect("uri"));
        let client = Client::try_from(config).expect("client");
        let settings = KubernetesSettings {
            namespace: "proxies".to_owned(),
            image: "ubuntu/squid:5.7-22.04_beta".to_owned(),
            service_type: ServiceType::ClusterIP,
            node_address: None,
            timeout_seconds: 1,
        };
        KubernetesProvider::new("cluster", settings, client)
    }

    #[tokio::test]
    async fn objects_carry_the_squid_config_and_a_hashed_password() {
        let provider = offline_provider();
        let objects = provider
            .objects(&request("crawler"), jiff::Timestamp::UNIX_EPOCH)
            .expect("valid request");
        let conf = &objects.config_map.data.as_ref().expect("data")["squid.conf"];
        assert!(conf.lines().any(|l| l == "http_port 3128"), "{conf}");
        assert!(
            conf.contains("auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid/passwd\n"),
            "{conf}"
        );
        let secret = objects.secret.expect("a Secret with credentials");
        let passwd = &secret.string_data.as_ref().expect("string data")["passwd"];
        assert!(passwd.starts_with("crawler:$6$"), "{passwd}");
        assert!(!passwd.contains("canary") && !conf.contains("canary"));
        assert_eq!(
            objects.pod.metadata.name.as_deref(),
            Some("epo-crawl-web-1-0a1b2c3d")
        );
    }

    #[tokio::test]
    async fn a_user_name_squid_cannot_carry_produces_no_object() {
        let provider = offline_provider();
        for (username, expected) in [
            (
                "a:b",
                SquidError::UserNameCharacter {
                    position: 2,
                    character: ':',
                },
            ),
            ("", SquidError::EmptyUserName),
        ] {
            let outcome = provider.objects(&request(username), jiff::Timestamp::UNIX_EPOCH);
            assert!(
                matches!(&outcome, Err(err) if *err == expected),
                "{username:?}: {:?}",
                outcome.err()
            );
        }
    }

    #[tokio::test]
    async fn create_refuses_a_bad_user_name_before_calling_the_api_server() {
        let provider = offline_provider();
        // Not Unavailable: the API server (here: nothing) was never asked.
        assert_user_name_refused(provider.create(&request("crawler\r")).await, "crawler\\r");
    }

    fn forbidden(message: &str) -> String {
        let mut status = kube::core::Status::failure(message, "Forbidden");
        status.code = 403;
        match KubeFailure::from_kube(kube::Error::Api(Box::new(status)), Kind::Pod, "create", "proxies") {
            KubeFailure::Other(ProviderError::Misconfigured(text)) => text,
            _ => panic!("a 403 is a configuration problem"),
        }
    }

    #[test]
    fn an_rbac_denial_names_the_missing_verb_and_the_role() {
        let text = forbidden(
            "pods is forbidden: User \"system:serviceaccount:egress-proxies-system:egress-proxies-operator\" \
             cannot create resource \"pods\" in API group \"\" in the namespace \"proxies\"",
        );
        assert!(text.contains("needs the \"create\" verb on pods"), "{text}");
        assert!(text.contains("kubernetes_provider_role.yaml"), "{text}");
    }

    /// Seen on a real kube-apiserver: admission refuses with 403 too (here the ServiceAccount
    /// admission plugin, in a namespace whose `default` ServiceAccount does not exist yet);
    /// blaming RBAC sent the reader to the wrong file.
    #[test]
    fn a_403_from_admission_says_what_the_server_said_not_rbac() {
        let text = forbidden(
            "pods \"epo-x\" is forbidden: error looking up service account proxies/default: \
             serviceaccount \"default\" not found",
        );
        assert!(text.contains("serviceaccount \"default\" not found"), "{text}");
        assert!(!text.contains("kubernetes_provider_role.yaml"), "{text}");
    }
}
