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
use crate::diloco::{
    Begin, Retention, RetentionArgs, RoleIo, ShepherdArgs, ShepherdHooks, ShepherdPlan, WorkerArgs, WorkerPlan,
};
use crate::observe::events::{EventLog, Events};
use crate::training::device::Placement;

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
    pub(crate) nat: Box<NatFlags>,
    #[command(flatten)]
    pub(crate) local: LocalArgs,
}

/// NAT traversal: relays, hole punching and UPnP (see docs/networking.md, "Behind a home router").
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct NatFlags {
    /// Relay to reserve a slot on, so that peers reach this node through it even when
    /// AutoNAT has not decided (repeatable), e.g. /ip4/1.2.3.4/udp/4001/quic-v1/p2p/12D3...;
    /// a node that AutoNAT finds unreachable reserves on relays among its peers anyway
    #[arg(long = "relay", value_name = "MULTIADDR")]
    pub(crate) relay: Vec<Multiaddr>,
    /// This node's public address (repeatable), e.g. /ip4/203.0.113.7/udp/4001/quic-v1:
    /// taken as confirmed, given to peers and in relay reservations. Needed where no
    /// peer can confirm it: the only public node of a network, or one behind a
    /// cloud's 1:1 NAT or a port forward
    #[arg(long = "external-address", value_name = "MULTIADDR", value_parser = parse_external)]
    pub(crate) external_address: Vec<Multiaddr>,
    /// Ask the router for a port mapping (UPnP IGD); off by default
    #[arg(long)]
    pub(crate) upnp: bool,
    /// Do not relay for peers behind NATs (a publicly reachable node does by default)
    #[arg(long)]
    pub(crate) no_relay_service: bool,
    /// Bytes one circuit relayed for others may carry, both ways together, e.g. 64MiB
    /// [default: 256MiB]
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub(crate) relay_circuit_bytes: Option<u64>,
    /// Seconds one circuit relayed for others may last [default: 1800]
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=u64::from(u32::MAX)))]
    pub(crate) relay_circuit_secs: Option<u64>,
    /// Circuits relayed for others at once [default: 32]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub(crate) relay_max_circuits: Option<u64>,
}

impl NatFlags {
    /// Whether any was given (for the commands that do not join the network).
    fn given(&self) -> bool {
        !self.relay.is_empty()
            || !self.external_address.is_empty()
            || self.upnp
            || self.no_relay_service
            || self.relay_circuit_bytes.is_some()
            || self.relay_circuit_secs.is_some()
            || self.relay_max_circuits.is_some()
    }

    /// `self` with the flags `own` gives (which win).
    fn merge(&self, own: NatFlags) -> NatFlags {
        let mut relay = self.relay.clone();
        relay.extend(own.relay);
        let mut external_address = self.external_address.clone();
        external_address.extend(own.external_address);
        NatFlags {
            relay,
            external_address,
            upnp: self.upnp || own.upnp,
            no_relay_service: self.no_relay_service || own.no_relay_service,
            relay_circuit_bytes: own.relay_circuit_bytes.or(self.relay_circuit_bytes),
            relay_circuit_secs: own.relay_circuit_secs.or(self.relay_circuit_secs),
            relay_max_circuits: own.relay_max_circuits.or(self.relay_max_circuits),
        }
    }

    /// The flags again, for a child process (`--scale`).
    pub(crate) fn args(&self) -> Vec<String> {
        let mut out = Vec::new();
        for addr in &self.relay {
            out.extend(["--relay".to_owned(), addr.to_string()]);
        }
        for addr in &self.external_address {
            out.extend(["--external-address".to_owned(), addr.to_string()]);
        }
        if self.upnp {
            out.push("--upnp".into());
        }
        if self.no_relay_service {
            out.push("--no-relay-service".into());
        }
        let values = [
            ("--relay-circuit-bytes", self.relay_circuit_bytes),
            ("--relay-circuit-secs", self.relay_circuit_secs),
            ("--relay-max-circuits", self.relay_max_circuits),
        ];
        for (flag, value) in values {
            if let Some(v) = value {
                out.extend([flag.to_owned(), v.to_string()]);
            }
        }
        out
    }

