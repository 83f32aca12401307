//! The tandem router: OpenAI-compatible HTTP front end that sends each request through a
//! prefill worker and a decode worker. Built in issue 3; this crate reserves its place in the
//! workspace and has no behaviour yet.
