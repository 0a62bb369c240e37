//! An in-process network of nodes on loopback, for tests, benchmarks and `sim`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::error::StartError;
use crate::events::Event;
use crate::identity_file::load_or_create;
use crate::node::Node;

/// Why a test network operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TestNetError {
    /// A node did not start.
    #[error(transparent)]
    Start(#[from] StartError),
    /// A node's identity could not be made.
    #[error(transparent)]
    Identity(#[from] crate::identity_file::IdentityError),
    /// A node did not report a listen address in time.
    #[error("node {index} reported no listen address within {seconds} s")]
    NoAddress {
        /// The node.
        index: usize,
        /// Seconds waited.
        seconds: u64,
    },
    /// The node's event loop stopped.
    #[error(transparent)]
    Stopped(#[from] crate::error::Stopped),
}

/// One running node of a [`TestNet`].
#[derive(Debug)]
pub struct TestNode {
    /// Its handle.
    pub node: Node,
    /// Its events; tests may drain them (undrained events are dropped and counted).
    pub events: mpsc::Receiver<Event>,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// Its listen addresses, each ending in `/p2p/<peer-id>`.
    pub addrs: Vec<Multiaddr>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl TestNode {
    /// Starts a node with `config` and waits for its listen addresses.
    pub async fn start(index: usize, config: Config) -> Result<Self, TestNetError> {
        let identity = load_or_create(&config.data_dir)?;
        let data_dir = config.data_dir.clone();
        let want = config.listen.len();
        let (node, events, event_loop) = Node::new(&identity, config)?;
        let cancel = CancellationToken::new();
        let task = tokio::spawn(event_loop.run(cancel.clone()));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut addrs = node.listen_addrs().await?;
        while addrs.len() < want && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            addrs = node.listen_addrs().await?;
        }
        if addrs.is_empty() {
            return Err(TestNetError::NoAddress { index, seconds: 10 });
        }
        let peer = node.peer_id();
        let addrs = addrs.into_iter().map(|a| a.with(Protocol::P2p(peer))).collect();
        Ok(Self { node, events, data_dir, addrs, cancel, task })
    }

    /// This node's PeerId.
    pub fn peer_id(&self) -> PeerId {
        self.node.peer_id()
    }

    /// Stops the node and waits for its event loop to end.
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

/// Adjusts each node's config.
type Tweak = Arc<dyn Fn(&mut Config) + Send + Sync>;

/// A seed node and any number of nodes bootstrapped from it, all on loopback.
pub struct TestNet {
    base: PathBuf,
    /// Node 0 is the seed.
    pub nodes: Vec<TestNode>,
    started: usize,
    tweak: Tweak,
}

impl std::fmt::Debug for TestNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestNet").field("base", &self.base).field("nodes", &self.nodes).finish_non_exhaustive()
    }
}

impl TestNet {
    /// Starts the seed with data under `base`. `tweak` adjusts every node's config.
    pub async fn new(base: &Path, tweak: impl Fn(&mut Config) + Send + Sync + 'static) -> Result<Self, TestNetError> {
        let tweak: Tweak = Arc::new(tweak);
        let mut config = Config::loopback(base.join("node-0"));
        tweak(&mut config);
        let seed = TestNode::start(0, config).await?;
        Ok(Self { base: base.to_owned(), nodes: vec![seed], started: 1, tweak })
    }

    /// The seed's addresses.
    pub fn seed_addrs(&self) -> Vec<Multiaddr> {
        self.nodes.first().map(|n| n.addrs.clone()).unwrap_or_default()
    }

    /// Starts another node bootstrapped from the seed; returns its index.
    pub async fn add(&mut self) -> Result<usize, TestNetError> {
        let index = self.started;
        self.started += 1;
        let mut config = Config::loopback(self.base.join(format!("node-{index}")));
        config.bootstrap = self.seed_addrs();
        (self.tweak)(&mut config);
        let node = TestNode::start(index, config).await?;
        self.nodes.push(node);
        Ok(self.nodes.len() - 1)
    }

    /// Stops and removes node `i` (its data stays on disk).
    pub async fn remove(&mut self, i: usize) {
        if i < self.nodes.len() {
            self.nodes.remove(i).stop().await;
        }
    }

    /// Stops every node.
    pub async fn shutdown(self) {
        for n in self.nodes {
            n.stop().await;
        }
    }
}
