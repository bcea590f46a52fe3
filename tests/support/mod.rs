//! Support code shared by integration tests (and benches, through `#[path]`).
//!
//! Each module is self-contained; include this folder with `mod support;` from a test.

pub mod fake_apiserver;
