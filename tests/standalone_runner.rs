//! The standalone runner's bookkeeping, with the in-memory provider and scripted health: the
//! manifests folder drives the same lifecycle as a cluster, bad manifests don't disturb good
//! ones, and a restart re-creates nothing and cleans up what vanished while it was down. One
//! test runs the real `local` provider: a restart tells only the credentials changes that
//! happened.

#[allow(dead_code)]
#[macro_use]
mod support {
    #[macro_use]
    pub mod contract;
    pub mod local;
    pub mod ports;
    pub mod process;
    pub mod scripted;
}

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use egress_proxies_operator::{
    api::ProxyKey,
    controller::{ProviderAvailability, ReconcilerConfig},
    health::Verdict,
    provider::{ProviderRegistry, local::LocalProvider, memory::MemoryProvider},
    standalone::{Standalone, StandaloneDeps, store::Store},
};
use support::{
    local::StateDir,
    ports::free_port,
    scripted::{ScriptedHealth, ScriptedLeases, key},
};

fn manifest(name: &str, port: u32) -> String {
    format!(
        "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\nmetadata:\n  name: {name}\nspec:\n  provider: local\n  port: {port}\n  attributes:\n    pool: a\n"
    )
}

/// A temporary folder holding `manifests/` with a manifest per (name, port) of `proxies`, and
/// where the runner keeps its `state/`. Keep the folder while the paths are used.
fn folders(proxies: &[(&str, u32)]) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (manifests, state) = (dir.path().join("manifests"), dir.path().join("state"));
    std::fs::create_dir_all(&manifests).expect("mkdir");
    for (name, port) in proxies {
        std::fs::write(manifests.join(format!("{name}.yaml")), manifest(name, *port)).expect("write");
    }
    (dir, manifests, state)
}

struct Host {
    provider: Arc<MemoryProvider>,
    health: Arc<ScriptedHealth>,
    leases: Arc<ScriptedLeases>,
    availability: ProviderAvailability,
}

impl Host {
    fn new() -> Self {
        Self {
            provider: Arc::new(MemoryProvider::new("local")),
            health: ScriptedHealth::new(),
            leases: ScriptedLeases::new(),
            availability: ProviderAvailability::default(),
        }
    }

    fn open(&self, manifests: &Path, state: &Path) -> Standalone {
        self.open_with(manifests, state, ReconcilerConfig::default())
    }

    fn open_with(&self, manifests: &Path, state: &Path, reconciler: ReconcilerConfig) -> Standalone {
        let mut providers = ProviderRegistry::new();
        providers.insert(self.provider.clone());
        Standalone::open(
            manifests,
            state,
            StandaloneDeps {
                providers,
                leases: self.leases.clone(),
                health: self.health.clone(),
                availability: self.availability.clone(),
                reconciler,
            },
        )
        .expect("opens")
    }
}

fn phase(state: &Path, key: &ProxyKey) -> Option<String> {
    Store::read_only(state)
        .expect("state")
        .get(key)
        .expect("readable")?
        .status?
        .phase
}

/// Steps until `done` holds, at most a bounded number of rounds (each round reconciles what is
/// due; nothing here waits on wall-clock timers).
async fn step_until(runner: &mut Standalone, mut done: impl FnMut() -> bool) {
    for _ in 0..20 {
        runner.step().await;
        if done() {
            return;
        }
    }
    panic!(
        "condition not reached after 20 rounds; progress: {}",
        runner.progress().line()
    );
}

