//! The cloud-init seed's Squid files, checked with the real Squid: the generated config
//! parses (`squid -k parse`), and the password file written for the proxy credentials lets
//! Squid's basic-auth helper accept the right password and refuse a wrong one.

#[path = "support/libvirt_requests.rs"]
mod libvirt_requests;

use std::{
    io::Write,
    path::Path,
    process::{Command, Stdio},
};

use egress_proxies_operator::provider::{
    libvirt::seed::proxy_cloud_config,
    squid::{
        Prepared,
        debian::{CONF_PATH as SQUID_CONF_PATH, PASSWD_PATH as SQUID_PASSWD_PATH},
    },
};

/// The `write_files` of our cloud-config part, as (path, content).
fn written_files(request: &egress_proxies_operator::provider::InstanceRequest) -> Vec<(String, String)> {
    let prepared = Prepared::for_request(request).expect("a request Squid can carry");
    let config = proxy_cloud_config(request, &prepared);
    let value: serde_json::Value =
        serde_norway::from_str(config.strip_prefix("#cloud-config\n").expect("header")).expect("YAML");
    value["write_files"]
        .as_array()
        .expect("write_files")
        .iter()
        .map(|file| {
            (
                file["path"].as_str().expect("path").to_owned(),
                file["content"].as_str().expect("content").to_owned(),
            )
        })
        .collect()
}

fn squid_parses(conf: &Path) -> Result<(), String> {
    let output = Command::new("/usr/sbin/squid")
        .args(["-k", "parse", "-f"])
        .arg(conf)
        .output()
        .expect("run squid");
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

fn helper_says(passwd: &Path, line: &str) -> String {
    let mut child = Command::new("/usr/lib/squid/basic_ncsa_auth")
        .arg(passwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run basic_ncsa_auth");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{line}\n").as_bytes())
        .expect("write");
    let output = child.wait_with_output().expect("wait");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

#[test]
fn squid_accepts_the_config_and_the_password_file() {
    let folder = tempfile::tempdir().expect("temp");
    let mut req = libvirt_requests::request("squid");
    req.placement.outgoing_address = Some("127.0.0.1".into());
    let files = written_files(&req);
    assert_eq!(
        files.iter().map(|(path, _)| path.as_str()).collect::<Vec<_>>(),
        [SQUID_CONF_PATH, SQUID_PASSWD_PATH]
    );
    let passwd = folder.path().join("passwd");
    std::fs::write(&passwd, &files[1].1).expect("write passwd");
    let conf = folder.path().join("squid.conf");
    let text = files[0]
        .1
        .replace(SQUID_PASSWD_PATH, passwd.to_str().expect("UTF-8"));
    std::fs::write(&conf, text).expect("write conf");
    squid_parses(&conf).expect("squid parses the authenticated config");

    assert_eq!(helper_says(&passwd, "crawler not-in-logs"), "OK");
    assert!(helper_says(&passwd, "crawler wrong").starts_with("ERR"));
    assert!(helper_says(&passwd, "someone not-in-logs").starts_with("ERR"));

    req.credentials = None;
    let open = written_files(&req);
    assert_eq!(open.len(), 1, "no password file without credentials");
    std::fs::write(&conf, &open[0].1).expect("write conf");
    squid_parses(&conf).expect("squid parses the open config");
}
