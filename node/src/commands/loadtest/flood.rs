//! `pcp-node loadtest --flood RUN_ID`: fresh keys at a run's coordinators.
//!
//! Each of `--workers` identities, made fresh from `--seed` and never admitted (it
//! says no hello), is a node of its own connected to `--shepherd` and every
//! `--flood-at`. Every half second it sends each of them a real heartbeat signed
//! for the run, and gossips another on the run's topic: the load of a heartbeat
//! flood from cheap identities on the run's candidates, whose consensus shares the
//! network with it. It counts the heartbeats answered (a refusal is an answer)
//! and those that found none (dropped by a busy coordinator, or timed out), and
//! the gossip published, and prints a line of them every 10 s and at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pcp_bootstrap::{EventLoop, Multiaddr, Node, PeerId};
use pcp_protocol::{Identity, RunId};
use pcp_schema::{Heartbeat, Message as _};
use rand::{Rng as _, SeedableRng as _};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::Failure;
use crate::diloco::wire::{self, Signer};

/// The flood's options (with `--workers` identities, `--seed` and `--timeout-s`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct FloodArgs {
    /// Flood this run's coordinators: `--shepherd` and each `--flood-at`, with
    /// `--workers` fresh keys that heartbeat them and gossip, and never say hello.
    #[arg(long, value_name = "RUN_ID")]
    pub(crate) flood: Option<RunId>,
    /// Another coordinator to flood (a candidate's address, with `/p2p/<peer id>`).
    #[arg(long, value_name = "MULTIADDR", requires = "flood")]
    flood_at: Vec<Multiaddr>,
}

/// How often each key heartbeats every target and gossips.
const EVERY: Duration = Duration::from_millis(500);
/// How long a heartbeat waits for its answer, as a worker's does.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the flood prints what it did.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What every key did.
#[derive(Debug, Default)]
struct Counts {
    sent: AtomicU64,
    answered: AtomicU64,
    unanswered: AtomicU64,
    gossiped: AtomicU64,
    gossip_refused: AtomicU64,
}

impl Counts {
    fn line(&self, keys: usize) -> String {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "flood: {keys} fresh keys; heartbeats sent {}, answered {}, unanswered {}; gossip published {}, refused {}",
            n(&self.sent),
            n(&self.answered),
            n(&self.unanswered),
            n(&self.gossiped),
            n(&self.gossip_refused)
        )
    }
}

/// Runs the flood of `run` on `targets` with `keys` fresh identities from `seed`,
/// for `timeout` or until interrupted (SIGINT, SIGTERM).
pub(crate) async fn run(
    run: RunId,
    first: &Multiaddr,
    flood: &FloodArgs,
    (keys, seed, timeout): (usize, u64, Duration),
    data_dir: &std::path::Path,
) -> Result<(), Failure> {
    let targets: Vec<Multiaddr> = std::iter::once(first).chain(&flood.flood_at).cloned().collect();
    let mut peers = Vec::new();
    for t in &targets {
        let peer = t.iter().find_map(|p| match p {
            pcp_bootstrap::multiaddr::Protocol::P2p(peer) => Some(peer),
            _ => None,
        });
        peers.push(peer.ok_or_else(|| Failure::input(anyhow::anyhow!("{t} has no /p2p/<peer id>")))?);
    }
    let counts = Arc::new(Counts::default());
    let cancel = CancellationToken::new();
    let (mut tasks, mut loops) = (JoinSet::new(), JoinSet::new());
    // apart from the synthetic workers' keys of the same seed: these are never admitted
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0xf100_d5ee_d000_0000);
    for i in 0..keys {
        let identity = Identity::from_secret(rng.r#gen());
        let config = super::dial_only(targets.clone(), data_dir.join(format!("flood-{i}")));
        let (node, _events, event_loop): (Node, _, EventLoop) =
            Node::new(&identity, config).map_err(|e| Failure::input(anyhow::anyhow!("flood key {i}: {e}")))?;
        loops.spawn(event_loop.run(cancel.child_token()));
        let key = Key { node, signer: Signer::new(identity), run, peers: peers.clone(), counts: counts.clone() };
        tasks.spawn(key.run(cancel.child_token()));
        if i % 32 == 31 {
            // the coordinators handshake a few dozen connections at a time
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut sigterm = crate::commands::join::terminate_signal().map_err(Failure::input)?;
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    let mut progress = tokio::time::interval(PROGRESS_EVERY);
    loop {
        tokio::select! {
            () = &mut deadline => break,
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
            _ = progress.tick() => say(&counts.line(keys))?,
        }
    }
    cancel.cancel();
    tasks.shutdown().await;
    loops.shutdown().await;
    say(&counts.line(keys))
}

/// A line on stdout, at once (a test reads it while the flood runs).
fn say(line: &str) -> Result<(), Failure> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| Failure::from(anyhow::anyhow!("writing stdout: {e}")))
}

/// One fresh key.
struct Key {
    node: Node,
    signer: Signer,
    run: RunId,
    peers: Vec<PeerId>,
    counts: Arc<Counts>,
}

impl Key {
    fn heartbeat(&self) -> Heartbeat {
        Heartbeat::new(self.run.0, 0, wire::unix_ms())
    }

    async fn run(mut self, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut asking = JoinSet::new();
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
                Some(done) = asking.join_next() => {
                    let answered = matches!(done, Ok(Ok(Ok(_))));
                    let counter = if answered { &self.counts.answered } else { &self.counts.unanswered };
                    counter.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            for peer in self.peers.clone() {
                // as many heartbeats in flight as targets: a silent one is not piled on
                if asking.len() >= self.peers.len() {
                    break;
                }
                let hb = self.heartbeat();
                let envelope = self.signer.seal(self.run, 0, &hb);
                let node = self.node.clone();
                self.counts.sent.fetch_add(1, Ordering::Relaxed);
                asking.spawn(async move { tokio::time::timeout(ASK_TIMEOUT, node.request(peer, envelope)).await });
            }
            let hb = self.heartbeat();
            let envelope = self.signer.seal(self.run, 0, &hb);
            let published = self.node.publish(self.run, envelope.encode()).await;
            let counter = if published.is_ok() { &self.counts.gossiped } else { &self.counts.gossip_refused };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}