#[tokio::test]
async fn folder_changes_drive_the_lifecycle_and_restarts_are_safe() {
    let (_dir, manifests, state) = folders(&[("a", 3128), ("b", 3129)]);
    std::fs::write(manifests.join("broken.yaml"), manifest("c", 70000)).expect("write");
    let host = Host::new();
    let (a, b, c) = (key("default", "a"), key("default", "b"), key("default", "c"));

    let mut runner = host.open(&manifests, &state);
    step_until(&mut runner, || {
        phase(&state, &a).as_deref() == Some("provisioning")
            && phase(&state, &b).as_deref() == Some("provisioning")
    })
    .await;
    assert_eq!(phase(&state, &c), None, "an invalid manifest creates nothing");
    assert_eq!(host.provider.created_count(), 2);

    for k in [&a, &b] {
        host.health.set(k, Verdict::Passing);
        runner.trigger(k.clone());
    }
    step_until(&mut runner, || {
        phase(&state, &a).as_deref() == Some("healthy") && phase(&state, &b).as_deref() == Some("healthy")
    })
    .await;
    assert!(
        host.leases.entry(&a).expect("registered").open,
        "a healthy proxy takes leases"
    );

    // Breaking a file keeps its proxy as it was.
    std::fs::write(manifests.join("b.yaml"), "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\nmetadata: {name: b}\nspec: {provider: local, port: -1}\n").expect("write");
    runner.step().await;
    assert_eq!(phase(&state, &b).as_deref(), Some("healthy"));
    assert!(
        runner
            .progress()
            .line()
            .contains("2 manifest file(s) with problems"),
        "{}",
        runner.progress().line()
    );

    // Removing a manifest deletes its instance and its record.
    std::fs::remove_file(manifests.join("a.yaml")).expect("rm");
    step_until(&mut runner, || {
        Store::read_only(&state).unwrap().get(&a).unwrap().is_none()
    })
    .await;
    assert_eq!(host.provider.deleted_count(), 1);
    let trail = Store::read_only(&state).unwrap().audit(&a).unwrap();
    assert_eq!(trail.last().expect("audited").entry.reason, "Deleted");

    // Restart: nothing is re-created, the state is as it was.
    drop(runner);
    std::fs::write(manifests.join("b.yaml"), manifest("b", 3129)).expect("repair");
    let mut runner = host.open(&manifests, &state);
    runner.step().await;
    runner.step().await;
    assert_eq!(phase(&state, &b).as_deref(), Some("healthy"));
    assert_eq!(host.provider.created_count(), 2, "a restart re-creates nothing");

    // A manifest removed while the operator is down is cleaned up after the restart.
    drop(runner);
    std::fs::remove_file(manifests.join("b.yaml")).expect("rm");
    let mut runner = host.open(&manifests, &state);
    step_until(&mut runner, || {
        Store::read_only(&state).unwrap().get(&b).unwrap().is_none()
    })
    .await;
    assert!(
        host.provider.names().is_empty(),
        "no instance left: {:?}",
        host.provider.names()
    );
}

#[tokio::test]
async fn a_second_runner_on_the_same_state_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let host = Host::new();
    let _first = host.open(dir.path(), &dir.path().join("state"));
    let mut providers = ProviderRegistry::new();
    providers.insert(host.provider.clone());
    let second = Standalone::open(
        dir.path(),
        &dir.path().join("state"),
        StandaloneDeps {
            providers,
            leases: host.leases.clone(),
            health: host.health.clone(),
            availability: ProviderAvailability::default(),
            reconciler: ReconcilerConfig::default(),
        },
    );
    let message = second.err().expect("refused").to_string();
    assert!(message.contains("in use by another"), "{message}");
}

fn cloud_init_secret(revision: u32) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: squid-init\n  labels:\n    crawl.example.com/cloud-init: \"true\"\nstringData:\n  user-data: |\n    #cloud-config\n    # revision {revision}\n"
    )
}