    /// The swarm's NAT configuration.
    pub(crate) fn config(&self) -> pcp_bootstrap::NatConfig {
        let mut nat = pcp_bootstrap::NatConfig {
            relays: self.relay.clone(),
            upnp: self.upnp,
            external_addresses: self.external_address.clone(),
            ..Default::default()
        };
        nat.relay_service = !self.no_relay_service;
        let limits = &mut nat.relay_limits;
        if let Some(bytes) = self.relay_circuit_bytes {
            limits.max_circuit_bytes = bytes;
        }
        if let Some(secs) = self.relay_circuit_secs {
            limits.max_circuit_duration = Duration::from_secs(secs);
        }
        if let Some(n) = self.relay_max_circuits {
            limits.max_circuits = usize::try_from(n).unwrap_or(usize::MAX);
        }
        nat
    }
}

/// An address for `--external-address` (see [`pcp_bootstrap::parse_external_address`]).
fn parse_external(text: &str) -> Result<Multiaddr, String> {
    pcp_bootstrap::parse_external_address(text).map_err(|e| e.to_string())
}

/// A byte count: a number with an optional unit (`B`, `KiB`, `MiB`, `GiB`, `KB`, `MB`,
/// `GB`); at least 1 KiB.
fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("{text:?} is not a byte count (e.g. 268435456 or 256MiB)"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" | "k" => 1 << 10,
        "mib" | "m" => 1 << 20,
        "gib" | "g" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => return Err(format!("unknown unit {other:?} in {text:?} (use KiB, MiB or GiB)")),
    };
    let bytes = n.checked_mul(scale).ok_or_else(|| format!("{text:?} is too large"))?;
    if bytes < 1 << 10 {
        return Err(format!("{text:?}: a circuit must carry at least 1KiB"));
    }
    Ok(bytes)
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
            (
                !peers && self.nat.given(),
                "--relay, --external-address, --upnp, --no-relay-service and --relay-circuit-*",
            ),
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
            nat: self.nat.merge(*own.nat),
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
    /// Relays, hole punching, UPnP.
    pub(crate) nat: NatFlags,
    /// Data directory: identity key and blob store.
    pub(crate) data_dir: PathBuf,
    /// Where events go as JSON lines.
    pub(crate) events: Option<PathBuf>,
    /// Where Prometheus metrics are served.
    pub(crate) metrics: Option<std::net::SocketAddr>,
}

