//! gRPC clearing gateway (mTLS, SM2/SM4 envelope, batching). Built by the clearing issue.
