//! Scoring throughput and latency of the reference model per device and batch size:
//! `cargo bench -p aether-gpu-worker --bench scoring` (CPU), or with `--features cuda` on a
//! machine with an NVIDIA GPU (CPU and `cuda:0` in the same run, the CPU as the baseline).
//! `--secs S` sets the time spent per row (default 2 s).
//!
//! Each row times whole `score_batch` calls on one thread, as a worker runs them: trade
//! validation, the feature matrix, the copy to the device and the scores back.

use std::time::{Duration, Instant};

use aether_gpu_worker::train::generate;
use aether_gpu_worker::{DeviceChoice, Model, REFERENCE_MODEL_DIGEST, reference};

/// The gateway's default most trades per batch is 500; 1 is a lone trade, 4096 what a
/// larger worker could take.
const BATCH_SIZES: [usize; 5] = [1, 64, 500, 4096, 16384];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let secs = args
        .iter()
        .position(|a| a == "--secs")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse::<f64>())
        .transpose()?
        .unwrap_or(2.0);
    let dir = tempfile::tempdir()?;
    let saved = reference::install(dir.path())?;
    let mut devices = vec![DeviceChoice::Cpu];
    if cfg!(feature = "cuda") {
        devices.push(DeviceChoice::Cuda(0));
    }
    let book = generate(7, *BATCH_SIZES.iter().max().unwrap_or(&1), 0.1);
    let trades: Vec<_> = book.iter().map(|l| (l.trade.clone(), l.context)).collect();

    println!("| device | batch | batches | median batch | p99 batch | trades/s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for device in devices {
        let started = Instant::now();
        let model = Model::load_on(&saved.weights_path, REFERENCE_MODEL_DIGEST, device)?;
        // The first batch pays for the device's set-up (a CUDA context, kernel loading).
        model.score_batch(&trades[..1])?;
        eprintln!(
            "{}: load and first score {:.1} ms",
            model.device_name(),
            started.elapsed().as_secs_f64() * 1e3
        );
        for size in BATCH_SIZES {
            let batch = &trades[..size];
            for _ in 0..3 {
                model.score_batch(batch)?;
            }
            let mut times = Vec::new();
            let row_started = Instant::now();
            while row_started.elapsed() < Duration::from_secs_f64(secs) || times.len() < 5 {
                let t = Instant::now();
                let scores = model.score_batch(batch)?;
                times.push(t.elapsed());
                std::hint::black_box(scores);
            }
            let total: Duration = times.iter().sum();
            times.sort();
            let pick = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
            println!(
                "| {} | {size} | {} | {:.3} ms | {:.3} ms | {:.0} |",
                model.device_name(),
                times.len(),
                pick(0.5).as_secs_f64() * 1e3,
                pick(0.99).as_secs_f64() * 1e3,
                (size * times.len()) as f64 / total.as_secs_f64(),
            );
        }
    }
    Ok(())
}
