//! Control plane (engines, policies, rollouts, snapshots). Built by the control-plane issue.
