//! Which proxy credentials each running instance accepts, as far as this process knows.
//!
//! Credentials are not part of the spec hash (rotating a password must not rebuild a VM), and
//! they never go into the status. So the reconciler keeps, in memory, the credentials it gave
//! each instance (at create, or by `update_credentials`). Leases and health probes use exactly
//! these — the discovery API hands out new credentials only once the instance accepts them —
//! and the fact `credentials_changed` compares them with the Secret's. An instance whose
//! provider cannot update them in place is marked for replacement (`spec_changed`), which goes
//! through the pool's budget like any spec change. After a restart nothing is known: the first
//! reconcile asks the provider whether the instance accepts the Secret's credentials
//! ([`crate::provider::Provider::check_credentials`]). If it does, nothing happens; if not, they
//! are given in place or the instance is replaced; if the provider cannot tell, one that updates
//! in place gives them again (idempotent), and for one that cannot the instance is assumed to
//! run them.

use std::{
    collections::{HashMap, HashSet},
    sync::{Mutex, MutexGuard},
};

use crate::{api::ProxyKey, provider::Credentials};

#[derive(Clone, Debug, Default)]
struct Applied {
    /// What the instance accepts now.
    running: Option<Credentials>,
    /// The provider cannot update in place: these wait for a new instance.
    replace_for: Option<Option<Credentials>>,
    /// The last update failed with these (its retry backs off).
    failed_for: Option<Option<Credentials>>,
}

/// The credentials book of one reconciler.
#[derive(Debug, Default)]
pub struct CredentialsBook {
    applied: Mutex<HashMap<ProxyKey, Applied>>,
    /// Not known, but not the Secret's: after a restart the provider found these instances on
    /// other credentials (which it cannot name).
    found_different: Mutex<HashSet<ProxyKey>>,
}

impl CredentialsBook {
    fn lock(&self) -> MutexGuard<'_, HashMap<ProxyKey, Applied>> {
        crate::sync::lock(&self.applied)
    }

    /// The instance of `key` accepts `credentials` (a create or an update gave them, or the
    /// provider confirmed it).
    pub fn set_running(&self, key: &ProxyKey, credentials: Option<Credentials>) {
        crate::sync::lock(&self.found_different).remove(key);
        self.lock().insert(
            key.clone(),
            Applied {
                running: credentials,
                replace_for: None,
                failed_for: None,
            },
        );
    }

    /// Only a new instance of `key` can carry `credentials`.
    pub fn replace_for(&self, key: &ProxyKey, credentials: Option<Credentials>) {
        let mut applied = self.lock();
        let entry = applied.entry(key.clone()).or_default();
        entry.replace_for = Some(credentials);
        // The new instance will carry them: no update of the old one is pending any more.
        entry.failed_for = None;
    }

    /// Giving the instance of `key` `credentials` failed (a retry is scheduled).
    pub fn update_failed(&self, key: &ProxyKey, credentials: Option<Credentials>) {
        self.lock().entry(key.clone()).or_default().failed_for = Some(credentials);
    }

    /// The Secret was rotated again since an update failed: the new credentials are a new
    /// request, tried at once like a spec edit (and backing off on their own if they fail too),
    /// rather than waiting silently behind the failed one's backoff.
    pub fn rotated_since_failure(&self, key: &ProxyKey, desired: Option<&Credentials>) -> bool {
        self.lock()
            .get(key)
            .and_then(|a| a.failed_for.as_ref())
            .is_some_and(|failed| failed.as_ref() != desired)
    }

    /// The provider found the instance of `key`, not known yet, on other credentials than the
    /// Secret's: if it cannot give them in place, only a new instance can.
    pub fn found_different(&self, key: &ProxyKey) {
        crate::sync::lock(&self.found_different).insert(key.clone());
    }

    /// Whether the provider found the instance of `key` on other credentials (and nothing has
    /// given it any since).
    pub fn was_found_different(&self, key: &ProxyKey) -> bool {
        crate::sync::lock(&self.found_different).contains(key)
    }

    /// The instance of `key` is gone.
    pub fn forget(&self, key: &ProxyKey) {
        crate::sync::lock(&self.found_different).remove(key);
        self.lock().remove(key);
    }

    /// Whether this process knows what the instance of `key` accepts.
    pub fn known(&self, key: &ProxyKey) -> bool {
        self.lock().contains_key(key)
    }

    /// What leases and probes of `key` use: what the instance accepts, or (not known yet, after a
    /// restart) the Secret's.
    pub fn running_or(&self, key: &ProxyKey, desired: Option<&Credentials>) -> Option<Credentials> {
        match self.lock().get(key) {
            Some(applied) => applied.running.clone(),
            None => desired.cloned(),
        }
    }

    /// `(credentials_changed, needs_replacement)` for the Secret's `desired` credentials:
    /// changed while the instance was not given them and no replacement waits for them;
    /// a replacement is needed when the provider said only a new instance can carry them.
    ///
    /// Unknown (after a restart): a provider that updates `in_place` is asked to apply them (once,
    /// idempotent, if it could not tell which the instance accepts); one that cannot update them
    /// in place replaces an instance it [found on other credentials](Self::found_different); for
    /// one that could not tell, the instance is assumed to run them (replacing every
    /// such instance on every start would be worse), and later rotations are compared with that.
    pub fn compare(&self, key: &ProxyKey, desired: Option<&Credentials>, in_place: bool) -> (bool, bool) {
        let found_different = self.was_found_different(key);
        let mut applied = self.lock();
        match applied.get(key) {
            None if in_place => (true, false),
            // Assumed to run the Secret's, unless the provider found it on others: then only a
            // new instance can carry them.
            None => {
                applied.insert(
                    key.clone(),
                    Applied {
                        running: desired.cloned(),
                        replace_for: found_different.then(|| desired.cloned()),
                        failed_for: None,
                    },
                );
                (false, found_different)
            }
            Some(applied)
                if applied
                    .replace_for
                    .as_ref()
                    .is_some_and(|r| r.as_ref() == desired) =>
            {
                (false, true)
            }
            Some(applied) => (applied.running.as_ref() != desired, false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(password: &str) -> Credentials {
        Credentials {
            username: "crawler".into(),
            password: password.into(),
        }
    }

    #[test]
    fn the_book_tells_what_to_do_with_a_rotation() {
        let book = CredentialsBook::default();
        let key = ProxyKey::new("crawl", "a");
        let (old, new) = (creds("old"), creds("new"));
        assert_eq!(
            book.compare(&key, Some(&old), true),
            (true, false),
            "unknown after a restart: apply once"
        );
        assert_eq!(book.running_or(&key, Some(&old)), Some(old.clone()));
        book.set_running(&key, Some(old.clone()));
        assert_eq!(book.compare(&key, Some(&old), true), (false, false));
        assert_eq!(book.compare(&key, Some(&new), true), (true, false), "rotated");
        book.replace_for(&key, Some(new.clone()));
        assert_eq!(
            book.compare(&key, Some(&new), true),
            (false, true),
            "waits for a new instance"
        );
        assert_eq!(
            book.running_or(&key, Some(&new)),
            Some(old.clone()),
            "leases keep what the instance accepts"
        );
        book.set_running(&key, Some(new.clone()));
        assert_eq!(book.compare(&key, Some(&new), true), (false, false));
        book.forget(&key);
        assert!(!book.known(&key));
        // A provider that cannot update in place: what runs after a restart is assumed current,
        // and a later rotation is seen against it.
        assert_eq!(book.compare(&key, Some(&old), false), (false, false));
        assert_eq!(book.compare(&key, Some(&new), false), (true, false));
    }
}
