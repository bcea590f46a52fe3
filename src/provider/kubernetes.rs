//! The `kubernetes` provider: each proxy is a Squid Pod in the configured namespace, with a
//! ConfigMap holding its `squid.conf`, a Secret holding its password file (only when the
//! Proxy has credentials) and a Service exposing it, all named after the instance.
//!
//! Every object carries the managed-by and provider-instance labels, so a provider instance
//! lists, reads and deletes only what it made, and the owner annotations orphan GC reads.
//! The Pod is the instance: it is created last (a crash leaves no proxy without its config)
//! and it is what `get` and `list` read; the Service only supplies the endpoint.

use std::{collections::BTreeMap, future::Future, time::Duration};

use async_trait::async_trait;
use k8s_openapi::{
    api::core::v1::{
        ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, KeyToPath, Pod, PodSpec, Probe, Secret,
        SecretVolumeSource, Service, ServicePort, ServiceSpec, TCPSocketAction, Volume, VolumeMount,
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions},
};
use serde::de::DeserializeOwned;

use super::{
    Endpoint, Installation, Instance, InstanceRequest, InstanceState, Owner, ProbeReport, Provider,
    ProviderError, ProviderId,
    libvirt::{
        crypt,
        seed::{SQUID_CONF_PATH, SQUID_PASSWD_PATH, squid_conf},
    },
};
use crate::config::{KubernetesSettings, ServiceType};

/// Provider type name.
pub const PROVIDER_TYPE: &str = "kubernetes";

/// Label every object this operator makes carries.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "egress-proxies-operator";
/// Label naming the provider instance that made the object.
pub const PROVIDER_INSTANCE_LABEL: &str = "crawl.example.com/provider-instance";
/// Label naming the proxy instance (the object name): the Service's selector.
pub const INSTANCE_LABEL: &str = "crawl.example.com/instance";

/// Owner annotations, as orphan GC reads them.
pub const OWNER_UID_ANNOTATION: &str = "crawl.example.com/owner-uid";
/// The owning Proxy's namespace.
pub const OWNER_NAMESPACE_ANNOTATION: &str = "crawl.example.com/owner-namespace";
/// The owning Proxy's name.
pub const OWNER_NAME_ANNOTATION: &str = "crawl.example.com/owner-name";
/// The spec hash the instance runs.
pub const SPEC_HASH_ANNOTATION: &str = "crawl.example.com/spec-hash";
/// When the instance was created (RFC 3339).
pub const CREATED_AT_ANNOTATION: &str = "crawl.example.com/created-at";
/// The cluster identity of the installation that made (or adopted) the instance.
pub const INSTALLATION_CLUSTER_ANNOTATION: &str = "crawl.example.com/installation-cluster";
/// The name of the installation that made (or adopted) the instance.
pub const INSTALLATION_NAME_ANNOTATION: &str = "crawl.example.com/installation-name";

/// The installation an object's annotations name; `None` if they name none (legacy).
fn stamped_installation(meta: &ObjectMeta) -> Option<Installation> {
    let annotations = meta.annotations.as_ref()?;
    Some(Installation::new(
        annotations.get(INSTALLATION_CLUSTER_ANNOTATION)?.as_str(),
        annotations.get(INSTALLATION_NAME_ANNOTATION)?.as_str(),
    ))
}

