// Compiles the protocol with protox (pure Rust), so building needs no protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/hindsight_data.proto");
    let fds = protox::compile(["proto/hindsight_data.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
