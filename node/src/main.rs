//! `pcp-node`: one binary for every role in a pcp network.

mod bench;
mod checkpoint;
mod config;
mod data;
mod engine;
mod events;
mod generate;
mod graph;
mod model;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A peer in the pcp training network.
#[derive(Debug, Parser)]
#[command(name = "pcp-node", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Import, inspect and differentiate StableHLO models.
    #[command(subcommand)]
    Graph(graph::GraphCommand),
    /// Train a model on this node alone.
    Train(train::TrainArgs),
    /// Sample text from a checkpoint.
    Generate(generate::GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// An error with the exit code it maps to: 2 for bad input, 1 otherwise.
#[derive(Debug)]
pub(crate) struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl Failure {
    /// Bad input from the user: exit code 2.
    pub(crate) fn input(error: impl Into<anyhow::Error>) -> Self {
        Self { code: 2, error: error.into() }
    }
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(error: E) -> Self {
        Self { code: 1, error: error.into() }
    }
}

/// `$XDG_DATA_HOME/pcp`, `~/.local/share/pcp`, or `.pcp` without a home.
pub(crate) fn default_data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("pcp");
    }
    match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        Some(home) => PathBuf::from(home).join(".local/share/pcp"),
        None => PathBuf::from(".pcp"),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Graph(command)) => graph::run(command),
        Some(Command::Train(args)) => train::run(args),
        Some(Command::Generate(args)) => generate::run(args),
        Some(Command::Bench(command)) => bench::run(command),
        None => Err(Failure::input(anyhow::anyhow!("no command given; see `pcp-node --help`"))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let chain: Vec<String> = failure.error.chain().map(ToString::to_string).collect();
            let mut message = chain.join(": ").replace('\n', " ");
            // anyhow's context often repeats its source; say each part once.
            for part in &chain[1..] {
                let doubled = format!("{part}: {part}");
                message = message.replace(&doubled, part);
            }
            eprintln!("error: {message}");
            ExitCode::from(failure.code)
        }
    }
}
