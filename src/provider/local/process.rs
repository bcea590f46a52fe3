//! Squid processes: starting one in its own session, recognising ours in `/proc`, stopping
//! them, validating a config, and checking addresses and ports before Squid tries them.

use std::{
    fs,
    io::{self, Read, Seek, SeekFrom},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
    process::Stdio,
    time::Duration,
};

use rustix::process::{Pid, Signal};

use super::state::InstanceDir;
use crate::provider::ProviderError;

/// The environment Squid and its helpers get: nothing of the operator's (which may hold
/// tokens), only a search path.
const SQUID_PATH_ENV: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// How long a `squid -k parse` may take.
const PARSE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a connection attempt to a proxy's port may take when checking it is up.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// How long to wait after SIGKILL for the process to be gone.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// How often to look again while waiting for a process to exit.
const POLL: Duration = Duration::from_millis(25);

/// The arguments of a live process, or `None` if it is gone or a zombie (a zombie's
/// `/proc/PID/cmdline` is empty).
pub(super) fn process_argv(pid: i32) -> Option<Vec<String>> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let argv: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|arg| !arg.is_empty())
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect();
    (!argv.is_empty()).then_some(argv)
}

/// Whether `argv` is a Squid serving `config` (started as `squid -N -n SERVICE -f CONFIG`), not another
/// program, another instance, or a passing `squid -k ...` command on the same config.
pub(super) fn argv_runs_config(argv: &[String], squid_path: &Path, config: &Path) -> bool {
    let Some(program) = argv.first() else {
        return false;
    };
    let same_program = Path::new(program).file_name() == squid_path.file_name();
    let config = config.to_string_lossy();
    let runs_config = argv.windows(2).any(|pair| pair[0] == "-f" && pair[1] == config);
    let is_command = argv.iter().any(|arg| arg == "-k");
    same_program && runs_config && !is_command
}

/// Whether `pid` is alive and is our Squid for `config`: a recycled pid never counts.
pub(super) fn is_our_squid(pid: i32, squid_path: &Path, config: &Path) -> bool {
    pid > 0 && process_argv(pid).is_some_and(|argv| argv_runs_config(&argv, squid_path, config))
}

/// Every live Squid serving `config`, found by scanning `/proc` (for when the pid records
/// were lost, e.g. a crash between starting Squid and writing `process.json`).
pub(super) fn find_squids(squid_path: &Path, config: &Path) -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<i32> = entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| is_our_squid(*pid, squid_path, config))
        .collect();
    pids.sort_unstable();
    pids
}

/// Reads a pid file (Squid's or ours); `None` if missing or garbled.
pub(super) fn read_pid_file(path: &Path) -> Option<i32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn send(pid: i32, signal: Signal) {
    if let Some(pid) = Pid::from_raw(pid) {
        // It may have exited since it was checked; that is what we want anyway.
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// A process as `/proc/PID/stat` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ProcStat {
    /// State letter (`R`, `S`, `Z`...).
    pub state: char,
    /// Start time in clock ticks after boot: with the pid, it names one process for good.
    pub start_ticks: u64,
}

/// `/proc/PID/stat` of `pid`, if it exists.
pub(super) fn proc_stat(pid: i32) -> Option<ProcStat> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat)
}

/// Parses `/proc/PID/stat`: `pid (comm) state ...`, where comm may hold spaces and ')'.
pub(super) fn parse_stat(stat: &str) -> Option<ProcStat> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After comm: field 3 (state) is fields[0], field 22 (starttime) is fields[19].
    Some(ProcStat {
        state: fields.first()?.chars().next()?,
        start_ticks: fields.get(19)?.parse().ok()?,
    })
}

/// Whether the process `pid` that started at `start_ticks` has finished exiting: gone, a
/// zombie, or the pid now names another process. Only then are its files closed, its
/// listening socket included (its cmdline empties earlier, while it is still exiting).
pub(super) fn has_exited(pid: i32, start_ticks: u64) -> bool {
    proc_stat(pid).is_none_or(|stat| stat.start_ticks != start_ticks || matches!(stat.state, 'Z' | 'X' | 'x'))
}

