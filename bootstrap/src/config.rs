//! Node configuration.

use std::path::PathBuf;
use std::time::Duration;

use libp2p::Multiaddr;
use pcp_schema::MAX_BLOB_SIZE;

/// How a node runs. [`Config::new`] gives production defaults.
#[derive(Debug, Clone)]
pub struct Config {
    /// Data directory: identity key and blob store.
    pub data_dir: PathBuf,
    /// Addresses to listen on (QUIC first, TCP as fallback).
    pub listen: Vec<Multiaddr>,
    /// Seed peers, each with a `/p2p/<peer-id>` suffix or without.
    pub bootstrap: Vec<Multiaddr>,
    /// How often to re-run the Kademlia bootstrap and re-dial lost seed peers.
    pub rebootstrap_interval: Duration,
    /// How often to retry the seeds while no peer at all is connected.
    pub recovery_interval: Duration,
    /// How long a peer that sent a bad chunk or message stays banned.
    pub ban_duration: Duration,
    /// Largest blob fetched or stored.
    pub max_blob_size: u64,
    /// Chunk requests in flight per provider.
    pub chunk_window: usize,
    /// Capacity of the command queue.
    pub command_queue: usize,
    /// Capacity of the event queue; events beyond it are dropped and counted.
    pub event_queue: usize,
    /// Idle connections are closed after this long.
    pub idle_timeout: Duration,
    /// Agent string sent in identify.
    pub agent: String,
    /// Offer TLS 1.3 (`/tls/1.0.0`) before noise on TCP connections. With `false` TCP
    /// offers noise only (the fallback every libp2p peer speaks).
    pub tcp_tls: bool,
}

impl Config {
    /// Defaults: listen on every interface (QUIC and TCP, ephemeral ports), no seeds.
    pub fn new(data_dir: PathBuf) -> Self {
        Self {
            data_dir,
            listen: vec![
                "/ip4/0.0.0.0/udp/0/quic-v1".parse().expect("valid literal multiaddr"),
                "/ip4/0.0.0.0/tcp/0".parse().expect("valid literal multiaddr"),
            ],
            bootstrap: Vec::new(),
            rebootstrap_interval: Duration::from_secs(60),
            recovery_interval: Duration::from_secs(2),
            ban_duration: Duration::from_secs(600),
            max_blob_size: MAX_BLOB_SIZE,
            chunk_window: 8,
            command_queue: 64,
            event_queue: 4096,
            idle_timeout: Duration::from_secs(30),
            agent: format!("pcp-node/{}", env!("CARGO_PKG_VERSION")),
            tcp_tls: true,
        }
    }

    /// Loopback-only listening (QUIC and TCP on ephemeral ports), for tests and benches.
    pub fn loopback(data_dir: PathBuf) -> Self {
        Self {
            listen: vec![
                "/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("valid literal multiaddr"),
                "/ip4/127.0.0.1/tcp/0".parse().expect("valid literal multiaddr"),
            ],
            ..Self::new(data_dir)
        }
    }
}
