//! The `egress-proxies-operator` binary: one subcommand per job. Errors become `anyhow`
//! reports here, at the edge, and nowhere else.

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context;

/// mimalloc rather than glibc's allocator: glibc keeps memory freed in the middle of its heaps
/// (after the initial list, a mass replacement), so a long-running operator's resident set
/// drifts well above its live heap; at 10,000 Proxies mimalloc's is ~10 MB smaller
/// (`cargo bench --bench converge`, which runs the operator on the same allocator).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use clap::{Args, Parser, Subcommand};
use egress_proxies_operator::{
    api, app,
    check::{Checker, Report},
    cluster,
    config::ProvidersConfig,
    machine, net,
    standalone::{self, status},
    telemetry::tracing_setup,
};

/// Provisions, health-checks and leases egress proxies.
#[derive(Parser)]
#[command(name = "egress-proxies-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The lifecycle's timers, retry backoff and pool budgets (docs/machines.md, docs/operations.md).
#[derive(Args, Clone, Copy, Debug)]
struct LifecycleArgs {
    /// Seconds a new instance may take to pass its first health check; after that it is
    /// deleted and created afresh (reason ProvisioningTimedOut). VMs under software emulation
    /// need minutes.
    #[arg(long, value_name = "SECONDS", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    provisioning_timeout: u64,
    /// Seconds a proxy may fail its health checks before it is replaced (within the budgets).
    #[arg(long, value_name = "SECONDS", default_value_t = 900, value_parser = clap::value_parser!(u64).range(1..))]
    degraded_timeout: u64,
    /// Seconds a drain waits for leases before revoking them, and between retries of a delete
    /// that did not finish.
    #[arg(long, value_name = "SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    drain_timeout: u64,
    /// Seconds before the first retry of a failed provider call (doubling per failure).
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    retry_initial: u64,
    /// The longest retry delay, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    retry_cap: u64,
    /// At most this percentage of a provider instance's proxies may be unavailable (being
    /// provisioned or replaced) at once; at least one.
    #[arg(long, value_name = "PERCENT", default_value_t = 25, value_parser = clap::value_parser!(u32).range(0..=100))]
    max_unavailable: u32,
    /// Health-driven replacement pauses while more than this percentage of a provider instance's
    /// proxies is degraded.
    #[arg(long, value_name = "PERCENT", default_value_t = 40, value_parser = clap::value_parser!(u32).range(0..=100))]
    max_unhealthy: u32,
    /// Seconds between two probes of each provider instance by the provider-health monitor
    /// (`ProviderHealth`, and holding Proxies back while a provider is down).
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    provider_probe_interval: u64,
}

impl LifecycleArgs {
    fn config(self) -> anyhow::Result<egress_proxies_operator::controller::ReconcilerConfig> {
        use egress_proxies_operator::{
            controller::{ReconcilerConfig, pool::Budgets},
            machine::{Backoff, Timers},
        };
        use std::time::Duration;
        if self.retry_initial > self.retry_cap {
            anyhow::bail!(
                "--retry-initial ({} s) must not exceed --retry-cap ({} s)",
                self.retry_initial,
                self.retry_cap
            );
        }
        Ok(ReconcilerConfig {
            timers: Timers {
                provisioning_timeout: Duration::from_secs(self.provisioning_timeout),
                degraded_timeout: Duration::from_secs(self.degraded_timeout),
                drain_timeout: Duration::from_secs(self.drain_timeout),
                ..Timers::default()
            },
            backoff: Backoff {
                initial: Duration::from_secs(self.retry_initial),
                cap: Duration::from_secs(self.retry_cap),
                ..Backoff::default()
            },
            budgets: Budgets {
                max_unavailable_percent: self.max_unavailable,
                max_unhealthy_percent: self.max_unhealthy,
            },
        })
    }
}

