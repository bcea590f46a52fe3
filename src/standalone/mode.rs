//! Standalone mode's assembly: the state folder's files (installation ID, lease checkpoint and
//! journal, signing key, tokens), the adapters it hands the core (file checkpoint, log sink for
//! provider health, state-folder live owners, the status page from the store) and the runner.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use tokio::sync::watch;
use tracing::info;

use super::{
    Standalone, StandaloneDeps, StandaloneError, owners::StateOwners, recycle::StandaloneRecycle,
    store::Store, ui::StoreSource,
};
use crate::app::{
    AppError, CoreAdapters, CoreFlags, CoreMetrics, CoreTasks, DiscoveryAuthOptions, GatewayOptions,
    StatusPageAt, StopSignal, discovery_authenticator, start_core,
};
use crate::{
    config::ProvidersConfig,
    controller::ReconcilerConfig,
    discovery::Readiness,
    gc::GcConfig,
    lease::{
        LeaseStore, LeaseStoreConfig,
        checkpoint::{CheckpointStore, FileCheckpoint, MaintenanceConfig},
        journal::{self, Journal, JournalConfig, JournalMetrics},
        token::LeaseSigner,
    },
    monitor::LogSink,
    provider::{Installation, ProviderRegistry},
};

impl From<StandaloneError> for AppError {
    fn from(error: StandaloneError) -> Self {
        AppError::Mode(Box::new(error))
    }
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
    /// The gateway and the quotas (rules and quotas validated before start).
    pub gateway: GatewayOptions,
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
    /// With durable leases: how long the journal's writer waits for more operations after a
    /// batch's first before it syncs ([`JournalConfig::window`]).
    pub lease_journal_window: Duration,
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

/// The tokens file standalone mode creates when none is given.
pub fn default_tokens_file(state: &std::path::Path) -> PathBuf {
    state.join("discovery-tokens")
}

/// Runs standalone mode until `shutdown` resolves.
pub async fn run_standalone(
    options: StandaloneOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AppError> {
    let config = ProvidersConfig::load(&options.providers_config)?;
    // Checked before anything is made (the state folder, a token, the journal).
    if !options.manifests.is_dir() {
        return Err(StandaloneError::Manifests(options.manifests.clone()).into());
    }
    std::fs::create_dir_all(&options.state)
        .map_err(|e| AppError::Startup(format!("creating {}: {e}", options.state.display())))?;
    let installation = Installation::new(installation_id(&options.state)?, &options.installation_name);
    info!(installation = %installation, "installation identity");
    let providers = ProviderRegistry::for_installation(&config, None, &installation)?;
    // Locked before anything reads or writes the folder's leases: a second operator on the
    // same folder stops here, before its upkeep could save over this one's checkpoint.
    let records = Store::open(&options.state).map_err(StandaloneError::from)?;
    let leases = restore_leases(&options).await?;
    let signer = LeaseSigner::load_or_create(&options.state.join("lease-signing.key"))
        .map_err(|e| AppError::Startup(format!("lease signing key: {e}")))?;
    let mut auth_options = options.auth.clone();
    if !auth_options.no_auth && auth_options.tokens_file.is_none() {
        auth_options.tokens_file = Some(ensure_tokens_file(&default_tokens_file(&options.state))?);
    }
    let auth = discovery_authenticator(&auth_options, None).await?;
    let journal_metrics = JournalMetrics::default();
    let metrics = CoreMetrics::register(|registry| journal_metrics.register(registry));
    let journal = start_journal(&options, &leases, journal_metrics)?;
    let stop = StopSignal::default();
    // One process, always ready: nothing to sync and no one to lead.
    let (_ready, readiness) = watch::channel(Readiness {
        caches_synced: true,
        leader: true,
        ..Readiness::default()
    });
    let (recycle, recycle_asks) = StandaloneRecycle::channel();
    let adapters = CoreAdapters {
        providers: providers.clone(),
        leases: leases.store.clone(),
        signer,
        auth,
        readiness,
        proxies: Arc::new(StoreSource::new(&options.state)),
        status_page: StatusPageAt::DiscoveryApi,
        provider_health: Arc::new(LogSink),
        checkpoint: match journal {
            Some(_) => None,
            None => Some(leases.checkpoint.clone() as Arc<dyn CheckpointStore>),
        },
        journal: journal.clone(),
        gc: Some((
            Arc::new(StateOwners(options.state.clone())),
            GcConfig {
                grace: options.gc_grace,
                dry_run: false,
                namespace: None,
            },
        )),
        recycle: Arc::new(recycle),
    };
    let flags = CoreFlags {
        discovery_listen: options.listen,
        provider_probe_interval: options.provider_probe_interval,
        gc_interval: options.gc_interval,
        gateway: options.gateway.clone(),
    };
    let core = start_core(adapters, flags, &metrics, &stop).await?;
    // The last checkpoint is taken once the core's tasks are done: the gateway's leases, which
    // are never journalled, have all been given back by then, so none is restored.
    let (stop_compaction, compaction_stopped) = tokio::sync::oneshot::channel::<()>();
    let compaction = journal.map(|journal| {
        tokio::spawn(journal::compaction(
            leases.store.clone(),
            journal,
            (*leases.checkpoint).clone(),
            options.state.clone(),
            MaintenanceConfig::default().checkpoint_interval,
            metrics.checkpoint.clone(),
            async move {
                let _ = compaction_stopped.await;
            },
        ))
    });

    let runner = Standalone::with_store(
        &options.manifests,
        records,
        StandaloneDeps {
            providers,
            leases: Arc::new(leases.store),
            health: Arc::new(core.health.clone()),
            availability: core.availability.clone(),
            reconciler: options.reconciler.clone(),
        },
    );
    let runner = match runner {
        Ok(runner) => runner
            .with_metrics(metrics.metrics.clone())
            .with_recycle_requests(recycle_asks),
        Err(err) => {
            wind_down(&stop, core.tasks, stop_compaction, compaction).await;
            return Err(err.into());
        }
    };
    if !options.terminal_progress {
        runner.progress().mute();
    }
    info!(
        discovery = %format!("http://{}", core.discovery_addr),
        tokens = %auth_options
            .tokens_file
            .as_ref()
            .map_or_else(|| "(none: --discovery-no-auth)".to_owned(), |p| p.display().to_string()),
        manifests = %options.manifests.display(),
        "standalone mode running"
    );
    runner
        .run(core.triggers, core.provider_flips, options.poll, shutdown)
        .await;
    wind_down(&stop, core.tasks, stop_compaction, compaction).await;
    Ok(())
}

/// Stops the core's tasks, then the journal's compaction (which saves the last checkpoint),
/// waiting for each: nothing is cut short by the runtime's end.
async fn wind_down<T>(
    stop: &StopSignal,
    tasks: CoreTasks,
    stop_compaction: tokio::sync::oneshot::Sender<()>,
    compaction: Option<tokio::task::JoinHandle<T>>,
) {
    stop.stop();
    tasks.join().await;
    let _ = stop_compaction.send(());
    if let Some(compaction) = compaction {
        let _ = compaction.await;
    }
}

/// With durable leases, the journal every acquire, renewal and release is written to before
/// it is answered; its compaction then saves the checkpoint and the core's upkeep only reaps.
fn start_journal(
    options: &StandaloneOptions,
    leases: &RestoredLeases,
    metrics: JournalMetrics,
) -> Result<Option<Journal>, AppError> {
    if !options.durable_leases {
        return Ok(None);
    }
    let config = JournalConfig {
        window: options.lease_journal_window,
        ..JournalConfig::new(&options.state)
    };
    Journal::start(config, leases.last_seq + 1, metrics)
        .map(Some)
        .map_err(|e| AppError::Startup(e.to_string()))
}

/// The lease store as the state folder left it, and where it is checkpointed.
struct RestoredLeases {
    store: LeaseStore,
    checkpoint: Arc<FileCheckpoint>,
    /// The journal's last sequence number: a new journal continues after it.
    last_seq: u64,
}

/// Leases restored from the last checkpoint with the journal replayed onto it (also with
/// durability off: a journal left by an earlier run holds answered operations).
async fn restore_leases(options: &StandaloneOptions) -> Result<RestoredLeases, AppError> {
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
    Ok(RestoredLeases {
        store,
        checkpoint,
        last_seq: recovered.last_seq,
    })
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

    fn options(dir: &std::path::Path) -> StandaloneOptions {
        let manifests = dir.join("manifests");
        std::fs::create_dir_all(&manifests).expect("manifests folder");
        std::fs::write(
            dir.join("providers.yaml"),
            format!(
                "providers:\n  - name: local\n    type: local\n    settings:\n      stateDir: {}\n",
                dir.join("squids").display()
            ),
        )
        .expect("providers config");
        StandaloneOptions {
            manifests,
            providers_config: dir.join("providers.yaml"),
            state: dir.join("state"),
            listen: "127.0.0.1:0".parse().expect("an address"),
            gateway: GatewayOptions::default(),
            auth: DiscoveryAuthOptions::default(),
            poll: Duration::from_millis(100),
            gc_grace: Duration::from_secs(300),
            reconciler: ReconcilerConfig::default(),
            provider_probe_interval: Duration::from_secs(30),
            terminal_progress: false,
            gc_interval: Duration::from_secs(60),
            installation_name: "test".into(),
            durable_leases: true,
            lease_journal_window: Duration::from_millis(1),
        }
    }

    #[tokio::test]
    async fn a_second_operator_on_the_same_state_folder_is_refused_and_the_first_runs_on() {
        let dir = tempfile::tempdir().expect("temp dir");
        let options = options(dir.path());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let first = tokio::spawn(run_standalone(options.clone(), async {
            let _ = stopped.await;
        }));
        // The first one holds the folder once its store is open.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while Store::open(&options.state).is_ok() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the first operator never locked the folder"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let second = tokio::time::timeout(Duration::from_secs(20), run_standalone(options.clone(), async {}))
            .await
            .expect("the second one returns at once");
        let err = second.expect_err("the folder is taken");
        assert!(err.to_string().contains("is in use by another"), "{err}");
        stop.send(()).expect("the first operator still runs");
        tokio::time::timeout(Duration::from_secs(30), first)
            .await
            .expect("stops")
            .expect("no panic")
            .expect("clean exit");
    }
}
