//! egress-proxies-operator: a Kubernetes operator (and a standalone single-host mode) that
//! provisions egress proxies through named provider instances, health-checks them through
//! the proxy, and leases them to crawlers.
//!
//! See `docs/architecture.md` for how the modules fit together.

pub mod api;
pub mod app;
pub mod check;
pub mod cluster;
pub mod config;
pub mod controller;
pub mod discovery;
pub mod effects;
pub mod gateway;
pub mod gc;
pub mod hashing;
pub mod health;
pub(crate) mod json_writer;
pub mod lease;
pub mod machine;
pub mod markup;
pub mod monitor;
pub mod net;
pub mod outcomes;
pub mod politeness;
pub mod provider;
pub mod standalone;
pub mod sync;
pub mod telemetry;
pub mod ui;
pub mod usage;