#[derive(Subcommand)]
enum Command {
    /// Print the CustomResourceDefinitions (Proxy, ProviderHealth) as YAML.
    Crd {
        /// Write one file per CRD into this folder (e.g. config/crd/bases) instead of printing.
        #[arg(long, value_name = "DIR")]
        out_dir: Option<PathBuf>,
    },
    /// Print the discovery API's OpenAPI 3.1 contract (what docs/openapi.json holds).
    Openapi,
    /// Validate Proxy manifests (CRD schema, unknown fields, CEL rules) and providers configs offline.
    Check {
        /// Files to validate; each may hold several YAML documents.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Also require every Proxy's spec.provider to name an instance of this providers config.
        #[arg(long, value_name = "FILE")]
        providers_config: Option<PathBuf>,
    },
    /// Print the lifecycle tables as Markdown with Mermaid diagrams (docs/machines.md).
    Machines {
        /// Compare with docs/machines.md in the current directory instead; fail if it differs.
        #[arg(long)]
        check: bool,
    },
    /// Run the operator against the cluster of the kubeconfig / in-cluster config (cluster mode).
    Run(RunArgs),
    /// Run the whole operator on this host without Kubernetes (standalone mode).
    Standalone {
        /// Folder of Proxy manifests (and the Secrets they reference).
        #[arg(long, value_name = "DIR")]
        manifests: PathBuf,
        /// Providers config.
        #[arg(long, value_name = "FILE")]
        providers_config: PathBuf,
        /// State folder: status, audit trail, leases.
        #[arg(long, value_name = "DIR", default_value = ".standalone/state")]
        state: PathBuf,
        /// Address of the discovery API.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        #[command(flatten)]
        gateway: GatewayArgs,
        /// Static bearer tokens of the discovery API, one per line, re-read every 2 s (default: a
        /// token created in the state folder).
        #[arg(long = "discovery-tokens", alias = "tokens", value_name = "FILE")]
        discovery_tokens: Option<PathBuf>,
        /// Serve the discovery API without any authentication (logged as a warning).
        #[arg(long, conflicts_with = "discovery_tokens")]
        discovery_no_auth: bool,
        #[command(flatten)]
        lifecycle: LifecycleArgs,
        /// This installation's name: with the state folder's generated ID it is stamped on
        /// every instance, and orphan GC and adoption act only on instances carrying both.
        #[arg(long, default_value = "standalone")]
        installation_name: String,
        /// Answer lease operations before they are durable: leases are then checkpointed once
        /// a second, and a crash can lose the last second's acquires and releases (docs/api.md).
        /// By default each acquire, renewal and release is in the lease journal (fsynced, with
        /// group commit) before it is answered.
        #[arg(long)]
        no_durable_leases: bool,
        /// How long the lease journal waits, after the first operation of a batch, for as many
        /// more as its last batch held before one fsync commits them all: longer makes bigger
        /// batches under load (fewer syncs), and adds at most this much to a lone operation.
        #[arg(long, value_name = "MS", default_value_t = 1, value_parser = clap::value_parser!(u64).range(0..=100))]
        lease_journal_window_ms: u64,
        /// Log as JSON lines instead of text.
        #[arg(long)]
        json_logs: bool,
    },
    /// Show the proxies of a standalone state folder, like `kubectl get proxies`.
    Status {
        /// State folder.
        #[arg(long, value_name = "DIR", default_value = ".standalone/state")]
        state: PathBuf,
        /// Print the audit trail of this proxy (`name` or `namespace/name`) instead.
        #[arg(long, value_name = "PROXY")]
        audit: Option<String>,
    },
    /// Replay a lifecycle scenario file (e.g. machines/scenarios/*.yaml) and print its audit trail.
    Audit {
        /// The scenario file.
        #[arg(value_name = "SCENARIO")]
        scenario: PathBuf,
    },
}

/// A Kubernetes UID (8-4-4-4-12 hex digits), so that a placeholder left in a manifest stops
/// the operator instead of becoming an identity two clusters share.
fn cluster_uid(value: &str) -> Result<String, String> {
    let groups: Vec<&str> = value.trim().split('-').collect();
    let shaped = groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(group, len)| group.len() == len && group.chars().all(|c| c.is_ascii_hexdigit()));
    if shaped {
        Ok(value.trim().to_ascii_lowercase())
    } else {
        Err(format!(
            "{value:?} is not a UID (8-4-4-4-12 hex digits); a cluster admin reads the cluster's with \
             kubectl get namespace kube-system -o jsonpath='{{.metadata.uid}}'"
        ))
    }
}

