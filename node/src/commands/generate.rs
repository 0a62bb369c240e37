//! `pcp-node generate`: sample text from a checkpoint.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use pcp_runtime::HostTensor;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

use crate::Failure;
use crate::commands::join::NetArgs;
use crate::commands::train::{DeviceArgs, load_engine};
use crate::training::checkpoint::Checkpoint;
use crate::training::config::Experiment;
use crate::training::data::Vocab;
use crate::training::model::Model;

#[derive(Debug, clap::Args)]
pub(crate) struct GenerateArgs {
    /// A checkpoint directory (or a directory of checkpoints).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// Softmax temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample from the k most likely tokens only.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    device: DeviceArgs,
}

/// Samples; `net` supplies the data directory (artifact cache).
pub(crate) async fn run(args: GenerateArgs, net: &NetArgs) -> Result<(), Failure> {
    let checkpoint = Checkpoint::load(&args.checkpoint).map_err(Failure::input)?;
    let experiment: Experiment =
        serde_json::from_value(checkpoint.meta["experiment"].clone()).context("checkpoint has no experiment")?;
    // The run's vocab.json sits beside its checkpoints; older ones carry it in meta.
    let vocab_file = args.checkpoint.join("vocab.json");
    let vocab: Vocab = if vocab_file.is_file() {
        Vocab::load(&vocab_file).map_err(Failure::input)?
    } else {
        serde_json::from_value(checkpoint.meta["vocab"].clone()).context("checkpoint has no vocabulary")?
    };
    let source = checkpoint.meta["model"].as_str().context("checkpoint names no model")?.to_owned();
    let model = Model::load(&source, vocab.size()).map_err(Failure::input)?;
    if model.module.function("logits").is_none() {
        return Err(Failure::input(anyhow::anyhow!(
            "model {source} has no @logits function, so it cannot generate; use a built-in model"
        )));
    }
    let (batch, block) = model.batch_block()?;
    let int64 = model.data.first().is_some_and(|t| t.element.name() == "i64");
    let data_dir = net.data_dir.clone();
    let engine = load_engine(&experiment, &model, &args.device, &data_dir, Some(&checkpoint), 1).await?;
    let mut context = vocab.encode(&args.prompt).map_err(Failure::input)?;
    if context.is_empty() {
        return Err(Failure::input(anyhow::anyhow!("the prompt is empty")));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let mut out = std::io::stdout().lock();
    write!(out, "{}", args.prompt)?;
    let vocab_size = vocab.size();
    for _ in 0..args.tokens {
        let window = &context[context.len().saturating_sub(block)..];
        let last = window.len() - 1;
        // Right-pad: causal attention keeps padding from reaching `last`.
        let mut ids = vec![0i64; batch * block];
        for (i, t) in window.iter().enumerate() {
            ids[i] = i64::from(*t);
        }
        let inputs = if int64 {
            HostTensor::i64(vec![batch, block], ids)?
        } else {
            HostTensor::i32(vec![batch, block], ids.iter().map(|v| *v as i32).collect())?
        };
        let logits = engine.logits(inputs).await?;
        let row = &logits[last * vocab_size..(last + 1) * vocab_size];
        let token = sample(row, args.temperature, args.top_k, &mut rng);
        context.push(token as u16);
        let text = vocab.decode(&[token as u16]).unwrap_or_default();
        write!(out, "{text}")?;
        out.flush()?;
    }
    writeln!(out)?;
    Ok(())
}

/// Samples an index from `logits` with temperature and top-k.
fn sample(logits: &[f32], temperature: f64, top_k: Option<usize>, rng: &mut ChaCha8Rng) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]));
    if temperature <= 0.0 {
        return order[0];
    }
    order.truncate(top_k.unwrap_or(logits.len()).max(1));
    let max = f64::from(logits[order[0]]);
    let weights: Vec<f64> = order.iter().map(|i| ((f64::from(logits[*i]) - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (i, w) in order.iter().zip(&weights) {
        if u < *w {
            return *i;
        }
        u -= w;
    }
    order[order.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_top_k() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let logits = [0.1, 3.0, 2.9, -1.0];
        assert_eq!(sample(&logits, 0.0, None, &mut rng), 1);
        for _ in 0..100 {
            let t = sample(&logits, 1.0, Some(2), &mut rng);
            assert!(t == 1 || t == 2);
        }
    }
}
