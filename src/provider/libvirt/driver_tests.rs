//! The driver's own promises, over an access path whose calls the test controls: what the
//! real backends cannot be made to do on cue (block in the middle of an operation).

use std::{
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

use super::{Access, LibvirtProvider, NewVolume, Session, Stamped};
use crate::{
    config::{BootSettings, KvmSettings, NetworkSettings},
    provider::{
        InstanceState, Provider, ProviderError,
        libvirt::{KVM2_NAMESPACE, Kind, Lookup, tests::settings},
    },
};

/// What the fake backend saw, and the gate its first lookup waits at.
#[derive(Default)]
struct Backend {
    events: Mutex<Vec<String>>,
    open: Mutex<bool>,
    opened: Condvar,
}

impl Backend {
    fn event(&self, event: String) {
        self.events.lock().expect("events").push(event);
    }

    fn events(&self) -> Vec<String> {
        self.events.lock().expect("events").clone()
    }

    fn release(&self) {
        *self.open.lock().expect("gate") = true;
        self.opened.notify_all();
    }

    fn wait(&self) {
        let open = self.open.lock().expect("gate");
        drop(self.opened.wait_while(open, |open| !*open).expect("gate"));
    }
}

/// Opens the gate when dropped, so a failing test does not leave a thread blocked at it (the
/// runtime would wait for that thread forever).
struct ReleaseOnDrop(Arc<Backend>);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        self.0.release();
    }
}

struct Fake(Arc<Backend>);

impl Access for Fake {
    const KIND: Kind = Kind::new("fake", KVM2_NAMESPACE);
    type Session = Arc<Backend>;

    fn open(&self, _settings: &KvmSettings) -> Result<Arc<Backend>, ProviderError> {
        Ok(Arc::clone(&self.0))
    }

    fn operation_timeout(&self, _settings: &KvmSettings) -> Option<Duration> {
        Some(Duration::from_millis(100))
    }
}

/// No domain, no pool: a lookup of `epo-a` waits at the gate; every lookup finds nothing.
impl Session for Arc<Backend> {
    type Domain = ();
    type Pool = ();

    fn lookup(&self, name: &str) -> Result<Lookup<()>, ProviderError> {
        self.event(format!("lookup {name}"));
        if name == "epo-a" {
            self.wait();
        }
        self.event(format!("looked up {name}"));
        Ok(Lookup::Missing)
    }
    fn vanished(&self, _name: &str) -> Result<bool, ProviderError> {
        Ok(true)
    }
    fn stamped(&self) -> Result<Vec<Stamped<()>>, ProviderError> {
        Ok(Vec::new())
    }
    fn state(&self, (): &(), _name: &str) -> Result<InstanceState, ProviderError> {
        Ok(InstanceState::Stopped)
    }
    fn is_active(&self, (): &(), _name: &str) -> Result<bool, ProviderError> {
        Ok(false)
    }
    fn discover_address(&self, (): &(), _name: &str) -> Option<String> {
        None
    }
    fn pool(&self, _name: &str) -> Result<Option<((), bool)>, ProviderError> {
        Ok(None)
    }
    fn volume_xml(&self, (): &(), _name: &str) -> Result<Option<String>, ProviderError> {
        Ok(None)
    }
    fn network_active(&self, _name: &str) -> Result<Option<bool>, ProviderError> {
        Ok(None)
    }
    fn create_volume(&self, (): &(), _: &NewVolume<'_>) -> Result<(), ProviderError> {
        Ok(())
    }
    fn delete_volume(&self, (): &(), _name: &str) -> Result<(), ProviderError> {
        Ok(())
    }
    fn define(&self, _name: &str, _xml: &str) -> Result<(), ProviderError> {
        Ok(())
    }
    fn start(&self, (): &(), _name: &str) -> Result<(), ProviderError> {
        Ok(())
    }
    fn remove_domain(&self, name: &str) -> Result<(), ProviderError> {
        self.event(format!("remove {name}"));
        Ok(())
    }
    fn set_stamp(&self, (): &(), _: &str, _: &str, _: bool) -> Result<(), ProviderError> {
        Ok(())
    }
    fn versions(&self) -> Result<String, ProviderError> {
        Ok("fake".to_owned())
    }
}

#[tokio::test]
async fn an_operation_its_caller_gave_up_on_keeps_the_name_lock_until_its_work_ends() {
    let backend = Arc::new(Backend::default());
    let _release = ReleaseOnDrop(Arc::clone(&backend));
    let provider = Arc::new(LibvirtProvider::with_access(
        "fake",
        settings(NetworkSettings::default(), BootSettings::default()),
        Fake(Arc::clone(&backend)),
    ));
    // The first delete blocks in its lookup; its caller stops waiting after the timeout.
    match provider.delete("epo-a").await {
        Err(ProviderError::Unavailable(message)) => assert!(message.contains("within 100ms"), "{message}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // A second delete of that name waits for the first one's work, not for its caller...
    let mut second = tokio::spawn({
        let provider = Arc::clone(&provider);
        async move { provider.delete("epo-a").await }
    });
    let early = tokio::time::timeout(Duration::from_millis(300), &mut second).await;
    assert!(
        early.is_err(),
        "the second delete ran while the first held the lock"
    );
    // (another name does not wait)
    provider.delete("epo-b").await.expect("another name");
    assert_eq!(
        backend.events(),
        ["lookup epo-a", "lookup epo-b", "looked up epo-b", "remove epo-b"]
    );
    // ...and runs once that work ends.
    backend.release();
    tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("the second delete ends")
        .expect("task")
        .expect("deleted");
    assert_eq!(
        backend.events()[4..],
        [
            "looked up epo-a",
            "remove epo-a",
            "lookup epo-a",
            "looked up epo-a",
            "remove epo-a",
        ]
    );
}
