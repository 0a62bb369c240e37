//! `pcp-node bench aggregate`: what the shepherd spends on each contribution, in
//! time and memory. Each synthetic, seeded contribution goes the shepherd's way:
//! its encoded bytes → [`compress::decode_delta`] → `Delta::validate` →
//! [`RunningMean::add`] bounded to the running norm bound → dropped, one at a
//! time (the dense tensors a contribution was encoded from are freed before it is
//! decoded, and the next is made only once it is gone), then [`RunningMean::finish`].
//! The process's peak RSS is reported next to the budget of 3 × the parameter bytes
//! (the running sum, one message and its decoded form) + 256 MiB.

use std::io::Write as _;
use std::time::Instant;

use anyhow::Context as _;
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::aggregate::{RunningMean, running_bound};
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::shepherd;
use pcp_protocol::diloco::sparse::ErrorFeedback;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::Failure;
use crate::training::model::Model;

/// Decode, validate and add at the shepherd: seconds per contribution and peak RSS.
#[derive(Debug, clap::Args)]
pub(crate) struct AggregateArgs {
    /// nanogpt-small, nanogpt-medium, gpt2-124m, or a .mlir loss module (only its parameter sizes are read).
    #[arg(long, default_value = "gpt2-124m")]
    model: String,
    /// Contributions added to the round's running mean.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    contributions: u32,
    /// fp32, bf16, int8, sparse or sparse:chunk=N,k=N,bits=2|4|8,decay=F,down=N.
    #[arg(long, default_value = "fp32", value_parser = Encoding::parse_spec)]
    encoding: Encoding,
    /// Seed of the synthetic contributions.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// One contribution at the shepherd, seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Cost {
    decode: f64,
    validate: f64,
    add: f64,
}

impl Cost {
    fn total(&self) -> f64 {
        self.decode + self.validate + self.add
    }
}

/// What [`aggregate`] did and measured.
#[derive(Debug)]
struct Outcome {
    /// The round's mean.
    mean: Tensors,
    /// Bytes of one encoded contribution.
    bytes: usize,
    /// The worker's `compress::encode`, seconds, per contribution.
    encode: Vec<f64>,
    /// Sparse: the worker's `ErrorFeedback::compress` (decay, add, top-k, encode, subtract), seconds, once.
    feedback: Option<f64>,
    /// The shepherd's cost per contribution.
    costs: Vec<Cost>,
    /// Contributions scaled down to the norm bound.
    scaled: usize,
}

/// Contribution `i`: values uniform in ±scale, scale 0.5–2 × 10⁻³ drawn per
/// contribution (so the norm bound scales some down), and 1,000–5,000 samples.
fn contribution(sizes: &[usize], seed: u64, i: u32) -> (Tensors, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(u64::from(i));
    let scale = 1e-3 * rng.gen_range(0.5f32..2.0);
    let samples = rng.gen_range(1_000..=5_000);
    let tensors = sizes.iter().map(|n| (0..*n).map(|_| scale * rng.gen_range(-1.0f32..1.0)).collect()).collect();
    (tensors, samples)
}

