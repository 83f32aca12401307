//! Generates the gRPC code from `proto/tandem.proto` with protox (no protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/tandem.proto");
    let fds = protox::compile(["proto/tandem.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