/// The flags of `run` (cluster mode).
#[derive(Args)]
struct RunArgs {
    /// Providers config.
    #[arg(long, value_name = "FILE")]
    providers_config: PathBuf,
    /// Watch only this namespace (disables orphan GC unless --gc-allow-namespaced).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,
    /// Run orphan GC in namespace-restricted mode (it then judges only that namespace's instances).
    #[arg(long)]
    gc_allow_namespaced: bool,
    /// Only log what orphan GC would delete.
    #[arg(long)]
    gc_dry_run: bool,
    /// Orphan GC spares instances younger than this (their create may be in flight).
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    gc_grace_seconds: u64,
    /// Time between two orphan GC passes.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    gc_interval_seconds: u64,
    #[command(flatten)]
    lifecycle: LifecycleArgs,
    /// Namespace of the leader Lease and the lease checkpoint.
    #[arg(long, env = "POD_NAMESPACE", default_value = "egress-proxies-system")]
    system_namespace: String,
    /// This replica's identity.
    #[arg(long, env = "POD_NAME", default_value = "egress-proxies-operator")]
    identity: String,
    /// This installation's name in the cluster: with the cluster's identity (the
    /// kube-system namespace's UID) it is stamped on every instance, and orphan GC and
    /// adoption act only on instances carrying both. Give each installation sharing a
    /// backend its own.
    #[arg(long, env = "POD_NAMESPACE", default_value = "egress-proxies-operator")]
    installation_name: String,
    /// The cluster's identity, stamped on every instance. By default it is read: the UID of the
    /// kube-system namespace (needs get on namespaces/kube-system). An install that may not read
    /// it (namespace-restricted, with its Role alone) passes that UID here, as a cluster admin
    /// reads it: `kubectl get namespace kube-system -o jsonpath='{.metadata.uid}'`.
    #[arg(long, value_name = "UID", env = "EPO_CLUSTER_ID", value_parser = cluster_uid)]
    cluster_id: Option<String>,
    /// Do not publish ProviderHealth objects (cluster-scoped, so a namespace-restricted install
    /// with its Role alone may not write them). Provider health is still probed, holds
    /// provisioning while a provider is down, and shows in metrics and the logs.
    #[arg(long)]
    no_provider_health_objects: bool,
    /// Admin server address (/healthz, /readyz, /metrics).
    #[arg(long, default_value = "0.0.0.0:8081")]
    admin_listen: std::net::SocketAddr,
    /// Discovery API address.
    #[arg(long, default_value = "0.0.0.0:8080")]
    discovery_listen: std::net::SocketAddr,
    #[command(flatten)]
    gateway: GatewayArgs,
    /// How the discovery API authenticates callers (at least one method, or --discovery-no-auth).
    #[command(flatten)]
    auth: ClusterAuthArgs,
    /// Key signing lease tokens, shared by all replicas.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "/etc/egress-proxies-operator/lease-key/key"
    )]
    lease_signing_key: PathBuf,
    /// Parallel reconciles.
    #[arg(long, default_value_t = 8)]
    concurrency: u16,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    json_logs: bool,
}

impl RunArgs {
    /// Cluster mode's options, with the discovery API's authentication checked before anything
    /// connects (a missing choice is a usage error, not a cluster problem).
    fn options(self) -> anyhow::Result<cluster::ClusterOptions> {
        let auth = self.auth.options();
        auth.validate(true)?;
        Ok(cluster::ClusterOptions {
            providers_config: self.providers_config,
            namespace: self.namespace,
            gc_allow_namespaced: self.gc_allow_namespaced,
            gc_dry_run: self.gc_dry_run,
            gc_grace: std::time::Duration::from_secs(self.gc_grace_seconds),
            gc_interval: std::time::Duration::from_secs(self.gc_interval_seconds.max(1)),
            reconciler: self.lifecycle.config()?,
            provider_probe_interval: std::time::Duration::from_secs(self.lifecycle.provider_probe_interval),
            system_namespace: self.system_namespace,
            identity: self.identity,
            installation_name: self.installation_name,
            cluster_id: self.cluster_id,
            provider_health_objects: !self.no_provider_health_objects,
            admin_listen: self.admin_listen,
            discovery_listen: self.discovery_listen,
            gateway: self.gateway.options()?,
            auth,
            signing_key: self.lease_signing_key,
            concurrency: self.concurrency,
        })
    }
}

/// The gateway's flags, the same in both modes (docs/gateway.md).
#[derive(clap::Args)]
struct GatewayArgs {
    /// Serve the gateway, a rotating forward proxy (`curl -x http://HOLDER:TOKEN@ADDR`), on this
    /// address (default: off).
    #[arg(long, value_name = "ADDR")]
    gateway_listen: Option<std::net::SocketAddr>,
    /// Release a gateway session's lease once no request used it for this many seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    gateway_session_idle_seconds: u64,
    /// The gateway's ban rules (YAML or JSON, docs/gateway.md), checked at start; without it
    /// a 403 or 429 bans the proxy for the target's domain.
    #[arg(long, value_name = "FILE")]
    gateway_rules: Option<PathBuf>,
    /// Quotas per token (YAML or JSON, docs/gateway.md "Usage and quotas"), checked at start:
    /// a token over a quota gets 429 `quota_exceeded` from the gateway and from lease acquires.
    #[arg(long, value_name = "FILE")]
    quotas: Option<PathBuf>,
}