#[tokio::test]
async fn rotating_a_referenced_secret_replaces_its_proxy_without_waiting_for_the_resync() {
    let (_dir, manifests, state) = folders(&[]);
    let with_cloud_init = format!(
        "{}  cloudInit:\n    secretRef:\n      name: squid-init\n",
        manifest("a", 3128)
    );
    std::fs::write(manifests.join("a.yaml"), &with_cloud_init).expect("write");
    std::fs::write(manifests.join("b.yaml"), manifest("b", 3129)).expect("write");
    std::fs::write(manifests.join("secret.yaml"), cloud_init_secret(1)).expect("write");
    let host = Host::new();
    let (a, b) = (key("default", "a"), key("default", "b"));
    let mut runner = host.open(&manifests, &state);
    step_until(&mut runner, || {
        phase(&state, &a).as_deref() == Some("provisioning")
            && phase(&state, &b).as_deref() == Some("provisioning")
    })
    .await;
    for k in [&a, &b] {
        host.health.set(k, Verdict::Passing);
        runner.trigger(k.clone());
    }
    step_until(&mut runner, || {
        phase(&state, &a).as_deref() == Some("healthy") && phase(&state, &b).as_deref() == Some("healthy")
    })
    .await;
    let spec_hash = |k: &ProxyKey| {
        Store::read_only(&state)
            .unwrap()
            .get(k)
            .unwrap()
            .unwrap()
            .status
            .unwrap()
            .spec_hash
    };
    let (old_hash, b_hash) = (spec_hash(&a), spec_hash(&b));
    assert_eq!(host.provider.created_count(), 2);

    // Healthy proxies are due again only at the resync, minutes away: the rotation alone must
    // bring `a` back (and leave `b`, which does not reference the Secret, alone).
    std::fs::write(manifests.join("secret.yaml"), cloud_init_secret(2)).expect("rotate");
    step_until(&mut runner, || host.provider.deleted_count() == 1).await;
    let trail = Store::read_only(&state).unwrap().audit(&a).unwrap();
    assert!(
        trail.iter().any(|line| line.entry.reason == "SpecChanged"),
        "{:?}",
        trail.iter().map(|line| &line.entry.reason).collect::<Vec<_>>()
    );
    step_until(&mut runner, || host.provider.created_count() == 3).await;
    assert_ne!(spec_hash(&a), old_hash, "the new instance runs the new content");
    assert_eq!(spec_hash(&b), b_hash);
    assert_eq!(phase(&state, &b).as_deref(), Some("healthy"));
}

/// A recycle request in a manifest's annotations (no spec change, so no generation) reaches the
/// lifecycle at once, recycles its proxy once, and is recorded in the status.
#[tokio::test]
async fn a_recycle_annotation_in_a_manifest_replaces_its_proxy_once() {
    let (_dir, manifests, state) = folders(&[("a", 3128)]);
    let host = Host::new();
    let a = key("default", "a");
    let mut runner = host.open(&manifests, &state);
    step_until(&mut runner, || {
        phase(&state, &a).as_deref() == Some("provisioning")
    })
    .await;
    host.health.set(&a, Verdict::Passing);
    runner.trigger(a.clone());
    step_until(&mut runner, || phase(&state, &a).as_deref() == Some("healthy")).await;
    assert_eq!(host.provider.created_count(), 1);

    let annotated = manifest("a", 3128).replace(
        "metadata:\n  name: a\n",
        "metadata:\n  name: a\n  annotations:\n    crawl.example.com/recycle: ban-1\n",
    );
    std::fs::write(manifests.join("a.yaml"), &annotated).expect("annotate");
    step_until(&mut runner, || host.provider.created_count() == 2).await;
    let record = Store::read_only(&state).unwrap().get(&a).unwrap().unwrap();
    assert_eq!(record.generation, 1, "an annotation moves no generation");
    assert_eq!(record.status.unwrap().last_recycle.as_deref(), Some("ban-1"));
    let trail = Store::read_only(&state).unwrap().audit(&a).unwrap();
    assert!(trail.iter().any(|line| line.entry.reason == "Recycled"));
    // The same request is no new one: nothing more is created.
    for _ in 0..5 {
        runner.trigger(a.clone());
        runner.step().await;
    }
    assert_eq!(host.provider.created_count(), 2);
}