/// Waits until every process in `processes` (pid, start ticks) has exited, or `timeout`
/// passes; returns those still there.
async fn wait_exited(mut processes: Vec<(i32, u64)>, timeout: Duration) -> Vec<(i32, u64)> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        processes.retain(|(pid, ticks)| !has_exited(*pid, *ticks));
        if processes.is_empty() || tokio::time::Instant::now() >= deadline {
            return processes;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits up to `timeout` for the process `pid` started at `start_ticks` to finish exiting.
pub(super) async fn wait_for_exit(pid: i32, start_ticks: u64, timeout: Duration) -> bool {
    wait_exited(vec![(pid, start_ticks)], timeout).await.is_empty()
}

/// Stops the Squids `pids` serving `config`: SIGTERM, wait up to `grace`, then SIGKILL.
/// Returns once each has exited (its port is free again). A signal only ever reaches the
/// process that was checked to be ours (pid and start time). Fails only if a process
/// survives SIGKILL.
pub(super) async fn stop(
    pids: &[i32],
    squid_path: &Path,
    config: &Path,
    grace: Duration,
) -> Result<(), String> {
    let ours: Vec<(i32, u64)> = pids
        .iter()
        .filter(|pid| is_our_squid(**pid, squid_path, config))
        .filter_map(|pid| Some((*pid, proc_stat(*pid)?.start_ticks)))
        .collect();
    for (pid, _) in &ours {
        send(*pid, Signal::TERM);
    }
    let remaining = wait_exited(ours, grace).await;
    if remaining.is_empty() {
        return Ok(());
    }
    tracing::warn!(processes = ?remaining, "squid did not stop after SIGTERM; sending SIGKILL");
    for (pid, ticks) in &remaining {
        if !has_exited(*pid, *ticks) {
            send(*pid, Signal::KILL);
        }
    }
    let remaining = wait_exited(remaining, KILL_TIMEOUT).await;
    if remaining.is_empty() {
        Ok(())
    } else {
        Err(format!("squid processes {remaining:?} survived SIGKILL"))
    }
}

/// Squid with a minimal environment (a fixed PATH for the helpers it starts) and no stdin.
fn squid_command(squid_path: &Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(squid_path);
    command
        .env_clear()
        .env("PATH", SQUID_PATH_ENV)
        .stdin(Stdio::null());
    command
}

/// Validates `config` with `squid -k parse`. Squid reports some fatal problems (a missing
/// helper) with exit status 0, so a `FATAL:` line fails the check too.
pub(super) async fn parse_config(squid_path: &Path, config: &Path) -> Result<(), ProviderError> {
    let mut command = squid_command(squid_path);
    command
        .arg("-k")
        .arg("parse")
        .arg("-f")
        .arg(config)
        .kill_on_drop(true);
    let output = match tokio::time::timeout(PARSE_TIMEOUT, command.output()).await {
        Ok(Ok(output)) => output,
        Ok(Err(err)) => return Err(spawn_error(squid_path, &err)),
        Err(_) => {
            return Err(ProviderError::Backend(format!(
                "`squid -k parse` did not finish within {}s",
                PARSE_TIMEOUT.as_secs()
            )));
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let fatal = text.lines().any(|line| line.contains("FATAL:"));
    if output.status.success() && !fatal {
        return Ok(());
    }
    Err(ProviderError::Misconfigured(format!(
        "the generated Squid config does not parse ({}): {}",
        output.status,
        parse_problems(&text)
    )))
}

/// The lines of Squid's parse output that say what is wrong, without timestamps.
pub(super) fn parse_problems(output: &str) -> String {
    const MARKERS: [&str; 5] = ["FATAL", "ERROR", "unrecognized", "Bungled", "WARNING"];
    let mut problems: Vec<&str> = Vec::new();
    for line in output.lines() {
        let message = strip_timestamp(line).trim();
        if MARKERS.iter().any(|marker| message.contains(marker)) && !problems.contains(&message) {
            problems.push(message);
        }
    }
    if problems.is_empty() {
        problems = output
            .lines()
            .map(|line| strip_timestamp(line).trim())
            .filter(|line| !line.is_empty())
            .collect();
        let skip = problems.len().saturating_sub(3);
        problems.drain(..skip);
    }
    let mut joined = problems.join("; ");
    truncate(&mut joined, 800);
    joined
}

/// `2026/12/02 13:02:11| message` → `message`.
fn strip_timestamp(line: &str) -> &str {
    match line.split_once("| ") {
        Some((stamp, message)) if stamp.len() == 19 && stamp.starts_with(|c: char| c.is_ascii_digit()) => {
            message
        }
        _ => line,
    }
}

fn truncate(text: &mut String, max: usize) {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str(" ...");
    }
}

/// A failure to run the Squid binary, as a provider error.
pub(super) fn spawn_error(squid_path: &Path, err: &io::Error) -> ProviderError {
    match err.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::PermissionDenied => ProviderError::Misconfigured(format!(
            "cannot run squid at {}: {err} (set squidPath in the providers config)",
            squid_path.display()
        )),
        _ => ProviderError::Backend(format!("cannot run squid at {}: {err}", squid_path.display())),
    }
}

/// `squid -v`'s first line (`Squid Cache: Version 5.7`).
pub(super) async fn squid_version(squid_path: &Path) -> Result<String, ProviderError> {
    let mut command = squid_command(squid_path);
    command.arg("-v").kill_on_drop(true);
    let output = match tokio::time::timeout(PARSE_TIMEOUT, command.output()).await {
        Ok(Ok(output)) => output,
        Ok(Err(err)) => return Err(spawn_error(squid_path, &err)),
        Err(_) => return Err(ProviderError::Unavailable("`squid -v` did not answer".to_owned())),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    match stdout.lines().next() {
        Some(first) if output.status.success() && first.contains("Squid") => Ok(first.trim().to_owned()),
        _ => Err(ProviderError::Misconfigured(format!(
            "{} does not look like Squid (`-v` said {:?})",
            squid_path.display(),
            stdout.lines().next().unwrap_or_default()
        ))),
    }
}

/// Starts `squid -N -n SERVICE -f CONFIG` (its own shared-memory names, see
/// [`InstanceDir::squid_service_name`]) in its own session (so it outlives the operator and never
/// gets the operator's terminal signals), in the instance's `run/` folder, with its output
/// appended to `run/squid.out`.
pub(super) fn spawn_squid(
    squid_path: &Path,
    dir: &InstanceDir,
) -> Result<tokio::process::Child, ProviderError> {
    let output = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.output_file())
        .map_err(|err| {
            ProviderError::Backend(format!("cannot open {}: {err}", dir.output_file().display()))
        })?;
    let output_for_stderr = output
        .try_clone()
        .map_err(|err| ProviderError::Backend(format!("cannot duplicate output file: {err}")))?;
    let mut command = squid_command(squid_path);
    command
        .arg("-N")
        .arg("-n")
        .arg(dir.squid_service_name())
        .arg("-f")
        .arg(dir.config_file())
        .current_dir(dir.run_dir())
        .stdout(Stdio::from(output))
        .stderr(Stdio::from(output_for_stderr))
        .kill_on_drop(false);
    // SAFETY: the closure runs in the forked child before exec and only calls setsid(2),
    // which is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| rustix::process::setsid().map(drop).map_err(io::Error::from));
    }
    command.spawn().map_err(|err| spawn_error(squid_path, &err))
}

