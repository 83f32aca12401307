//! Generates the gRPC code from `proto/tandem.proto` with protox (no protoc needed), and the
//! help text of each `WorkerLoad` field from the comment above it in the same file.

use std::fmt::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/tandem.proto");
    let fds = protox::compile(["proto/tandem.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .type_attribute("tandem.v1.WorkerLoad", "#[derive(serde::Serialize)]")
        .compile_fds(fds)?;
    let src = std::fs::read_to_string("proto/tandem.proto")?;
    let mut out = String::from(
        "/// Each `WorkerLoad` field, the router's gauge for it, and its help text (the field's\n\
         /// comment in `tandem.proto`).\n",
    );
    out.push_str("pub const LOAD_FIELDS: &[(&str, &str, &str)] = &[\n");
    let body = src
        .split("message WorkerLoad {")
        .nth(1)
        .and_then(|s| s.split('}').next())
        .ok_or("tandem.proto has no message WorkerLoad")?;
    let mut help = String::new();
    for line in body.lines().map(str::trim) {
        if let Some(c) = line.strip_prefix("//") {
            help.push_str(if help.is_empty() { "" } else { " " });
            help.push_str(c.trim());
        } else if let Some(name) = line.split_whitespace().nth(1) {
            if help.is_empty() {
                return Err(format!("WorkerLoad.{name} has no comment (its help text)").into());
            }
            // A comment may name the gauge (`[metric: NAME]`), e.g. where `_total` would read
            // as a counter's suffix; otherwise it is `tandem_worker_<field>`.
            let (text, metric) = match help.split_once("[metric: ") {
                Some((text, rest)) => (text.trim_end(), rest.trim_end_matches(']').to_string()),
                None => (help.as_str(), format!("tandem_worker_{name}")),
            };
            writeln!(out, "    ({name:?}, {metric:?}, {text:?}),")?;
            help.clear();
        }
    }
    out.push_str("];\n");
    std::fs::write(
        std::path::Path::new(&std::env::var("OUT_DIR")?).join("load_fields.rs"),
        out,
    )?;
    Ok(())
}
