//! The objects of one `kubernetes` instance: the labels and owner annotations every object
//! carries, the ConfigMap, Secret, Service and Pod rendered from an [`InstanceRequest`]
//! ([`KubernetesProvider::objects`], which refuses a request Squid cannot carry before any
//! object exists), and the [`Instance`] read back from a Pod and its Service. Pure: no API
//! calls (those are [`super`]'s). The Squid config and password file are
//! [`crate::provider::squid`]'s.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{
        ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, KeyToPath, Pod, PodSpec, Probe, Secret,
        SecretVolumeSource, Service, ServicePort, ServiceSpec, TCPSocketAction, Volume, VolumeMount,
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};

use super::{KubernetesProvider, PROVIDER_TYPE};
use crate::{
    config::ServiceType,
    provider::{
        Endpoint, Installation, Instance, InstanceRequest, InstanceState, Owner, ProviderId,
        squid::{Conf, Prepared, SquidError, debian},
    },
};

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
pub(super) fn stamped_installation(meta: &ObjectMeta) -> Option<Installation> {
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
/// The password file line `secret` (an instance's password Secret) holds, if any.
pub(super) fn password_line(secret: &Secret) -> Option<String> {
    let line = secret.data.as_ref()?.get(PASSWD_KEY)?;
    String::from_utf8(line.0.clone()).ok()
}

/// Name of the Squid container and the Service port.
const CONTAINER: &str = "squid";

/// Everything one instance is made of, rendered and not yet sent.
pub(super) struct Objects {
    pub(super) config_map: ConfigMap,
    /// Only with credentials.
    pub(super) secret: Option<Secret>,
    pub(super) service: Service,
    pub(super) pod: Pod,
}

impl KubernetesProvider {
    /// The objects of `request`'s instance, created at `created_at`; a request Squid cannot
    /// carry (a user name against [`crate::provider::squid::USER_NAME_RULE`]) is refused here,
    /// so no ConfigMap, Secret or Pod of it ever reaches the API server.
    pub(super) fn objects(
        &self,
        request: &InstanceRequest,
        created_at: jiff::Timestamp,
    ) -> Result<Objects, SquidError> {
        let prepared = Prepared::for_request(request)?;
        let meta = self.metadata(request, created_at);
        Ok(Objects {
            config_map: self.config_map(request, &prepared, meta.clone()),
            secret: Self::secret(&prepared, meta.clone()),
            service: self.service(request, meta.clone()),
            pod: self.pod(request, meta),
        })
    }

    /// Name, labels and owner annotations every object of `request` carries.
    pub(super) fn metadata(&self, request: &InstanceRequest, created_at: jiff::Timestamp) -> ObjectMeta {
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

    fn config_map(&self, request: &InstanceRequest, prepared: &Prepared, meta: ObjectMeta) -> ConfigMap {
        // The image's Debian layout and defaults, as in a VM guest.
        let conf = Conf::debian(
            "Written by egress-proxies-operator into this ConfigMap; replaced with the instance.",
            &request.name,
            request.port,
            prepared.outgoing,
            prepared.password_line.is_some(),
        )
        .render();
        ConfigMap {
            metadata: meta,
            data: Some(BTreeMap::from([(CONF_KEY.to_owned(), conf)])),
            ..ConfigMap::default()
        }
    }

    fn secret(prepared: &Prepared, meta: ObjectMeta) -> Option<Secret> {
        let passwd = prepared.password_line.clone()?;
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
            mount_path: debian::CONF_PATH.to_owned(),
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
                mount_path: debian::PASSWD_PATH.to_owned(),
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
    pub(super) fn instance_of(&self, pod: &Pod, service: Option<&Service>) -> Instance {
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
    pub(super) fn endpoint(&self, service: &Service) -> Option<Endpoint> {
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
}
