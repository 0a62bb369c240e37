//! `pcp-node`: one binary for shepherds, workers and operators.
#![allow(
    clippy::print_stdout,
    reason = "stdout belongs to the user: the CLI prints results there"
)]

mod bench;
mod blob;
mod events;
mod join;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A pcp peer. Without a subcommand it joins the network.
#[derive(Debug, Parser)]
#[command(name = "pcp-node", version, about)]
struct Cli {
    #[command(flatten)]
    net: join::NetArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Add blobs to the store or fetch them from the network.
    Blob(blob::BlobArgs),
    /// Benchmarks.
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,libp2p_kad=error")),
        )
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match &cli.command {
            None => join::run(&cli.net).await,
            Some(Command::Blob(args)) => blob::run(args, &cli.net).await,
            Some(Command::Bench(args)) => bench::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<join::Usage>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
