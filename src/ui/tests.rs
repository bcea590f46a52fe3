use hyper::HeaderMap;

use super::{render::esc, *};

#[test]
fn every_html_special_character_is_escaped() {
    assert_eq!(
        esc(r#"<script>alert("x&'y")</script>"#),
        "&lt;script&gt;alert(&quot;x&amp;&#39;y&quot;)&lt;/script&gt;"
    );
}

#[test]
fn a_token_comes_from_bearer_or_the_basic_password() {
    let with = |value: &str| {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(value).expect("header"),
        );
        presented_token(&headers)
    };
    assert_eq!(with("Bearer abc").as_deref(), Some("abc"));
    // "ui:tok:en" — the password may hold a colon; the user name is ignored.
    assert_eq!(with("Basic dWk6dG9rOmVu").as_deref(), Some("tok:en"));
    assert_eq!(with("Basic !!!"), None);
    assert_eq!(with("Digest x"), None);
    assert_eq!(presented_token(&HeaderMap::new()), None);
}

#[test]
fn the_audit_log_keeps_the_last_entries_per_proxy() {
    let log = AuditLog::default();
    let entry = |reason: &str| AuditEntry {
        at: Timestamp::UNIX_EPOCH,
        from: crate::machine::table::Phase::Healthy,
        event: crate::machine::table::Event::HealthFailed,
        to: crate::machine::table::Phase::Degraded,
        guard: Vec::new(),
        effects: Vec::new(),
        reason: reason.to_owned(),
        note: String::new(),
        cause: Some(format!("cause of {reason}")),
    };
    let entries: Vec<_> = (0..AUDIT_ENTRIES_SHOWN + 3)
        .map(|i| entry(&format!("R{i}")))
        .collect();
    log.record("crawl", "web-1", &entries);
    log.record("crawl", "web-2", &entries[..1]);
    let last = log.last("crawl", "web-1", 2);
    let reasons: Vec<_> = last.iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(
        reasons,
        [
            format!("R{}", AUDIT_ENTRIES_SHOWN + 1),
            format!("R{}", AUDIT_ENTRIES_SHOWN + 2)
        ]
    );
    assert_eq!(last[0].message, format!("cause of R{}", AUDIT_ENTRIES_SHOWN + 1));
    assert_eq!(log.last("crawl", "web-1", 100).len(), AUDIT_ENTRIES_SHOWN);
    log.forget("crawl", "web-1");
    assert!(log.last("crawl", "web-1", 100).is_empty());
    assert_eq!(log.last("crawl", "web-2", 100).len(), 1);
}
