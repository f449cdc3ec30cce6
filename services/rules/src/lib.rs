//! Compliance rule engine (CEL). Built by the control-plane issue.
