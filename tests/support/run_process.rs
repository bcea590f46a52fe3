//! The operator binary's `run` (cluster mode) as a test's child process, reading the files
//! [`super::cluster_app::local_cluster`] writes into a folder, as a ServiceAccount's kubeconfig.

use std::{net::SocketAddr, path::Path, process::Command};

use super::{free_port, process::GroupChild};

/// The namespace the replica runs in (its leader Lease, its lease checkpoint).
const SYSTEM_NAMESPACE: &str = "egress-proxies-system";

/// A running `egress-proxies-operator run`; killed with its process group on drop.
pub struct RunProcess {
    /// The admin server (`/healthz`, `/readyz`, `/metrics`).
    pub admin: SocketAddr,
    /// The discovery API.
    pub discovery: SocketAddr,
    pub child: GroupChild,
}

impl RunProcess {
    /// Starts `run` as replica `identity` with `dir`'s providers config, tokens and signing
    /// key, authenticating with `kubeconfig`, plus `extra` flags; logs to `dir/<identity>.log`.
    pub fn spawn(dir: &Path, kubeconfig: &Path, identity: &str, extra: &[&str]) -> Self {
        Self::spawn_in(SYSTEM_NAMESPACE, dir, kubeconfig, identity, extra)
    }

    /// [`Self::spawn`] for a replica running in namespace `namespace` (its `POD_NAMESPACE`).
    pub fn spawn_in(namespace: &str, dir: &Path, kubeconfig: &Path, identity: &str, extra: &[&str]) -> Self {
        let admin: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let discovery: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let mut command = Command::new(env!("CARGO_BIN_EXE_egress-proxies-operator"));
        command
            .arg("run")
            .arg(format!(
                "--providers-config={}",
                dir.join("providers.yaml").display()
            ))
            .arg(format!("--discovery-tokens={}", dir.join("tokens").display()))
            .arg(format!("--lease-signing-key={}", dir.join("key").display()))
            .arg(format!("--admin-listen={admin}"))
            .arg(format!("--discovery-listen={discovery}"))
            .args(extra)
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAMESPACE", namespace)
            .env("POD_NAME", identity)
            .env("RUST_LOG", "info");
        let child = GroupChild::spawn(&mut command, &dir.join(format!("{identity}.log")));
        Self {
            admin,
            discovery,
            child,
        }
    }
}
