//! The router's integration tests, one test binary (one link of the router and its fakes rather
//! than seven), a module by topic. `cargo test -p router --test all <module>::` runs one topic,
//! e.g. `--test all migration::`. The fuzz target (`../fuzz.rs`) has a binary of its own: it
//! fails on any panic in its process while it runs.

mod fake;
mod http;
mod kubernetes;
mod migration;
mod one_core;
mod registry;
mod request;
mod status;
