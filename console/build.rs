//! `include_dir!` cannot tell cargo which files it read: rebuild when the built console
//! changes (cargo scans the whole directory).
fn main() {
    println!("cargo:rerun-if-changed=dist");
}
