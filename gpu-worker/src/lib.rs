//! Clearing model runtime (scoring + netting). Built by the clearing issue.
