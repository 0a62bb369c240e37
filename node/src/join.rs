//! The default command: join the network, report reachability, provide the blob store
//! and log events until interrupted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use pcp_bootstrap::multiaddr::Protocol;
use pcp_bootstrap::{Config, Event, EventLoop, Multiaddr, Node, Reachability, load_or_create};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::events::EventLog;

/// How long the reachability self-test waits for a dial-back.
const REACHABILITY_WAIT: Duration = Duration::from_secs(15);

/// An error in what the user typed or gave us (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Usage(pub(crate) String);

/// Network options, accepted before or after a subcommand.
#[derive(Debug, Clone, Args)]
pub(crate) struct NetArgs {
    /// Seed peer to join through (repeatable), e.g. /ip4/1.2.3.4/udp/4001/quic-v1/p2p/12D3...
    #[arg(long = "bootstrap", value_name = "MULTIADDR", global = true)]
    pub(crate) bootstrap: Vec<Multiaddr>,
    /// Address to listen on (repeatable); default: QUIC and TCP on every interface.
    #[arg(long = "listen", value_name = "MULTIADDR", global = true)]
    pub(crate) listen: Vec<Multiaddr>,
    /// Data directory: identity key and blob store.
    #[arg(long, value_name = "DIR", global = true, default_value_os_t = default_data_dir())]
    pub(crate) data_dir: PathBuf,
    /// Write network events to this file as JSON lines.
    #[arg(long, value_name = "FILE", global = true)]
    pub(crate) events: Option<PathBuf>,
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
    pub(crate) events: mpsc::Receiver<Event>,
    pub(crate) log: EventLog,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    pub(crate) fn start(args: &NetArgs) -> anyhow::Result<Self> {
        let identity = load_or_create(&args.data_dir)?;
        let (node, events, event_loop): (Node, _, EventLoop) = Node::new(&identity, args.config())?;
        let log = EventLog::open(args.events.as_deref(), node.peer_id())?;
        let cancel = CancellationToken::new();
        let task = tokio::spawn(event_loop.run(cancel.clone()));
        Ok(Self { node, events, log, cancel, task })
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

/// Runs the default command.
pub(crate) async fn run(args: &NetArgs) -> anyhow::Result<()> {
    let mut running = Running::start(args)?;
    let peer = running.node.peer_id();
    println!("peer id: {peer}");
    let mut reach_timer = Box::pin(tokio::time::sleep(REACHABILITY_WAIT));
    let mut reach_done = false;
    if args.bootstrap.is_empty() {
        println!("reachability: seed node (no --bootstrap): no peer to dial back yet; waiting for others");
    }
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    loop {
        tokio::select! {
            event = running.events.recv() => {
                let Some(event) = event else { break };
                running.log.write(&event)?;
                match &event {
                    Event::Listening { addr } => println!("listening on {addr}/p2p/{peer}"),
                    Event::Reachability(r) if !matches!(r, Reachability::Unknown) => {
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
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
        }
    }
    running.stop().await;
    Ok(())
}
