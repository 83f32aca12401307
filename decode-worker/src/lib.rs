//! The tandem decode worker: receives KV caches and generates with continuous batching. Built in
//! issue 3; this crate reserves its place in the workspace and has no behaviour yet.