#[tokio::test]
async fn proxies_held_by_an_unavailable_provider_provision_as_soon_as_it_returns() {
    let (_dir, manifests, state) = folders(&[("a", 3128)]);
    let host = Host::new();
    let a = key("default", "a");
    host.availability.set(
        "local",
        Some("libvirt at qemu:///system: connection refused".into()),
    );

    let mut runner = host.open(&manifests, &state);
    step_until(&mut runner, || phase(&state, &a).as_deref() == Some("pending")).await;
    let status = Store::read_only(&state)
        .unwrap()
        .get(&a)
        .unwrap()
        .unwrap()
        .status
        .unwrap();
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready condition");
    assert_eq!(ready.reason, "ProviderUnavailable", "{ready:?}");
    assert_eq!(
        host.provider.created_count(),
        0,
        "nothing provisioned while the provider is down"
    );

    // Back, but nobody says so: the held Proxy waits for its own retry (far off).
    host.availability.set("local", None);
    runner.trigger_provider("another-provider");
    runner.step().await;
    assert_eq!(phase(&state, &a).as_deref(), Some("pending"));
    assert_eq!(host.provider.created_count(), 0);

    // The monitor's flip for its provider makes it due at once.
    runner.trigger_provider("local");
    step_until(&mut runner, || {
        phase(&state, &a).as_deref() == Some("provisioning")
    })
    .await;
    assert_eq!(host.provider.created_count(), 1);
}

/// Standalone mode backs off like cluster mode: a provider that fails every create is asked with
/// the defaults scaled down 100x (10 s doubling to 5 min becomes 100 ms doubling to 3 s), so a
/// 6 s window stands for the first 10 minutes; the runner steps whenever it says something is due.
#[tokio::test]
async fn a_provider_that_fails_every_create_is_asked_with_backoff() {
    let (_dir, manifests, state) = folders(&[("a", 3128)]);
    let host = Host::new();
    host.provider.fail_next_creates(1_000_000);
    let config = ReconcilerConfig {
        backoff: egress_proxies_operator::machine::Backoff {
            initial: std::time::Duration::from_millis(100),
            cap: std::time::Duration::from_secs(3),
            jitter: 0.1,
        },
        ..ReconcilerConfig::default()
    };
    let mut runner = host.open_with(&manifests, &state, config);
    let window = tokio::time::Instant::now() + std::time::Duration::from_secs(6);
    while tokio::time::Instant::now() < window {
        let next = runner.step().await;
        let wake = next.map_or(window, |at| at.min(window));
        tokio::time::sleep_until(wake.max(tokio::time::Instant::now() + std::time::Duration::from_millis(5)))
            .await;
    }
    let calls = host.provider.create_calls();
    assert!(
        (4..=8).contains(&calls),
        "{calls} create calls in the scaled first 10 minutes"
    );
    let status = Store::read_only(&state)
        .unwrap()
        .get(&key("default", "a"))
        .unwrap()
        .unwrap()
        .status
        .unwrap();
    assert!(status.retry_attempts.unwrap_or(0) >= 4, "{status:?}");
    assert!(status.next_attempt_time.is_some(), "{status:?}");
}

