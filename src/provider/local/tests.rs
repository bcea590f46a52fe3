use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use super::{
    config::{Plan, squid_conf},
    process::{self, argv_runs_config, failure_in_log, parse_problems},
    state::{InstanceDir, OwnerRecord},
    *,
};
use crate::provider::{
    Installation, Owner,
    fixtures::{assert_user_name_refused, request_with_user},
};

fn dir() -> InstanceDir {
    InstanceDir::at(PathBuf::from("/var/lib/epo/local/epo-crawl-web-1-0a1b2c3d"))
}

fn plan(password_line: Option<&str>) -> Plan {
    Plan {
        listen: "127.0.0.1:3128".parse().expect("addr"),
        outgoing: None,
        password_line: password_line.map(str::to_owned),
    }
}

fn lines(conf: &str) -> Vec<&str> {
    conf.lines().filter(|l| !l.starts_with('#')).collect()
}

#[test]
fn config_without_credentials_listens_on_the_placement_address_and_allows_all() {
    let settings = LocalSettings::new("/var/lib/epo/local");
    let conf = squid_conf("epo-crawl-web-1-0a1b2c3d", &plan(None), &dir(), &settings, None);
    let lines = lines(&conf);
    for expected in [
        "http_port 127.0.0.1:3128",
        "visible_hostname epo-crawl-web-1-0a1b2c3d",
        "pid_filename /var/lib/epo/local/epo-crawl-web-1-0a1b2c3d/run/squid.pid",
        "cache_log /var/lib/epo/local/epo-crawl-web-1-0a1b2c3d/run/cache.log",
        "access_log stdio:/var/lib/epo/local/epo-crawl-web-1-0a1b2c3d/run/access.log",
        "coredump_dir /var/lib/epo/local/epo-crawl-web-1-0a1b2c3d/run",
        "shutdown_lifetime 1 seconds",
        "forwarded_for delete",
        "via off",
        "cache deny all",
        "http_access deny manager",
        "http_access allow all",
    ] {
        assert!(lines.contains(&expected), "missing {expected:?} in\n{conf}");
    }
    for absent in [
        "cache_dir",
        "auth_param",
        "tcp_outgoing_address",
        "cache_effective_user",
    ] {
        assert!(!conf.contains(absent), "unexpected {absent:?} in\n{conf}");
    }
    assert_eq!(
        lines.last(),
        Some(&"http_access allow all"),
        "access rules come last"
    );
}

#[test]
fn config_with_credentials_uses_the_settings_helper_and_the_instances_password_file() {
    let settings = LocalSettings {
        access_log: false,
        extra_config: vec!["acl crawlers src 10.0.0.0/8".to_owned()],
        ..LocalSettings::new("/var/lib/epo/local")
    };
    let mut plan = plan(Some("crawler:$6$x$y\n"));
    plan.outgoing = Some("192.0.2.7".parse().expect("ip"));
    let conf = squid_conf("epo-a", &plan, &dir(), &settings, Some("proxy"));
    let lines = lines(&conf);
    let position = |line: &str| {
        lines
            .iter()
            .position(|l| *l == line)
            .unwrap_or_else(|| panic!("missing {line:?} in\n{conf}"))
    };
    position(&format!(
        "auth_param basic program {} /var/lib/epo/local/epo-crawl-web-1-0a1b2c3d/passwords",
        settings.auth_helper_path.display()
    ));
    // The password file is rewritten in place: old credentials must stop working soon.
    position("auth_param basic credentialsttl 1 minute");
    position("tcp_outgoing_address 192.0.2.7");
    position("cache_effective_user proxy");
    position("access_log none");
    // Extra directives come before the access rules, so they can add ACLs the rules use.
    let extra_at = position("acl crawlers src 10.0.0.0/8");
    let acl = position("acl authenticated proxy_auth REQUIRED");
    let allow = position("http_access allow authenticated");
    let deny = position("http_access deny all");
    assert!(extra_at < acl && acl < allow && allow < deny, "{conf}");
    assert!(!conf.contains("http_access allow all"), "{conf}");
}

