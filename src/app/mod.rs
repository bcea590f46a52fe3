//! Assembly of the operator's parts for each mode; the binary's `standalone` and `run`
//! subcommands are thin wrappers around [`run_standalone`] and [`run_cluster`].

pub mod cluster;

use std::{collections::HashSet, future::Future, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use async_trait::async_trait;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::{
    config::{ConfigError, ProvidersConfig},
    controller::{ProviderAvailability, ReconcilerConfig},
    discovery::{
        self, DiscoveryConfig, DiscoveryMetrics, DiscoveryState, Readiness,
        auth::{
            AnyOf, Authenticator, NoAuthentication, ReloadingTokens, TokenFile, TokenReviewAuthenticator,
            TokenSecret,
        },
    },
    gc::{self, GcConfig, LiveOwners},
    health::{HealthConfig, HealthEngine},
    lease::{
        LeaseStore, LeaseStoreConfig,
        checkpoint::{CheckpointReport, CheckpointStore, FileCheckpoint, MaintenanceConfig, maintenance},
        journal::{self, Journal, JournalConfig, JournalMetrics},
        token::LeaseSigner,
    },
    monitor::{LogSink, Monitor},
    provider::{Installation, ProviderRegistry, RegistryError},
    standalone::{Standalone, StandaloneDeps, StandaloneError, ui::StoreSource},
    store::Store,
    telemetry::Metrics,
    ui::StatusPage,
};

/// Why the operator could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The providers config.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Building the providers.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The state or manifests folder.
    #[error(transparent)]
    Standalone(#[from] StandaloneError),
    /// Anything else at start-up (bind, key files, engines).
    #[error("{0}")]
    Startup(String),
}

/// Options of standalone mode.
#[derive(Clone, Debug)]
pub struct StandaloneOptions {
    /// Folder of Proxy (and Secret) manifests.
    pub manifests: PathBuf,
    /// Providers config file.
    pub providers_config: PathBuf,
    /// State folder (embedded store, lease checkpoint, signing key).
    pub state: PathBuf,
    /// Discovery API address.
    pub listen: SocketAddr,
    /// Authentication of the discovery API. Without a tokens file (and without `no_auth`), a
    /// file with one random token is created under the state folder and used.
    pub auth: DiscoveryAuthOptions,
    /// How often the manifests folder is re-read.
    pub poll: Duration,
    /// Grace period of orphan GC.
    pub gc_grace: Duration,
    /// The lifecycle's timers, retry backoff and pool budgets.
    pub reconciler: ReconcilerConfig,
    /// How often the provider-health monitor probes each provider instance.
    pub provider_probe_interval: Duration,
    /// Print the live progress line to stderr (off with JSON logs: it is not JSON).
    pub terminal_progress: bool,
    /// Time between two orphan GC passes.
    pub gc_interval: Duration,
    /// This installation's name; its cluster identity is the ID generated once into the
    /// state folder ([`installation_id`]).
    pub installation_name: String,
    /// Make every acquire, renewal and release durable (the lease journal) before answering
    /// it. Off: leases are checkpointed once a second and a crash can lose the last second's
    /// operations (docs/api.md).
    pub durable_leases: bool,
}

/// The file in the state folder holding standalone mode's lease snapshot (the lease journal's
/// segments, [`journal::SEGMENT_PREFIX`], sit beside it).
pub const LEASE_CHECKPOINT_FILE: &str = "leases.checkpoint";

/// The file in the state folder holding standalone mode's generated cluster identity.
pub const INSTALLATION_ID_FILE: &str = "installation-id";

/// Standalone mode's cluster identity: generated at the first start into `state`'s
/// [`INSTALLATION_ID_FILE`] and read back ever after, so it lives as long as the state folder.
pub fn installation_id(state: &std::path::Path) -> Result<String, AppError> {
    let path = state.join(INSTALLATION_ID_FILE);
    let startup = |e: std::io::Error| AppError::Startup(format!("installation ID {}: {e}", path.display()));
    if !path.exists() {
        // Written beside it and linked into place: the file appears whole or not at all, and
        // of two concurrent starts the first link wins.
        let id: String = (0..16).map(|_| format!("{:02x}", fastrand::u8(..))).collect();
        let temp = state.join(format!(".{INSTALLATION_ID_FILE}.{:08x}", fastrand::u32(..)));
        std::fs::write(&temp, format!("{id}\n"))
            .and_then(|()| std::fs::File::open(&temp)?.sync_all())
            .map_err(startup)?;
        let linked = std::fs::hard_link(&temp, &path);
        let _ = std::fs::remove_file(&temp);
        match linked {
            Ok(()) => info!(path = %path.display(), "generated this state folder's installation ID"),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(startup(err)),
        }
    }
    let id = std::fs::read_to_string(&path).map_err(startup)?.trim().to_owned();
    if id.is_empty() {
        return Err(AppError::Startup(format!(
            "installation ID {} is empty: restore it from a backup (instances stamped with the \
             lost ID are no longer this installation's)",
            path.display()
        )));
    }
    Ok(id)
}

/// How the discovery API authenticates callers: static tokens (a file, a Secret), Kubernetes
/// TokenReview, or both; no authentication only when `no_auth` says so.
#[derive(Clone, Debug, Default)]
pub struct DiscoveryAuthOptions {
    /// Static tokens file (one per line), re-read every `reload_interval`.
    pub tokens_file: Option<PathBuf>,
    /// Secret in the operator's namespace whose data keys are tokens, re-read every
    /// `reload_interval` (cluster mode only).
    pub tokens_secret: Option<String>,
    /// TokenReview: the audiences a token must hold (cluster mode only; empty: off).
    pub token_review_audiences: Vec<String>,
    /// TokenReview: user names allowed in, exact or a `prefix*` (empty: every authenticated user).
    pub allowed_subjects: Vec<String>,
    /// No authentication at all (the explicit opt-out); excludes every other option.
    pub no_auth: bool,
    /// How often token files and Secrets are re-read.
    pub reload_interval: Duration,
}

/// Default of [`DiscoveryAuthOptions::reload_interval`]: a rotated token works (and the old one
/// stops working) within this long, plus the kubelet's delay for a mounted Secret.
pub const TOKEN_RELOAD_INTERVAL: Duration = Duration::from_secs(2);

impl DiscoveryAuthOptions {
    /// Static tokens from `path`, reloaded every [`TOKEN_RELOAD_INTERVAL`].
    pub fn tokens_file(path: PathBuf) -> Self {
        Self {
            tokens_file: Some(path),
            reload_interval: TOKEN_RELOAD_INTERVAL,
            ..Self::default()
        }
    }

    /// Checks that exactly one choice was made (some methods, or the opt-out) and that each
    /// method fits the mode (`cluster`: Secrets and TokenReview need Kubernetes). Pure, so the
    /// binary checks its flags before connecting anywhere.
    pub fn validate(&self, cluster: bool) -> Result<(), AppError> {
        let misconfigured =
            |why: &str| Err(AppError::Startup(format!("discovery API authentication: {why}")));
        let any_method = self.tokens_file.is_some()
            || self.tokens_secret.is_some()
            || !self.token_review_audiences.is_empty();
        if self.no_auth {
            if any_method || !self.allowed_subjects.is_empty() {
                return misconfigured(
                    "--discovery-no-auth excludes every other --discovery-* authentication flag",
                );
            }
            return Ok(());
        }
        if !any_method {
            return misconfigured(
                "choose --discovery-tokens, --discovery-tokens-secret and/or --discovery-token-review \
                 with --discovery-token-audience (or opt out explicitly with --discovery-no-auth)",
            );
        }
        if self.token_review_audiences.is_empty() && !self.allowed_subjects.is_empty() {
            return misconfigured(
                "--discovery-allowed-subject applies to TokenReview only (add --discovery-token-review)",
            );
        }
        if !cluster && self.tokens_secret.is_some() {
            return misconfigured("--discovery-tokens-secret needs cluster mode");
        }
        if !cluster && !self.token_review_audiences.is_empty() {
            return misconfigured("--discovery-token-review needs cluster mode");
        }
        Ok(())
    }
}

/// The discovery API's authenticator for `options` (see [`DiscoveryAuthOptions::validate`]).
/// `kube`: the client and the operator's namespace, in cluster mode (Secrets and TokenReview
/// need them). Token files and Secrets are read once here (an unreadable one fails the start),
/// then re-read in the background. Logs what is in force, and loudly when nothing is.
pub async fn discovery_authenticator(
    options: &DiscoveryAuthOptions,
    kube: Option<(&kube::Client, &str)>,
) -> Result<Arc<dyn Authenticator>, AppError> {
    options.validate(kube.is_some())?;
    if options.no_auth {
        warn!(
            "discovery API authentication is OFF (--discovery-no-auth): anyone who can reach it can lease proxies"
        );
        return Ok(Arc::new(NoAuthentication));
    }
    let reload = if options.reload_interval.is_zero() {
        TOKEN_RELOAD_INTERVAL
    } else {
        options.reload_interval
    };
    let needs_cluster = |flag: &str| AppError::Startup(format!("{flag} needs cluster mode"));
    let mut chain: Vec<Arc<dyn Authenticator>> = Vec::new();
    if let Some(path) = &options.tokens_file {
        let tokens = ReloadingTokens::start(TokenFile(path.clone()), reload)
            .await
            .map_err(|e| AppError::Startup(e.to_string()))?;
        chain.push(Arc::new(tokens));
    }
    if let Some(name) = &options.tokens_secret {
        let (client, namespace) = kube.ok_or_else(|| needs_cluster("--discovery-tokens-secret"))?;
        let tokens = ReloadingTokens::start(TokenSecret::new(client.clone(), namespace, name), reload)
            .await
            .map_err(|e| AppError::Startup(e.to_string()))?;
        chain.push(Arc::new(tokens));
    }
    if !options.token_review_audiences.is_empty() {
        let (client, _) = kube.ok_or_else(|| needs_cluster("--discovery-token-review"))?;
        info!(
            audiences = ?options.token_review_audiences,
            allowed_subjects = ?options.allowed_subjects,
            "discovery API accepts Kubernetes tokens (TokenReview)"
        );
        chain.push(Arc::new(TokenReviewAuthenticator::new(
            client.clone(),
            options.token_review_audiences.clone(),
            options.allowed_subjects.clone(),
        )));
    }
    Ok(match chain.len() {
        1 => chain.remove(0),
        _ => Arc::new(AnyOf(chain)),
    })
}

/// The tokens file standalone mode creates when none is given.
pub fn default_tokens_file(state: &std::path::Path) -> PathBuf {
    state.join("discovery-tokens")
}

/// Runs standalone mode until `shutdown` resolves.
pub async fn run_standalone(
    options: StandaloneOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AppError> {
    let config = ProvidersConfig::load(&options.providers_config)?;
    std::fs::create_dir_all(&options.state)
        .map_err(|e| AppError::Startup(format!("creating {}: {e}", options.state.display())))?;
    let installation = Installation::new(installation_id(&options.state)?, &options.installation_name);
    info!(installation = %installation, "installation identity");
    let providers = ProviderRegistry::for_installation(&config, None, &installation)?;

    // Leases: restored from the last checkpoint and the journal replayed onto it (also with
    // durability off: a journal left by an earlier run holds answered operations), signed
    // with a key kept in the state folder.
    let store = LeaseStore::new(LeaseStoreConfig::default());
    let checkpoint = Arc::new(FileCheckpoint::new(options.state.join(LEASE_CHECKPOINT_FILE)));
    let recovered = journal::recover_and_compact(&options.state, &checkpoint)
        .await
        .map_err(|e| AppError::Startup(format!("recovering leases: {e}")))?;
    info!(
        leases = recovered.checkpoint.lease_count(),
        replayed = recovered.replayed,
        torn_segments = recovered.torn,
        durable = options.durable_leases,
        "leases restored"
    );
    store.restore(&recovered.checkpoint);
    if options.durable_leases && recovered.exact {
        // Nothing answered was lost: restored leases are as real as live ones. (After a run
        // without the journal, the unconfirmed-lease grace applies once more.)
        store.trust_restored();
    }
    let signer = LeaseSigner::load_or_create(&options.state.join("lease-signing.key"))
        .map_err(|e| AppError::Startup(format!("lease signing key: {e}")))?;
    let mut auth_options = options.auth.clone();
    if !auth_options.no_auth && auth_options.tokens_file.is_none() {
        auth_options.tokens_file = Some(ensure_tokens_file(&default_tokens_file(&options.state))?);
    }
    let auth = discovery_authenticator(&auth_options, None).await?;

    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let discovery_metrics = DiscoveryMetrics::register(&mut registry);
    let checkpoint_report = CheckpointReport::default();
    checkpoint_report.register(&mut registry);
    let journal_metrics = JournalMetrics::default();
    journal_metrics.register(&mut registry);
    let registry = Arc::new(registry);
    let (health_handle, mut health_events) = HealthEngine::start(HealthConfig {
        probe_metrics: Some(metrics.probe_metrics()),
        ..HealthConfig::default()
    })
    .map_err(|e| AppError::Startup(e.to_string()))?;
    let availability = ProviderAvailability::default();
    let (_readiness_tx, readiness) = watch::channel(Readiness {
        caches_synced: true,
        leader: true,
        ..Readiness::default()
    });
    let state = DiscoveryState::new(
        store.clone(),
        signer,
        auth.clone(),
        readiness,
        registry,
        discovery_metrics,
        DiscoveryConfig::default(),
    );
    let status_page = Arc::new(StatusPage::new(
        Arc::new(StoreSource::new(&options.state)),
        store.clone(),
        health_handle.clone(),
        availability.clone(),
        providers.iter().map(|(name, _)| name.to_owned()).collect(),
        auth,
    ));
    let health_log = status_page.health_log();
    state.set_status_page(status_page);
    let journal = if options.durable_leases {
        let journal = Journal::start(
            JournalConfig::new(&options.state),
            recovered.last_seq + 1,
            journal_metrics,
        )
        .map_err(|e| AppError::Startup(e.to_string()))?;
        state.set_journal(journal.clone());
        Some(journal)
    } else {
        None
    };
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .map_err(|e| AppError::Startup(format!("binding the discovery API on {}: {e}", options.listen)))?;
    let listen = listener
        .local_addr()
        .map_err(|e| AppError::Startup(e.to_string()))?;

    let runner = Standalone::open(
        &options.manifests,
        &options.state,
        StandaloneDeps {
            providers: providers.clone(),
            leases: Arc::new(store.clone()),
            health: Arc::new(health_handle),
            availability: availability.clone(),
            reconciler: options.reconciler.clone(),
        },
    )?
    .with_metrics(metrics.clone());
    if !options.terminal_progress {
        runner.progress().mute();
    }
    info!(
        discovery = %format!("http://{listen}"),
        tokens = %auth_options
            .tokens_file
            .as_ref()
            .map_or_else(|| "(none: --discovery-no-auth)".to_owned(), |p| p.display().to_string()),
        manifests = %options.manifests.display(),
        "standalone mode running"
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let (trigger_tx, trigger_rx) = mpsc::channel(1024);
    let forward = tokio::spawn(async move {
        while let Some(event) = health_events.recv().await {
            health_log.record(&event);
            if trigger_tx.send(event.key.clone()).await.is_err() {
                break;
            }
        }
    });
    let api = tokio::spawn(discovery::serve(listener, state, stopped()));
    // With the journal, compaction saves the checkpoint and maintenance only reaps.
    let maintenance_config = MaintenanceConfig::default();
    let compaction = journal.map(|journal| {
        tokio::spawn(journal::compaction(
            store.clone(),
            journal,
            (*checkpoint).clone(),
            options.state.clone(),
            maintenance_config.checkpoint_interval,
            checkpoint_report.clone(),
            stopped(),
        ))
    });
    let sink = match compaction {
        Some(_) => None,
        None => Some(checkpoint as Arc<dyn CheckpointStore>),
    };
    let upkeep = tokio::spawn(maintenance(
        store.clone(),
        sink,
        MaintenanceConfig {
            report: checkpoint_report,
            ..maintenance_config
        },
        stopped(),
    ));
    let (flips_tx, flips_rx) = mpsc::unbounded_channel();
    let monitor = Monitor::new(
        providers.clone(),
        availability,
        Arc::new(LogSink),
        Duration::from_secs(10),
    )
    .with_metrics(metrics.clone())
    .on_change(Arc::new(move |provider: &str| {
        // The runner may have stopped already; then nothing needs the news.
        let _ = flips_tx.send(provider.to_owned());
    }));
    let monitor = tokio::spawn(monitor.run(options.provider_probe_interval, stopped()));
    let owners = StateOwners(options.state.clone());
    let gc_config = GcConfig {
        grace: options.gc_grace,
        dry_run: false,
        namespace: None,
    };
    let gc_loop = tokio::spawn(gc::run(
        providers,
        owners,
        gc_config,
        options.gc_interval,
        Some(metrics),
        stopped(),
    ));

    runner.run(trigger_rx, flips_rx, options.poll, shutdown).await;
    let _ = stop_tx.send(true);
    forward.abort();
    for task in [monitor, gc_loop] {
        let _ = task.await;
    }
    if let Ok(Err(err)) = api.await {
        warn!(error = %err, "discovery API stopped with an error");
    }
    if let Ok(Err(err)) = upkeep.await {
        warn!(error = %err, "the last lease checkpoint failed");
    }
    if let Some(compaction) = compaction {
        let _ = compaction.await;
    }
    Ok(())
}

/// Creates a tokens file with one random token if it does not exist (readable by the owner only).
fn ensure_tokens_file(path: &std::path::Path) -> Result<PathBuf, AppError> {
    if !path.exists() {
        let token: String = (0..32).map(|_| format!("{:02x}", fastrand::u8(..))).collect();
        let write = || -> std::io::Result<()> {
            use std::{io::Write, os::unix::fs::OpenOptionsExt};
            let mut file = std::fs::OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .open(path)?;
            writeln!(file, "{token}")
        };
        write().map_err(|e| AppError::Startup(format!("creating {}: {e}", path.display())))?;
        info!(path = %path.display(), "created a discovery API token");
    }
    Ok(path.to_owned())
}

/// Live owners in standalone mode: the records of the state folder.
struct StateOwners(PathBuf);

#[async_trait]
impl LiveOwners for StateOwners {
    async fn live_uids(&self, _namespace: Option<&str>) -> Result<HashSet<String>, String> {
        let store = Store::read_only(&self.0).map_err(|e| e.to_string())?;
        Ok(store
            .list()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|(_, r)| r.uid)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_installation_id_is_generated_once_and_kept_with_the_state_folder() {
        let state = tempfile::tempdir().expect("temp dir");
        let first = installation_id(state.path()).expect("generated");
        assert_eq!(first.len(), 32, "{first}");
        assert_eq!(installation_id(state.path()).expect("read back"), first);
        let other = tempfile::tempdir().expect("temp dir");
        assert_ne!(
            installation_id(other.path()).expect("generated"),
            first,
            "one per state folder"
        );
        // Nothing but the ID file is left behind.
        let files: Vec<_> = std::fs::read_dir(state.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(files, [INSTALLATION_ID_FILE]);

        std::fs::write(state.path().join(INSTALLATION_ID_FILE), "\n").expect("emptied");
        let err = installation_id(state.path()).expect_err("an empty ID is refused");
        assert!(err.to_string().contains("is empty"), "{err}");
    }
}