/// Issue 24: a create that fails once and succeeds on its retry leaves a retry time in the past
/// while the instance boots. The runner, on tokio's paused clock (the reconciler's clock follows
/// it), must look again only at the booting state's poll (10 s), not at once over and over: 30
/// simulated seconds of booting take a handful of reconciles (the failed create, the retry, two
/// polls), where a 0 s wake-up spins at one instant until the bound below stops it.
#[tokio::test(start_paused = true)]
async fn a_create_that_succeeds_on_its_retry_does_not_storm_while_the_instance_boots() {
    use egress_proxies_operator::{machine::Backoff, provider::InstanceState};
    use tokio::time::{Duration, Instant};

    let (_dir, manifests, state) = folders(&[("a", 3128)]);
    let host = Host::new();
    host.provider.fail_next_creates(1);
    host.provider.start_instances_as(InstanceState::Starting);
    let config = ReconcilerConfig {
        backoff: Backoff {
            initial: std::time::Duration::from_secs(1),
            cap: std::time::Duration::from_secs(3),
            jitter: 0.0,
        },
        ..ReconcilerConfig::default()
    };
    let start = Instant::now();
    let epoch = jiff::Timestamp::constant(1_735_689_600, 0);
    let mut runner = host
        .open_with(&manifests, &state, config)
        .with_clock(move || epoch.checked_add(Instant::now() - start).expect("in range"));
    let a = key("default", "a");
    // Runs the runner as `run` does, on simulated time, until `until`; stops early once it has
    // made `bound` reconciles (a storm never lets simulated time move).
    async fn run_until(runner: &mut Standalone, until: Instant, bound: u64) {
        let before = runner.reconciles();
        while Instant::now() < until && runner.reconciles() - before < bound {
            let next = runner.step().await;
            tokio::time::sleep_until(next.map_or(until, |at| at.min(until))).await;
        }
    }

    run_until(&mut runner, start + Duration::from_secs(30), 200).await;
    assert_eq!(phase(&state, &a).as_deref(), Some("provisioning"));
    assert_eq!(host.provider.create_calls(), 2, "the failed create and its retry");
    let booting = runner.reconciles();
    assert!(
        booting <= 5,
        "{booting} reconciles in 30 s while the instance boots (the failed create, the retry \
         and a poll every 10 s make 4)"
    );

    // Healthy: from now on only the resync (5 min) looks again.
    host.provider
        .set_state(&host.provider.names()[0], InstanceState::Running);
    host.health.set(&a, Verdict::Passing);
    runner.trigger(a.clone());
    run_until(&mut runner, start + Duration::from_secs(31), 200).await;
    assert_eq!(phase(&state, &a).as_deref(), Some("healthy"));
    let healthy_at = runner.reconciles();
    run_until(&mut runner, start + Duration::from_secs(31 + 600), 200).await;
    let resting = runner.reconciles() - healthy_at;
    assert!(
        resting <= 3,
        "{resting} reconciles in 10 min at rest (the 5-minute resync, at the Proxy's own phase \
         of each period, makes 2 or 3)"
    );
}

/// A Proxy that never got the finalizer (its provider is unknown: nothing was ever created) goes
/// at once when its manifest is removed, as the API server deletes an object without finalizers;
/// it used to be marked deleting and stay, its delete failing for want of the provider.
#[tokio::test]
async fn a_proxy_without_the_finalizer_goes_with_its_manifest() {
    let (_dir, manifests, state) = folders(&[]);
    std::fs::write(
        manifests.join("typo.yaml"),
        "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\nmetadata:\n  name: typo\nspec:\n  provider: lcoal\n",
    )
    .expect("write");
    let host = Host::new();
    let typo = key("default", "typo");
    let mut runner = host.open(&manifests, &state);
    step_until(&mut runner, || phase(&state, &typo).as_deref() == Some("pending")).await;
    std::fs::remove_file(manifests.join("typo.yaml")).expect("rm");
    runner.step().await;
    assert!(
        Store::read_only(&state).unwrap().get(&typo).unwrap().is_none(),
        "the record is gone"
    );
    assert_eq!(host.provider.create_calls(), 0);
}

/// Proxies per phase as the state folder holds them.
fn phases_in(state: &Path) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for (_, record) in Store::read_only(state).expect("state").list().expect("readable") {
        let phase = record
            .status
            .and_then(|s| s.phase)
            .unwrap_or_else(|| "pending".to_owned());
        *counts.entry(phase).or_insert(0) += 1;
    }
    counts
}

