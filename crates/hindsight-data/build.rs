// Compiles the protocol with protox (pure Rust), so building needs no protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/hindsight_data.proto");
    let fds = protox::compile(["proto/hindsight_data.proto"], ["proto"])?;
    // Unit payloads are `Bytes`: decoding slices tonic's receive buffer
    // instead of copying a whole batch again.
    tonic_prost_build::configure()
        .bytes(".hindsight.data.v1.Unit.payload")
        .compile_fds(fds)?;
    Ok(())
}
