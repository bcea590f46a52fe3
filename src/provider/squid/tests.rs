use std::{
    io::Write,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use sha_crypt::{PasswordHash, PasswordVerifier, ShaCrypt};

use super::*;
use crate::provider::{ProviderError, fixtures::request};

fn credentials(username: &str, password: &str) -> Credentials {
    Credentials {
        username: username.into(),
        password: password.into(),
    }
}

/// The config a VM guest or a Pod gets: Debian's paths, the distribution's defaults.
fn machine_conf(auth: bool) -> Conf<'static> {
    Conf::debian("Written by a test.", "epo-crawl-web-1-0a1b2c3d", 3128, None, auth)
}

/// The directives of `conf`, comments left out.
fn directives(conf: &str) -> Vec<&str> {
    conf.lines().filter(|l| !l.starts_with('#')).collect()
}

fn position(conf: &str, line: &str) -> usize {
    directives(conf)
        .iter()
        .position(|l| *l == line)
        .unwrap_or_else(|| panic!("missing {line:?} in\n{conf}"))
}

#[test]
fn a_machines_open_config_is_exactly_the_distribution_defaults_plus_ours() {
    let conf = machine_conf(false).render();
    assert_eq!(
        directives(&conf),
        [
            "http_port 3128",
            "visible_hostname epo-crawl-web-1-0a1b2c3d",
            "cache deny all",
            "http_access deny manager",
            "http_access allow all",
        ],
        "{conf}"
    );
    assert!(conf.starts_with("# Written by a test.\n"), "{conf}");
}

#[test]
fn a_machines_authenticated_config_asks_debians_helper_and_denies_everyone_else() {
    let mut conf = machine_conf(true);
    conf.outgoing = Some("192.0.2.9".parse().expect("ip"));
    let conf = conf.render();
    assert_eq!(
        directives(&conf),
        [
            "http_port 3128",
            "visible_hostname epo-crawl-web-1-0a1b2c3d",
            "cache deny all",
            "tcp_outgoing_address 192.0.2.9",
            "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid/passwd",
            "auth_param basic realm egress-proxy",
            "http_access deny manager",
            "acl authenticated proxy_auth REQUIRED",
            "http_access allow authenticated",
            "http_access deny all",
        ],
        "{conf}"
    );
}

#[test]
fn a_shared_hosts_config_has_its_own_files_and_options() {
    let extra = vec!["acl crawlers src 10.0.0.0/8".to_owned()];
    let conf = Conf {
        header: "Generated for a test.",
        name: "epo-a",
        listen: Listen::Address("127.0.0.1:3128".parse().expect("addr")),
        outgoing: None,
        auth: Some(Auth {
            helper: Path::new("/usr/lib/squid/basic_ncsa_auth"),
            passwords: Path::new("/state/epo-a/passwords"),
            updated_in_place: true,
        }),
        own_files: Some(OwnFiles {
            pid: Path::new("/state/epo-a/run/squid.pid"),
            cache_log: Path::new("/state/epo-a/run/cache.log"),
            access_log: Some(Path::new("/state/epo-a/run/access.log")),
            coredump_dir: Path::new("/state/epo-a/run"),
        }),
        fast_shutdown: true,
        anonymous: true,
        effective_user: Some("proxy"),
        extra: &extra,
    }
    .render();
    for expected in [
        "http_port 127.0.0.1:3128",
        "pid_filename /state/epo-a/run/squid.pid",
        "cache_log /state/epo-a/run/cache.log",
        "access_log stdio:/state/epo-a/run/access.log",
        "coredump_dir /state/epo-a/run",
        "netdb_filename none",
        "pinger_enable off",
        "logfile_rotate 0",
        "shutdown_lifetime 1 seconds",
        "forwarded_for delete",
        "via off",
        "httpd_suppress_version_string on",
        "cache_effective_user proxy",
        "auth_param basic program /usr/lib/squid/basic_ncsa_auth /state/epo-a/passwords",
        "auth_param basic children 4 startup=1 idle=1",
        "auth_param basic credentialsttl 1 minute",
    ] {
        position(&conf, expected);
    }
    // Extra directives come before the access rules, so they can add ACLs the rules use.
    let extra_at = position(&conf, "acl crawlers src 10.0.0.0/8");
    let manager = position(&conf, "http_access deny manager");
    let acl = position(&conf, "acl authenticated proxy_auth REQUIRED");
    let allow = position(&conf, "http_access allow authenticated");
    let deny = position(&conf, "http_access deny all");
    assert!(
        extra_at < manager && manager < acl && acl < allow && allow < deny,
        "{conf}"
    );
    assert_eq!(directives(&conf).last(), Some(&"http_access deny all"));
    assert!(!conf.contains("http_access allow all"), "{conf}");
}

