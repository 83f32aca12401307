//! The etcd v3 client's gRPC code, from the subset of etcd's API in `proto/` (written for
//! tandem, wire-compatible with etcd 3.4 and 3.5), compiled by protox: no protoc needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["v3electionpb.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