impl GatewayArgs {
    /// The gateway's options, with the rules file's rules (or the default ones) and the quotas
    /// file's quotas (or none).
    fn options(&self) -> anyhow::Result<app::GatewayOptions> {
        Ok(app::GatewayOptions {
            listen: self.gateway_listen,
            session_idle: std::time::Duration::from_secs(self.gateway_session_idle_seconds),
            rules: match &self.gateway_rules {
                Some(path) => egress_proxies_operator::gateway::rules::Rules::load(path)?,
                None => Default::default(),
            },
            quotas: match &self.quotas {
                Some(path) => egress_proxies_operator::usage::Quotas::load(path)?,
                None => Default::default(),
            },
        })
    }
}

/// Discovery API authentication flags of `run`: static tokens (file and/or Secret), TokenReview,
/// or the explicit opt-out.
#[derive(clap::Args)]
struct ClusterAuthArgs {
    /// Static bearer tokens, one per line (e.g. a mounted Secret's key), re-read every 2 s.
    #[arg(long = "discovery-tokens", alias = "tokens", value_name = "FILE")]
    discovery_tokens: Option<PathBuf>,
    /// Static bearer tokens from this Secret in the operator's namespace (each data key a token),
    /// re-read every 2 s through the API.
    #[arg(long, value_name = "NAME")]
    discovery_tokens_secret: Option<String>,
    /// Accept Kubernetes service-account tokens, verified with a TokenReview (needs
    /// --discovery-token-audience).
    #[arg(long, requires = "discovery_token_audience")]
    discovery_token_review: bool,
    /// Audience a TokenReview'd token must hold (repeatable), e.g. the one crawlers request for
    /// their projected service-account token.
    #[arg(long, value_name = "AUDIENCE", requires = "discovery_token_review")]
    discovery_token_audience: Vec<String>,
    /// TokenReview'd users allowed in (repeatable), exact or ending in `*`, e.g.
    /// `system:serviceaccount:crawlers:*` (default: every authenticated user).
    #[arg(long, value_name = "USER", requires = "discovery_token_review")]
    discovery_allowed_subject: Vec<String>,
    /// Serve the discovery API without any authentication (logged as a warning).
    #[arg(long, conflicts_with_all = ["discovery_tokens", "discovery_tokens_secret", "discovery_token_review"])]
    discovery_no_auth: bool,
}

impl ClusterAuthArgs {
    fn options(self) -> app::DiscoveryAuthOptions {
        app::DiscoveryAuthOptions {
            tokens_file: self.discovery_tokens,
            tokens_secret: self.discovery_tokens_secret,
            token_review_audiences: if self.discovery_token_review {
                self.discovery_token_audience
            } else {
                Vec::new()
            },
            allowed_subjects: self.discovery_allowed_subject,
            no_auth: self.discovery_no_auth,
            reload_interval: app::TOKEN_RELOAD_INTERVAL,
        }
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C). The handlers are installed when this is called
/// (inside the runtime, before start-up work), so a signal during start-up is a graceful stop
/// that still flushes the last spans, not the default kill.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let terminate = signal(SignalKind::terminate());
    let interrupt = signal(SignalKind::interrupt());
    async move {
        let received = |installed: std::io::Result<tokio::signal::unix::Signal>| async move {
            match installed {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = received(terminate) => {}
            _ = received(interrupt) => {}
        }
        tracing::info!("shutting down");
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", report(&err));
            ExitCode::FAILURE
        }
    }
}

/// The error and each cause its predecessor's message does not already say. Some errors
/// (kube's among them) write their source into their own message and also return it, which
/// `{:#}` would print again at every level.
fn report(err: &anyhow::Error) -> String {
    let mut text = String::new();
    let mut previous = String::new();
    for cause in err.chain() {
        let message = cause.to_string();
        if !previous.contains(&message) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&message);
        }
        previous = message;
    }
    text
}

