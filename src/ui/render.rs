//! HTML of the status page, built as a string: every value goes through [`esc`].

use std::fmt::Write as _;

use jiff::Timestamp;

use super::{PageQuery, ProxyRow, StatusView};
use crate::{health::Verdict, lease::Availability};

use crate::markup::escape as esc;

const STYLE: &str = "
body{font:14px/1.4 'DejaVu Sans',system-ui,sans-serif;margin:1.5em;color:#1d2330;background:#f6f7f9}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.6em 0 .5em}
.meta{color:#5b6475;margin-bottom:1em}
table{border-collapse:collapse;background:#fff;width:100%;box-shadow:0 1px 2px #0002}
th,td{text-align:left;padding:.35em .6em;border-bottom:1px solid #e3e6eb;vertical-align:top}
th{background:#eceff3;font-weight:600}
code{font:13px 'DejaVu Sans Mono',monospace}
.badge{display:inline-block;padding:0 .5em;border-radius:.7em;font-size:.9em;font-weight:600;background:#e3e6eb}
.healthy,.up,.passing,.available{background:#d3f2dc;color:#13612e}
.degraded,.down,.failing,.closed{background:#fbd9d6;color:#8c1d13}
.provisioning,.replacing,.pending,.busy,.cooling-down,.draining,.unknown{background:#fdf0c8;color:#6b5200}
.deleting{background:#e0dcf5;color:#3d2c8d}
.muted{color:#5b6475}.err{color:#8c1d13}.nowrap,.endpoint{white-space:nowrap}
.summary span{margin-right:1.2em}
details{margin:.3em 0}summary{cursor:pointer}
.audit td{font-size:.92em}
.history{margin-top:.2em;font-size:.85em;color:#5b6475}.history .badge{font-weight:400}
.banned{background:#fbd9d6;color:#8c1d13}.restarted{color:#8c1d13}
.attributes{margin-top:.2em}.attr{display:inline-block;font:12px 'DejaVu Sans Mono',monospace;background:#e8ecf6;color:#2b3a67;border-radius:.3em;padding:0 .35em;margin:.1em 0}
ul.bans,ul.holders{list-style:none;margin:.3em 0 0;padding:0;font-size:.9em}
.process{font-size:.88em;margin-top:.2em}
.filters{margin:.2em 0 .5em}.filters input{width:16em}.pages{margin:.3em 0 .6em;color:#5b6475}
a{color:#1f4fa8}
";

/// How long ago `since` was, as `kubectl` shows an age: in its largest unit (`42s`, `10m`,
/// `3h`, `5d`). The page and standalone mode's `status` table read alike.
pub fn age(now: Timestamp, since: Timestamp) -> String {
    let secs = now.duration_since(since).as_secs().max(0);
    match secs {
        0..=119 => format!("{secs}s"),
        120..=7199 => format!("{}m", secs / 60),
        7200..=172_799 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86_400),
    }
}

/// A proxy's phase with a requested deletion beside it, until the phase says it itself
/// (`healthy (deleting)`, then `deleting`). The page and `status` read alike.
pub fn phase_label(phase: &str, deleting: bool) -> String {
    if deleting && phase != "deleting" {
        format!("{phase} (deleting)")
    } else {
        phase.to_owned()
    }
}

/// A timestamp as the page shows one (UTC, to the second).
fn clock(at: Timestamp) -> String {
    at.strftime("%H:%M:%S").to_string()
}

/// How long until `until`, in an age's units (`0s` once past).
fn left(now: Timestamp, until: Timestamp) -> String {
    age(until, now.min(until))
}

/// The whole page.
pub fn page(view: &StatusView) -> String {
    let mut html = String::with_capacity(16 * 1024 + view.proxies.len() * 2048);
    html.push_str("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">");
    // Reloads the same URL, query string included: the page keeps its filters and page.
    if view.query.refresh > 0 {
        let _ = write!(
            html,
            "<meta http-equiv=\"refresh\" content=\"{}\">",
            view.query.refresh
        );
    }
    let refresh = if view.query.refresh > 0 {
        format!(
            "reloads every {} s (<a href=\"{}\">stop</a>)",
            view.query.refresh,
            esc(&PageQuery {
                refresh: 0,
                ..view.query.clone()
            }
            .with_page(view.query.page))
        )
    } else {
        format!(
            "not reloading (<a href=\"{}\">reload every {} s</a>)",
            esc(&PageQuery {
                refresh: PageQuery::DEFAULT_REFRESH,
                ..view.query.clone()
            }
            .with_page(view.query.page)),
            PageQuery::DEFAULT_REFRESH
        )
    };
    let _ = write!(
        html,
        "<title>egress-proxies-operator status</title><style>{STYLE}</style></head><body>\
         <h1>egress-proxies-operator</h1>\
         <div class=\"meta\">{} mode · taken <span id=\"taken\">{}</span> · <span id=\"refresh\">{refresh}</span></div>",
        esc(view.mode),
        esc(&view.now.strftime("%Y-%m-%d %H:%M:%S UTC").to_string()),
    );
    summary(&mut html, view);
    providers(&mut html, view);
    super::usage::section(&mut html, &view.usage);
    proxies(&mut html, view);
    audit(&mut html, view);
    html.push_str("</body></html>\n");
    html
}

fn summary(html: &mut String, view: &StatusView) {
    html.push_str("<div class=\"summary\" id=\"summary\">");
    let _ = write!(
        html,
        "<span><a href=\"{}\"><b>{}</b> proxies</a></span>",
        esc(&PageQuery {
            phase: None,
            q: None,
            ..view.query.clone()
        }
        .with_page(1)),
        view.total
    );
    for (phase, n) in &view.phases {
        let _ = write!(
            html,
            "<span><a href=\"{}\"><b>{n}</b> {}</a></span>",
            esc(&PageQuery {
                phase: Some(phase.clone()),
                ..view.query.clone()
            }
            .with_page(1)),
            esc(phase)
        );
    }
    let _ = write!(
        html,
        "<span><b id=\"active-leases\">{}</b> active leases</span></div>",
        view.active_leases
    );
}

fn providers(html: &mut String, view: &StatusView) {
    html.push_str(
        "<h2>Providers</h2><table id=\"providers\"><thead><tr><th>provider</th><th>health</th>\
         <th>proxies</th><th>last probe</th></tr></thead><tbody>",
    );
    for p in &view.providers {
        let (class, word) = match p.down_reason {
            Some(_) => ("down", "unavailable"),
            None => ("up", "available"),
        };
        let _ = write!(
            html,
            "<tr data-provider=\"{name}\"><td><code>{name}</code></td><td><span class=\"badge {class}\">{word}</span></td>\
             <td>{}</td><td class=\"{}\">{}</td></tr>",
            p.proxies,
            if p.down_reason.is_some() { "err" } else { "muted" },
            esc(p.down_reason.as_deref().unwrap_or("answered (or not probed yet)")),
            name = esc(&p.name),
        );
    }
    if view.providers.is_empty() {
        html.push_str("<tr><td colspan=\"4\" class=\"muted\">no provider configured</td></tr>");
    }
    html.push_str("</tbody></table>");
}

/// The filter form and the page links (plain GET: no script).
fn navigation(html: &mut String, view: &StatusView) {
    let q = &view.query;
    html.push_str("<form class=\"filters\" method=\"get\" action=\"\"><label>phase <select name=\"phase\"><option value=\"\">any</option>");
    let mut phases: Vec<&str> = view.phases.keys().map(String::as_str).collect();
    if let Some(phase) = q.phase.as_deref()
        && !phases.contains(&phase)
    {
        phases.push(phase);
    }
    for phase in phases {
        let _ = write!(
            html,
            "<option{}>{}</option>",
            if q.phase.as_deref() == Some(phase) {
                " selected"
            } else {
                ""
            },
            esc(phase)
        );
    }
    let _ = write!(
        html,
        "</select></label> <label>text <input name=\"q\" value=\"{}\" placeholder=\"name, endpoint, key=value\"></label>",
        esc(q.q.as_deref().unwrap_or(""))
    );
    if q.limit != PageQuery::DEFAULT_LIMIT {
        let _ = write!(
            html,
            "<input type=\"hidden\" name=\"limit\" value=\"{}\">",
            q.limit
        );
    }
    if q.refresh != PageQuery::DEFAULT_REFRESH {
        let _ = write!(
            html,
            "<input type=\"hidden\" name=\"refresh\" value=\"{}\">",
            q.refresh
        );
    }
    html.push_str(" <button>filter</button></form>");
    let pages = view.matched.div_ceil(q.limit).max(1);
    let first = (q.page - 1) * q.limit;
    let _ = write!(
        html,
        "<div class=\"pages\" id=\"pages\">proxies {}–{} of <b id=\"matched\">{}</b>{} · page {} of {}",
        if view.proxies.is_empty() { 0 } else { first + 1 },
        first + view.proxies.len(),
        view.matched,
        if view.matched == view.total {
            String::new()
        } else {
            format!(" matching (of {})", view.total)
        },
        q.page,
        pages
    );
    for (label, page, rel) in [
        ("first", 1, "first"),
        ("previous", q.page.saturating_sub(1), "prev"),
        ("next", q.page + 1, "next"),
        ("last", pages, "last"),
    ] {
        if (1..=pages).contains(&page) && page != q.page {
            let _ = write!(
                html,
                " · <a rel=\"{rel}\" href=\"{}\">{label}</a>",
                esc(&q.with_page(page))
            );
        }
    }
    html.push_str("</div>");
}

fn proxies(html: &mut String, view: &StatusView) {
    html.push_str("<h2>Proxies</h2>");
    navigation(html, view);
    html.push_str(
        "<table id=\"proxies\"><thead><tr><th>proxy</th><th>phase</th><th>provider</th>\
         <th>endpoint</th><th>leases</th><th>health</th><th>ready</th><th>traffic</th><th>age</th></tr></thead><tbody>",
    );
    for row in &view.proxies {
        let s = &row.state;
        let phase_class = if s.deleting { "deleting" } else { s.phase.as_str() };
        let phase_text = phase_label(&s.phase, s.deleting);
        let _ = write!(
            html,
            "<tr class=\"proxy\" data-proxy=\"{ns}/{name}\" data-phase=\"{phase}\">\
             <td class=\"nowrap\"><span class=\"muted\">{ns}/</span><b>{name}</b>",
            ns = esc(&s.namespace),
            name = esc(&s.name),
            phase = esc(&s.phase),
        );
        wrapped(
            html,
            ("<div class=\"attributes\">", "</div>"),
            &row.attributes,
            |html, (key, value)| {
                let _ = write!(
                    html,
                    "<span class=\"attr\" data-attr=\"{k}\">{k}={v}</span> ",
                    k = esc(key),
                    v = esc(value)
                );
            },
        );
        let _ = write!(
            html,
            "</td><td><span class=\"badge {phase_class}\">{phase_text}</span></td>\
             <td><code>{provider}</code>",
            phase_class = esc(phase_class),
            phase_text = esc(&phase_text),
            provider = esc(&s.provider),
        );
        process(html, row, view.now);
        let _ = write!(
            html,
            "</td><td><code class=\"endpoint\">{}</code></td>",
            esc(s.endpoint.as_deref().unwrap_or("-"))
        );
        leases(html, row, view.now);
        health(html, row, view.now);
        match &s.ready {
            Some((reason, message)) => {
                let _ = write!(
                    html,
                    "<td><b>{}</b><br><span class=\"muted\">{}</span></td>",
                    esc(reason),
                    esc(message)
                );
            }
            None => html.push_str("<td class=\"muted\">-</td>"),
        }
        match &row.traffic {
            Some(t) => {
                let _ = write!(
                    html,
                    "<td class=\"traffic\">{}<br>{}, {}",
                    counted(t.requests, "request"),
                    counted(t.errors, "error"),
                    counted(t.bans, "ban")
                );
                if let Some(q) = t.latency {
                    let _ = write!(
                        html,
                        "<br><span class=\"muted\">p50 {} ms, p95 {} ms</span>",
                        q.p50, q.p95
                    );
                }
                if let Some((domain, requests)) = &t.top_domain {
                    let _ = write!(
                        html,
                        "<br><span class=\"muted\">{}; most: {} ({requests})</span>",
                        counted(t.domains as u64, "domain"),
                        esc(domain)
                    );
                }
                html.push_str("</td>");
            }
            None => html.push_str("<td class=\"traffic muted\">not measured</td>"),
        }
        let _ = write!(
            html,
            "<td>{}</td></tr>",
            esc(&s.created.map_or_else(|| "-".to_owned(), |c| age(view.now, c)))
        );
    }
    if view.proxies.is_empty() {
        html.push_str("<tr><td colspan=\"9\" class=\"muted\">no proxies</td></tr>");
    }
    html.push_str("</tbody></table>");
}

/// The local process behind a proxy: how often supervision restarted it.
fn process(html: &mut String, row: &ProxyRow, now: Timestamp) {
    let Some(p) = &row.process else { return };
    let class = if p.restarts > 0 { "restarted" } else { "muted" };
    let _ = write!(
        html,
        "<div class=\"process {class}\">process restarts: <b class=\"restarts\">{}</b>",
        p.restarts
    );
    if let Some(at) = p.last_restart {
        let _ = write!(html, ", last {} ({} ago)", esc(&clock(at)), esc(&age(now, at)));
    }
    if let Some(error) = &p.last_error {
        let _ = write!(html, "<br><span class=\"err\">{}</span>", esc(error));
    }
    html.push_str("</div>");
}

fn leases(html: &mut String, row: &ProxyRow, now: Timestamp) {
    let Some(l) = &row.leases else {
        html.push_str("<td class=\"muted\">not in rotation</td>");
        return;
    };
    let (class, word) = match l.availability {
        Availability::Available => ("available", "available"),
        Availability::Busy => ("busy", "all slots taken"),
        Availability::CoolingDown => ("cooling-down", "cooling down"),
        Availability::Banned => ("banned", "banned for the domain"),
        Availability::Closed => ("closed", "closed"),
        Availability::Draining => ("draining", "draining"),
    };
    let _ = write!(
        html,
        "<td><span class=\"leases\"><b>{}</b> / {}</span> slots <span class=\"badge {class}\">{word}</span>",
        l.active, l.max_concurrent
    );
    if let Some(until) = l.cooldown_until {
        let _ = write!(
            html,
            "<div class=\"muted\">cooling down until {} ({} left)</div>",
            esc(&clock(until)),
            esc(&left(now, until))
        );
    }
    wrapped(
        html,
        ("<ul class=\"bans\">", "</ul>"),
        &l.bans,
        |html, (domain, until)| {
            let _ = write!(
                html,
                "<li class=\"ban\" data-domain=\"{d}\"><span class=\"badge banned\">banned</span> for <b>{d}</b> until {} ({} left)</li>",
                esc(&clock(*until)),
                esc(&left(now, *until)),
                d = esc(domain),
            );
        },
    );
    wrapped(
        html,
        ("<ul class=\"holders\">", "</ul>"),
        &l.holders,
        |html, h| {
            let id = h
                .id_tail
                .as_deref()
                .map_or_else(|| "(ID not kept)".to_owned(), |tail| format!("…{tail}"));
            let _ = write!(
                html,
                "<li class=\"holder\"><b>{}</b> <code class=\"lease-id\">{}</code>",
                esc(&h.holder),
                esc(&id)
            );
            if let Some(domain) = &h.target_domain {
                let _ = write!(html, " for {}", esc(domain));
            }
            let _ = write!(
                html,
                " <span class=\"muted\">since {}, ends in {}</span></li>",
                esc(&age(now, h.acquired)),
                esc(&left(now, h.expires))
            );
        },
    );
    html.push_str("</td>");
}

/// `items` rendered by `item` between `open` and `close`; nothing at all when there are none.
fn wrapped<'a, T: 'a>(
    html: &mut String,
    (open, close): (&str, &str),
    items: impl IntoIterator<Item = &'a T>,
    mut item: impl FnMut(&mut String, &'a T),
) {
    let mut items = items.into_iter().peekable();
    if items.peek().is_none() {
        return;
    }
    html.push_str(open);
    for each in items {
        item(html, each);
    }
    html.push_str(close);
}

fn health(html: &mut String, row: &ProxyRow, now: Timestamp) {
    let Some(h) = &row.health else {
        html.push_str("<td class=\"muted\">not probed</td>");
        return;
    };
    let (class, word) = verdict(h.verdict);
    let _ = write!(html, "<td><span class=\"badge {class}\">{word}</span>");
    if let Some(since) = h.verdict_since {
        let _ = write!(html, " for {}", esc(&age(now, since)));
    }
    if h.recovered {
        html.push_str(" (recovered)");
    }
    let _ = write!(
        html,
        "<br><span class=\"muted\">probes: {}; streak: {} passed, {} failed",
        h.probes, h.consecutive_successes, h.consecutive_failures
    );
    if let Some(latency) = h.last_latency {
        let _ = write!(html, "; last {} ms", latency.as_millis());
    }
    if let Some(at) = h.last_probe_at {
        let _ = write!(html, "; {} ago", esc(&age(now, at)));
    }
    html.push_str("</span>");
    if let Some(error) = &h.last_error {
        let _ = write!(html, "<br><span class=\"err\">{}</span>", esc(error));
    }
    if !row.health_history.is_empty() {
        html.push_str("<div class=\"history\">changes:");
        for change in &row.health_history {
            let (class, word) = verdict(change.verdict);
            let title = change.error.as_deref().unwrap_or(word);
            let _ = write!(
                html,
                " <span class=\"badge {class}\" title=\"{}\">{} {word}</span>",
                esc(title),
                esc(&change.at.strftime("%H:%M:%S").to_string()),
            );
        }
        html.push_str("</div>");
    }
    html.push_str("</td>");
}

fn verdict(verdict: Verdict) -> (&'static str, &'static str) {
    match verdict {
        Verdict::Passing => ("passing", "passing"),
        Verdict::Failing => ("failing", "failing"),
        Verdict::Unknown => ("unknown", "unknown"),
    }
}

fn audit(html: &mut String, view: &StatusView) {
    let _ = write!(
        html,
        "<h2>Recent lifecycle (last {} transitions per proxy on this page)</h2>",
        super::AUDIT_ENTRIES_SHOWN
    );
    for row in &view.proxies {
        let s = &row.state;
        let _ = write!(
            html,
            "<details open class=\"audit\" data-proxy=\"{ns}/{name}\"><summary><b>{ns}/{name}</b> \
             <span class=\"muted\">({} entries)</span></summary>",
            row.audit.len(),
            ns = esc(&s.namespace),
            name = esc(&s.name),
        );
        if row.audit.is_empty() {
            html.push_str("<p class=\"muted\">no transition yet</p></details>");
            continue;
        }
        html.push_str(
            "<table><thead><tr><th>at</th><th>transition</th><th>reason</th><th>cause</th></tr></thead><tbody>",
        );
        for entry in row.audit.iter().rev() {
            let _ = write!(
                html,
                "<tr><td>{}</td><td><code>{}</code></td><td class=\"reason\">{}</td><td>{}</td></tr>",
                esc(&entry.at.strftime("%H:%M:%S").to_string()),
                esc(&entry.arrow),
                esc(&entry.reason),
                esc(&entry.message),
            );
        }
        html.push_str("</tbody></table></details>");
    }
}

/// `n` and `noun`, plural unless `n` is 1.
fn counted(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}
