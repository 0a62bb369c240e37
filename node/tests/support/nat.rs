//! A NAT lab for multi-process tests and `bench/nat_lab.sh`: an "internet" of public
//! hosts, and home routers that NAT the hosts of their LANs, all network namespaces
//! on one machine (after `support/netns.rs`, which is one flat LAN).
//!
//! - The internet is a Linux bridge in namespace `<prefix>-inet`, on 198.18.0.0/24
//!   (the benchmarking range). Public host `i` (1-based) is namespace `<prefix>-p<i>`
//!   at 198.18.0.`i`.
//! - Router `r` (1-based) is namespace `<prefix>-r<r>`: `wan0` on the internet at
//!   198.18.0.`100+r`, and a LAN bridge at 192.168.`r`.1/24. Its host `h` is namespace
//!   `<prefix>-r<r>h<h>` at 192.168.`r`.`10+h`, with the router as default route.
//! - A router forwards, masquerades what leaves `wan0` and, like a home router, drops
//!   what arrives on `wan0` unless it belongs to a connection a LAN host opened
//!   (nftables: `ct state established,related`). [`Mapping::EndpointIndependent`]
//!   is plain `masquerade`: Linux keeps a flow's source port where it can, so one LAN
//!   socket has one public port whatever it talks to, as most home routers do.
//!   [`Mapping::Symmetric`] is `masquerade fully-random`: a random public port for
//!   every new flow, i.e. for every destination.
//!
//! [`NatLab::cloud_vm`] puts a public host behind a cloud's 1:1 NAT.
//!
//! [`Filter::Stateful`] routers filter as the commonest home-router firewall is
//! written: the forward and input chains drop by policy and accept what comes from
//! the LAN and what belongs to a connection already open (`ct state
//! established,related`), masquerading as above.
//!
//! Dropping unsolicited packets matters beyond realism: a packet the router drops
//! never commits a conntrack entry, so a hole punch's first packet from the far side,
//! arriving before the near side's own, cannot make the router pick another port for
//! the near side's flow (which a committed entry for the same tuple would).
//!
//! Building a lab needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), iproute2 and nftables
//! (`nft`) with NAT in the kernel. Where it cannot be built, [`NatLab::new`] says what
//! is missing in one line; [`NatLab::for_test`] prints it and lets the test return,
//! unless `PCP_REQUIRE_NETNS=1` (CI), where it panics with it. Dropping a lab deletes
//! its namespaces and kills nothing: stop the processes in it first.

use std::ffi::OsStr;
use std::fmt;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::namespaces::{Namespaces, ip, remove_stale, run, udp_in};

/// Labs made by this process so far: each gets its own names.
static LABS: AtomicU32 = AtomicU32::new(0);

/// How a router maps its LAN hosts' ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// One public port per LAN socket, whatever the destination (`masquerade`).
    EndpointIndependent,
    /// A new random public port per destination (`masquerade fully-random`).
    Symmetric,
}

/// How a router filters what it forwards and receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Filter {
    /// Accept by default; drop what arrives on `wan0` unless `ct state
    /// established,related`.
    WanDrop,
    /// `policy drop`; accept from the LAN; accept `ct state established,related`.
    Stateful,
}

/// Why a lab cannot be built here, in one line.
#[derive(Debug)]
pub(crate) struct Unavailable(String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NAT lab unavailable: {}", self.0)
    }
}

/// A machine of the lab: its namespace and address.
#[derive(Debug, Clone)]
pub(crate) struct Host {
    pub(crate) ns: String,
    pub(crate) addr: Ipv4Addr,
}

/// Public hosts and NATed LANs; see the module docs.
#[derive(Debug)]
pub(crate) struct NatLab {
    prefix: String,
    publics: usize,
    routers: Vec<(Mapping, usize)>,
    filter: Filter,
    spaces: Namespaces,
}

