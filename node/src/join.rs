//! The default command: join the network, report reachability, provide the blob store
//! and log events; then work as a DiLoCo worker (or, with `--shepherd`, run a shepherd)
//! until the run ends or the node is interrupted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pcp_bootstrap::multiaddr::Protocol;
use pcp_bootstrap::{Config, Event, EventLoop, Multiaddr, Node, Reachability, StartError, load_or_create};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::Failure;
use crate::diloco::{Begin, RoleIo, ShepherdArgs, ShepherdHooks, ShepherdPlan, WorkerArgs, WorkerPlan};
use crate::events::{EventLog, Events};

/// How long the reachability self-test waits for a dial-back.
const REACHABILITY_WAIT: Duration = Duration::from_secs(15);

/// An error in what the user typed or gave us (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Usage(pub(crate) String);

/// The data directory flag, for every command that keeps state.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct DataDirArg {
    /// Data directory: identity key, blob store and caches [default: ~/.pcp]
    #[arg(long, value_name = "DIR")]
    pub(crate) data_dir: Option<PathBuf>,
}

/// The events flag, for the commands that record events.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct EventsArg {
    /// Write events to this file as JSON lines.
    #[arg(long, value_name = "FILE")]
    pub(crate) events: Option<PathBuf>,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (rounds, losses, bytes,
    /// rejections by reason, peers, fetch throughput, step throughput).
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
}

/// The flags of the commands that run a local job: data directory and events.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct LocalArgs {
    #[command(flatten)]
    pub(crate) data_dir: DataDirArg,
    #[command(flatten)]
    pub(crate) events: EventsArg,
}

/// The flags of the commands that join the network. Each command declares only the
/// flags it uses; the flags may also come before the subcommand
/// (`pcp-node --data-dir D train …`), where they apply to it if it has them.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct NetFlags {
    /// Seed peer to join through (repeatable), e.g. /ip4/1.2.3.4/udp/4001/quic-v1/p2p/12D3...
    #[arg(long = "bootstrap", value_name = "MULTIADDR")]
    pub(crate) bootstrap: Vec<Multiaddr>,
    /// Address to listen on (repeatable); default: QUIC and TCP on every interface.
    #[arg(long = "listen", value_name = "MULTIADDR")]
    pub(crate) listen: Vec<Multiaddr>,
    #[command(flatten)]
    pub(crate) local: LocalArgs,
}

impl From<DataDirArg> for NetFlags {
    fn from(data_dir: DataDirArg) -> Self {
        Self { local: LocalArgs { data_dir, events: EventsArg::default() }, ..Self::default() }
    }
}

impl From<LocalArgs> for NetFlags {
    fn from(local: LocalArgs) -> Self {
        Self { local, ..Self::default() }
    }
}

/// Which of the [`NetFlags`] a command has.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Uses {
    /// None: the command neither keeps state nor joins the network.
    Nothing,
    /// `--data-dir`.
    DataDir,
    /// `--data-dir` and `--events`.
    Local,
    /// All of them.
    Network,
}

impl NetFlags {
    /// The flags given before the subcommand (`self`) merged into those given to
    /// `command` (`own`, which wins). A flag before the subcommand that `command` does
    /// not have is a usage error rather than silently ignored.
    pub(crate) fn resolve(&self, own: NetFlags, command: &str, uses: Uses) -> Result<NetArgs, Usage> {
        let (peers, data_dir, events) = match uses {
            Uses::Nothing => (false, false, false),
            Uses::DataDir => (false, true, false),
            Uses::Local => (false, true, true),
            Uses::Network => (true, true, true),
        };
        let unused = [
            (!peers && !self.bootstrap.is_empty(), "--bootstrap"),
            (!peers && !self.listen.is_empty(), "--listen"),
            (!data_dir && self.local.data_dir.data_dir.is_some(), "--data-dir"),
            (!events && self.local.events.events.is_some(), "--events"),
            (!events && self.local.events.metrics_addr.is_some(), "--metrics-addr"),
        ];
        if let Some((_, flag)) = unused.into_iter().find(|(given, _)| *given) {
            return Err(Usage(format!(
                "{flag} is not an option of `pcp-node {command}` (see `pcp-node {command} --help`)"
            )));
        }
        let mut bootstrap = self.bootstrap.clone();
        bootstrap.extend(own.bootstrap);
        let mut listen = self.listen.clone();
        listen.extend(own.listen);
        Ok(NetArgs {
            bootstrap,
            listen,
            data_dir: own
                .local
                .data_dir
                .data_dir
                .or_else(|| self.local.data_dir.data_dir.clone())
                .unwrap_or_else(default_data_dir),
            events: own.local.events.events.or_else(|| self.local.events.events.clone()),
            metrics: own.local.events.metrics_addr.or(self.local.events.metrics_addr),
        })
    }
}

