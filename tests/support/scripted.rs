//! Scripted stand-ins for the health engine and the lease store in controller tests: the test
//! decides the verdicts and the number of active leases, and can read what the controller
//! registered. They implement the same interfaces as the real executors.

#![allow(dead_code)] // Each test binary uses a different part of the support code.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use egress_proxies_operator::{
    api::ProxyKey,
    health::{HealthControl, HealthTarget, Verdict},
    lease::{DrainStatus, LeaseControl, LeaseTarget},
};

pub fn key(namespace: &str, name: &str) -> ProxyKey {
    ProxyKey::new(namespace, name)
}

/// Health verdicts set by the test.
#[derive(Default)]
pub struct ScriptedHealth {
    verdicts: Mutex<HashMap<ProxyKey, Verdict>>,
    targets: Mutex<HashMap<ProxyKey, HealthTarget>>,
}

impl ScriptedHealth {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// The verdict the controller will observe for `key`.
    pub fn set(&self, key: &ProxyKey, verdict: Verdict) {
        self.verdicts.lock().unwrap().insert(key.clone(), verdict);
    }

    /// What the controller asked to probe for `key`.
    pub fn target(&self, key: &ProxyKey) -> Option<HealthTarget> {
        self.targets.lock().unwrap().get(key).cloned()
    }
}

impl HealthControl for ScriptedHealth {
    fn upsert(&self, target: HealthTarget) {
        self.targets.lock().unwrap().insert(target.key.clone(), target);
    }

    fn remove(&self, key: &ProxyKey) {
        self.targets.lock().unwrap().remove(key);
        self.verdicts.lock().unwrap().remove(key);
    }

    fn verdict(&self, key: &ProxyKey) -> Verdict {
        self.verdicts
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(Verdict::Unknown)
    }
}

/// A lease registry whose active counts the test sets.
#[derive(Default)]
pub struct ScriptedLeases {
    state: Mutex<HashMap<ProxyKey, LeaseEntry>>,
}

#[derive(Clone, Debug, Default)]
pub struct LeaseEntry {
    pub target: Option<LeaseTarget>,
    pub open: bool,
    pub active: usize,
    pub revoked: usize,
}

impl ScriptedLeases {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    pub fn set_active(&self, key: &ProxyKey, active: usize) {
        self.state.lock().unwrap().entry(key.clone()).or_default().active = active;
    }

    pub fn entry(&self, key: &ProxyKey) -> Option<LeaseEntry> {
        self.state.lock().unwrap().get(key).cloned()
    }
}

impl LeaseControl for ScriptedLeases {
    fn upsert(&self, target: LeaseTarget) {
        let key = target.key.clone();
        self.state.lock().unwrap().entry(key).or_default().target = Some(target);
    }

    fn set_admission(&self, key: &ProxyKey, open: bool) {
        self.state.lock().unwrap().entry(key.clone()).or_default().open = open;
    }

    fn drain(&self, key: &ProxyKey) -> DrainStatus {
        let mut state = self.state.lock().unwrap();
        let entry = state.entry(key.clone()).or_default();
        entry.open = false;
        match entry.active {
            0 => DrainStatus::Drained,
            active => DrainStatus::Pending { active },
        }
    }

    fn revoke_all(&self, key: &ProxyKey) -> usize {
        let mut state = self.state.lock().unwrap();
        let entry = state.entry(key.clone()).or_default();
        let revoked = entry.active;
        entry.revoked += revoked;
        entry.active = 0;
        revoked
    }

    fn remove(&self, key: &ProxyKey) {
        self.state.lock().unwrap().remove(key);
    }

    fn active(&self, key: &ProxyKey) -> usize {
        self.state.lock().unwrap().get(key).map_or(0, |e| e.active)
    }
}
