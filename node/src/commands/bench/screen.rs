//! `pcp-node bench screen`: what one contribution's screen costs, in its parts,
//! as `scoring::losses` runs it. The round's parameters are resident on the
//! device (uploaded once a round, not timed); a seeded synthetic contribution,
//! encoded in `--encoding` and decoded as the shepherd decodes it, is uploaded
//! and scored by three forward passes that move the parameters on the device.
//! A sparse one in a top-k layout goes up as its kept indices and values
//! (`eval_sparse` scatters them); any other, and the same one made dense (what
//! a screen of another layout or of a fragment uploads), as a dense tensor a
//! parameter (`eval_moved`). The host parts (its entries or its dense copy
//! made, then uploaded) are what a screen costs the shepherd's event loop or a
//! screener's training loop, whatever the device's speed.

use std::io::Write as _;
use std::time::Instant;

use pcp_protocol::diloco::aggregate::Delta;
use pcp_protocol::diloco::compress::{self, Encoding};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::Failure;
use crate::commands::join::NetArgs;
use crate::commands::train::{DeviceArgs, load_screening_engine};
use crate::diloco::scoring;
use crate::training::config::Experiment;
use crate::training::data::Batch;
use crate::training::model::Model;

/// One contribution's screen, in its parts: seconds per contribution.
#[derive(Debug, clap::Args)]
pub(crate) struct ScreenArgs {
    /// nanogpt-small, nanogpt-medium, gpt2-124m, or a .mlir loss module.
    #[arg(long, default_value = "nanogpt-small")]
    model: String,
    /// The vocabulary (gpt2-124m's 50257; the demo corpus's 65 by default).
    #[arg(long, default_value_t = 65)]
    vocab: usize,
    /// fp32, bf16, int8, sparse or sparse:chunk=N,k=N,bits=2|4|8,decay=F,down=N.
    #[arg(long, default_value = "sparse", value_parser = Encoding::parse_spec)]
    encoding: Encoding,
    /// Sequences a batch (default: the preset's).
    #[arg(long)]
    batch: Option<usize>,
    /// Screens timed of each kind (the median is shown).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    screens: u32,
    #[command(flatten)]
    device: DeviceArgs,
}

/// One screen's parts, seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Parts {
    made: f64,
    upload: f64,
    forward: f64,
}

pub(crate) async fn run(args: ScreenArgs, net: &NetArgs) -> Result<(), Failure> {
    let experiment = Experiment { model: Some(args.model.clone()), ..Experiment::default() };
    let model = Model::load_with_batch(&args.model, args.vocab, args.batch).map_err(Failure::input)?;
    let (rows, block) = model.batch_block()?;
    let sparse_screen = crate::diloco::wire::sparse_screen(args.encoding);
    let engine = load_screening_engine(&experiment, &model, &args.device, &net.data_dir, None, (1, sparse_screen))
        .await
        .map_err(Failure::input)?;
    let sizes = engine.sizes();
    let base = engine.resident(engine.params().await?).await?;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let tokens: Vec<u16> = (0..rows * (block + 1)).map(|_| rng.gen_range(0..args.vocab.min(65_536)) as u16).collect();
    let batch =
        Batch::from_windows(rows, &tokens).ok_or_else(|| Failure::input(anyhow::anyhow!("the synthetic batch")))?;
    let delta: Vec<Vec<f32>> =
        sizes.iter().map(|n| (0..*n).map(|_| 1e-3 * rng.gen_range(-1.0f32..1.0)).collect()).collect();
    let bytes = compress::encode(&delta, args.encoding);
    let whole = compress::decode_delta(&bytes, &sizes, args.encoding).map_err(Failure::input)?;
    let made_dense = Delta::Dense(whole.to_dense(&sizes));
    drop(delta);
    let mut out = std::io::stdout().lock();
    let params: usize = sizes.iter().sum();
    writeln!(
        out,
        "{}: {params} parameters, {} ({} bytes a contribution), on {}",
        args.model,
        args.encoding.spec(),
        bytes.len(),
        args.device.backend
    )?;
    writeln!(out, "{:<12} {:>9} {:>9} {:>9} {:>9}", "uploaded as", "made s", "upload s", "host s", "3 passes s")?;
    let first = if sparse_screen.is_some() && !matches!(whole, Delta::Dense(_)) { "sparse" } else { "dense" };
    for (name, contribution) in [(first, &whole), ("made dense", &made_dense)] {
        let mut timed = Vec::new();
        for _ in 0..args.screens {
            timed.push(screen(&engine, &base, contribution, &batch).await?);
        }
        let median = |f: fn(&Parts) -> f64| {
            let mut v: Vec<f64> = timed.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (d, u, f) = (median(|p| p.made), median(|p| p.upload), median(|p| p.forward));
        writeln!(out, "{name:<12} {d:>9.3} {u:>9.3} {:>9.3} {f:>9.3}", d + u)?;
    }
    Ok(())
}

/// One screen of `delta` at `base`, timed as `scoring::losses` runs it.
async fn screen(
    engine: &crate::training::engine::Engine,
    base: &crate::training::engine::Resident,
    delta: &Delta,
    batch: &Batch,
) -> anyhow::Result<Parts> {
    let started = Instant::now();
    let prepared = scoring::Prepared::of(engine, delta)?;
    let made_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let uploaded = prepared.upload(engine).await?;
    let upload = started.elapsed().as_secs_f64();
    let started = Instant::now();
    for alpha in [0.0, -1.0, 1.0] {
        let loss = engine.eval_moved(base, &uploaded, alpha, batch).await?;
        anyhow::ensure!(loss.is_finite(), "a non-finite loss at {alpha} × the contribution");
    }
    Ok(Parts { made: made_s, upload, forward: started.elapsed().as_secs_f64() })
}
