//! Reading a Proxy's Secrets: the cloud-init user-data and the proxy credentials, the same in
//! both modes (cluster mode reads the Secrets from the API server, standalone mode from the
//! manifests folder).

use k8s_openapi::api::core::v1::Secret;

use crate::{
    api::SecretKeyRef,
    effects::SecretError,
    provider::{Credentials, UserData},
};

/// Default Secret key of cloud-init user-data.
pub const DEFAULT_CLOUD_INIT_KEY: &str = "user-data";

/// The text of `key` in a Secret (`data`, or `stringData` as written in a manifest).
pub fn secret_value(secret: &Secret, key: &str) -> Option<String> {
    // As the API server does, `stringData` wins over `data` for the same key.
    if let Some(value) = secret.string_data.as_ref().and_then(|d| d.get(key)) {
        return Some(value.clone());
    }
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .and_then(|v| String::from_utf8(v.0.clone()).ok())
}

/// The cloud-init user-data in `secret` (the Secret `secret_ref` names), both modes alike.
pub fn user_data_of(
    secret: &Secret,
    namespace: &str,
    secret_ref: &SecretKeyRef,
) -> Result<UserData, SecretError> {
    let key = secret_ref.key_or(DEFAULT_CLOUD_INIT_KEY);
    secret_value(secret, key).map(UserData).ok_or_else(|| {
        SecretError::NotUsable(format!(
            "Secret {namespace}/{} has no key {key:?}",
            secret_ref.name
        ))
    })
}

/// The proxy credentials in `secret` (keys `username` and `password`), both modes alike.
pub fn credentials_of(
    secret: &Secret,
    namespace: &str,
    secret_name: &str,
) -> Result<Credentials, SecretError> {
    match (secret_value(secret, "username"), secret_value(secret, "password")) {
        (Some(username), Some(password)) => Ok(Credentials { username, password }),
        _ => Err(SecretError::NotUsable(format!(
            "Secret {namespace}/{secret_name} must have the keys \"username\" and \"password\""
        ))),
    }
}
