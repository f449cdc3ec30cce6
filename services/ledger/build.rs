//! `sqlx::migrate!` embeds the migration folders at compile time, and cargo does not watch
//! them by itself: without this, a new migration file leaves a stale build that never
//! creates its table.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
