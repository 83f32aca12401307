//! The router's integration tests, one test binary (one link of the router and its fakes rather
//! than eight), a module by topic. `cargo test -p router --test all <module>::` runs one topic,
//! e.g. `--test all fuzz::`.

mod fake;
mod fuzz;
mod http;
mod kubernetes;
mod migration;
mod one_core;
mod registry;
mod request;
mod status;
