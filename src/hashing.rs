//! The hash map of the request paths (the lease API's and the gateway's): foldhash under a
//! random seed of each map's own instead of std's SipHash, which cost about four times as much
//! a lookup (with a dozen lookups a gateway request, about a twentieth of its work).
//!
//! Why that is safe where these maps are used: their keys are names that authenticated callers
//! or the operator's own configuration chose (holders, tokens, session keys, target domains,
//! proxy keys and endpoints), every map that grows with callers' names is capped, and making
//! lookups collide would take the seed, which nothing reveals.

use std::collections::HashMap;

/// A `HashMap` hashed with foldhash under a random seed ([`HashMap::default`] makes one).
pub type FastMap<K, V> = HashMap<K, V, foldhash::quality::RandomState>;
