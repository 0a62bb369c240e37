//! `pcp-node`: one binary for every role in a pcp network.

mod graph;

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

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Graph(command)) => graph::run(command),
        None => Err(Failure::input(anyhow::anyhow!("no command given; see `pcp-node --help`"))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let chain: Vec<String> = failure.error.chain().map(ToString::to_string).collect();
            eprintln!("error: {}", chain.join(": ").replace('\n', " "));
            ExitCode::from(failure.code)
        }
    }
}
