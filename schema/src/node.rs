//! A node's hello and capabilities.

use crate::codec::{self, DecodeError, MAX_CONTROL_MESSAGE, Message, fixed, list_len, malformed};
use crate::wire::pcp_capnp::{backend, capabilities, node_hello};

/// A compute backend and the targets a node can run it on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    /// Backend name, e.g. `rocm`.
    pub name: String,
    /// Targets, e.g. `gfx942`.
    pub targets: Vec<String>,
}

/// What a node brings.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Backends and their targets.
    pub backends: Vec<Backend>,
    /// Free device memory in bytes.
    pub free_memory_bytes: u64,
    /// It offers to sum parameter shards for the run (`--aggregate`).
    pub aggregate: bool,
}

/// The first message a node sends about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeHello {
    /// The node's ed25519 public key.
    pub peer: [u8; 32],
    /// The wire protocol version it speaks.
    pub protocol_version: u32,
    /// Free-form agent string, e.g. `pcp-node/0.1.0`.
    pub agent: String,
    /// What it can run.
    pub capabilities: Capabilities,
    /// A join certificate from the run's authorizer (empty: none).
    pub certificate: Vec<u8>,
    /// The nonce of its identity's proof of work for the run (0: none).
    pub pow_nonce: u64,
}

impl Capabilities {
    pub(crate) fn write(&self, mut b: capabilities::Builder<'_>) {
        b.set_free_memory_bytes(self.free_memory_bytes);
        b.set_aggregate(self.aggregate);
        let mut list = b.init_backends(list_len(self.backends.len()));
        for (i, backend) in (0..).zip(&self.backends) {
            let mut e = list.reborrow().get(i);
            e.set_name(backend.name.as_str());
            let mut targets = e.init_targets(list_len(backend.targets.len()));
            for (j, t) in (0..).zip(&backend.targets) {
                targets.set(j, t.as_str());
            }
        }
    }

    pub(crate) fn read(what: &'static str, r: capabilities::Reader<'_>) -> Result<Self, DecodeError> {
        let list = r.get_backends().map_err(|e| malformed(what, e))?;
        let mut backends = Vec::with_capacity(list.len() as usize);
        for e in list.iter() {
            backends.push(read_backend(what, e)?);
        }
        Ok(Self { backends, free_memory_bytes: r.get_free_memory_bytes(), aggregate: r.get_aggregate() })
    }
}

fn read_backend(what: &'static str, e: backend::Reader<'_>) -> Result<Backend, DecodeError> {
    let list = e.get_targets().map_err(|e| malformed(what, e))?;
    let mut targets = Vec::with_capacity(list.len() as usize);
    for t in list.iter() {
        targets.push(codec::text(what, "targets", t)?);
    }
    Ok(Backend { name: codec::text(what, "name", e.get_name())?, targets })
}

impl Message for NodeHello {
    const NAME: &'static str = "NodeHello";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<node_hello::Builder<'_>>();
        root.set_peer(&self.peer[..]);
        root.set_protocol_version(self.protocol_version);
        root.set_agent(self.agent.as_str());
        self.capabilities.write(root.reborrow().init_capabilities());
        if !self.certificate.is_empty() {
            root.set_certificate(&self.certificate[..]);
        }
        root.set_pow_nonce(self.pow_nonce);
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = NodeHello::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<node_hello::Reader<'_>>().map_err(|e| malformed(W, e))?;
            Ok(Self {
                peer: fixed(W, "peer", r.get_peer().map_err(|e| malformed(W, e))?)?,
                protocol_version: r.get_protocol_version(),
                agent: codec::text(W, "agent", r.get_agent())?,
                capabilities: Capabilities::read(W, r.get_capabilities().map_err(|e| malformed(W, e))?)?,
                certificate: r.get_certificate().map_err(|e| malformed(W, e))?.to_vec(),
                pow_nonce: r.get_pow_nonce(),
            })
        })
    }
}
