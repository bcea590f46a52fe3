//! Cluster mode's periodic resync: one sweep over the cached Proxies, spread evenly over the
//! resync period, instead of a timer per Proxy. A Proxy that waits for nothing but the resync
//! ([`crate::controller::plan::Wake::resync_only`]) gets no scheduler entry of its own: at
//! 10,000 healthy Proxies those entries held about 8 MB of the operator's memory.

use std::{sync::Arc, time::Duration};

use futures::Stream;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::time::{Interval, MissedTickBehavior};

use crate::api::Proxy;

/// How often the sweep hands out its next slice.
pub const TICK: Duration = Duration::from_secs(1);

struct Sweep {
    store: Store<Proxy>,
    ticks_per_round: usize,
    round: std::vec::IntoIter<Arc<Proxy>>,
    per_tick: usize,
    left_this_tick: usize,
    tick: Interval,
}

/// Every cached Proxy once per `period`, a slice every `tick` ([`TICK`]), starting one period
/// after the start (the initial list reconciles everything once already).
pub fn sweep(
    store: Store<Proxy>,
    period: Duration,
    tick: Duration,
) -> impl Stream<Item = ObjectRef<Proxy>> + Send {
    let ticks_per_round = usize::try_from(period.as_nanos() / tick.as_nanos().max(1))
        .unwrap_or(usize::MAX)
        .max(1);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, tick);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let state = Sweep {
        store,
        ticks_per_round,
        round: Vec::new().into_iter(),
        per_tick: 0,
        left_this_tick: 0,
        tick,
    };
    futures::stream::unfold(state, |mut sweep| async move {
        loop {
            if sweep.left_this_tick == 0 {
                sweep.tick.tick().await;
                if sweep.round.len() == 0 {
                    let round = sweep.store.state();
                    sweep.per_tick = round.len().div_ceil(sweep.ticks_per_round);
                    sweep.round = round.into_iter();
                }
                sweep.left_this_tick = sweep.per_tick;
                continue;
            }
            sweep.left_this_tick -= 1;
            if let Some(proxy) = sweep.round.next() {
                return Some((ObjectRef::from_obj(&*proxy), sweep));
            }
            sweep.left_this_tick = 0;
        }
    })
}

#[cfg(test)]
mod tests {

    use futures::StreamExt;
    use kube::runtime::watcher;

    use super::*;

    fn proxy(name: &str) -> Proxy {
        let mut proxy = Proxy::new(
            name,
            serde_json::from_value(serde_json::json!({"provider": "p"})).unwrap(),
        );
        proxy.metadata.namespace = Some("ns".to_owned());
        proxy
    }

    #[tokio::test]
    async fn every_cached_proxy_is_visited_once_per_period_in_slices() {
        let (store, mut writer) = kube::runtime::reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        for i in 0..25 {
            writer.apply_watcher_event(&watcher::Event::InitApply(proxy(&format!("p{i}"))));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let (period, tick) = (Duration::from_millis(200), Duration::from_millis(20));
        let start = tokio::time::Instant::now();
        let visits: Vec<(Duration, String)> = sweep(store, period, tick)
            .take(50)
            .map(|r| (start.elapsed(), r.name))
            .collect()
            .await;
        assert!(
            visits.iter().all(|(at, _)| *at >= period),
            "none before one period: {visits:?}"
        );
        for round in visits.chunks(25) {
            let mut names: Vec<&str> = round.iter().map(|(_, n)| n.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), 25, "each Proxy once per round");
            // 25 over 10 ticks: 3 per tick, so a round spans 8 ticks (less the lateness of its
            // first tick): never a burst.
            let span = round[24].0 - round[0].0;
            assert!(span >= tick * 7, "a round is spread over the period: {span:?}");
        }
    }
}
