//! Live owners for orphan GC in standalone mode: the records of the state folder, read afresh
//! at each pass (the runner writes a record before it creates the instance). Read-only: never
//! takes the folder's lock.

use std::{collections::HashSet, path::PathBuf};

use async_trait::async_trait;

use super::store::Store;
use crate::gc::LiveOwners;

/// The UIDs of the Proxies recorded in a state folder.
pub struct StateOwners(pub PathBuf);

#[async_trait]
impl LiveOwners for StateOwners {
    async fn live_uids(&self, _namespace: Option<&str>) -> Result<HashSet<String>, String> {
        let store = Store::read_only(&self.0).map_err(|e| e.to_string())?;
        Ok(store
            .list()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|(_, r)| r.uid)
            .collect())
    }
}
