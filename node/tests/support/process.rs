//! Helpers the multi-process attack tests share: a node's listen addresses from
//! its stdout, and a process's memory from `/proc`.

use std::io::BufReader;
use std::process::ChildStdout;

use anyhow::{Context, bail};
use libp2p::{Multiaddr, PeerId};

/// The node's peer id and its loopback TCP and QUIC addresses (without `/p2p/`),
/// from the lines it prints once it listens; its stdout is drained after, so it
/// never blocks on it.
pub(crate) fn listen_addresses(
    mut lines: std::io::Lines<BufReader<ChildStdout>>,
) -> anyhow::Result<(PeerId, Multiaddr, Multiaddr)> {
    let (mut tcp, mut quic) = (None, None);
    while tcp.is_none() || quic.is_none() {
        let line = lines.next().context("the node exited before listening")??;
        for word in line.split_whitespace().filter(|w| w.starts_with("/ip4/127.0.0.1/")) {
            let addr: Multiaddr = word.parse()?;
            if word.contains("/quic-v1") { quic = Some(addr) } else { tcp = Some(addr) }
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let strip = |mut a: Multiaddr| -> anyhow::Result<(Multiaddr, PeerId)> {
        match a.pop() {
            Some(libp2p::multiaddr::Protocol::P2p(peer)) => Ok((a, peer)),
            _ => bail!("listen address without /p2p/: {a}"),
        }
    };
    let (tcp, peer) = strip(tcp.context("tcp")?)?;
    let (quic, _) = strip(quic.context("quic")?)?;
    Ok((peer, tcp, quic))
}

/// A `/proc/PID/status` field in bytes (`VmRSS:`, `VmHWM:`).
pub(crate) fn memory(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with(field)).with_context(|| format!("no {field}"))?;
    let kib: u64 = line.split_whitespace().nth(1).context("no value")?.parse()?;
    Ok(kib * 1024)
}
