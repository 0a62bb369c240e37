//! `pcp-node bench …`: benchmarks.

mod blob;
mod step;

use crate::Failure;
use crate::join::NetArgs;

#[derive(Debug, clap::Subcommand)]
pub(crate) enum BenchCommand {
    /// Tokens per second and peak RSS of the fused training step.
    Step(step::StepArgs),
    /// Blob transfer throughput between two nodes vs raw TCP loopback.
    Blob(blob::BlobArgs),
}

pub(crate) async fn run(command: BenchCommand, net: &NetArgs) -> Result<(), Failure> {
    match command {
        BenchCommand::Step(args) => step::run(args, net).await,
        BenchCommand::Blob(args) => Ok(blob::run(&args).await?),
    }
}