/// The servers' descriptors up to the hard limit (see [`net::raise_descriptor_limit`]); a
/// failure only costs capacity, so it is logged and the operator runs on.
fn raise_descriptor_limit() {
    match net::raise_descriptor_limit() {
        Ok((before, after)) if before != after => {
            tracing::info!(before = ?before, after = ?after, "raised the open-file limit to its hard limit");
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "cannot raise the open-file limit; serving within it"),
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Crd { out_dir: None } => {
            print!("{}", api::render_all()?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Openapi => {
            print!("{}", egress_proxies_operator::discovery::openapi::json());
            Ok(ExitCode::SUCCESS)
        }
        Command::Crd { out_dir: Some(dir) } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for file in api::crd_files()? {
                let path = dir.join(&file.file_name);
                std::fs::write(&path, file.yaml).with_context(|| format!("writing {}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Check {
            files,
            providers_config,
        } => {
            let providers = providers_config
                .as_deref()
                .map(ProvidersConfig::load)
                .transpose()?;
            let checker = Checker::new(providers);
            let mut report = Report::default();
            for file in &files {
                checker.check_file(file, &mut report);
            }
            for problem in &report.problems {
                println!("{problem}");
            }
            if report.problems.is_empty() {
                eprintln!("{} document(s) in {} file(s): ok", report.documents, files.len());
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!(
                    "{} problem(s) in {} document(s) of {} file(s)",
                    report.problems.len(),
                    report.documents,
                    files.len()
                );
                Ok(ExitCode::FAILURE)
            }
        }
        Command::Machines { check: false } => {
            print!("{}", machine::docs::render_markdown());
            Ok(ExitCode::SUCCESS)
        }
        Command::Machines { check: true } => {
            let path = std::path::Path::new(machine::docs::DOC_PATH);
            machine::docs::check_markdown(path)?;
            eprintln!("{} is up to date", path.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Standalone {
            manifests,
            providers_config,
            state,
            listen,
            gateway,
            discovery_tokens,
            discovery_no_auth,
            lifecycle,
            installation_name,
            no_durable_leases,
            lease_journal_window_ms,
            json_logs,
        } => {
            let telemetry = tracing_setup::init(json_logs)?;
            raise_descriptor_limit();
            let options = standalone::StandaloneOptions {
                installation_name,
                durable_leases: !no_durable_leases,
                lease_journal_window: std::time::Duration::from_millis(lease_journal_window_ms),
                manifests,
                providers_config,
                state,
                listen,
                gateway: gateway.options()?,
                auth: app::DiscoveryAuthOptions {
                    tokens_file: discovery_tokens,
                    no_auth: discovery_no_auth,
                    reload_interval: app::TOKEN_RELOAD_INTERVAL,
                    ..app::DiscoveryAuthOptions::default()
                },
                poll: std::time::Duration::from_secs(1),
                gc_grace: std::time::Duration::from_secs(300),
                reconciler: lifecycle.config()?,
                provider_probe_interval: std::time::Duration::from_secs(lifecycle.provider_probe_interval),
                terminal_progress: !json_logs,
                gc_interval: std::time::Duration::from_secs(60),
            };
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            runtime.block_on(async { standalone::run_standalone(options, shutdown_signal()).await })?;
            telemetry.shutdown();
            Ok(ExitCode::SUCCESS)
        }
        Command::Run(args) => {
            let json_logs = args.json_logs;
            let options = args.options()?;
            let telemetry = tracing_setup::init(json_logs)?;
            raise_descriptor_limit();
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            runtime.block_on(async {
                let shutdown = shutdown_signal();
                let client = kube::Client::try_default()
                    .await
                    .context("connecting to the cluster")?;
                cluster::run_cluster(client, options, shutdown).await?;
                anyhow::Ok(())
            })?;
            telemetry.shutdown();
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { state, audit } => {
            let store = standalone::store::Store::read_only(&state)?;
            match audit {
                Some(proxy) => {
                    let (namespace, name) = proxy.split_once('/').unwrap_or(("default", proxy.as_str()));
                    let key = egress_proxies_operator::api::ProxyKey::new(namespace, name);
                    let Some(trail) = status::render_audit(&store, &key)? else {
                        let known: Vec<String> =
                            store.list()?.into_iter().map(|(k, _)| k.to_string()).collect();
                        anyhow::bail!(
                            "no proxy {key} in {} (it has: {}); name one as NAME or NAMESPACE/NAME",
                            state.display(),
                            if known.is_empty() {
                                "none".to_owned()
                            } else {
                                known.join(", ")
                            }
                        );
                    };
                    print!("{trail}");
                }
                None => {
                    let checkpoint = state.join(standalone::mode::LEASE_CHECKPOINT_FILE);
                    let leases =
                        egress_proxies_operator::lease::journal::active_leases_by_proxy(&state, &checkpoint);
                    let count = |key: &egress_proxies_operator::api::ProxyKey| {
                        leases.get(key.as_str()).copied().unwrap_or(0)
                    };
                    print!(
                        "{}",
                        status::render_table(&store, jiff::Timestamp::now(), &count)?
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Audit { scenario } => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .context("starting the async runtime")?;
            let trail = runtime.block_on(egress_proxies_operator::controller::simulate::replay_file(
                &scenario,
            ))?;
            print!("{trail}");
            Ok(ExitCode::SUCCESS)
        }
    }
}
