//! The shepherd's outer step at a sparse run's close, at a model's full size:
//! the mean's division, SparseLoCo's error feedback (e ← e + lr·mean), the sparse
//! update's encoding (the chunked top-k of e, quantized) and its subtraction from
//! the buffer and the parameters: what the node logs as "outer step".
//!
//! ```sh
//! cargo run --release -p pcp-simulations --example shepherd_close -- [--model gpt2-124m] [--threads 2] [--repeats 3]
//! ```
//!
//! The mean is a smooth pseudo-random tensor set; figures are the fastest of
//! `--repeats` closes, wall time (CPU time of this thread with `PCP_BENCH_CPU=1`).

use std::io::Write;

use anyhow::Context;
use clap::Parser;
use pcp_protocol::diloco::aggregate::Delta;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::sketch::{Sketch, sketch_and_share};
use pcp_protocol::diloco::sparse::{self, ErrorFeedback, Settings};
use pcp_simulations::ModelPreset;

#[derive(Debug, Parser)]
#[command(about = "Time the shepherd's sparse outer step")]
struct Cli {
    /// Model preset whose tensor sizes are used.
    #[arg(long, default_value = "gpt2-124m")]
    model: String,
    /// Threads the close runs on (the shepherd's add threads).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Closes timed; the fastest is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let preset = ModelPreset::parse(&cli.model).with_context(|| format!("unknown model {}", cli.model))?;
    let sizes: Vec<usize> = preset.spec().tensor_sizes.iter().map(|n| *n as usize).collect();
    let params: usize = sizes.iter().sum();
    let wave = |n: usize, salt: u32| -> Vec<f32> {
        (0..n as u32)
            .map(|i| (i.wrapping_add(salt).wrapping_mul(2_654_435_761) as f32 / u32::MAX as f32 - 0.5) * 1e-3)
            .collect()
    };
    let mut theta: Vec<Vec<f32>> = sizes.iter().map(|n| wave(*n, 7)).collect();
    let layout = Settings::default().down();
    let mut feedback = ErrorFeedback::new(&sizes, 1.0, layout);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(
        out,
        "{}: {params} parameters in {} tensors, update {layout:?}, {} thread(s)",
        cli.model,
        sizes.len(),
        cli.threads
    )?;
    let (mut mean_s, mut encode_s, mut apply_s) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    let (mut params_sketch_s, mut update_sketch_s) = (f64::INFINITY, f64::INFINITY);
    // a worker's contribution (the default k 4), as the shepherd decodes it
    let encoding = Encoding::Sparse(Settings::default());
    let contribution = {
        let tensors: Vec<Vec<f32>> = sizes.iter().map(|n| wave(*n, 11)).collect();
        compress::decode_delta(&compress::encode(&tensors, encoding), &sizes, encoding)?
    };
    let (mut check_s, mut dense_check_s) = (f64::INFINITY, f64::INFINITY);
    let dense = Delta::Dense(sizes.iter().map(|n| wave(*n, 13)).collect());
    for round in 0..cli.repeats.max(1) as u64 {
        let mut sum: Vec<Vec<f32>> = sizes.iter().map(|n| wave(*n, round as u32)).collect();
        let at = Clock::now();
        let inv = 1.0 / 3.0f64;
        sum.iter_mut().flatten().for_each(|v| *v = (f64::from(*v) * inv) as f32);
        mean_s = mean_s.min(at.seconds());
        let at = Clock::now();
        let (bytes, sent) = feedback.compress_seeded_on(&sum, 0.7, round, cli.threads);
        encode_s = encode_s.min(at.seconds());
        let at = Clock::now();
        sparse::subtract(&mut theta, &sent, 1.0);
        apply_s = apply_s.min(at.seconds());
        std::hint::black_box(bytes);
        // the copy check's sketch of the update: of the parameters after it, or of the sparse update itself
        let at = Clock::now();
        std::hint::black_box(Sketch::of_tensors(0x5eed, &theta));
        params_sketch_s = params_sketch_s.min(at.seconds());
        let at = Clock::now();
        std::hint::black_box(Sketch::of_sparse(0x5eed, &sent));
        update_sketch_s = update_sketch_s.min(at.seconds());
        // and each contribution's: its sketch and its share on the update's support
        let at = Clock::now();
        std::hint::black_box(sketch_and_share(0x5eed, &contribution, Some(&sent), cli.threads));
        check_s = check_s.min(at.seconds());
        let at = Clock::now();
        std::hint::black_box(sketch_and_share(0x5eed, &dense, None, cli.threads));
        dense_check_s = dense_check_s.min(at.seconds());
    }
    writeln!(
        out,
        "mean {mean_s:.3} s, error feedback + encode {encode_s:.3} s, parameters {apply_s:.3} s: {:.3} s ({:.2e} s a parameter)",
        mean_s + encode_s + apply_s,
        (mean_s + encode_s + apply_s) / params as f64
    )?;
    writeln!(
        out,
        "the copy check's update sketch: {params_sketch_s:.3} s from the parameters, {update_sketch_s:.3} s from the sparse update"
    )?;
    writeln!(
        out,
        "the copy check of a contribution (its sketch and its share on the update's support): {:.1} ms; of a dense one (its sketch): {:.1} ms",
        check_s * 1e3,
        dense_check_s * 1e3
    )?;
    Ok(())
}

/// CPU time of this thread with `PCP_BENCH_CPU=1`, wall time otherwise.
struct Clock(pcp_simulations::decode::Stopwatch);

impl Clock {
    fn now() -> Self {
        Self(pcp_simulations::decode::Stopwatch::start())
    }

    fn seconds(&self) -> f64 {
        if std::env::var_os("PCP_BENCH_CPU").is_some() { self.0.seconds() } else { self.0.wall_seconds() }
    }
}