impl NatLab {
    /// Builds a lab of `publics` public hosts and one router per entry of `routers`
    /// (its mapping and how many hosts its LAN has), which filter as `filter` says.
    pub(crate) fn new(publics: usize, routers: &[(Mapping, usize)], filter: Filter) -> Result<Self, Unavailable> {
        assert!(publics <= 90 && routers.len() <= 99, "at most 90 public hosts and 99 routers");
        assert!(routers.iter().all(|(_, n)| (1..=200).contains(n)), "a LAN has 1 to 200 hosts");
        for (tool, arg, package) in [("ip", "-V", "iproute2"), ("nft", "--version", "nftables")] {
            match Command::new(tool).arg(arg).output() {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(Unavailable(format!("no `{tool}` command on PATH (install {package})")));
                }
                Err(e) => return Err(Unavailable(format!("cannot run `{tool} {arg}`: {e}"))),
                Ok(_) => {}
            }
        }
        remove_stale("pcn");
        let pid = std::process::id();
        let lab = LABS.fetch_add(1, Ordering::Relaxed);
        let mut this = Self {
            prefix: format!("pcn{:02}{pid}", lab % 100),
            publics,
            routers: routers.to_vec(),
            filter,
            spaces: Namespaces::default(),
        };
        let inet = this.inet();
        this.spaces.add(&inet).map_err(Unavailable)?;
        ip(&["-n", &inet, "link", "add", "br0", "type", "bridge", "forward_delay", "0"])
            .map_err(|e| Unavailable(format!("no Linux bridge (CONFIG_BRIDGE or the bridge module): {e}")))?;
        ip(&["-n", &inet, "link", "set", "br0", "up"]).map_err(Unavailable)?;
        for i in 1..=publics {
            let host = this.public(i);
            this.spaces.add(&host.ns).map_err(Unavailable)?;
            this.plug(&inet, "br0", &format!("p{i}"), &host.ns, "eth0")?;
            ip(&["-n", &host.ns, "addr", "add", &format!("{}/24", host.addr), "dev", "eth0"]).map_err(Unavailable)?;
        }
        for r in 1..=routers.len() {
            this.add_router(r)?;
        }
        Ok(this)
    }

    /// The lab for a test, or `None` (after printing why) where this machine cannot
    /// build one; with `PCP_REQUIRE_NETNS=1` that is a panic instead.
    pub(crate) fn for_test(publics: usize, routers: &[(Mapping, usize)]) -> Option<Self> {
        Self::for_test_with(publics, routers, Filter::WanDrop)
    }

    /// [`NatLab::for_test`] with routers that filter as `filter` says.
    pub(crate) fn for_test_with(publics: usize, routers: &[(Mapping, usize)], filter: Filter) -> Option<Self> {
        match Self::new(publics, routers, filter) {
            Ok(lab) => Some(lab),
            Err(e) if std::env::var("PCP_REQUIRE_NETNS").is_ok_and(|v| v == "1") => {
                panic!("{e} (PCP_REQUIRE_NETNS=1)")
            }
            Err(e) => {
                eprintln!("skipped: {e} (set PCP_REQUIRE_NETNS=1 to fail instead)");
                None
            }
        }
    }

    fn inet(&self) -> String {
        format!("{}-inet", self.prefix)
    }

    /// Public host `i`.
    pub(crate) fn public(&self, i: usize) -> Host {
        assert!((1..=self.publics).contains(&i), "public host {i} is not in this lab of {}", self.publics);
        Host { ns: format!("{}-p{i}", self.prefix), addr: Ipv4Addr::new(198, 18, 0, i as u8) }
    }

    /// Turns public host `i` into a cloud VM behind a 1:1 NAT, as most clouds rent
    /// them: it holds only a private address, 10.10.0.`i` (returned), and
    /// the host's public address is translated to it both ways (nftables `dnat` and
    /// `snat`). A node there cannot see its public address among its own.
    pub(crate) fn cloud_vm(&self, i: usize) -> Result<Host, Unavailable> {
        let public = self.public(i);
        let vm = Host { ns: public.ns.clone(), addr: Ipv4Addr::new(10, 10, 0, i as u8) };
        // on `lo`: an address of the host's own that no neighbour can reach but by the NAT
        ip(&["-n", &vm.ns, "addr", "add", &format!("{}/32", vm.addr), "dev", "lo"]).map_err(Unavailable)?;
        let rules = format!(
            "table ip cloud {{
                chain pre {{ type nat hook prerouting priority dstnat; iifname \"eth0\" ip daddr {public} dnat to {vm}; }}
                chain post {{ type nat hook postrouting priority srcnat; oifname \"eth0\" ip saddr {vm} snat to {public}; }}
            }}",
            public = public.addr,
            vm = vm.addr,
        );
        run(&["ip", "netns", "exec", &vm.ns, "nft", &rules])
            .map_err(|e| Unavailable(format!("no nftables NAT in this kernel (CONFIG_NFT_NAT): {e}")))?;
        Ok(vm)
    }

    /// Router `r`'s namespace.
    pub(crate) fn router(&self, r: usize) -> String {
        assert!((1..=self.routers.len()).contains(&r), "router {r} is not in this lab");
        format!("{}-r{r}", self.prefix)
    }

    /// Router `r`'s public address.
    pub(crate) fn router_wan(&self, r: usize) -> Ipv4Addr {
        let _ = self.router(r);
        Ipv4Addr::new(198, 18, 0, 100 + r as u8)
    }

    /// Host `h` behind router `r`.
    pub(crate) fn private(&self, r: usize, h: usize) -> Host {
        let n = self.routers.get(r.wrapping_sub(1)).map_or(0, |(_, n)| *n);
        assert!((1..=n).contains(&h), "host {h} is not behind router {r} ({n} hosts)");
        Host { ns: format!("{}-r{r}h{h}", self.prefix), addr: Ipv4Addr::new(192, 168, r as u8, 10 + h as u8) }
    }

    /// `program` run in `host`'s namespace (`ip netns exec`, which execs it: the
    /// child's pid is the program's).
    pub(crate) fn cmd(&self, host: &Host, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &host.ns]).arg(program);
        command
    }

    /// A UDP socket bound in `host`'s namespace, on an ephemeral port.
    pub(crate) fn udp(&self, host: &Host) -> std::net::UdpSocket {
        udp_in(&host.ns, host.addr)
    }

    /// Bytes `host` received and sent on `eth0` so far.
    pub(crate) fn bytes(&self, host: &Host) -> (u64, u64) {
        let out = Command::new("ip")
            .args(["-n", &host.ns, "-j", "-s", "link", "show", "dev", "eth0"])
            .output()
            .unwrap_or_else(|e| panic!("reading {}'s counters: {e}", host.ns));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!("reading {}'s counters: {e}: {}", host.ns, String::from_utf8_lossy(&out.stderr))
        });
        let stats = &json[0]["stats64"];
        let get = |dir: &str| stats[dir]["bytes"].as_u64().unwrap_or_else(|| panic!("no {dir} bytes in {json}"));
        (get("rx"), get("tx"))
    }

    /// A veth pair: `outer` in namespace `at` (joined to `bridge` there), `inner`
    /// in namespace `ns`; both up, with `lo` of `ns`.
    fn plug(&self, at: &str, bridge: &str, outer: &str, ns: &str, inner: &str) -> Result<(), Unavailable> {
        ip(&["link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", at])
            .map_err(|e| Unavailable(format!("no veth pairs (CONFIG_VETH or the veth module): {e}")))?;
        ip(&["-n", at, "link", "set", outer, "master", bridge]).map_err(Unavailable)?;
        ip(&["-n", at, "link", "set", outer, "up"]).map_err(Unavailable)?;
        ip(&["-n", ns, "link", "set", inner, "up"]).map_err(Unavailable)?;
        ip(&["-n", ns, "link", "set", "lo", "up"]).map_err(Unavailable)?;
        Ok(())
    }

    fn add_router(&mut self, r: usize) -> Result<(), Unavailable> {
        let (mapping, hosts) = self.routers[r - 1];
        let router = self.router(r);
        self.spaces.add(&router).map_err(Unavailable)?;
        let inet = self.inet();
        self.plug(&inet, "br0", &format!("r{r}"), &router, "wan0")?;
        ip(&["-n", &router, "addr", "add", &format!("{}/24", self.router_wan(r)), "dev", "wan0"])
            .map_err(Unavailable)?;
        ip(&["-n", &router, "link", "add", "lan0", "type", "bridge", "forward_delay", "0"]).map_err(Unavailable)?;
        ip(&["-n", &router, "link", "set", "lan0", "up"]).map_err(Unavailable)?;
        ip(&["-n", &router, "addr", "add", &format!("192.168.{r}.1/24"), "dev", "lan0"]).map_err(Unavailable)?;
        for h in 1..=hosts {
            let host = self.private(r, h);
            self.spaces.add(&host.ns).map_err(Unavailable)?;
            self.plug(&router, "lan0", &format!("h{h}"), &host.ns, "eth0")?;
            ip(&["-n", &host.ns, "addr", "add", &format!("{}/24", host.addr), "dev", "eth0"]).map_err(Unavailable)?;
            ip(&["-n", &host.ns, "route", "add", "default", "via", &format!("192.168.{r}.1")]).map_err(Unavailable)?;
        }
        run(&["ip", "netns", "exec", &router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
            .map_err(|e| Unavailable(format!("cannot turn on IP forwarding: {e}")))?;
        let masquerade = match mapping {
            Mapping::EndpointIndependent => "masquerade",
            Mapping::Symmetric => "masquerade fully-random",
        };
        let filter = match self.filter {
            Filter::WanDrop => "iifname \"wan0\" ct state established,related accept; iifname \"wan0\" drop;",
            Filter::Stateful => {
                "policy drop; iifname \"lo\" accept; iifname \"lan0\" accept; ct state established,related accept;"
            }
        };
        let rules = format!(
            "table ip home {{
                chain nat {{ type nat hook postrouting priority srcnat; oifname \"wan0\" {masquerade}; }}
                chain input {{ type filter hook input priority filter; {filter} }}
                chain forward {{ type filter hook forward priority filter; {filter} }}
            }}"
        );
        run(&["ip", "netns", "exec", &router, "nft", &rules]).map_err(|e| {
            Unavailable(format!(
                "no nftables NAT in this kernel (CONFIG_NF_TABLES, CONFIG_NFT_NAT, CONFIG_NFT_MASQ, CONFIG_NFT_CT): {e}"
            ))
        })?;
        Ok(())
    }
}
