//! The tandem prefill worker: runs prompts' forward passes and ships their KV cache to decode
//! workers. Built in issue 3; this crate reserves its place in the workspace and has no
//! behaviour yet.
