//! The shepherd's work per sparse contribution at a model's full size:
//! `sparse::Packed::check` (decode, validate, norm) and the add into the
//! round's running sum, one contribution at a time (batch 1, what the shepherd
//! did before batching) against a batch added range by range of the sum.
//!
//! ```sh
//! CARGO_TARGET_DIR=/tmp/simtarget cargo run --release -p pcp-simulations --example shepherd_add -- \
//!   [--model gpt2-124m] [--contributions 64] [--batches 1,8,32] [--threads 1] [--repeats 3]
//! ```
//!
//! The contributions are copies of one encoded message, each in its own
//! allocation (as received messages are). Figures are the mean over the
//! contributions, after one warm-up contribution that allocates the sum, the
//! fastest of `--repeats` passes (the machine may be shared).

use std::io::Write;

use anyhow::Context;
use clap::Parser;
use pcp_protocol::diloco::aggregate::{Delta, RunningMean};
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::sparse::Settings;
use pcp_simulations::ModelPreset;
use pcp_simulations::decode::Stopwatch;

#[derive(Debug, Parser)]
#[command(about = "Time the shepherd's check and add of sparse contributions")]
struct Cli {
    /// Model preset whose tensor sizes are used.
    #[arg(long, default_value = "gpt2-124m")]
    model: String,
    /// Contributions timed for each batch size.
    #[arg(long, default_value_t = 64)]
    contributions: usize,
    /// Batch sizes to compare (1: one contribution at a time).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Passes of each measurement; the fastest is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Threads the add splits large tensors over.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let preset = ModelPreset::parse(&cli.model).with_context(|| format!("unknown model {}", cli.model))?;
    let sizes: Vec<usize> = preset.spec().tensor_sizes.iter().map(|n| *n as usize).collect();
    let encoding = Encoding::Sparse(Settings::default());
    let params: usize = sizes.iter().sum();
    eprintln!("{}: {params} parameters in {} tensors; encoding one message…", cli.model, sizes.len());
    let bytes = {
        let tensors: Vec<Vec<f32>> = sizes
            .iter()
            .map(|n| {
                (0..*n as u32).map(|i| (i.wrapping_mul(2_654_435_761) as f32 / u32::MAX as f32 - 0.5) * 1e-3).collect()
            })
            .collect();
        compress::encode(&tensors, encoding)
    };
    eprintln!("message: {:.2} MB", bytes.len() as f64 / 1e6);
    let copies: Vec<Vec<u8>> = (0..cli.contributions).map(|_| bytes.clone()).collect();

    // check: decode, validate, norm; the best of `repeats` passes (the machine is shared)
    let mut check_ms = f64::INFINITY;
    let mut deltas = Vec::with_capacity(copies.len());
    for _ in 0..cli.repeats.max(1) {
        deltas.clear();
        let started = Clock::now();
        for b in &copies {
            let delta = compress::decode_delta(b, &sizes, encoding).context("the encoder's own message")?;
            let norm = delta.validate(&sizes).map_err(|e| anyhow::anyhow!("{e}"))?;
            deltas.push((delta, norm));
        }
        check_ms = check_ms.min(started.elapsed_ms() / copies.len() as f64);
    }
    // of which copying the message into the `Packed` it is kept as
    let mut copy_ms = f64::INFINITY;
    let mut kept: Vec<Vec<u8>> = Vec::with_capacity(copies.len());
    for _ in 0..cli.repeats.max(1) {
        kept.clear();
        let started = Clock::now();
        kept.extend(copies.iter().map(|b| b.to_vec()));
        copy_ms = copy_ms.min(started.elapsed_ms() / copies.len() as f64);
    }
    drop(kept);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "check (decode + validate): {check_ms:.2} ms a contribution (copying the message: {copy_ms:.2} ms)")?;

    for batch in &cli.batches {
        let add_ms = (0..cli.repeats.max(1))
            .map(|_| time_adds(&deltas, &sizes, *batch, cli.threads))
            .fold(f64::INFINITY, f64::min);
        writeln!(
            out,
            "add, batch {batch:>3}, {} thread(s): {add_ms:.2} ms a contribution; check + add {:.2} ms",
            cli.threads,
            check_ms + add_ms
        )?;
    }
    Ok(())
}

/// Mean milliseconds to push each of `deltas` to a fresh running mean batched
/// by `batch` and flush it (the last batch added), the sum
/// allocated and touched by a warm-up contribution first.
fn time_adds(deltas: &[(Delta, f64)], sizes: &[usize], batch: usize, threads: usize) -> f64 {
    let mut mean = RunningMean::with_batch(threads, batch);
    if let Some((d, norm)) = deltas.first() {
        mean.add(d, 1.0, *norm, f64::INFINITY, sizes);
    }
    // the copies a shepherd would own, made before the clock starts
    let owned: Vec<(Delta, f64)> = deltas.to_vec();
    let started = Clock::now();
    for (d, norm) in owned {
        mean.push(d, 1.0, norm, f64::INFINITY, sizes);
    }
    mean.flush();
    let ms = started.elapsed_ms() / deltas.len().max(1) as f64;
    std::hint::black_box(mean.finish());
    ms
}

/// CPU time of this thread with `PCP_BENCH_CPU=1` (what the work costs a core
/// when other processes share the machine), wall time otherwise.
struct Clock(Stopwatch);

impl Clock {
    fn now() -> Self {
        Self(Stopwatch::start())
    }

    fn elapsed_ms(&self) -> f64 {
        1e3 * if std::env::var_os("PCP_BENCH_CPU").is_some() { self.0.seconds() } else { self.0.wall_seconds() }
    }
}
