//! Generated protobuf and gRPC code for `proto/aether/v1` (clearing, worker, snapshot).
//!
//! Client and server stubs both live here so that the gateway, the workers and the
//! end-to-end tests share one definition of the wire protocol.

/// Protobuf package namespace `aether`.
pub mod aether {
    /// Protobuf package `aether.v1`.
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("aether.v1");
    }
}

pub use aether::v1;

/// Encoded `FileDescriptorSet` of every `aether.v1` file (with imports and source
/// info), for `tonic_reflection::server::Builder::register_encoded_file_descriptor_set`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/aether_v1_descriptor.bin"));
