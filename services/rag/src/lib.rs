//! Versioned regulatory corpus and retrieval. Built by the control-plane issue.