/// Established connections a shepherd (or a candidate, which may become one) holds:
/// one per participant of its run, and its DHT and candidate peers. Who may hold
/// them is bounded by the run's admission (`--admit`, `--max-workers-per-ip`) and the
/// per-address caps of `pcp_bootstrap`.
pub(crate) const COORDINATOR_MAX_CONNECTIONS: u32 = 16_384;

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
        config.nat = self.nat.config();
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
        Self::start_with(args, args.config())
    }

    /// Starts a node with `config` (made from `args`, then adjusted).
    pub(crate) fn start_with(args: &NetArgs, config: Config) -> anyhow::Result<Self> {
        let identity = load_or_create(&args.data_dir)?;
        let (node, events, event_loop): (Node, _, EventLoop) = Node::new(&identity, config).map_err(|e| match e {
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

fn print_reachability(r: &Reachability, peer: &pcp_bootstrap::PeerId, declared: &[Multiaddr]) {
    match r {
        Reachability::Public(addr) => {
            let how = if declared.contains(addr) { "declared with --external-address" } else { "confirmed" };
            let mut addr = addr.clone();
            if !matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
                addr.push(Protocol::P2p(*peer));
            }
            println!("reachability: dialable at {addr} ({how})");
        }
        Reachability::Private => println!(
            "reachability: NOT dialable: peers could not dial back (behind a NAT or firewall); \
             reserving a slot on a relay so that others can reach this node"
        ),
        Reachability::Unknown => println!("reachability: unknown"),
    }
}

/// The line a person reads for a NAT traversal event, if it is one worth a line.
pub(crate) fn nat_line(event: &Event, me: &pcp_bootstrap::PeerId) -> Option<String> {
    Some(match event {
        Event::RelayReserved { addr, renewal: false, limit_bytes, limit_seconds, .. } => {
            let limits = match (limit_bytes, limit_seconds) {
                (Some(b), Some(s)) => format!(" (each connection through it: up to {} MiB and {s} s)", b >> 20),
                _ => String::new(),
            };
            format!("relay: reachable at {addr}/p2p/{me}{limits}")
        }
        Event::RelayLost { relay, reason } => format!("relay: lost the reservation on {relay}: {reason}"),
        Event::HolePunched { peer, result: Ok(addr) } => format!("hole punched: direct connection to {peer} at {addr}"),
        Event::HolePunched { peer, result: Err(reason) } => {
            format!("hole punch to {peer} failed ({reason}); its traffic goes through the relay")
        }
        Event::PortMapping { result: Ok(addr) } => format!("upnp: the router forwards {addr}/p2p/{me} to this node"),
        Event::PortMapping { result: Err(reason) } => format!("upnp: {reason}"),
        Event::Relayed(pcp_bootstrap::RelayService::Status { enabled: true }) => {
            "relay: publicly reachable: relaying for peers behind NATs (--no-relay-service turns it off)".to_owned()
        }
        _ => return None,
    })
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
    /// `None`), ready to lead it, keeping the blobs of its recent rounds, its own
    /// engine on the placement given.
    Candidate(Option<pcp_protocol::RunId>, ShepherdHooks, Retention, Placement),
}

impl Role {
    /// The role the flags ask for.
    pub(crate) fn from_args(
        net: &NetArgs,
        shepherd: &ShepherdArgs,
        worker: &WorkerArgs,
        retention: RetentionArgs,
    ) -> Result<Self, Failure> {
        if shepherd.shepherd {
            if shepherd.candidate.iter().any(String::is_empty) {
                return Err(Failure::input(anyhow::anyhow!(
                    "with --shepherd, --candidate names a candidate: a peer id, a hex public key or an identity.key"
                )));
            }
            let mut plan = ShepherdPlan::new(shepherd, &net.data_dir)?;
            plan.retention = Retention::new(retention.keep()).checkpoint_every(shepherd.checkpoint_rounds);
            plan.engine.on = own_placement(worker)?;
            return Ok(Self::Shepherd(Box::new(plan), ShepherdHooks::default()));
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
            let on = own_placement(worker)?;
            return Ok(Self::Candidate(Some(run), ShepherdHooks::default(), Retention::new(retention.keep()), on));
        }
        if worker.no_train {
            return Ok(Self::Relay);
        }
        let mut plan = WorkerPlan::new(worker)?;
        plan.keep_rounds = retention.keep();
        Ok(Self::Worker(plan))
    }
}

/// Where a coordinator runs its own engine (its screen and validation):
/// `--backend` and `--target`, checked like a worker's.
fn own_placement(worker: &WorkerArgs) -> Result<Placement, Failure> {
    Placement::resolve(&worker.backend, worker.target.as_deref())
        .map_err(|e| Failure::input(e.context("the shepherd's own engine (--backend, --target)")))
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
    let _metrics = crate::observe::metrics::serve(args.metrics).await.map_err(Failure::input)?;
    // a node of its own reports to wandb when it may lead (`sim` starts one for all)
    let _wandb = match &role {
        Role::Shepherd(plan, _) if interactive => {
            crate::observe::wandb::Bridge::start(Some(plan.experiment()), "shepherd")
        }
        Role::Candidate(..) if interactive => crate::observe::wandb::Bridge::start(None, "shepherd"),
        _ => None,
    };
    let mut config = args.config();
    // a coordinator (or one who may become it) must be found through the DHT by the
    // workers and candidates it may lead, reachable address confirmed or not yet; a
    // volunteer aggregator, by the workers that send it their slices
    let coordinator = matches!(role, Role::Shepherd(..) | Role::Candidate(..));
    let aggregator = matches!(&role, Role::Worker(p) if p.aggregate);
    config.dht_server = coordinator || aggregator;
    if coordinator || aggregator {
        // every participant of its run holds a connection to it (an aggregator: every
        // worker that sends it a slice)
        config.max_connections = COORDINATOR_MAX_CONNECTIONS;
    }
    let mut running = Running::start_with(args, config).map_err(Failure::input)?;
    let events = Events::open(args.events.as_deref()).map_err(Failure::input)?;
    let (requests_tx, inbox, single) = match role {
        Role::Shepherd(..) | Role::Candidate(..) => {
            let (tx, inbox) = crate::diloco::inbox::coordinator(running.node.admission().clone());
            (tx, Some(inbox), None)
        }
        Role::Worker(..) | Role::Relay => {
            let (tx, rx) = crate::diloco::inbox::single();
            (tx, None, Some(rx))
        }
    };
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
                let inbox = inbox.expect("a coordinator's");
                crate::diloco::candidate_run(Begin::Lead(plan), io, inbox, hooks, role_cancel).await
            }
            Role::Candidate(run, hooks, retention, on) => {
                let inbox = inbox.expect("a coordinator's");
                crate::diloco::candidate_run(Begin::Standby(run, retention, on), io, inbox, hooks, role_cancel).await
            }
            Role::Worker(plan) => crate::diloco::worker_run(plan, io, single.expect("a worker's"), role_cancel).await,
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
    (requests, listening): (crate::diloco::inbox::Outbox, Option<mpsc::Sender<Multiaddr>>),
    work: impl std::future::Future<Output = anyhow::Result<()>>,
    cancel: CancellationToken,
) -> Result<(), Failure> {
    let peer = running.node.peer_id();
    // the dashboard, when it is up, owns stdout and shows these itself
    let say = interactive && !crate::observe::tui::owns_stdout();
    if say {
        println!("peer id: {peer}");
    }
    let mut reach_timer = Box::pin(tokio::time::sleep(REACHABILITY_WAIT));
    let mut reach_done = !say;
    if say && args.bootstrap.is_empty() && args.nat.external_address.is_empty() {
        println!(
            "reachability: seed node (no --bootstrap): no peer to dial back yet; waiting for others \
             (a public node that dials no one: give its public address with --external-address)"
        );
    }
    // only an interactive node owns the process's signals; `sim` handles them itself
    let mut sigterm = if interactive { Some(terminate_signal()?) } else { None };
    // relay losses said so far (bounded: a hostile relay's reasons are many)
    let mut said = std::collections::HashSet::new();
    tokio::pin!(work);
    loop {
        tokio::select! {
            result = &mut work => return Ok(result?),
            event = running.events.recv() => {
                let event = match event {
                    None => break,
                    // a full queue means the role is behind: the request is dropped and
                    // the peer's stream resets now, which it treats as a failure (left
                    // waiting, it would wait out its timeout, and a worker its heartbeats)
                    Some(request @ Event::Request { .. }) => {
                        if let Err(dropped) = requests.try_send(request)
                            && let Event::Request { peer, id, .. } = *dropped
                        {
                            tracing::debug!(%peer, "request dropped: the role is busy");
                            running.node.leave_unanswered(id);
                        }
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
                if said.len() >= 64 {
                    said.clear();
                }
                if let (Event::Listening { addr }, Some(tx)) = (&event, &listening) {
                    let _ = tx.try_send(addr.clone());
                }
                // a relay that fails the same way again and again is said once
                if let Some(line) = nat_line(&event, &peer)
                    && (!matches!(event, Event::RelayLost { .. }) || said.insert(line.clone()))
                {
                    if say {
                        println!("{line}");
                    }
                    tracing::info!("{line}");
                }
                match &event {
                    Event::Listening { addr } if say => println!("listening on {addr}/p2p/{peer}"),
                    Event::Reachability(r) if say && !matches!(r, Reachability::Unknown) => {
                        print_reachability(r, &peer, &args.nat.external_address);
                        reach_done = true;
                    }
                    _ => {}
                }
            }
            () = &mut reach_timer, if !reach_done && !args.bootstrap.is_empty() => {
                reach_done = true;
                // relayed addresses were printed as their reservations came
                let external: Vec<Multiaddr> = running
                    .node
                    .external_addrs()
                    .await?
                    .into_iter()
                    .filter(|a| !a.iter().any(|p| matches!(p, Protocol::P2pCircuit)))
                    .collect();
                if external.is_empty() {
                    println!("reachability: not confirmed within {}s (no peer has dialed us back yet)", REACHABILITY_WAIT.as_secs());
                } else {
                    for mut a in external {
                        if !matches!(a.iter().last(), Some(Protocol::P2p(_))) {
                            a.push(Protocol::P2p(peer));
                        }
                        println!("reachability: confirmed external address {a}");
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
