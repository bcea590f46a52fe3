//! What wakes the controller besides Proxy watch events, read from the controller's own
//! reflector cache: a provider whose availability flipped names its Proxies without a LIST
//! against the API server. Must not touch: the API server (reads the cache only).

use futures::{Stream, StreamExt, stream};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc;

use crate::{api::Proxy, api::ProxyKey};

/// The cached Proxies placed on `provider`.
pub fn proxies_on(proxies: &Store<Proxy>, provider: &str) -> Vec<ObjectRef<Proxy>> {
    proxies
        .state()
        .iter()
        .filter(|p| p.spec.provider == provider)
        .map(|p| ObjectRef::from_obj(&**p))
        .collect()
}

/// Every cached Proxy on each provider named on `flips` (e.g. by
/// [`crate::monitor::Monitor::on_change`]), as it arrives.
pub fn provider_flips(
    proxies: Store<Proxy>,
    flips: mpsc::UnboundedReceiver<String>,
) -> impl Stream<Item = ObjectRef<Proxy>> + Send + 'static {
    stream::unfold(flips, |mut rx| async move { rx.recv().await.map(|p| (p, rx)) })
        .flat_map(move |provider| stream::iter(proxies_on(&proxies, &provider)))
}

/// The controller's reference for a Proxy named by its key.
pub fn object_ref(key: &ProxyKey) -> ObjectRef<Proxy> {
    ObjectRef::new(key.name()).within(key.namespace())
}

#[cfg(test)]
mod tests {
    use kube::runtime::{reflector, watcher};

    use super::*;

    fn proxy(name: &str, provider: &str) -> Proxy {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "crawl.example.com/v1alpha1", "kind": "Proxy",
            "metadata": {"name": name, "namespace": "crawl"},
            "spec": {"provider": provider},
        }))
        .expect("a valid Proxy")
    }

    fn cache(proxies: &[(&str, &str)]) -> Store<Proxy> {
        let (store, mut writer) = reflector::store();
        for (name, provider) in proxies {
            writer.apply_watcher_event(&watcher::Event::Apply(proxy(name, provider)));
        }
        store
    }

    #[test]
    fn a_provider_names_the_cached_proxies_placed_on_it() {
        let store = cache(&[("a", "kvm"), ("b", "local"), ("c", "kvm")]);
        let mut names: Vec<String> = proxies_on(&store, "kvm").into_iter().map(|r| r.name).collect();
        names.sort();
        assert_eq!(names, ["a", "c"]);
        assert!(proxies_on(&store, "kvm2").is_empty(), "no Proxy on it");
    }

    #[tokio::test]
    async fn each_flip_yields_its_providers_proxies_and_the_stream_ends_with_the_channel() {
        let store = cache(&[("a", "kvm"), ("b", "local")]);
        let (flips, rx) = mpsc::unbounded_channel();
        flips.send("local".to_owned()).expect("open");
        flips.send("kvm".to_owned()).expect("open");
        drop(flips);
        let refs: Vec<ObjectRef<Proxy>> = provider_flips(store, rx).collect().await;
        assert_eq!(
            refs,
            [
                object_ref(&ProxyKey::new("crawl", "b")),
                object_ref(&ProxyKey::new("crawl", "a")),
            ]
        );
    }
}