/// The progress line's counts follow every change (creation, health, deletion, a restart)
/// while each step reads only the records that may have changed: a step with nothing due
/// reads none, a step that reconciles one Proxy reads one, however many there are.
#[tokio::test]
async fn the_progress_counts_follow_changes_reading_only_what_changed() {
    let (_dir, manifests, state) = folders(&[]);
    const N: u32 = 12;
    for i in 0..N {
        std::fs::write(
            manifests.join(format!("p{i}.yaml")),
            manifest(&format!("p{i}"), 4000 + i),
        )
        .expect("write");
    }
    let host = Host::new();
    let keys: Vec<ProxyKey> = (0..N).map(|i| key("default", &format!("p{i}"))).collect();
    let counts_agree = |runner: &Standalone| {
        let want = phases_in(&state);
        for (phase, n) in &want {
            assert_eq!(
                runner.progress().count(phase),
                *n,
                "{phase}: {}",
                runner.progress().line()
            );
        }
        assert_eq!(want.values().sum::<usize>(), N as usize);
    };

    let mut runner = host.open(&manifests, &state);
    step_until(&mut runner, || {
        keys.iter()
            .all(|k| phase(&state, k).as_deref() == Some("provisioning"))
    })
    .await;
    counts_agree(&runner);
    for k in &keys {
        host.health.set(k, Verdict::Passing);
        runner.trigger(k.clone());
    }
    step_until(&mut runner, || {
        keys.iter()
            .all(|k| phase(&state, k).as_deref() == Some("healthy"))
    })
    .await;
    counts_agree(&runner);
    assert_eq!(runner.progress().count("healthy"), N as usize);

    // Nothing due: nothing read. One Proxy triggered: one read, and its new phase counted.
    let reads = runner.phase_reads();
    runner.step().await;
    assert_eq!(runner.phase_reads(), reads);
    host.health.set(&keys[3], Verdict::Failing);
    runner.trigger(keys[3].clone());
    runner.step().await;
    assert_eq!(runner.phase_reads(), reads + 1);
    counts_agree(&runner);
    assert_eq!(
        runner.progress().count("healthy"),
        N as usize - 1,
        "{}",
        runner.progress().line()
    );

    // A removed manifest: its deletion is counted until its record goes.
    std::fs::remove_file(manifests.join("p5.yaml")).expect("rm");
    step_until(&mut runner, || {
        Store::read_only(&state).unwrap().get(&keys[5]).unwrap().is_none()
    })
    .await;
    let left = phases_in(&state);
    for (phase, n) in &left {
        assert_eq!(
            runner.progress().count(phase),
            *n,
            "{phase}: {}",
            runner.progress().line()
        );
    }
    assert_eq!(left.values().sum::<usize>(), N as usize - 1);

    // A restart counts the records it loads once.
    drop(runner);
    let runner = host.open(&manifests, &state);
    let mut runner = runner;
    runner.step().await;
    for (phase, n) in &phases_in(&state) {
        assert_eq!(
            runner.progress().count(phase),
            *n,
            "{phase}: {}",
            runner.progress().line()
        );
    }
}

/// Proxies that became Healthy together were all resynced together five minutes later, and
/// again five minutes after that: at 10,000 a burst of 10,000 reconciles every five minutes
/// on the thread beside the lease API. On tokio's paused clock, 40 proxies made Healthy at
/// one instant must each be resynced once within the next period, spread over it, not at one
/// instant.
#[tokio::test(start_paused = true)]
async fn resyncs_of_proxies_that_settled_together_are_spread_out() {
    use tokio::time::{Duration, Instant};

    let (_dir, manifests, state) = folders(&[]);
    let names: Vec<String> = (0..40).map(|i| format!("p{i:02}")).collect();
    for (i, name) in names.iter().enumerate() {
        std::fs::write(
            manifests.join(format!("{name}.yaml")),
            manifest(name, 3000 + i as u32),
        )
        .expect("write");
    }
    let host = Host::new();
    for name in &names {
        host.health.set(&key("default", name), Verdict::Passing);
    }
    let start = Instant::now();
    let epoch = jiff::Timestamp::constant(1_735_689_600, 0);
    let mut runner = host
        .open(&manifests, &state)
        .with_clock(move || epoch.checked_add(Instant::now() - start).expect("in range"));
    step_until(&mut runner, || {
        names
            .iter()
            .all(|name| phase(&state, &key("default", name)).as_deref() == Some("healthy"))
    })
    .await;
    let settled = Instant::now();
    let resync = Duration::from_secs(300);
    // Every step within one period after settling: when the reconciles happened.
    let mut at = Vec::new();
    loop {
        let before = runner.reconciles();
        let next = runner.step().await;
        for _ in before..runner.reconciles() {
            at.push(Instant::now() - settled);
        }
        match next {
            Some(next) if next <= settled + resync => tokio::time::sleep_until(next).await,
            _ => break,
        }
    }
    assert_eq!(at.len(), names.len(), "one resync each within the period: {at:?}");
    let (first, last) = (at[0], at[at.len() - 1]);
    assert!(
        last - first >= resync / 2,
        "the resyncs came within {:?} of each other",
        last - first
    );
}

