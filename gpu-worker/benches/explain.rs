//! One held decision's explanation on one core, and how its checks sit against their
//! thresholds: `cargo bench -p aether-gpu-worker --bench explain`.
//!
//! The trades are the reference model's held ones (score ≥ 0.5) from a synthetic book
//! with planted anomalies (seed 99, not the training seed); each is explained as the
//! worker does (`ClearingModel::explain`: 8,192 + 256 forward passes, 200 resamples),
//! timed one at a time on this thread.

use std::time::Instant;

use aether_gpu_worker::features::features;
use aether_gpu_worker::train::generate;
use aether_gpu_worker::{ClearingModel, DeviceChoice, REFERENCE_MODEL_DIGEST, reference};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let saved = reference::install(dir.path())?;
    let model = ClearingModel::load(
        &saved.weights_path,
        REFERENCE_MODEL_DIGEST,
        DeviceChoice::Cpu,
    )?;
    let book = generate(99, 4000, 0.3);
    let rows: Vec<_> = book
        .iter()
        .map(|t| features(&t.trade, &t.context))
        .collect();
    let scores = model.model().score_features(&rows.concat())?;
    let held: Vec<_> = rows
        .iter()
        .zip(&scores)
        .filter(|(_, s)| s.score >= 0.5)
        .map(|(r, _)| *r)
        .take(500)
        .collect();
    // The reference forward pass alone (what an explanation would take 8,448 of, one per
    // coalition and background row, without the walk), and the walk over one background
    // row's 256 coalitions, over pairs of held rows (raw values: only the groups the two
    // rows share change the cost).
    let weights = model.model().weights();
    let passes = 200_000;
    let mut sum = 0f64;
    let started = Instant::now();
    for k in 0..passes {
        sum += f64::from(weights.forward(&held[k % held.len()]));
    }
    let reference_pass = started.elapsed();
    let walk = aether_gpu_worker::explain::ByInput::new(weights);
    let mut scratch = aether_gpu_worker::explain::Scratch::default();
    let mut values = [0f64; 256];
    let walks = 20_000;
    let started = Instant::now();
    for k in 0..walks {
        let (x, b) = (&held[k % held.len()], &held[(7 * k + 3) % held.len()]);
        walk.coalition_values(x, b, &mut values, &mut scratch);
        sum += values[k % 256];
    }
    let walked = started.elapsed();
    println!(
        "reference forward pass {:.0} ns; one row's 256 coalitions {:.1} µs (sum {sum})",
        reference_pass.as_nanos() as f64 / passes as f64,
        walked.as_secs_f64() * 1e6 / walks as f64
    );
    // Warm the background (drawn once per model) outside the timings.
    model.explain("warm-up", &held[0])?;
    let mut micros = Vec::new();
    let (mut fidelity, mut distance, mut width) = (Vec::new(), Vec::new(), Vec::new());
    let mut failed = 0;
    for (i, row) in held.iter().enumerate() {
        let started = Instant::now();
        let e = model.explain(&format!("held-{i}"), row)?;
        micros.push(started.elapsed().as_secs_f64() * 1e6);
        fidelity.push(e.lime.fidelity_error);
        distance.push(e.lime.neighbourhood_distance);
        width.push(
            e.attributions
                .iter()
                .map(|a| a.ci95[1] - a.ci95[0])
                .fold(0.0, f64::max),
        );
        failed += usize::from(!e.failures.is_empty());
    }
    for v in [&mut micros, &mut fidelity, &mut distance, &mut width] {
        v.sort_by(f64::total_cmp);
    }
    let q = |v: &[f64], p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    println!(
        "held trades explained: {} ({failed} failed a check)",
        held.len()
    );
    println!(
        "latency µs: p50 {:.0}, p99 {:.0}, max {:.0}",
        q(&micros, 0.5),
        q(&micros, 0.99),
        q(&micros, 1.0)
    );
    for (name, v, limit) in [
        ("fidelity error |f(x) − g(1)|", &fidelity, "ε₁ 0.05"),
        ("neighbourhood distance", &distance, "ε₂ 2.0"),
        ("widest 95 % interval", &width, "0.25"),
    ] {
        println!(
            "{name}: p50 {:.3}, p95 {:.3}, max {:.3} (bound {limit})",
            q(v, 0.5),
            q(v, 0.95),
            q(v, 1.0)
        );
    }
    Ok(())
}
