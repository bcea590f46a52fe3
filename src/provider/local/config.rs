//! The `local` provider's settings and requests: checking the settings when the provider is
//! built ([`check`]), the Squid user it drops to, what `create` derives from a request
//! ([`plan`]) and the `squid.conf` it writes ([`squid_conf`], through the shared
//! [`crate::provider::squid`] writer). It touches no files and starts nothing.

use std::{
    fs,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use super::state::InstanceDir;
use crate::{
    config::LocalSettings,
    provider::{
        InstanceRequest, ProviderError,
        squid::{self, Auth, Conf, Listen, OwnFiles, Prepared},
    },
};

/// Settings that cannot work, found when the provider is built.
#[derive(Debug, thiserror::Error)]
pub enum LocalSetupError {
    /// A relative `stateDir` cannot be made absolute (no working directory).
    #[error("stateDir {path:?} is relative and the working directory is unknown: {reason}")]
    StateDirUnresolvable {
        /// The setting.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A path that goes into squid.conf has a character Squid's config syntax cannot carry.
    #[error(
        "{field} {path:?} cannot be written into a Squid config: it must not contain spaces, quotes or '#'"
    )]
    UnusablePath {
        /// The setting.
        field: &'static str,
        /// Its value.
        path: PathBuf,
    },
    /// An address setting is not an IP address.
    #[error("{field} {value:?} is not an IP address")]
    NotAnAddress {
        /// The setting.
        field: &'static str,
        /// Its value.
        value: String,
    },
    /// An `extraConfig` entry is empty or spans lines.
    #[error("extraConfig[{0}] must be one Squid directive on one line")]
    ExtraConfig(usize),
    /// A timeout is zero.
    #[error("{0} must be at least 1")]
    ZeroTimeout(&'static str),
    /// The operator runs as root and `squidUser` does not exist.
    #[error("squidUser {0:?} does not exist on this host (Squid drops to it when the operator runs as root)")]
    UnknownSquidUser(String),
}

/// The user Squid drops to when started as root.
#[derive(Clone, Debug)]
pub(super) struct SquidUser {
    pub(super) name: String,
    pub(super) uid: u32,
    pub(super) gid: u32,
}

/// Settings that passed [`check`], with what was derived from them.
pub(super) struct Checked {
    /// The settings, `stateDir` made absolute.
    pub(super) settings: LocalSettings,
    /// `bindAddress`, parsed.
    pub(super) bind_address: IpAddr,
    /// The user Squid drops to, when the operator runs as root.
    pub(super) squid_user: Option<SquidUser>,
}

/// Checks `settings` and resolves a relative `stateDir` against the working directory (Squid
/// configs need absolute paths).
pub(super) fn check(mut settings: LocalSettings) -> Result<Checked, LocalSetupError> {
    settings.state_dir =
        std::path::absolute(&settings.state_dir).map_err(|err| LocalSetupError::StateDirUnresolvable {
            path: settings.state_dir.clone(),
            reason: err.to_string(),
        })?;
    for (field, path) in [
        ("stateDir", &settings.state_dir),
        ("authHelperPath", &settings.auth_helper_path),
    ] {
        if !squid::is_config_token(&path.to_string_lossy()) {
            return Err(LocalSetupError::UnusablePath {
                field,
                path: path.clone(),
            });
        }
    }
    let bind_address = parse_ip("bindAddress", &settings.bind_address)?;
    if let Some(advertise) = &settings.advertise_address {
        parse_ip("advertiseAddress", advertise)?;
    }
    if let Some(index) = settings
        .extra_config
        .iter()
        .position(|line| line.trim().is_empty() || line.contains(['\n', '\r']))
    {
        return Err(LocalSetupError::ExtraConfig(index));
    }
    if settings.start_timeout_seconds == 0 {
        return Err(LocalSetupError::ZeroTimeout("startTimeoutSeconds"));
    }
    if settings.stop_timeout_seconds == 0 {
        return Err(LocalSetupError::ZeroTimeout("stopTimeoutSeconds"));
    }
    let squid_user = if rustix::process::geteuid().is_root() {
        let (uid, gid) = lookup_user(&settings.squid_user)
            .ok_or_else(|| LocalSetupError::UnknownSquidUser(settings.squid_user.clone()))?;
        Some(SquidUser {
            name: settings.squid_user.clone(),
            uid,
            gid,
        })
    } else {
        None
    };
    Ok(Checked {
        settings,
        bind_address,
        squid_user,
    })
}

/// What `create` derived from a request.
pub(super) struct Plan {
    pub(super) listen: SocketAddr,
    pub(super) outgoing: Option<IpAddr>,
    pub(super) password_line: Option<String>,
}

/// Validates a request into what the config needs; `prepared` is what Squid's module made of
/// it (checked credentials and outgoing address).
pub(super) fn plan(
    request: &InstanceRequest,
    prepared: Prepared,
    bind_address: IpAddr,
) -> Result<Plan, ProviderError> {
    if request.port == 0 {
        return Err(ProviderError::Rejected("port 0 cannot be listened on".to_owned()));
    }
    let address = match &request.placement.address {
        Some(address) => address.parse::<IpAddr>().map_err(|_| {
            ProviderError::Rejected(format!("placement.address {address:?} is not an IP address"))
        })?,
        None => bind_address,
    };
    Ok(Plan {
        listen: SocketAddr::new(address, request.port),
        outgoing: prepared.outgoing,
        password_line: prepared.password_line,
    })
}

/// The `squid.conf` of instance `name` whose folder will be `dir` (the config names files
/// there): one of many Squids on this host, so with its own files, a fast stop for delete and
/// a short credentials cache for in-place updates; it hides clients and itself from the sites
/// crawled. `effective_user` is the user Squid drops to when the operator runs as root.
pub(super) fn squid_conf(
    name: &str,
    plan: &Plan,
    dir: &InstanceDir,
    settings: &LocalSettings,
    effective_user: Option<&str>,
) -> String {
    let (passwords, run) = (dir.passwords_file(), dir.run_dir());
    let (pid, cache_log, access_log) = (dir.squid_pid_file(), dir.cache_log(), dir.access_log());
    let header = format!(
        "Generated by egress-proxies-operator for instance {name}; rewritten on create, do not edit."
    );
    Conf {
        header: &header,
        name,
        listen: Listen::Address(plan.listen),
        outgoing: plan.outgoing,
        auth: plan.password_line.is_some().then_some(Auth {
            helper: &settings.auth_helper_path,
            passwords: &passwords,
            updated_in_place: true,
        }),
        own_files: Some(OwnFiles {
            pid: &pid,
            cache_log: &cache_log,
            access_log: settings.access_log.then_some(access_log.as_path()),
            coredump_dir: &run,
        }),
        fast_shutdown: true,
        anonymous: true,
        effective_user,
        extra: &settings.extra_config,
    }
    .render()
}

pub(super) fn parse_ip(field: &'static str, value: &str) -> Result<IpAddr, LocalSetupError> {
    value.parse().map_err(|_| LocalSetupError::NotAnAddress {
        field,
        value: value.to_owned(),
    })
}

/// `name`'s uid and primary gid from `/etc/passwd`.
fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() >= 4 && fields[0] == name {
            Some((fields[2].parse().ok()?, fields[3].parse().ok()?))
        } else {
            None
        }
    })
}

/// Checks that `user` can search every folder from `/` to `path` (by owner, primary group or
/// others bits), since Squid opens its logs there after dropping to that user.
pub(super) fn check_reachable_by(path: &Path, user: &SquidUser) -> Result<(), ProviderError> {
    use std::os::unix::fs::MetadataExt;
    for folder in path.ancestors() {
        let metadata = fs::metadata(folder)
            .map_err(|err| ProviderError::Backend(format!("cannot read {}: {err}", folder.display())))?;
        let mode = metadata.mode();
        let searchable = mode & 0o001 != 0
            || (metadata.uid() == user.uid && mode & 0o100 != 0)
            || (metadata.gid() == user.gid && mode & 0o010 != 0);
        if !searchable {
            return Err(ProviderError::Misconfigured(format!(
                "Squid runs as user {:?}, which cannot reach stateDir {}: {} has mode {:o}",
                user.name,
                path.display(),
                folder.display(),
                mode & 0o7777
            )));
        }
    }
    Ok(())
}