/// Key of `squid.conf` in the ConfigMap.
const CONF_KEY: &str = "squid.conf";
/// Key of the password file in the Secret.
const PASSWD_KEY: &str = "passwd";
/// Name of the Squid container and the Service port.
const CONTAINER: &str = "squid";

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

    /// Name, labels and owner annotations every object of `request` carries.
    fn metadata(&self, request: &InstanceRequest, created_at: jiff::Timestamp) -> ObjectMeta {
        let labels = BTreeMap::from([
            (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
            (PROVIDER_INSTANCE_LABEL.to_owned(), self.instance.clone()),
            (INSTANCE_LABEL.to_owned(), request.name.clone()),
        ]);
        let annotations = BTreeMap::from([
            (OWNER_UID_ANNOTATION.to_owned(), request.owner.uid.clone()),
            (
                OWNER_NAMESPACE_ANNOTATION.to_owned(),
                request.owner.namespace.clone(),
            ),
            (OWNER_NAME_ANNOTATION.to_owned(), request.owner.name.clone()),
            (SPEC_HASH_ANNOTATION.to_owned(), request.spec_hash.clone()),
            (CREATED_AT_ANNOTATION.to_owned(), created_at.to_string()),
            (
                INSTALLATION_CLUSTER_ANNOTATION.to_owned(),
                self.installation.cluster_id.clone(),
            ),
            (
                INSTALLATION_NAME_ANNOTATION.to_owned(),
                self.installation.name.clone(),
            ),
        ]);
        ObjectMeta {
            name: Some(request.name.clone()),
            namespace: Some(self.settings.namespace.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        }
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
        if !self.is_ours(meta) {
            tracing::warn!(
                provider = %self.instance,
                resource = kind.resource(),
                name,
                "not deleting an object this provider instance did not make"
            );
            return Ok(());
        }
        if self.installation.is_foreign(stamped_installation(meta).as_ref()) {
            tracing::info!(
                provider = %self.instance,
                resource = kind.resource(),
                name,
                "not deleting an object of another installation"
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

    fn config_map(&self, request: &InstanceRequest, meta: ObjectMeta) -> ConfigMap {
        let conf = squid_conf(
            &request.name,
            request.port,
            request.credentials.is_some(),
            request.placement.outgoing_address.as_deref(),
        );
        ConfigMap {
            metadata: meta,
            data: Some(BTreeMap::from([(CONF_KEY.to_owned(), conf)])),
            ..ConfigMap::default()
        }
    }

    fn secret(request: &InstanceRequest, meta: ObjectMeta) -> Option<Secret> {
        let credentials = request.credentials.as_ref()?;
        let passwd = format!(
            "{}:{}\n",
            credentials.username,
            crypt::sha512_crypt(&credentials.password)
        );
        Some(Secret {
            metadata: meta,
            string_data: Some(BTreeMap::from([(PASSWD_KEY.to_owned(), passwd)])),
            ..Secret::default()
        })
    }

    fn service(&self, request: &InstanceRequest, meta: ObjectMeta) -> Service {
        let selector = BTreeMap::from([
            (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
            (INSTANCE_LABEL.to_owned(), request.name.clone()),
        ]);
        let service_type = match self.settings.service_type {
            ServiceType::ClusterIP => "ClusterIP",
            ServiceType::NodePort => "NodePort",
            ServiceType::LoadBalancer => "LoadBalancer",
        };
        Service {
            metadata: meta,
            spec: Some(ServiceSpec {
                type_: Some(service_type.to_owned()),
                selector: Some(selector),
                ports: Some(vec![ServicePort {
                    name: Some(CONTAINER.to_owned()),
                    port: i32::from(request.port),
                    target_port: Some(IntOrString::Int(i32::from(request.port))),
                    protocol: Some("TCP".to_owned()),
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        }
    }

    fn pod(&self, request: &InstanceRequest, meta: ObjectMeta) -> Pod {
        let port = i32::from(request.port);
        let mut volumes = vec![Volume {
            name: "config".to_owned(),
            config_map: Some(ConfigMapVolumeSource {
                name: request.name.clone(),
                items: Some(vec![KeyToPath {
                    key: CONF_KEY.to_owned(),
                    path: CONF_KEY.to_owned(),
                    mode: None,
                }]),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        }];
        // subPath mounts: each file lands where the image's Squid expects it, leaving the
        // rest of /etc/squid (mime.conf, error pages) as the image has it.
        let mut mounts = vec![VolumeMount {
            name: "config".to_owned(),
            mount_path: SQUID_CONF_PATH.to_owned(),
            sub_path: Some(CONF_KEY.to_owned()),
            read_only: Some(true),
            ..VolumeMount::default()
        }];
        if request.credentials.is_some() {
            volumes.push(Volume {
                name: "auth".to_owned(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(request.name.clone()),
                    // Squid's auth helper runs as the image's unprivileged user; the file holds
                    // only a salted hash, and only this container sees it.
                    default_mode: Some(0o444),
                    ..SecretVolumeSource::default()
                }),
                ..Volume::default()
            });
            mounts.push(VolumeMount {
                name: "auth".to_owned(),
                mount_path: SQUID_PASSWD_PATH.to_owned(),
                sub_path: Some(PASSWD_KEY.to_owned()),
                read_only: Some(true),
                ..VolumeMount::default()
            });
        }
        Pod {
            metadata: meta,
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: CONTAINER.to_owned(),
                    image: Some(self.settings.image.clone()),
                    ports: Some(vec![ContainerPort {
                        name: Some(CONTAINER.to_owned()),
                        container_port: port,
                        protocol: Some("TCP".to_owned()),
                        ..ContainerPort::default()
                    }]),
                    volume_mounts: Some(mounts),
                    readiness_probe: Some(Probe {
                        tcp_socket: Some(TCPSocketAction {
                            port: IntOrString::Int(port),
                            host: None,
                        }),
                        period_seconds: Some(5),
                        ..Probe::default()
                    }),
                    ..Container::default()
                }],
                volumes: Some(volumes),
                restart_policy: Some("Always".to_owned()),
                automount_service_account_token: Some(false),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    /// The instance `pod` is, with the endpoint its Service (if any) gives.
    fn instance_of(&self, pod: &Pod, service: Option<&Service>) -> Instance {
        let meta = &pod.metadata;
        let name = meta.name.clone().unwrap_or_default();
        let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key)).cloned();
        let owner = match (
            annotation(OWNER_UID_ANNOTATION),
            annotation(OWNER_NAMESPACE_ANNOTATION),
            annotation(OWNER_NAME_ANNOTATION),
        ) {
            (Some(uid), Some(namespace), Some(name)) => Some(Owner { uid, namespace, name }),
            _ => None,
        };
        let created_at = annotation(CREATED_AT_ANNOTATION)
            .and_then(|text| text.parse::<jiff::Timestamp>().ok())
            .or_else(|| meta.creation_timestamp.as_ref().map(|time| time.0))
            .unwrap_or(jiff::Timestamp::UNIX_EPOCH);
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let state = if meta.deletion_timestamp.is_some() {
            // Terminating: it will not serve again.
            InstanceState::Stopped
        } else {
            match phase {
                Some("Running") => InstanceState::Running,
                Some("Succeeded" | "Failed") => InstanceState::Stopped,
                _ => InstanceState::Starting,
            }
        };
        Instance {
            id: ProviderId::new(PROVIDER_TYPE, &self.instance, &name),
            owner,
            installation: stamped_installation(meta),
            spec_hash: annotation(SPEC_HASH_ANNOTATION),
            created_at,
            state,
            endpoint: service.and_then(|s| self.endpoint(s)),
        }
    }

    /// Where the Service is reached, once Kubernetes has said.
    fn endpoint(&self, service: &Service) -> Option<Endpoint> {
        let spec = service.spec.as_ref()?;
        let port = spec.ports.as_ref()?.first()?;
        let service_port = u16::try_from(port.port).ok()?;
        match self.settings.service_type {
            ServiceType::ClusterIP => {
                let ip = spec
                    .cluster_ip
                    .as_deref()
                    .filter(|ip| !ip.is_empty() && *ip != "None")?;
                Some(Endpoint {
                    host: ip.to_owned(),
                    port: service_port,
                })
            }
            ServiceType::NodePort => Some(Endpoint {
                host: self.settings.node_address.clone()?,
                port: u16::try_from(port.node_port?).ok()?,
            }),
            ServiceType::LoadBalancer => {
                let ingress = service
                    .status
                    .as_ref()?
                    .load_balancer
                    .as_ref()?
                    .ingress
                    .as_ref()?
                    .first()?;
                let host = ingress
                    .ip
                    .clone()
                    .filter(|ip| !ip.is_empty())
                    .or_else(|| ingress.hostname.clone().filter(|h| !h.is_empty()))?;
                Some(Endpoint {
                    host,
                    port: service_port,
                })
            }
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
        // The fast path of a repeated create: the Pod exists, nothing else to make.
        if let Some(pod) = self.pod_of(&request.name).await? {
            self.installation
                .refuse_foreign(&request.name, stamped_installation(&pod.metadata).as_ref())?;
            let service = self.service_of(&request.name).await?;
            return Ok(self.instance_of(&pod, service.as_ref()));
        }
        let meta = self.metadata(request, jiff::Timestamp::now());
        // Config first, Pod last: a crash in between leaves objects that a repeated create
        // completes (AlreadyExists counts as made) and delete removes, never a Pod without
        // its config.
        self.create_object(
            &self.config_maps,
            Kind::ConfigMap,
            &self.config_map(request, meta.clone()),
        )
        .await?;
        if let Some(secret) = Self::secret(request, meta.clone()) {
            self.create_object(&self.secrets, Kind::Secret, &secret).await?;
        }
        self.create_object(
            &self.services,
            Kind::Service,
            &self.service(request, meta.clone()),
        )
        .await?;
        self.create_object(&self.pods, Kind::Pod, &self.pod(request, meta))
            .await?;
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
                403 => Self::Other(ProviderError::Misconfigured(format!(
                    "{verb} {resource} in namespace {namespace} is forbidden: the operator's service \
                     account needs the {verb:?} verb on {resource} there (see \
                     config/rbac/kubernetes_provider_role.yaml)"
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
