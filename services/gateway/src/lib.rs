//! gRPC clearing gateway (mTLS, SM2/SM4 envelope, batching). Built by the clearing issue.

pub mod certs;
pub mod envelope;
pub mod identity;
pub mod pb;
pub mod tls;