/// A manifest of `name` on `port` whose proxy credentials are in the Secret `secret`.
fn manifest_with_auth(name: &str, port: u32, secret: &str) -> String {
    format!(
        "{}  auth:\n    secretRef:\n      name: {secret}\n",
        manifest(name, port)
    )
}

/// A Secret manifest holding proxy credentials.
fn credentials_secret(name: &str, password: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\nstringData:\n  username: crawler\n  password: {password}\n"
    )
}

/// A runner on the real `local` provider (Squid; its instances in a [`StateDir`], whose Squids
/// are killed when it drops) over manifests in a temporary folder, with scripted health and
/// leases.
struct LocalHost {
    local: StateDir,
    _dir: tempfile::TempDir,
    manifests: PathBuf,
    state: PathBuf,
    health: Arc<ScriptedHealth>,
    leases: Arc<ScriptedLeases>,
}

impl LocalHost {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let (manifests, state) = (dir.path().join("manifests"), dir.path().join("state"));
        std::fs::create_dir_all(&manifests).expect("mkdir");
        Self {
            local: StateDir::new(),
            _dir: dir,
            manifests,
            state,
            health: ScriptedHealth::new(),
            leases: ScriptedLeases::new(),
        }
    }

    fn write(&self, file: &str, content: &str) {
        std::fs::write(self.manifests.join(file), content).expect("write");
    }

    /// A runner as a new operator process opens it: a new provider, nothing known in memory.
    fn open(&self) -> Standalone {
        let mut providers = ProviderRegistry::new();
        providers.insert(Arc::new(
            LocalProvider::new("local", self.local.settings()).expect("settings"),
        ));
        Standalone::open(
            &self.manifests,
            &self.state,
            StandaloneDeps {
                providers,
                leases: self.leases.clone(),
                health: self.health.clone(),
                availability: ProviderAvailability::default(),
                reconciler: ReconcilerConfig::default(),
            },
        )
        .expect("opens")
    }

    /// The instance folder of the Proxy `name` (in namespace `default`).
    fn instance_folder(&self, name: &str) -> PathBuf {
        std::fs::read_dir(self.local.path())
            .expect("local state")
            .flatten()
            .find(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("epo-default-{name}-"))
            })
            .expect("instance folder")
            .path()
    }

    /// Opens a runner and steps until every one of `keys` is healthy (health passing).
    async fn healthy(&self, keys: &[ProxyKey]) -> Standalone {
        let mut runner = self.open();
        for k in keys {
            self.health.set(k, Verdict::Passing);
        }
        step_until(&mut runner, || {
            keys.iter()
                .all(|k| phase(&self.state, k).as_deref() == Some("healthy"))
        })
        .await;
        runner
    }

    /// The audit trail of `key`, as `reason (cause)`, from its `from`th entry on.
    fn trail_from(&self, key: &ProxyKey, from: usize) -> Vec<String> {
        let trail = Store::read_only(&self.state).unwrap().audit(key).unwrap();
        trail[from.min(trail.len())..]
            .iter()
            .map(|line| {
                format!(
                    "{} ({})",
                    line.entry.reason,
                    line.entry.cause.clone().unwrap_or_default()
                )
            })
            .collect()
    }

    fn trail_length(&self, key: &ProxyKey) -> usize {
        Store::read_only(&self.state).unwrap().audit(key).unwrap().len()
    }
}