/// Network options, resolved from [`NetFlags`].
#[derive(Debug, Clone)]
pub(crate) struct NetArgs {
    /// Seed peers.
    pub(crate) bootstrap: Vec<Multiaddr>,
    /// Listen addresses; empty for the default.
    pub(crate) listen: Vec<Multiaddr>,
    /// Data directory: identity key and blob store.
    pub(crate) data_dir: PathBuf,
    /// Where events go as JSON lines.
    pub(crate) events: Option<PathBuf>,
    /// Where Prometheus metrics are served.
    pub(crate) metrics: Option<std::net::SocketAddr>,
}

fn default_data_dir() -> PathBuf {
    std::env::var_os("HOME").map_or_else(|| PathBuf::from(".pcp"), |h| Path::new(&h).join(".pcp"))
}

impl NetArgs {
    pub(crate) fn config(&self) -> Config {
        let mut config = Config::new(self.data_dir.clone());
        if !self.listen.is_empty() {
            config.listen = self.listen.clone();
        }
        config.bootstrap = self.bootstrap.clone();
        config
    }
}

/// A started node: its handle, events, log and task.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) node: Node,
    pub(crate) identity: pcp_protocol::Identity,
    pub(crate) events: mpsc::Receiver<Event>,
    pub(crate) log: EventLog,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    pub(crate) fn start(args: &NetArgs) -> anyhow::Result<Self> {
        let identity = load_or_create(&args.data_dir)?;
        let (node, events, event_loop): (Node, _, EventLoop) =
            Node::new(&identity, args.config()).map_err(|e| match e {
                // the kernel's words for the address the user typed: `address already in use`
                StartError::Listen { addr, reason } => anyhow::Error::new(Usage(format!("--listen {addr}: {reason}"))),
                e => e.into(),
            })?;
        let log = EventLog::open(args.events.as_deref(), node.peer_id())?;
        let cancel = CancellationToken::new();
        let task = tokio::spawn(event_loop.run(cancel.clone()));
        Ok(Self { node, identity, events, log, cancel, task })
    }

    pub(crate) async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

fn print_reachability(r: &Reachability, peer: &pcp_bootstrap::PeerId) {
    match r {
        Reachability::Public(addr) => {
            let mut addr = addr.clone();
            if !matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
                addr.push(Protocol::P2p(*peer));
            }
            println!("reachability: dialable at {addr} (confirmed by a peer's dial-back)");
        }
        Reachability::Private => println!(
            "reachability: NOT dialable: peers could not dial back; others cannot reach this node (outbound only)"
        ),
        Reachability::Unknown => println!("reachability: unknown"),
    }
}

/// What a node does besides routing and serving blobs.
#[derive(Debug)]
pub(crate) enum Role {
    /// Nothing more.
    Relay,
    /// Shepherd a run.
    Shepherd(Box<ShepherdPlan>, ShepherdHooks),
    /// Find runs and train in them.
    Worker(WorkerPlan),
    /// Stand by as a coordinator candidate of a run (the first the DHT knows when
    /// `None`), ready to lead it.
    Candidate(Option<pcp_protocol::RunId>, ShepherdHooks),
}

impl Role {
    /// The role the flags ask for.
    pub(crate) fn from_args(net: &NetArgs, shepherd: &ShepherdArgs, worker: &WorkerArgs) -> Result<Self, Failure> {
        if shepherd.shepherd {
            if shepherd.candidate.iter().any(String::is_empty) {
                return Err(Failure::input(anyhow::anyhow!(
                    "with --shepherd, --candidate names a candidate: a peer id, a hex public key or an identity.key"
                )));
            }
            return Ok(Self::Shepherd(Box::new(ShepherdPlan::new(shepherd, &net.data_dir)?), ShepherdHooks::default()));
        }
        if !shepherd.candidate.is_empty() {
            if shepherd.candidate.iter().any(|c| !c.is_empty()) {
                return Err(Failure::input(anyhow::anyhow!(
                    "--candidate takes a value only with --shepherd; a standby is `--candidate --run RUN_ID`"
                )));
            }
            let run = worker.run.as_deref().ok_or_else(|| {
                Failure::input(anyhow::anyhow!("a standby candidate needs the run: --candidate --run RUN_ID"))
            })?;
            let run = run.parse().map_err(|e| Failure::input(anyhow::anyhow!("--run {run:?}: {e}")))?;
            return Ok(Self::Candidate(Some(run), ShepherdHooks::default()));
        }
        if worker.no_train {
            return Ok(Self::Relay);
        }
        Ok(Self::Worker(WorkerPlan::new(worker)?))
    }
}

