//! `pcp-node blob put|get`: operator commands for the blob store.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use pcp_bootstrap::{BlobStore, Event, StoreError};
use pcp_protocol::BlobHash;

use crate::commands::join::{DataDirArg, NetFlags, Running, Usage, Uses};

/// Blob store operations.
#[derive(Debug, Args)]
pub(crate) struct BlobArgs {
    #[command(subcommand)]
    command: BlobCommand,
}

#[derive(Debug, Subcommand)]
enum BlobCommand {
    /// Add a file to this node's blob store and print its content id; a running node
    /// provides every blob in its store.
    Put {
        /// The file to add.
        file: PathBuf,
        #[command(flatten)]
        data_dir: DataDirArg,
    },
    /// Join the network, fetch a blob from its providers, verify it and write it out.
    Get {
        /// The blob's content id (64 hex digits).
        hash: BlobHash,
        /// Where to write it.
        #[arg(short, long, value_name = "FILE")]
        output: PathBuf,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        #[command(flatten)]
        net: NetFlags,
    },
}

/// Runs a blob subcommand.
/// `root` holds the flags given before `blob`.
pub(crate) async fn run(args: &BlobArgs, root: &NetFlags) -> anyhow::Result<()> {
    match &args.command {
        BlobCommand::Put { file, data_dir } => {
            let net = root.resolve(data_dir.clone().into(), "blob put", Uses::DataDir)?;
            let store = BlobStore::open(&net.data_dir)?;
            let (hash, size) = store.put_file(file).map_err(|e| match e {
                StoreError::Io { ref path, .. } if path == file => anyhow::Error::new(Usage(e.to_string())),
                StoreError::TooLarge { .. } => anyhow::Error::new(Usage(e.to_string())),
                other => other.into(),
            })?;
            println!("{}", hash.to_hex());
            eprintln!("added {} ({size} bytes) to {}", file.display(), net.data_dir.display());
            Ok(())
        }
        BlobCommand::Get { hash, output, timeout, net } => {
            let net = &root.resolve(net.clone(), "blob get", Uses::Network)?;
            let _metrics = crate::observe::metrics::serve(net.metrics).await?;
            let store = BlobStore::open(&net.data_dir)?;
            if !store.contains(hash) && net.bootstrap.is_empty() {
                return Err(Usage(format!(
                    "blob {hash} is not in {} and no --bootstrap peer was given",
                    net.data_dir.display()
                ))
                .into());
            }
            let mut running = Running::start(net)?;
            let node = running.node.clone();
            let fetch = node.fetch(*hash, Duration::from_secs(*timeout));
            tokio::pin!(fetch);
            let spinner = crate::observe::progress::spinner(format!("fetching {hash:#}"));
            let report = loop {
                tokio::select! {
                    r = &mut fetch => break r,
                    Some(event) = running.events.recv() => running.log.write(&event)?,
                }
            };
            spinner.finish_and_clear();
            while let Ok(event) = running.events.try_recv() {
                running.log.write(&event)?;
            }
            let report = match report {
                Ok(r) => r,
                Err(e) => {
                    running.stop().await;
                    return Err(e.into());
                }
            };
            if report.providers == 0 {
                // it was already local: still record the event for the stream
                running.log.write(&Event::BlobFetched {
                    hash: *hash,
                    bytes: report.bytes,
                    providers: 0,
                    seconds: 0.0,
                    chunks: 0,
                    chunks_relayed: 0,
                })?;
            }
            std::fs::copy(&report.path, output).with_context(|| format!("writing {}", output.display()))?;
            let relayed = match report.chunks_relayed {
                0 => String::new(),
                n => format!(" ({n} of {} chunks through a relay)", report.chunks_fetched),
            };
            println!(
                "fetched {hash:#}: {} bytes from {} providers in {:.2} s{relayed} -> {}",
                report.bytes,
                report.providers,
                report.seconds,
                output.display()
            );
            running.stop().await;
            Ok(())
        }
    }
}
