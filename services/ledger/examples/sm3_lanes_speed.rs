//! SM3 throughput over event-sized messages: the `sm3` crate one message at a time against
//! `sm3_lanes` on each kind of lanes this CPU has (same digests, checked first).
//!
//! `cargo run --release -p aether-ledger --example sm3_lanes_speed`

use std::time::Instant;

use aether_ledger::sm3_lanes::{Lanes, sm3_many_on};

fn main() {
    // 10,000 messages of 600–700 bytes: the size of a clearing decision's hash input.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let messages: Vec<Vec<u8>> = (0..10_000)
        .map(|_| {
            let len = 600 + (next() % 100) as usize;
            (0..len).map(|_| next() as u8).collect()
        })
        .collect();
    let refs: Vec<&[u8]> = messages.iter().map(Vec::as_slice).collect();
    let bytes: usize = messages.iter().map(Vec::len).sum();
    let want = sm3_many_on(Lanes::Portable, &refs);
    for lanes in [Lanes::Portable, Lanes::Avx2, Lanes::Avx512] {
        if !lanes.supported() {
            println!("{lanes:?}: not supported by this CPU");
            continue;
        }
        assert_eq!(sm3_many_on(lanes, &refs), want, "{lanes:?}");
        let rounds = 20;
        let started = Instant::now();
        for _ in 0..rounds {
            std::hint::black_box(sm3_many_on(lanes, std::hint::black_box(&refs)));
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "{:<9} {:>7.0} MB/s  {:>5.2} µs per message",
            format!("{lanes:?}:"),
            (bytes * rounds) as f64 / secs / 1e6,
            secs * 1e6 / (rounds * messages.len()) as f64
        );
    }
}