/// Adds `contributions` synthetic contributions of tensors of `sizes` in
/// `encoding` to one running mean, as the shepherd does, one alive at a time.
/// Each is bounded by the shepherd's running bound (norm factor × the lower
/// median of the norms so far); the first by its own norm (the shepherd holds a
/// run's first contribution until a second arrives, the bench adds it at once).
fn aggregate(sizes: &[usize], contributions: u32, encoding: Encoding, seed: u64) -> anyhow::Result<Outcome> {
    let factor = shepherd::Config::default().norm_factor;
    // the worker's full sparse step, once, before the round's sum exists
    let feedback = match encoding.sparse() {
        Some(s) => {
            let (delta, _) = contribution(sizes, seed, u32::MAX);
            let mut feedback = ErrorFeedback::new(sizes, s.decay(), s.up);
            let started = Instant::now();
            let sent = feedback.compress(&delta, 1.0);
            let seconds = started.elapsed().as_secs_f64();
            drop((delta, feedback, sent));
            Some(seconds)
        }
        None => None,
    };
    let mut mean = RunningMean::default();
    let (mut norms, mut encode, mut costs) = (Vec::new(), Vec::new(), Vec::new());
    let (mut bytes_len, mut scaled) = (0, 0);
    for i in 0..contributions {
        let (delta, samples) = contribution(sizes, seed, i);
        let started = Instant::now();
        let bytes = compress::encode(&delta, encoding);
        encode.push(started.elapsed().as_secs_f64());
        drop(delta);
        bytes_len = bytes.len();

        let started = Instant::now();
        let decoded = compress::decode_delta(&bytes, sizes, encoding).with_context(|| format!("contribution {i}"))?;
        let decode = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let norm = decoded.validate(sizes).map_err(|e| anyhow::anyhow!("contribution {i}: {e}"))?;
        let validate = started.elapsed().as_secs_f64();
        norms.push(norm);
        let bound = running_bound(&[], &norms, factor).unwrap_or(factor * norm);
        let started = Instant::now();
        scaled += usize::from(mean.add(&decoded, samples as f64, norm, bound, sizes));
        let add = started.elapsed().as_secs_f64();
        drop(decoded);
        drop(bytes);
        costs.push(Cost { decode, validate, add });
    }
    let mean = mean.finish().context("no contribution was added")?;
    Ok(Outcome { mean, bytes: bytes_len, encode, feedback, costs, scaled })
}