/// Why Squid exited while starting, from the last `FATAL:` message in its logs (with its
/// continuation lines): the provider's configuration (`Misconfigured`), unless that start
/// could not bind `listen` because it was in use. That port is this Proxy's, so it is
/// `Rejected` as [`check_listen`] says of a port it finds taken: another process took it in
/// the moment between the check and Squid's own bind. No `FATAL:` at all: `Backend`.
pub(super) fn startup_failure(dir: &InstanceDir, listen: SocketAddr) -> ProviderError {
    [dir.cache_log(), dir.output_file()]
        .iter()
        .find_map(|path| failure_in_log(&read_tail(path, 64 * 1024)?, listen))
        .unwrap_or_else(|| {
            ProviderError::Backend(format!(
                "squid exited while starting; see {}",
                dir.cache_log().display()
            ))
        })
}

fn read_tail(path: &Path, max: u64) -> Option<String> {
    let mut file = fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(max))).ok()?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// The failure the last start in `log` ended with, if it wrote a `FATAL:` line. Logs are
/// appended across starts, so only the lines of that start (from its `Starting Squid` line)
/// speak of the port.
pub(super) fn failure_in_log(log: &str, listen: SocketAddr) -> Option<ProviderError> {
    let lines: Vec<&str> = log.lines().collect();
    let fatal_at = lines.iter().rposition(|line| line.contains("FATAL:"))?;
    let start_at = lines[..fatal_at]
        .iter()
        .rposition(|line| line.contains("Starting Squid"))
        .unwrap_or(0);
    // Squid 5.7: `commBind Cannot bind socket FD 9 to 127.0.0.1:3128: (98) Address already
    // in use`, then `FATAL: Unable to open HTTP Socket`.
    let bind_to_listen = format!(" to {listen}: ");
    let port_taken = lines[start_at..fatal_at].iter().any(|line| {
        line.contains("commBind") && line.contains(&bind_to_listen) && line.contains("Address already in use")
    });
    if port_taken {
        return Some(listen_taken(listen));
    }
    let mut message = strip_timestamp(lines[fatal_at]).trim().to_owned();
    for continuation in lines[fatal_at + 1..]
        .iter()
        .take_while(|line| line.starts_with('\t'))
    {
        message.push(' ');
        message.push_str(continuation.trim());
    }
    truncate(&mut message, 800);
    Some(ProviderError::Misconfigured(format!(
        "squid exited while starting: {message}"
    )))
}

