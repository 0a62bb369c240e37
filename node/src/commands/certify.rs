//! `pcp-node certify`: an authorizer signs a worker's join certificate.
//!
//! A run started with `--admit authorizer KEY` admits a worker whose hello carries
//! an unexpired certificate for its key and the run, signed by KEY. The authorizer
//! runs this with its own data directory (its identity), and gives the worker the
//! file for `--certificate`.

use std::path::PathBuf;

use anyhow::Context as _;
use pcp_protocol::RunId;
use pcp_protocol::admit::JoinCertificate;

use crate::Failure;
use crate::diloco::wire;

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct CertifyArgs {
    /// The worker's key: its peer id or hex public key.
    #[arg(long)]
    key: String,
    /// The run, by id (hex).
    #[arg(long, value_name = "RUN_ID")]
    run: String,
    /// How long the certificate holds, in seconds.
    #[arg(long, default_value_t = 7 * 24 * 3600)]
    expires_in_s: u64,
    /// Write the certificate here (hex) [default: stdout].
    #[arg(long)]
    out: Option<PathBuf>,
}

pub(crate) fn run(args: &CertifyArgs, data_dir: &std::path::Path) -> Result<(), Failure> {
    let authorizer = pcp_bootstrap::load_or_create(data_dir)?;
    let key = crate::diloco::parse_key(&args.key, "--key")?;
    let run: RunId = args.run.parse().map_err(|e| Failure::input(anyhow::anyhow!("--run {:?}: {e}", args.run)))?;
    let expires = wire::unix_ms().saturating_add(args.expires_in_s.saturating_mul(1000));
    let certificate = JoinCertificate::issue(&authorizer, run, key, expires);
    let text = hex::encode(certificate.to_bytes());
    match &args.out {
        Some(path) => {
            std::fs::write(path, format!("{text}\n")).with_context(|| format!("writing {}", path.display()))?
        }
        None => {
            use std::io::Write as _;
            writeln!(std::io::stdout().lock(), "{text}").context("writing the certificate")?;
        }
    }
    tracing::info!("certified {} for run {run} until {expires} (authorizer {})", args.key, authorizer.public());
    Ok(())
}