/// With the real `local` provider (it gives running Squids new credentials in place), a
/// restart says only what changed while the operator was down: a proxy without credentials and
/// one whose Secret stayed the same get no audit line and no rewritten password file; the one
/// whose Secret was rotated meanwhile gets its new password, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_tells_only_the_credentials_changes_that_happened() {
    let host = LocalHost::new();
    let port = || u32::from(free_port());
    host.write("open.yaml", &manifest("open", port()));
    host.write("same.yaml", &manifest_with_auth("same", port(), "same-auth"));
    host.write(
        "rotated.yaml",
        &manifest_with_auth("rotated", port(), "rotated-auth"),
    );
    host.write("same-auth.yaml", &credentials_secret("same-auth", "first-1"));
    host.write(
        "rotated-auth.yaml",
        &credentials_secret("rotated-auth", "first-2"),
    );
    let keys = ["open", "same", "rotated"].map(|name| key("default", name));
    let password_file =
        |name: &str| std::fs::read(host.instance_folder(name).join("passwords")).expect("password file");

    let runner = host.healthy(&keys).await;
    let before = keys.clone().map(|k| host.trail_length(&k));
    let (same_file, rotated_file) = (password_file("same"), password_file("rotated"));

    // Down: the operator stops (the Squids run on) and one Secret is rotated meanwhile.
    drop(runner);
    host.write(
        "rotated-auth.yaml",
        &credentials_secret("rotated-auth", "second-2"),
    );
    let mut runner = host.open();
    // One round reconciles every Proxy the state holds.
    runner.step().await;

    assert_eq!(
        host.trail_from(&keys[0], before[0]),
        Vec::<String>::new(),
        "nothing changed for the proxy without credentials"
    );
    assert_eq!(
        host.trail_from(&keys[1], before[1]),
        Vec::<String>::new(),
        "nothing changed for the proxy whose Secret stayed"
    );
    assert_eq!(
        password_file("same"),
        same_file,
        "an unchanged password file is left as it was"
    );
    assert_eq!(
        host.trail_from(&keys[2], before[2]),
        [
            "CredentialsUpdated (the instance ran other credentials than the Secret's (changed while the operator was down); it accepts the Secret's now)"
        ],
        "the rotation while down is applied and told"
    );
    assert_ne!(
        password_file("rotated"),
        rotated_file,
        "the rotated password reached Squid's file"
    );
    for k in &keys {
        assert_eq!(phase(&host.state, k).as_deref(), Some("healthy"));
    }
}

/// Authentication removed from a local proxy's manifest while the operator was down: its Squid
/// still asks for credentials, and only a new instance can stop asking, so the restart replaces
/// it. (It used to assume the instance ran what the manifest said: leases handed out no
/// credentials to a Squid that required them, and every request through it got a 407.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_removed_while_the_operator_was_down_replaces_the_instance() {
    let host = LocalHost::new();
    let port = u32::from(free_port());
    host.write(
        "guarded.yaml",
        &manifest_with_auth("guarded", port, "guarded-auth"),
    );
    host.write("guarded-auth.yaml", &credentials_secret("guarded-auth", "first"));
    let guarded = key("default", "guarded");
    let runner = host.healthy(std::slice::from_ref(&guarded)).await;
    assert!(host.instance_folder("guarded").join("passwords").exists());
    let before = host.trail_length(&guarded);

    drop(runner);
    host.write("guarded.yaml", &manifest("guarded", port));
    let mut runner = host.open();
    let reasons = || -> Vec<String> {
        host.trail_from(&guarded, before)
            .iter()
            .map(|line| line.split(' ').next().unwrap_or_default().to_owned())
            .collect()
    };
    step_until(&mut runner, || reasons().contains(&"InstanceCreated".to_owned())).await;
    assert_eq!(
        reasons()[..3],
        ["SpecChanged", "Recreating", "InstanceCreated"],
        "replaced"
    );
    let folder = host.instance_folder("guarded");
    assert!(
        !folder.join("passwords").exists(),
        "the new Squid asks for no credentials"
    );
    let conf = std::fs::read_to_string(folder.join("squid.conf")).expect("squid.conf");
    assert!(!conf.contains("auth_param"), "{conf}");
}