#[test]
fn config_brackets_ipv6_listen_addresses() {
    let settings = LocalSettings::new("/var/lib/epo/local");
    let mut plan = plan(None);
    plan.listen = SocketAddr::new("::1".parse::<IpAddr>().expect("ip"), 3128);
    assert!(squid_conf("epo-a", &plan, &dir(), &settings, None).contains("\nhttp_port [::1]:3128\n"));
}

/// Every file under `root`, relative.
fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(folder) = pending.pop() {
        for entry in fs::read_dir(&folder).expect("read_dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path.clone());
            }
            found.push(path.strip_prefix(root).expect("under root").to_path_buf());
        }
    }
    found
}

#[tokio::test]
async fn a_user_name_squid_cannot_carry_is_refused_before_any_file_is_written() {
    let state = tempfile::tempdir().expect("temp");
    let provider = LocalProvider::new("local", LocalSettings::new(state.path())).expect("provider");
    for username in ["a:b", "", "#crawler", "crawler\n"] {
        assert_user_name_refused(
            provider.create(&request_with_user(username)).await,
            &format!("{username:?}"),
        );
        assert_eq!(files_under(state.path()), Vec::<PathBuf>::new(), "{username:?}");
    }
    // Refused as well when a folder of that name is in the way (the check comes first).
    fs::create_dir(state.path().join("epo-crawl-web-1-0a1b2c3d")).expect("folder");
    let outcome = provider.create(&request_with_user("a b")).await;
    assert!(matches!(outcome, Err(ProviderError::Rejected(_))), "{outcome:?}");
    assert_eq!(
        files_under(state.path()),
        [PathBuf::from("epo-crawl-web-1-0a1b2c3d")]
    );
}

#[test]
fn backoff_grows_exponentially_and_is_capped() {
    let delays: Vec<u64> = (1..=10).map(|n| restart_backoff(n).as_secs()).collect();
    assert_eq!(delays, [0, 1, 2, 4, 8, 16, 32, 60, 60, 60]);
    assert_eq!(restart_backoff(u32::MAX), Duration::from_secs(60));
}

#[test]
fn only_our_squid_on_our_config_counts_as_alive() {
    let squid = Path::new("/usr/sbin/squid");
    let config = Path::new("/state/epo-a/squid.conf");
    let argv = |args: &[&str]| args.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>();
    assert!(argv_runs_config(
        &argv(&["/usr/sbin/squid", "-N", "-f", "/state/epo-a/squid.conf"]),
        squid,
        config
    ));
    // Another instance, another program, a passing `squid -k` command: not ours.
    assert!(!argv_runs_config(
        &argv(&["/usr/sbin/squid", "-N", "-f", "/state/epo-b/squid.conf"]),
        squid,
        config
    ));
    assert!(!argv_runs_config(
        &argv(&["/usr/bin/vim", "-f", "/state/epo-a/squid.conf"]),
        squid,
        config
    ));
    assert!(!argv_runs_config(
        &argv(&["/usr/sbin/squid", "-k", "parse", "-f", "/state/epo-a/squid.conf"]),
        squid,
        config
    ));
    assert!(!argv_runs_config(&[], squid, config));
    // A pid that does not exist is not alive.
    assert!(!process::is_our_squid(i32::MAX, squid, config));
}

#[test]
fn parse_problems_keep_what_is_wrong_without_timestamps() {
    let output = "2026/12/02 13:02:07| Processing: http_port 127.0.0.1:3999\n\
                  2026/12/02 13:02:07| inst/squid.conf(12): unrecognized: 'bogus_directive'\n\
                  2026/12/02 13:02:11| FATAL: Bungled inst/squid.conf line 12: bogus_directive 1\n";
    assert_eq!(
        parse_problems(output),
        "inst/squid.conf(12): unrecognized: 'bogus_directive'; FATAL: Bungled inst/squid.conf line 12: bogus_directive 1"
    );
}

/// What Squid 5.7 writes when its `http_port` is taken (recorded from a real run; the
/// `commBind` line names the cause, the `FATAL:` line only the effect).
fn port_taken_log(listen: &str) -> String {
    format!(
        "2026/12/06 10:02:20| Starting Squid Cache version 5.7 for x86_64-pc-linux-gnu...\n\
         2026/12/06 10:02:20| Service Name: epotestx\n\
         2026/12/06 10:02:20| Finished loading MIME types and icons.\n\
         2026/12/06 10:02:20| commBind Cannot bind socket FD 9 to {listen}: (98) Address already in use\n\
         2026/12/06 10:02:20| HTCP Disabled.\n\
         2026/12/06 10:02:20| Closing HTTP(S) port {listen}\n\
         2026/12/06 10:02:20| FATAL: Unable to open HTTP Socket\n\
         2026/12/06 10:02:20| Squid Cache (Version 5.7): Terminated abnormally.\n"
    )
}