/// `(peak, current)` resident set size in bytes, from /proc.
fn rss() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// The parameter tensors' sizes of `model`: a preset's, or a `.mlir` module's.
fn sizes_of(model: &str) -> anyhow::Result<Vec<usize>> {
    if let Some(preset) = pcp_simulations::ModelPreset::parse(model) {
        return Ok(preset.spec().tensor_sizes.iter().map(|n| *n as usize).collect());
    }
    anyhow::ensure!(
        model.ends_with(".mlir"),
        "--model {model} is not nanogpt-small, nanogpt-medium, gpt2-124m or a .mlir file"
    );
    let loaded = Model::load(model, 0)?;
    Ok(loaded.params.iter().map(|p| p.ty.elements().max(0) as usize).collect())
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// Runs the benchmark and prints its figures.
pub(crate) fn run(args: &AggregateArgs) -> Result<(), Failure> {
    let sizes = sizes_of(&args.model).map_err(Failure::input)?;
    let params: usize = sizes.iter().sum();
    let fp32 = compress::encoded_len(&sizes, Encoding::F32);
    let before = rss();
    let started = Instant::now();
    let outcome = aggregate(&sizes, args.contributions, args.encoding, args.seed)?;
    let wall = started.elapsed().as_secs_f64();
    let (peak, _) = rss().unwrap_or((0, 0));
    let budget = 3.0 * 4.0 * params as f64 + 256.0 * MIB;
    let n = outcome.costs.len();
    let per: Vec<f64> = outcome.costs.iter().map(Cost::total).collect();
    let part = |f: fn(&Cost) -> f64| mean(&outcome.costs.iter().map(f).collect::<Vec<_>>());
    let (decode, validate, add) = (part(|c| c.decode), part(|c| c.validate), part(|c| c.add));
    let encode = mean(&outcome.encode);
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "model        {} ({params} parameters in {} tensors, {:.1} MB at fp32)",
        args.model,
        sizes.len(),
        fp32 as f64 / 1e6
    )?;
    writeln!(
        out,
        "encoding     {}: {:.2} MB a contribution, {:.4} of fp32 ({:.1}x smaller)",
        args.encoding.spec(),
        outcome.bytes as f64 / 1e6,
        outcome.bytes as f64 / fp32 as f64,
        fp32 as f64 / outcome.bytes.max(1) as f64
    )?;
    write!(out, "worker       encode {encode:.3} s (compress::encode, mean of {n})")?;
    if let Some(feedback) = outcome.feedback {
        write!(out, "; error feedback + encode {feedback:.3} s (ErrorFeedback::compress, once)")?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "shepherd     decode {decode:.3} s + validate {validate:.3} s + add {add:.3} s = {:.3} s a contribution \
         (mean of {n}; median {:.3}, min {:.3}, max {:.3})",
        mean(&per),
        median(&per),
        per.iter().copied().fold(f64::INFINITY, f64::min),
        per.iter().copied().fold(0.0, f64::max),
    )?;
    writeln!(
        out,
        "encode+decode {:.3} s for {} (the worker's encode, the shepherd's decode)",
        outcome.feedback.unwrap_or(encode) + decode,
        args.model
    )?;
    writeln!(
        out,
        "round        {n} contributions: {:.2} s of shepherd time ({:.1} s with synthesis), {} scaled to the norm bound",
        per.iter().sum::<f64>(),
        wall,
        outcome.scaled
    )?;
    let verdict = if (peak as f64) < budget { "within" } else { "OVER" };
    writeln!(
        out,
        "peak RSS     {:.1} MiB (VmHWM; {:.1} MiB before the bench); budget 3 x {:.1} MiB + 256 MiB = {:.1} MiB: {verdict}",
        peak as f64 / MIB,
        before.map_or(f64::NAN, |b| b.1 as f64 / MIB),
        4.0 * params as f64 / MIB,
        budget / MIB
    )?;
    // the mean's norm, so the work cannot be optimized away and runs can be compared
    let norm = outcome.mean.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    writeln!(out, "mean         norm {norm:.6e}")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_protocol::diloco::aggregate::Delta;
    use pcp_protocol::diloco::sparse;

    /// The running mean the bench computes is the bounded, sample-weighted mean of
    /// what each contribution decodes to, computed here directly in f64.
    #[test]
    fn the_bench_computes_the_bounded_weighted_mean() -> anyhow::Result<()> {
        let sizes: Vec<usize> =
            pcp_simulations::ModelPreset::NanogptSmall.spec().tensor_sizes.iter().map(|n| *n as usize).collect();
        let factor = shepherd::Config::default().norm_factor;
        for encoding in [Encoding::F32, Encoding::Int8, Encoding::parse_spec("sparse").map_err(anyhow::Error::msg)?] {
            let outcome = aggregate(&sizes, 5, encoding, 11)?;
            assert_eq!(outcome.bytes, compress::encoded_len(&sizes, encoding), "{encoding:?}");
            assert_eq!((outcome.costs.len(), outcome.encode.len()), (5, 5));
            assert_eq!(outcome.feedback.is_some(), encoding.sparse().is_some());
            let mut sum: Vec<Vec<f64>> = sizes.iter().map(|n| vec![0.0; *n]).collect();
            let (mut samples, mut norms, mut scaled) = (0u64, Vec::new(), 0);
            for i in 0..5 {
                let (delta, s) = contribution(&sizes, 11, i);
                let decoded: Tensors = match encoding {
                    Encoding::F32 => delta,
                    Encoding::Sparse(settings) => Delta::Sparse(sparse::encode(&delta, settings.up).1).to_dense(&sizes),
                    dense => compress::decode(&compress::encode(&delta, dense), &sizes)?.0,
                };
                let norm = decoded.iter().flatten().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
                norms.push(norm);
                let bound = running_bound(&[], &norms, factor).unwrap_or(factor * norm);
                let scale = if norm > bound { bound / norm } else { 1.0 };
                scaled += usize::from(scale < 1.0);
                for (acc, d) in sum.iter_mut().zip(&decoded) {
                    acc.iter_mut().zip(d).for_each(|(a, d)| *a += scale * s as f64 * f64::from(*d));
                }
                samples += s;
            }
            assert!(scaled > 0, "{encoding:?}: the bound scaled nothing down; the test checks too little");
            assert_eq!(outcome.scaled, scaled, "{encoding:?}");
            let largest = sum.iter().flatten().fold(0.0f64, |m, v| m.max(v.abs())) / samples as f64;
            assert!(largest > 0.0);
            for (got, want) in outcome.mean.iter().flatten().zip(sum.iter().flatten()) {
                let want = want / samples as f64;
                assert!((f64::from(*got) - want).abs() <= 1e-5 * largest, "{encoding:?}: {got} vs {want}");
            }
            assert_eq!(outcome.mean.iter().map(Vec::len).collect::<Vec<_>>(), sizes);
        }
        Ok(())
    }
}
