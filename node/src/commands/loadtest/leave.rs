//! `pcp-node loadtest --leave-after-hello`: identities that say hello once and are
//! gone, the lockout attack on a run's admission.
//!
//! Each of `--workers` fresh identities from `--seed` is a node of its own: it
//! dials `--shepherd`, says one hello (with no proof of work: run the shepherd with
//! `--pow-bits 0`), records the answer (the run's manifest, or the refusal's code)
//! and closes its swarm without a heartbeat. `--hello-concurrency` of them are at it
//! at once, so the process holds that many swarms, not `--workers`. A shepherd that
//! keeps every such hello fills up and refuses the worker that comes next; one that
//! releases them does not (`node/tests/attacks_cli.rs`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use pcp_bootstrap::{EventLoop, Multiaddr, Node, PeerId};
use pcp_protocol::{Identity, RunId};
use pcp_schema::{Ack, Backend, Capabilities, MessageKind, NodeHello};
use rand::{Rng as _, SeedableRng as _};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Failure;
use crate::diloco::wire::{self, Signer};

/// The one-time hellos' options (with `--workers` identities, `--seed` and `--timeout-s`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct LeaveArgs {
    /// Each of `--workers` fresh identities says one hello, records the answer and
    /// leaves without a heartbeat (run the shepherd with `--pow-bits 0`).
    #[arg(long)]
    pub(crate) leave_after_hello: bool,
    /// `--leave-after-hello`: identities saying hello at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1024))]
    hello_concurrency: u64,
}

/// How long one identity waits to connect and have its hello answered (the first
/// ones wait for the artifact's compile).
const HELLO_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the progress line is printed (stderr).
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What the hellos got.
#[derive(Debug, Default, serde::Serialize)]
struct Outcome {
    /// Answered with the run's manifest.
    admitted: u64,
    /// Answered with a refusal, by its code.
    refused: BTreeMap<String, u64>,
    /// Never answered within [`HELLO_TIMEOUT`].
    unanswered: u64,
    seconds: f64,
}

/// Says `keys` one-time hellos to `shepherd` at `addr`.
pub(crate) async fn run(
    (addr, shepherd): (&Multiaddr, PeerId),
    args: &LeaveArgs,
    (keys, seed, timeout): (usize, u64, Duration),
    data_dir: &Path,
    json: Option<&Path>,
) -> Result<(), Failure> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x1ea7_e5a1_d0e5_ca11);
    let mut outcome = Outcome::default();
    let mut hellos = JoinSet::new();
    let mut progress = tokio::time::interval(PROGRESS_EVERY);
    let mut next = 0;
    while next < keys || !hellos.is_empty() {
        if Instant::now() > deadline {
            break;
        }
        if next < keys && hellos.len() < args.hello_concurrency as usize {
            let identity = Identity::from_secret(rng.r#gen());
            let dir = data_dir.join(format!("hello-{next}"));
            hellos.spawn(hello_once(identity, addr.clone(), shepherd, dir));
            next += 1;
            continue;
        }
        tokio::select! {
            _ = progress.tick() => tracing::info!(
                "loadtest: {next} of {keys} hellos said; {} answered with the manifest, refused {:?}, {} unanswered",
                outcome.admitted, outcome.refused, outcome.unanswered
            ),
            _ = tokio::signal::ctrl_c() => break,
            done = hellos.join_next() => match done {
                Some(Ok(Answer::Manifest)) => outcome.admitted += 1,
                Some(Ok(Answer::Refused(code))) => *outcome.refused.entry(code).or_default() += 1,
                Some(Ok(Answer::None)) => outcome.unanswered += 1,
                Some(Err(e)) => return Err(Failure::from(anyhow::anyhow!("a hello's task: {e}"))),
                None => {}
            },
        }
    }
    hellos.shutdown().await;
    outcome.seconds = started.elapsed().as_secs_f64();
    println!(
        "{next} one-time hellos in {:.1} s: {} answered with the manifest, refused {:?}, {} unanswered",
        outcome.seconds, outcome.admitted, outcome.refused, outcome.unanswered
    );
    if let Some(path) = json {
        let text = serde_json::to_vec_pretty(&outcome).map_err(|e| Failure::from(anyhow::anyhow!("{e}")))?;
        std::fs::write(path, text).map_err(|e| Failure::from(anyhow::anyhow!("writing {}: {e}", path.display())))?;
    }
    Ok(())
}

#[derive(Debug)]
enum Answer {
    Manifest,
    Refused(String),
    None,
}

/// One identity's hello: connect, say it, take the answer, close.
async fn hello_once(identity: Identity, addr: Multiaddr, shepherd: PeerId, dir: std::path::PathBuf) -> Answer {
    let config = super::dial_only(vec![addr], dir.clone());
    let built: Result<(Node, _, EventLoop), _> = Node::new(&identity, config);
    let Ok((node, _events, event_loop)) = built else { return Answer::None };
    let cancel = CancellationToken::new();
    let swarm = tokio::spawn(event_loop.run(cancel.clone()));
    let mut signer = Signer::new(identity);
    let hello = NodeHello {
        peer: signer.identity().public().0,
        protocol_version: wire::PROTOCOL_VERSION,
        agent: "pcp-node loadtest --leave-after-hello".into(),
        capabilities: Capabilities {
            backends: vec![Backend { name: "cpu".into(), targets: vec![String::new()] }],
            free_memory_bytes: 0,
            aggregate: false,
        },
        certificate: Vec::new(),
        pow_nonce: 0,
    };
    let ask = async {
        // the connection may still be opening: a few tries
        loop {
            match node.request(shepherd, signer.seal(RunId([0; 32]), 0, &hello)).await {
                Ok(answer) => return answer,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    };
    let answer = match tokio::time::timeout(HELLO_TIMEOUT, ask).await {
        Ok(a) if a.kind() == MessageKind::RunManifest => Answer::Manifest,
        Ok(a) => Answer::Refused(a.decode::<Ack>().map_or_else(|e| e.to_string(), |ack| format!("{:?}", ack.code))),
        Err(_) => Answer::None,
    };
    cancel.cancel();
    drop(node);
    let _ = swarm.await;
    let _ = std::fs::remove_dir_all(&dir);
    answer
}