/// Runs a node with `role` until the role is done, `cancel` fires, or (with
/// `interactive`) the process is interrupted. Without `interactive` nothing is
/// printed but the role's own output.
/// Listen addresses are sent to `listening` as they come up.
pub(crate) async fn run_node(
    args: &NetArgs,
    role: Role,
    interactive: bool,
    listening: Option<mpsc::Sender<Multiaddr>>,
    cancel: CancellationToken,
) -> Result<(), Failure> {
    let _metrics = crate::metrics::serve(args.metrics).await.map_err(Failure::input)?;
    // a node of its own reports to wandb when it may lead (`sim` starts one for all)
    let _wandb = match &role {
        Role::Shepherd(plan, _) if interactive => crate::wandb::Bridge::start(Some(plan.experiment()), "shepherd"),
        Role::Candidate(..) if interactive => crate::wandb::Bridge::start(None, "shepherd"),
        _ => None,
    };
    let mut running = Running::start(args).map_err(Failure::input)?;
    let events = Events::open(args.events.as_deref()).map_err(Failure::input)?;
    let (requests_tx, requests_rx) = mpsc::channel(256);
    let io = RoleIo {
        node: running.node.clone(),
        identity: running.identity.clone(),
        data_dir: args.data_dir.clone(),
        events,
    };
    let role_cancel = cancel.child_token();
    let work = async move {
        match role {
            Role::Relay => {
                role_cancel.cancelled().await;
                Ok(())
            }
            Role::Shepherd(plan, hooks) => {
                crate::diloco::candidate_run(Begin::Lead(plan), io, requests_rx, hooks, role_cancel).await
            }
            Role::Candidate(run, hooks) => {
                crate::diloco::candidate_run(Begin::Standby(run), io, requests_rx, hooks, role_cancel).await
            }
            Role::Worker(plan) => crate::diloco::worker_run(plan, io, requests_rx, role_cancel).await,
        }
    };
    let result = pump(&mut running, args, interactive, (requests_tx, listening), work, cancel).await;
    running.stop().await;
    result
}

/// SIGTERM as a stream.
pub(crate) fn terminate_signal() -> anyhow::Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("installing the SIGTERM handler")
}

/// Logs network events, hands requests to the role, and runs `work` to completion.
async fn pump(
    running: &mut Running,
    args: &NetArgs,
    interactive: bool,
    (requests, listening): (mpsc::Sender<Event>, Option<mpsc::Sender<Multiaddr>>),
    work: impl std::future::Future<Output = anyhow::Result<()>>,
    cancel: CancellationToken,
) -> Result<(), Failure> {
    let peer = running.node.peer_id();
    // the dashboard, when it is up, owns stdout and shows these itself
    let say = interactive && !crate::tui::owns_stdout();
    if say {
        println!("peer id: {peer}");
    }
    let mut reach_timer = Box::pin(tokio::time::sleep(REACHABILITY_WAIT));
    let mut reach_done = !say;
    if say && args.bootstrap.is_empty() {
        println!("reachability: seed node (no --bootstrap): no peer to dial back yet; waiting for others");
    }
    // only an interactive node owns the process's signals; `sim` handles them itself
    let mut sigterm = if interactive { Some(terminate_signal()?) } else { None };
    tokio::pin!(work);
    loop {
        tokio::select! {
            result = &mut work => return Ok(result?),
            event = running.events.recv() => {
                let event = match event {
                    None => break,
                    // a full queue means the role is behind: the request is dropped and
                    // the peer's stream resets, which it treats as a failure
                    Some(e @ Event::Request { .. }) => {
                        requests.try_send(e).unwrap_or_else(|_| tracing::debug!("request dropped: the role is busy"));
                        continue;
                    }
                    // gossip is logged and also handed to the role (workers check leases in it)
                    Some(Event::Gossip { run, from, message }) => {
                        let copy = Event::Gossip { run, from, message: message.clone() };
                        requests.try_send(copy).unwrap_or_else(|_| tracing::debug!("gossip dropped: the role is busy"));
                        Event::Gossip { run, from, message }
                    }
                    Some(e) => e,
                };
                running.log.write(&event)?;
                if let (Event::Listening { addr }, Some(tx)) = (&event, &listening) {
                    let _ = tx.try_send(addr.clone());
                }
                match &event {
                    Event::Listening { addr } if say => println!("listening on {addr}/p2p/{peer}"),
                    Event::Reachability(r) if say && !matches!(r, Reachability::Unknown) => {
                        print_reachability(r, &peer);
                        reach_done = true;
                    }
                    _ => {}
                }
            }
            () = &mut reach_timer, if !reach_done && !args.bootstrap.is_empty() => {
                reach_done = true;
                let external = running.node.external_addrs().await?;
                if external.is_empty() {
                    println!("reachability: not confirmed within {}s (no peer has dialed us back yet)", REACHABILITY_WAIT.as_secs());
                } else {
                    for a in external {
                        println!("reachability: confirmed external address {a}/p2p/{peer}");
                    }
                }
            }
            () = cancel.cancelled() => break,
            _ = tokio::signal::ctrl_c(), if interactive => break,
            _ = async { sigterm.as_mut()?.recv().await }, if sigterm.is_some() => break,
        }
    }
    Ok(())
}