/// A port taken by another process between the provider's own check and Squid's bind is
/// this Proxy's problem, as the check says of a port it finds taken (`Rejected`, the fix is
/// the Proxy owner's), not the provider's configuration; only the start that failed speaks.
#[test]
fn a_start_that_found_its_port_taken_is_a_rejected_request() {
    let listen: SocketAddr = "127.0.0.1:54039".parse().expect("addr");
    let rejected = failure_in_log(&port_taken_log("127.0.0.1:54039"), listen);
    assert!(
        matches!(&rejected, Some(ProviderError::Rejected(m)) if m.contains("127.0.0.1:54039 is already in use")),
        "{rejected:?}"
    );
    // Another listener's port (an extra `http_port` in the provider's settings) is the
    // provider's configuration.
    let other = failure_in_log(&port_taken_log("127.0.0.1:3130"), listen);
    assert!(
        matches!(&other, Some(ProviderError::Misconfigured(m)) if m.contains("FATAL: Unable to open HTTP Socket")),
        "{other:?}"
    );
    // The log is appended to across starts: an earlier start's taken port does not explain a
    // later start's other FATAL.
    let later = format!(
        "{}2026/12/06 10:05:00| Starting Squid Cache version 5.7 for x86_64-pc-linux-gnu...\n\
         2026/12/06 10:05:00| FATAL: Bungled squid.conf line 12: bogus_directive 1\n",
        port_taken_log("127.0.0.1:54039")
    );
    let later = failure_in_log(&later, listen);
    assert!(
        matches!(&later, Some(ProviderError::Misconfigured(m)) if m.contains("bogus_directive")),
        "{later:?}"
    );
    assert!(failure_in_log("2026/12/06 10:05:00| Starting Squid\n", listen).is_none());
}

/// The same with a real Squid, started on a port another socket holds (the provider's own
/// check is passed over here, as a process that takes the port just after it would).
#[tokio::test]
async fn a_real_squid_that_finds_its_port_taken_is_a_rejected_request() {
    use std::os::unix::fs::PermissionsExt;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let listen = taken.local_addr().expect("addr");
    let root = tempfile::tempdir().expect("tempdir");
    let dir = InstanceDir::at(root.path().join("epo-port-taken"));
    std::fs::create_dir_all(dir.run_dir()).expect("run dir");
    // Squid started by root drops to its own user, which must reach and write run/.
    for (path, mode) in [
        (root.path().to_owned(), 0o755),
        (dir.root().to_owned(), 0o755),
        (dir.run_dir(), 0o777),
    ] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let settings = LocalSettings::new(root.path());
    let plan = Plan {
        listen,
        outgoing: None,
        password_line: None,
    };
    let conf = squid_conf("epo-port-taken", &plan, &dir, &settings, None);
    std::fs::write(dir.config_file(), conf).expect("squid.conf");
    let mut squid = process::spawn_squid(&settings.squid_path, &dir).expect("spawn squid");
    let exited = tokio::time::timeout(Duration::from_secs(60), squid.wait()).await;
    if exited.is_err() {
        // It runs in its own session: nothing else would stop it.
        let _ = squid.start_kill();
    }
    for segment in dir.shared_memory_segments() {
        let _ = std::fs::remove_file(segment);
    }
    let status = exited.expect("squid exits on a taken port").expect("wait");
    assert!(!status.success(), "{status}");
    let failure = process::startup_failure(&dir, listen);
    assert!(
        matches!(&failure, ProviderError::Rejected(m) if m.contains("already in use")),
        "{failure:?}"
    );
    drop(taken);
}

