//! Regulator audit queries, proofs and evidence bundles. Built by the audit issue.