#[test]
fn own_files_without_an_access_log_write_none_and_ipv6_is_bracketed() {
    let mut conf = machine_conf(false);
    conf.listen = Listen::Address(SocketAddr::new("::1".parse::<IpAddr>().expect("ip"), 3128));
    conf.own_files = Some(OwnFiles {
        pid: Path::new("/s/pid"),
        cache_log: Path::new("/s/cache.log"),
        access_log: None,
        coredump_dir: Path::new("/s"),
    });
    let conf = conf.render();
    position(&conf, "access_log none");
    position(&conf, "http_port [::1]:3128");
}

fn squid_parses(conf: &Path) -> Result<(), String> {
    let output = Command::new("/usr/sbin/squid")
        .args(["-k", "parse", "-f"])
        .arg(conf)
        .output()
        .expect("run squid (the squid package provides it)");
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

#[test]
fn squid_parses_every_combination_of_the_options() {
    let folder = tempfile::tempdir().expect("temp");
    let file = |name: &str| -> PathBuf { folder.path().join(name) };
    let passwords = file("passwd");
    std::fs::write(&passwords, "").expect("passwd");
    let (pid, cache_log, access_log) = (file("squid.pid"), file("cache.log"), file("access.log"));
    let extra = vec!["acl crawlers src 10.0.0.0/8".to_owned()];
    for bits in 0..32u8 {
        let on = |bit: u8| bits & (1 << bit) != 0;
        let mut conf = machine_conf(false);
        conf.auth = on(0).then_some(Auth {
            helper: Path::new(debian::AUTH_HELPER),
            passwords: &passwords,
            updated_in_place: on(1),
        });
        conf.own_files = on(2).then_some(OwnFiles {
            pid: &pid,
            cache_log: &cache_log,
            access_log: on(1).then_some(access_log.as_path()),
            coredump_dir: folder.path(),
        });
        conf.fast_shutdown = on(3);
        conf.anonymous = on(3);
        conf.outgoing = on(4).then(|| "127.0.0.1".parse().expect("ip"));
        conf.listen = if on(4) {
            Listen::Address("127.0.0.1:3128".parse().expect("addr"))
        } else {
            Listen::Port(3128)
        };
        conf.extra = if on(2) { &extra } else { &[] };
        let text = conf.render();
        let path = file("squid.conf");
        std::fs::write(&path, &text).expect("conf");
        squid_parses(&path).unwrap_or_else(|err| panic!("{err}\n{text}"));
    }
}

#[test]
fn password_lines_are_sha512_crypt_and_verify() {
    let line = password_line(&credentials("crawler", "s3cret: with spaces")).expect("valid");
    let (user, hash) = line
        .strip_suffix('\n')
        .expect("one line")
        .split_once(':')
        .expect("user:hash");
    assert_eq!(user, "crawler");
    assert!(hash.starts_with("$6$"), "{hash}");
    let hash = PasswordHash::new(hash).expect("modular crypt format");
    ShaCrypt::default()
        .verify_password(b"s3cret: with spaces", &hash)
        .expect("the password verifies");
    assert!(ShaCrypt::default().verify_password(b"wrong", &hash).is_err());
    // Salted: the same password never gives the same line twice.
    assert_ne!(
        line,
        password_line(&credentials("crawler", "s3cret: with spaces")).expect("valid")
    );
}

#[test]
fn a_password_line_accepts_only_its_own_user_and_password() {
    let line = password_line(&credentials("crawler", "s3cret: with spaces")).expect("valid");
    assert!(password_line_accepts(
        &line,
        &credentials("crawler", "s3cret: with spaces")
    ));
    assert!(!password_line_accepts(&line, &credentials("crawler", "s3cret")));
    assert!(!password_line_accepts(
        &line,
        &credentials("crawler2", "s3cret: with spaces")
    ));
    assert!(!password_line_accepts(
        "",
        &credentials("crawler", "s3cret: with spaces")
    ));
    assert!(!password_line_accepts(
        "crawler:not-a-hash\n",
        &credentials("crawler", "not-a-hash")
    ));
}

/// What `basic_ncsa_auth` answers (OK or ERR) to each `user password` line, over `file`.
fn helper_answers(file: &str, requests: &str) -> Vec<String> {
    let helper = Path::new(debian::AUTH_HELPER);
    let passwords = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(passwords.path(), file).expect("write");
    let mut child = Command::new(helper)
        .arg(passwords.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the squid package provides basic_ncsa_auth");
    // The helper reads `user password` lines (URL-escaped) and answers OK or ERR per line.
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(requests.as_bytes())
        .expect("write");
    let output = child.wait_with_output().expect("helper exits at end of input");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| l.split_whitespace().next().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn password_lines_are_accepted_by_squids_helper() {
    let line = password_line(&credentials("crawler", "pa55word-longer-than-8")).expect("valid");
    assert_eq!(
        helper_answers(
            &line,
            "crawler pa55word-longer-than-8\ncrawler wrong\nnobody pa55word-longer-than-8\n"
        ),
        ["OK", "ERR", "ERR"]
    );
}

/// Why the rule refuses a leading '#': the helper skips such a line as a comment, so the
/// user could never log in.
#[test]
fn the_helper_reads_a_line_starting_with_hash_as_a_comment() {
    let line = password_line(&credentials("crawler", "pw")).expect("valid");
    assert_eq!(
        helper_answers(&format!("#{line}"), "%23crawler pw\n#crawler pw\n"),
        ["ERR", "ERR"]
    );
}

#[test]
fn user_names_squid_can_carry_pass_the_rule() {
    for user in [
        "crawler",
        "!",
        "~",
        "a#b",
        "user@example.com",
        &"u".repeat(MAX_USER_NAME),
    ] {
        check_credentials(&credentials(user, "any password, with: spaces é")).expect(user);
    }
}

#[test]
fn credentials_squid_cannot_carry_are_refused_with_the_rule_and_never_echoed() {
    use SquidError::*;
    let long = "u".repeat(MAX_USER_NAME + 1);
    for (user, password, expected) in [
        ("", "p", EmptyUserName),
        (
            "a:b",
            "p",
            UserNameCharacter {
                position: 2,
                character: ':',
            },
        ),
        (
            "a b",
            "p",
            UserNameCharacter {
                position: 2,
                character: ' ',
            },
        ),
        (
            "crawler\n",
            "p",
            UserNameCharacter {
                position: 8,
                character: '\n',
            },
        ),
        (
            "crawlér",
            "p",
            UserNameCharacter {
                position: 6,
                character: 'é',
            },
        ),
        (long.as_str(), "p", UserNameTooLong { length: 129 }),
        ("#crawler", "p", UserNameComment),
        ("crawler", "line\nbreak-canary", PasswordControlCharacter),
        ("crawler", "canary\n", PasswordControlCharacter),
    ] {
        let err = check_credentials(&credentials(user, password)).expect_err(user);
        assert_eq!(err, expected, "{user:?}");
        assert_eq!(
            password_line(&credentials(user, password)).expect_err(user),
            expected
        );
        let message = err.to_string();
        assert!(!message.contains("canary"), "{message}");
        if !matches!(err, PasswordControlCharacter) {
            assert!(message.contains(USER_NAME_RULE), "{message}");
        }
        let provider_error = ProviderError::from(err);
        assert!(
            matches!(provider_error, ProviderError::Rejected(_)),
            "{provider_error:?}"
        );
        assert!(!provider_error.is_transient());
    }
    assert_eq!(
        UserNameCharacter {
            position: 2,
            character: ':'
        }
        .to_string(),
        format!("character 2 of the proxy user name is ':'; {USER_NAME_RULE}")
    );
}

#[test]
fn a_request_is_prepared_only_when_squid_can_carry_it() {
    let prepared = Prepared::for_request(&request(None)).expect("open proxy");
    assert_eq!(
        prepared,
        Prepared {
            outgoing: None,
            password_line: None
        }
    );
    let mut with = request(Some(credentials("crawler", "s3cret")));
    with.placement.outgoing_address = Some("2001:db8::7".into());
    let prepared = Prepared::for_request(&with).expect("valid");
    assert_eq!(prepared.outgoing, Some("2001:db8::7".parse().expect("ip")));
    assert!(
        prepared
            .password_line
            .as_deref()
            .is_some_and(|line| line.starts_with("crawler:$6$"))
    );
    assert!(!format!("{prepared:?}").contains("$6$"), "Debug hides the hash");

    let bad_user = request(Some(credentials("a:b", "s3cret")));
    assert!(matches!(
        Prepared::for_request(&bad_user),
        Err(SquidError::UserNameCharacter { .. })
    ));
    let mut bad_address = request(None);
    bad_address.placement.outgoing_address = Some("10.0.0.1\nhttp_access allow all".into());
    let err = Prepared::for_request(&bad_address).expect_err("not an address");
    assert!(matches!(err, SquidError::OutgoingAddress(_)), "{err:?}");
    assert!(matches!(ProviderError::from(err), ProviderError::Rejected(_)));
}

#[test]
fn config_tokens_have_no_spaces_quotes_or_comments() {
    assert!(is_config_token("/var/lib/epo"));
    for bad in ["", "/a b", "/a\"b", "/a#b", "/a\nb"] {
        assert!(!is_config_token(bad), "{bad:?}");
    }
}
