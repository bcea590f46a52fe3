//! The NoCloud seed a libvirt provider's guest boots with: a small ISO labelled `cidata` with
//! `user-data` and `meta-data`.
//!
//! `user-data` is a MIME multi-part message, which cloud-init reads part by part: first the
//! Proxy's own user-data (from its Secret, untouched), then ours, a cloud-config that writes
//! Squid's config and password file (both from [`crate::provider::squid`]) for the Proxy's
//! port and credentials. Ours carries a `merge_how` that appends lists and keeps the user's
//! keys, so the user's `write_files`, `runcmd` and settings survive and ours is added (our
//! `squid.conf` is written last, so it wins over a user's copy).
//!
//! `meta-data`'s `instance-id` includes the spec hash: a replacement instance is a new
//! instance to cloud-init, which then runs its per-instance modules again.

use std::{path::Path, time::Duration};

use base64::Engine as _;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::provider::{
    InstanceRequest,
    squid::{Conf, Prepared, SquidError, debian},
};

/// Volume label NoCloud looks for.
pub const SEED_LABEL: &str = "cidata";

/// The two files of a NoCloud seed. `Debug` is redacted: user-data holds secrets.
#[derive(Clone, PartialEq, Eq)]
pub struct Seed {
    /// The merged user-data.
    pub user_data: String,
    /// `instance-id` and `local-hostname`.
    pub meta_data: String,
}

impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Seed(<{} bytes of user-data redacted>)", self.user_data.len())
    }
}

/// Building the seed ISO failed.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// A temporary file could not be written or read.
    #[error("cannot prepare the cloud-init seed: {0}")]
    Io(std::io::Error),
    /// `genisoimage` is not installed.
    #[error("genisoimage is not installed on the operator's host; it builds the cloud-init seed")]
    ToolMissing,
    /// `genisoimage` failed.
    #[error("genisoimage failed ({status}): {stderr}")]
    ToolFailed {
        /// Exit status.
        status: String,
        /// Its error output (file names and options only; never the seed's content).
        stderr: String,
    },
    /// The request cannot be written into Squid's config or password file.
    #[error(transparent)]
    Squid(#[from] SquidError),
    /// `genisoimage` did not finish in time.
    #[error("genisoimage did not finish within {0:?}")]
    Timeout(Duration),
}

impl Seed {
    /// The seed for `request`'s instance. A request Squid cannot carry (a user name against
    /// [`crate::provider::squid::USER_NAME_RULE`]) is refused here, before anything is written.
    pub fn for_request(request: &InstanceRequest) -> Result<Self, SeedError> {
        let prepared = Prepared::for_request(request)?;
        Ok(Self {
            user_data: user_data(request, &prepared),
            meta_data: meta_data(&request.name, &request.spec_hash),
        })
    }

