//! The audit trail earlier leaders left in Events, read back once when this replica starts
//! leading: the status page's in-memory trail starts empty in every process, and without this
//! a leader change would blank every Proxy's history on the page until its next transition.
//!
//! It reads only: the Events this controller published about Proxies
//! (`regarding.kind=Proxy`, `reportingController` ours), at most [`MAX_PAGES`] pages. A repeat
//! of an event (same note) within six minutes joined its first Event's series
//! ([`super::events`]), so an Event gives one row: its note at its last observed time.

use k8s_openapi::api::events::v1::Event as K8sEvent;
use kube::{Api, Client, api::ListParams};

use super::CONTROLLER_NAME;
use crate::ui::AuditRow;

/// Events per page of the list.
const PAGE: u32 = 500;
/// Pages read at most (10,000 Events): a bound on start-up work, not on correctness (the page
/// shows only the last few rows per Proxy).
const MAX_PAGES: usize = 20;

/// One row of a Proxy's trail, as an Event recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PastRow {
    pub namespace: String,
    pub name: String,
    pub row: AuditRow,
}

/// The rows of the Events this controller published about Proxies (in `namespace`, or in all).
pub async fn read(client: &Client, namespace: Option<&str>) -> Result<Vec<PastRow>, kube::Error> {
    let api: Api<K8sEvent> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let mut params = ListParams::default()
        .fields(&format!(
            "regarding.kind=Proxy,reportingController={CONTROLLER_NAME}"
        ))
        .limit(PAGE);
    let mut rows = Vec::new();
    for _ in 0..MAX_PAGES {
        let page = api.list(&params).await?;
        rows.extend(page.items.iter().filter_map(past_row));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    Ok(rows)
}

/// The row an Event of ours stands for; `None` for one that names no Proxy or no time.
fn past_row(event: &K8sEvent) -> Option<PastRow> {
    let regarding = event.regarding.as_ref()?;
    let at = event
        .series
        .as_ref()
        .map(|s| &s.last_observed_time.0)
        .or(event.event_time.as_ref().map(|t| &t.0))
        .or(event.metadata.creation_timestamp.as_ref().map(|t| &t.0))?;
    let reason = event.reason.clone().unwrap_or_default();
    let note = event.note.as_deref().unwrap_or_default();
    // The backend writes "{arrow} ({reason}): {message}".
    let (arrow, message) = note.split_once(&format!(" ({reason}): ")).unwrap_or(("", note));
    Some(PastRow {
        namespace: regarding.namespace.clone()?,
        name: regarding.name.clone()?,
        row: AuditRow {
            at: *at,
            arrow: arrow.to_owned(),
            reason,
            message: message.to_owned(),
        },
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::{core::v1::ObjectReference, events::v1::EventSeries},
        apimachinery::pkg::apis::meta::v1::MicroTime,
    };

    use super::*;

    fn event(note: &str, reason: &str, at: &str, last_observed: Option<&str>) -> K8sEvent {
        let time = |t: &str| MicroTime(t.parse().expect("a timestamp"));
        K8sEvent {
            regarding: Some(ObjectReference {
                kind: Some("Proxy".into()),
                namespace: Some("crawl".into()),
                name: Some("edge-1".into()),
                ..ObjectReference::default()
            }),
            note: Some(note.into()),
            reason: Some(reason.into()),
            event_time: Some(time(at)),
            series: last_observed.map(|t| EventSeries {
                count: 3,
                last_observed_time: time(t),
            }),
            ..K8sEvent::default()
        }
    }

    #[test]
    fn an_event_gives_its_arrow_reason_message_and_latest_time() {
        let row = past_row(&event(
            "provisioning --health_passed--> healthy (Healthy): passed 1 probe (needs 1)",
            "Healthy",
            "2026-12-03T10:00:00Z",
            Some("2026-12-03T10:04:00Z"),
        ))
        .expect("a row");
        assert_eq!((row.namespace.as_str(), row.name.as_str()), ("crawl", "edge-1"));
        assert_eq!(row.row.arrow, "provisioning --health_passed--> healthy");
        assert_eq!(row.row.reason, "Healthy");
        assert_eq!(row.row.message, "passed 1 probe (needs 1)");
        assert_eq!(
            row.row.at.to_string(),
            "2026-12-03T10:04:00Z",
            "the series' last time"
        );
    }

    #[test]
    fn a_note_of_another_shape_is_kept_whole_as_the_message() {
        let row =
            past_row(&event("written by hand", "Healthy", "2026-12-03T10:00:00Z", None)).expect("a row");
        assert_eq!(
            (row.row.arrow.as_str(), row.row.message.as_str()),
            ("", "written by hand")
        );
        assert_eq!(row.row.at.to_string(), "2026-12-03T10:00:00Z");
    }
}
