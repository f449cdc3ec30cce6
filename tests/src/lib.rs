//! Helpers shared by the end-to-end tests: spawning `aether` processes and test databases.