#[test]
fn owner_records_round_trip_in_camel_case() {
    let record = OwnerRecord {
        version: 1,
        provider_instance: "local".into(),
        installation: Some(Installation::new("cluster-1", "prod")),
        owner: Owner {
            uid: "uid-1".into(),
            namespace: "crawl".into(),
            name: "web-1".into(),
        },
        spec_hash: "abc".into(),
        created_at: "2026-01-02T03:04:05Z".parse().expect("timestamp"),
        address: "127.0.0.1".into(),
        port: 3128,
        outgoing_address: None,
        authenticated: false,
    };
    let json = serde_json::to_string(&record).expect("serialise");
    assert!(json.contains(r#""specHash":"abc""#) && json.contains(r#""createdAt":"2026-01-02T03:04:05Z""#));
    assert!(
        json.contains(r#""installation":{"clusterId":"cluster-1","name":"prod"}"#),
        "{json}"
    );
    assert_eq!(serde_json::from_str::<OwnerRecord>(&json).expect("parse"), record);
    // A record written before installations were recorded reads as legacy (none).
    let legacy = OwnerRecord {
        installation: None,
        ..record
    };
    let json = serde_json::to_string(&legacy).expect("serialise");
    assert!(!json.contains("installation"), "{json}");
    assert_eq!(serde_json::from_str::<OwnerRecord>(&json).expect("parse"), legacy);
}

#[test]
fn settings_that_cannot_work_are_refused_up_front() {
    let base = LocalSettings::new("/var/lib/epo");
    let refuse = |settings: LocalSettings| LocalProvider::new("local", settings).err().map(|e| e.to_string());
    let relative = LocalProvider::new("local", LocalSettings::new("relative/dir")).expect("resolved");
    assert_eq!(
        relative.state_dir(),
        std::env::current_dir().expect("cwd").join("relative/dir"),
        "resolved against the working directory"
    );
    assert!(refuse(LocalSettings::new("/with space")).is_some_and(|e| e.contains("stateDir")));
    assert!(
        refuse(LocalSettings {
            bind_address: "localhost".into(),
            ..base.clone()
        })
        .is_some_and(|e| e.contains("bindAddress"))
    );
    assert!(
        refuse(LocalSettings {
            extra_config: vec!["ok 1".into(), "two\nlines".into()],
            ..base.clone()
        })
        .is_some_and(|e| e.contains("extraConfig[1]"))
    );
    assert!(
        refuse(LocalSettings {
            stop_timeout_seconds: 0,
            ..base.clone()
        })
        .is_some_and(|e| e.contains("stopTimeoutSeconds"))
    );
    if rustix::process::geteuid().is_root() {
        assert!(
            refuse(LocalSettings {
                squid_user: "no-such-user-here".into(),
                ..base.clone()
            })
            .is_some_and(|e| e.contains("no-such-user-here"))
        );
    }
    assert!(refuse(base).is_none());
}

#[test]
fn proc_stat_parsing_survives_odd_command_names() {
    let stat = "4242 (squid) odd) name) S 1 4242 4242 0 -1 4194560 1262 0 0 0 2 1 0 0 20 0 1 0 987654 \
                58630144 3411 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
    assert_eq!(
        process::parse_stat(stat),
        Some(process::ProcStat {
            state: 'S',
            start_ticks: 987_654
        })
    );
    assert_eq!(process::parse_stat("garbage"), None);
    // This very process: running, and not exited.
    let me = std::process::id() as i32;
    let stat = process::proc_stat(me).expect("own stat");
    assert!(!process::has_exited(me, stat.start_ticks));
    // The same pid with another start time is another process: ours has exited.
    assert!(process::has_exited(me, stat.start_ticks + 1));
    assert!(process::has_exited(i32::MAX, 0));
}

#[test]
fn each_folder_gives_its_squid_an_alphanumeric_service_name_of_its_own() {
    let name = dir().squid_service_name();
    assert_eq!(
        name,
        dir().squid_service_name(),
        "fixed by the folder: a restart keeps it"
    );
    // Squid refuses `-n` values that are not alphanumeric.
    assert!(name.chars().all(|c| c.is_ascii_alphanumeric()), "{name}");
    assert!(name.starts_with("epo") && name.len() == 19, "{name}");
    let other = InstanceDir::at(PathBuf::from("/var/lib/epo/other/epo-crawl-web-1-0a1b2c3d"));
    assert_ne!(
        name,
        other.squid_service_name(),
        "same instance name, another state folder"
    );
}
