//! `pcp-node status`: join the network for a few seconds and report where this machine
//! stands behind NATs: whether peers can dial it, how its NAT maps ports (whether hole
//! punching can work), and the relay address others can reach it at.

use std::time::Duration;

use clap::Args;
use pcp_bootstrap::{NatMapping, NetStatus, Reachability};
use tokio::time::Instant;

use crate::commands::join::{NetFlags, Running, Usage, Uses, nat_line};

/// How long the report waits for the NAT's port mapping once reachability is known.
const MAPPING_WAIT: Duration = Duration::from_secs(20);

/// `pcp-node status` flags.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Watch at most this many seconds before reporting
    #[arg(long, value_name = "SECONDS", default_value_t = 45)]
    wait: u64,
    #[command(flatten)]
    net: NetFlags,
}

/// Joins through the seeds, waits until AutoNAT decided (and, behind a NAT, a relay
/// took a reservation) or `--wait` passed, and prints the report on stdout.
pub(crate) async fn run(args: &StatusArgs, root: &NetFlags) -> anyhow::Result<()> {
    let net = root.resolve(args.net.clone(), "status", Uses::Network)?;
    if net.bootstrap.is_empty() {
        return Err(Usage("pcp-node status needs a --bootstrap peer to test reachability with".into()).into());
    }
    let mut running = Running::start(&net)?;
    let me = running.node.peer_id();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.wait);
    let mut decided: Option<Instant> = None;
    loop {
        let status = running.node.net_status().await?;
        let done = match &status.reachability {
            Reachability::Public(_) => true,
            Reachability::Private => !status.relayed.is_empty(),
            Reachability::Unknown => false,
        };
        if done {
            let since = *decided.get_or_insert_with(Instant::now);
            if status.mapping != NatMapping::Unknown || since.elapsed() >= MAPPING_WAIT {
                break;
            }
        }
        let next = (Instant::now() + Duration::from_millis(250)).min(deadline);
        tokio::select! {
            Some(event) = running.events.recv() => {
                running.log.write(&event)?;
                if let Some(line) = nat_line(&event, &me) {
                    tracing::info!("{line}");
                }
            }
            () = tokio::time::sleep_until(next) => {}
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    let status = running.node.net_status().await?;
    let listen = running.node.listen_addrs().await?;
    println!("peer id: {me}");
    for addr in listen.iter().filter(|a| !a.to_string().contains("/p2p-circuit")) {
        println!("listening: {addr}");
    }
    for line in report(&status, &me, started.elapsed()) {
        println!("{line}");
    }
    running.stop().await;
    Ok(())
}

/// The report's lines after the listen addresses.
fn report(status: &NetStatus, me: &pcp_bootstrap::PeerId, waited: Duration) -> Vec<String> {
    let mut lines = vec![match &status.reachability {
        Reachability::Public(addr) => format!("reachability: public: peers dial this node at {addr}"),
        Reachability::Private => "reachability: private: peers cannot dial this node (a NAT or firewall)".into(),
        Reachability::Unknown => {
            format!("reachability: unknown after {} s: no peer has tested a dial-back yet", waited.as_secs())
        }
    }];
    lines.push(match status.mapping {
        NatMapping::Unknown => "NAT: mapping unknown (fewer than two peers have said where they see this node)".into(),
        NatMapping::None => "NAT: none: peers see this node at its own address".into(),
        NatMapping::EndpointIndependent => "NAT: endpoint-independent mapping (one port for every peer): \
                                            hole punching can connect it directly to other NATed peers"
            .into(),
        NatMapping::Symmetric => "NAT: symmetric (a new port for every peer): hole punching cannot work; \
                                  other NATed peers reach this node only through a relay"
            .into(),
    });
    let with_me = |addr: &pcp_bootstrap::Multiaddr| {
        let text = addr.to_string();
        if text.ends_with(&format!("/p2p/{me}")) { text } else { format!("{text}/p2p/{me}") }
    };
    for addr in &status.external {
        lines.push(format!("external: {}", with_me(addr)));
    }
    if status.relayed.is_empty() && !matches!(status.reachability, Reachability::Public(_)) {
        lines.push(match &status.relay_problem {
            Some((relay, why)) if why.contains(&relay.to_string()) => format!("relayed: no relay reservation: {why}"),
            Some((relay, why)) => format!("relayed: no relay reservation: relay {relay}: {why}"),
            None => "relayed: no relay reservation yet".into(),
        });
    }
    for addr in &status.relayed {
        lines.push(format!("relayed: {}", with_me(addr)));
    }
    lines.push(format!(
        "peers: {} connected directly, {} only through a relay",
        status.direct_peers, status.relayed_peers
    ));
    match &status.last_punch {
        Some((peer, Ok(addr))) => lines.push(format!("hole punch: direct connection to {peer} at {addr}")),
        Some((peer, Err(why))) => lines.push(format!("hole punch: to {peer} failed: {why}")),
        None => {}
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_says_what_a_symmetric_nat_means() {
        let me = pcp_bootstrap::PeerId::random();
        let relay: pcp_bootstrap::Multiaddr =
            "/ip4/198.18.0.1/udp/4001/quic-v1/p2p/12D3KooWEHnvjmay4ZnuzUzufxFmTBjD6CLvsvf6jum9aqaU6ZvS/p2p-circuit"
                .parse()
                .expect("addr");
        let status = NetStatus {
            reachability: Reachability::Private,
            external: Vec::new(),
            relayed: vec![relay.clone()],
            mapping: NatMapping::Symmetric,
            direct_peers: 2,
            relayed_peers: 1,
            relay_problem: None,
            last_punch: Some((me, Err("no direct connection within 5 s".into()))),
        };
        let lines = report(&status, &me, Duration::from_secs(3));
        assert!(lines[0].starts_with("reachability: private"), "{lines:?}");
        assert!(lines[1].contains("symmetric") && lines[1].contains("only through a relay"), "{lines:?}");
        assert_eq!(lines[2], format!("relayed: {relay}/p2p/{me}"));
        assert_eq!(lines[3], "peers: 2 connected directly, 1 only through a relay");
        assert_eq!(lines[4], format!("hole punch: to {me} failed: no direct connection within 5 s"));
    }

    #[test]
    fn the_report_names_a_relay_without_a_public_address() {
        let (me, relay) = (pcp_bootstrap::PeerId::random(), pcp_bootstrap::PeerId::random());
        let why = format!("relay {relay} has no confirmed public address: start it with --external-address");
        let status = NetStatus {
            reachability: Reachability::Private,
            external: Vec::new(),
            relayed: Vec::new(),
            mapping: NatMapping::EndpointIndependent,
            direct_peers: 1,
            relayed_peers: 0,
            relay_problem: Some((relay, why.clone())),
            last_punch: None,
        };
        let lines = report(&status, &me, Duration::from_secs(3));
        assert_eq!(lines[2], format!("relayed: no relay reservation: {why}"));
        assert_eq!(lines.len(), 4, "{lines:?}");
    }
}