    /// Builds the ISO (`genisoimage`, label `cidata`, Joliet and Rock Ridge) and returns its
    /// bytes. Files are written to a private temporary folder removed afterwards.
    pub async fn build_iso(&self, timeout: Duration) -> Result<Vec<u8>, SeedError> {
        let folder = tempfile::Builder::new()
            .prefix("epo-seed-")
            .tempdir()
            .map_err(SeedError::Io)?;
        write_private(&folder.path().join("user-data"), &self.user_data).map_err(SeedError::Io)?;
        write_private(&folder.path().join("meta-data"), &self.meta_data).map_err(SeedError::Io)?;
        let iso = folder.path().join("seed.iso");
        let mut command = tokio::process::Command::new("genisoimage");
        command
            .current_dir(folder.path())
            .args(["-quiet", "-output"])
            .arg(&iso)
            .args(["-volid", SEED_LABEL, "-joliet", "-rock", "user-data", "meta-data"])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let output = match tokio::time::timeout(timeout, command.output()).await {
            Err(_) => return Err(SeedError::Timeout(timeout)),
            Ok(Err(err)) if err.kind() == std::io::ErrorKind::NotFound => return Err(SeedError::ToolMissing),
            Ok(Err(err)) => return Err(SeedError::Io(err)),
            Ok(Ok(output)) => output,
        };
        if !output.status.success() {
            return Err(SeedError::ToolFailed {
                status: output.status.to_string(),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        tokio::fs::read(&iso).await.map_err(SeedError::Io)
    }
}

fn write_private(path: &Path, content: &str) -> std::io::Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(content.as_bytes())
}

/// NoCloud meta-data: a new `instance-id` per spec hash, the instance name as host name.
pub fn meta_data(name: &str, spec_hash: &str) -> String {
    let hash: String = spec_hash
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(16)
        .collect();
    format!("instance-id: {name}-{hash}\nlocal-hostname: {name}\n")
}

/// The guest's `squid.conf`: Debian's layout and defaults, listening on the Proxy's port.
pub fn squid_conf(request: &InstanceRequest, prepared: &Prepared) -> String {
    Conf::debian(
        "Written by egress-proxies-operator through cloud-init; replaced with the instance.",
        &request.name,
        request.port,
        prepared.outgoing,
        prepared.password_line.is_some(),
    )
    .render()
}

/// Our cloud-config part: Squid's config (and password file), a managed `/etc/hosts`, and a
/// merge rule that keeps what the user's part says.
pub fn proxy_cloud_config(request: &InstanceRequest, prepared: &Prepared) -> String {
    let mut files = vec![json!({
        "path": debian::CONF_PATH,
        "owner": "root:root",
        "permissions": "0644",
        "content": squid_conf(request, prepared),
    })];
    if let Some(line) = &prepared.password_line {
        files.push(json!({
            "path": debian::PASSWD_PATH,
            // `proxy` is a Debian base system group; Squid's helpers run as it.
            "owner": "root:proxy",
            "permissions": "0640",
            "content": line,
        }));
    }
    let config = json!({
        "merge_how": [
            {"name": "list", "settings": ["append"]},
            {"name": "dict", "settings": ["no_replace", "recurse_list"]},
        ],
        "manage_etc_hosts": true,
        "write_files": files,
    });
    // Serializing a JSON value to YAML cannot fail: every key is a string.
    let yaml = serde_norway::to_string(&config).unwrap_or_else(|_| config.to_string());
    format!("#cloud-config\n{yaml}")
}

/// The merged user-data: a MIME multi-part with the user's part (if any) and ours.
pub fn user_data(request: &InstanceRequest, prepared: &Prepared) -> String {
    let ours = proxy_cloud_config(request, prepared);
    let users = request.user_data.as_ref().map(|data| data.0.as_str());
    // A boundary derived from the content cannot occur in it.
    let digest = Sha256::digest(format!("{}\0{ours}", users.unwrap_or_default()).as_bytes());
    let boundary: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
    let boundary = format!("epo-{boundary}");
    let mut message =
        format!("Content-Type: multipart/mixed; boundary=\"{boundary}\"\r\nMIME-Version: 1.0\r\n\r\n");
    if let Some(users) = users {
        message.push_str(&format!("--{boundary}\r\n"));
        if is_mime(users) {
            // Already a MIME message (often multi-part): nested as it is, cloud-init walks it.
            message.push_str(users);
            if !users.ends_with('\n') {
                message.push_str("\r\n");
            }
        } else {
            // `text/x-not-multipart` makes cloud-init sniff the type from the first line
            // (`#cloud-config`, `#!`, `#include`...), as it does for plain user-data. Base64 keeps
            // any byte of it from looking like a boundary.
            message.push_str(
                "Content-Type: text/x-not-multipart; charset=\"utf-8\"\r\nMIME-Version: 1.0\r\n\
                 Content-Transfer-Encoding: base64\r\n\
                 Content-Disposition: attachment; filename=\"user-data\"\r\n\r\n",
            );
            message.push_str(&base64_mime(users.as_bytes()));
            message.push_str("\r\n");
        }
    }
    message.push_str(&format!(
        "--{boundary}\r\nContent-Type: text/cloud-config; charset=\"utf-8\"\r\nMIME-Version: 1.0\r\n\
         Content-Transfer-Encoding: base64\r\n\
         Content-Disposition: attachment; filename=\"egress-proxy.cfg\"\r\n\r\n"
    ));
    message.push_str(&base64_mime(ours.as_bytes()));
    message.push_str(&format!("\r\n--{boundary}--\r\n"));
    message
}

fn is_mime(text: &str) -> bool {
    let head = text
        .trim_start()
        .get(..16)
        .unwrap_or_default()
        .to_ascii_lowercase();
    head.starts_with("content-type:") || head.starts_with("mime-version:")
}

/// Standard base64 (RFC 4648, padded) in lines of 76 characters, as MIME wants.
pub(super) fn base64_mime(data: &[u8]) -> String {
    let encoded = base64::engine::general_purpose::STANDARD.encode(data);
    // Base64 is ASCII: cutting it at any byte leaves whole characters.
    encoded
        .as_bytes()
        .chunks(76)
        .map(String::from_utf8_lossy)
        .collect::<Vec<_>>()
        .join("\r\n")
}
