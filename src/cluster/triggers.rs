//! What wakes the controller besides Proxy watch events, read from the controller's own
//! reflector cache: a provider whose availability flipped names its Proxies without a LIST
//! against the API server.

use futures::{Stream, StreamExt, stream};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc;

use crate::{api::Proxy, effects::ProxyKey};

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
    ObjectRef::new(&key.name).within(&key.namespace)
}