/// `listen` is in use by another process: the Proxy asked for it, so the fix is the Proxy's.
fn listen_taken(listen: SocketAddr) -> ProviderError {
    ProviderError::Rejected(format!(
        "{listen} is already in use by another process: choose another port or address"
    ))
}

/// Checks that Squid will be able to listen on `addr`, to fail with a clear message before
/// anything is started.
pub(super) fn check_listen(addr: SocketAddr) -> Result<(), ProviderError> {
    match std::net::TcpListener::bind(addr) {
        Ok(_) => Ok(()),
        Err(err) => Err(match err.kind() {
            // The Proxy asked for this port or address: its problem, not the provider's.
            io::ErrorKind::AddrInUse => listen_taken(addr),
            io::ErrorKind::AddrNotAvailable => ProviderError::Rejected(format!(
                "cannot listen on {addr}: {} is not an address of this host",
                addr.ip()
            )),
            io::ErrorKind::PermissionDenied => ProviderError::Misconfigured(format!(
                "not allowed to listen on {addr} (ports below 1024 need privileges)"
            )),
            _ => ProviderError::Backend(format!("cannot check {addr}: {err}")),
        }),
    }
}

/// Checks that `ip` is an address of this host, so Squid can use it as a source address.
pub(super) fn check_outgoing(ip: IpAddr) -> Result<(), ProviderError> {
    match std::net::UdpSocket::bind(SocketAddr::new(ip, 0)) {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::AddrNotAvailable => Err(ProviderError::Rejected(format!(
            "placement.outgoingAddress {ip} is not an address of this host"
        ))),
        Err(err) => Err(ProviderError::Backend(format!(
            "cannot check outgoing address {ip}: {err}"
        ))),
    }
}

/// The address to connect to for a proxy listening on `listen` (a wildcard listener is
/// reached on loopback).
pub(super) fn connect_address(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port()),
        _ => listen,
    }
}

/// Whether something accepts TCP connections on `listen`.
pub(super) async fn accepts_connections(listen: SocketAddr) -> bool {
    matches!(
        tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect(connect_address(listen))
        )
        .await,
        Ok(Ok(_))
    )
}
