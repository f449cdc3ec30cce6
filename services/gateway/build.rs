//! Compiles `proto/aether/v1/*.proto` with protox (pure Rust, no system `protoc`) into
//! tonic client and server code, and writes the encoded file descriptor set that the
//! gateway serves over gRPC reflection.

use std::path::PathBuf;

use protox::prost::Message as _;

const PROTOS: [&str; 3] = [
    "aether/v1/clearing.proto",
    "aether/v1/worker.proto",
    "aether/v1/snapshot.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("../../proto");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    for proto in PROTOS {
        println!(
            "cargo:rerun-if-changed={}",
            proto_root.join(proto).display()
        );
    }

    let fds = protox::compile(PROTOS, [&proto_root])?;
    std::fs::write(
        out_dir.join("aether_v1_descriptor.bin"),
        fds.encode_to_vec(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
