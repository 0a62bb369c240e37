//! A network lab for multi-process tests: `n` network namespaces, each joined by
//! a veth pair to a Linux bridge in a "switch" namespace, so that processes run as
//! if on `n` machines of one LAN, and links between two of them can be cut and
//! healed while the processes run.
//!
//! Node `i` (1-based) lives in namespace `pcpNN<pid>-i` with `eth0` at
//! `10.X.Y.i/24` and `lo` up; the switch is `pcpNN<pid>-sw` (`NN` numbers the
//! labs of one test process, `X.Y` derive from the pid and `NN`). A cut drops
//! packets silently, as a lost route does: `ip rule … blackhole` for the peer's
//! source address on the receiving side's `eth0`, ahead of the `local` table. It
//! needs only iproute2 (`ip`) and policy routing in the kernel, not nft,
//! iptables or tc actions. Dropping a `Lab` deletes its namespaces and kills
//! nothing: stop the processes in it first.
//!
//! Building a lab needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN). Where it cannot be
//! built, [`Lab::new`] says what is missing in one line; [`Lab::for_test`] prints
//! that line and lets the test return, unless `PCP_REQUIRE_NETNS=1` (CI), where it
//! panics with it.

use std::ffi::OsStr;
use std::fmt;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::namespaces::{Namespaces, ip, remove_stale, udp_in};

/// Labs made by this process so far: each gets its own names and subnet.
static LABS: AtomicU32 = AtomicU32::new(0);

/// Where the lab's rules go in each namespace's policy routing: the drops before
/// the `local` table (moved from preference 0 to this one).
const LOCAL_PREF: u32 = 1000;
const DROP_PREF: u32 = 100;

/// Why a lab cannot be built here, in one line.
#[derive(Debug)]
pub(crate) struct Unavailable(String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "network namespace lab unavailable: {}", self.0)
    }
}

/// `n` namespaces on one bridge; see the module docs.
#[derive(Debug)]
pub(crate) struct Lab {
    prefix: String,
    net: [u8; 3],
    n: usize,
    spaces: Namespaces,
}

impl Lab {
    /// Builds a lab of `n` nodes (at most 250).
    pub(crate) fn new(n: usize) -> Result<Self, Unavailable> {
        assert!((1..=250).contains(&n), "a lab has 1 to 250 nodes, not {n}");
        match Command::new("ip").arg("-V").output() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Unavailable("no `ip` command (iproute2) on PATH".into()));
            }
            Err(e) => return Err(Unavailable(format!("cannot run `ip -V`: {e}"))),
            Ok(_) => {}
        }
        remove_stale("pcp");
        let pid = std::process::id();
        let lab = LABS.fetch_add(1, Ordering::Relaxed);
        // 10.100.0.0–10.249.255.0: clear of the usual 10.0.x and 10.1.x, and of
        // bench/link.sh's 10.77.0.0/24
        let net = [10, 100 + (pid % 150) as u8, (lab % 256) as u8];
        let mut this = Self { prefix: format!("pcp{:02}{pid}", lab % 100), net, n, spaces: Namespaces::default() };
        let sw = this.switch();
        this.spaces.add(&sw).map_err(Unavailable)?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge", "forward_delay", "0"])
            .map_err(|e| Unavailable(format!("no Linux bridge (CONFIG_BRIDGE or the bridge module): {e}")))?;
        ip(&["-n", &sw, "link", "set", "br0", "up"]).map_err(Unavailable)?;
        for i in 1..=n {
            let ns = this.ns(i);
            this.spaces.add(&ns).map_err(Unavailable)?;
            let port = format!("p{i}");
            ip(&["link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port, "netns", &sw])
                .map_err(|e| Unavailable(format!("no veth pairs (CONFIG_VETH or the veth module): {e}")))?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0"]).map_err(Unavailable)?;
            ip(&["-n", &sw, "link", "set", &port, "up"]).map_err(Unavailable)?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", this.addr(i)), "dev", "eth0"]).map_err(Unavailable)?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"]).map_err(Unavailable)?;
            ip(&["-n", &ns, "link", "set", "lo", "up"]).map_err(Unavailable)?;
            // the drops must come before the local table, which is looked up at 0
            ip(&["-n", &ns, "rule", "add", "pref", &LOCAL_PREF.to_string(), "lookup", "local"])
                .and_then(|()| ip(&["-n", &ns, "rule", "del", "pref", "0"]))
                .map_err(|e| Unavailable(format!("no policy routing (CONFIG_IP_MULTIPLE_TABLES): {e}")))?;
        }
        Ok(this)
    }

    /// The lab for a test, or `None` (after printing why) where this machine
    /// cannot build one; with `PCP_REQUIRE_NETNS=1` that is a panic instead.
    pub(crate) fn for_test(n: usize) -> Option<Self> {
        match Self::new(n) {
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

    /// The namespace of node `i`.
    pub(crate) fn ns(&self, i: usize) -> String {
        assert!((1..=self.n).contains(&i), "node {i} is not in this lab of {}", self.n);
        format!("{}-{i}", self.prefix)
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.prefix)
    }

    /// Node `i`'s address.
    pub(crate) fn addr(&self, i: usize) -> Ipv4Addr {
        assert!((1..=self.n).contains(&i), "node {i} is not in this lab of {}", self.n);
        Ipv4Addr::new(self.net[0], self.net[1], self.net[2], i as u8)
    }

    /// `program` run inside node `i`'s namespace (`ip netns exec`, which execs it:
    /// the child's pid is the program's).
    pub(crate) fn cmd(&self, i: usize, program: impl AsRef<OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.ns(i)]).arg(program);
        command
    }

    /// Drops every packet between nodes `i` and `j`, both ways.
    pub(crate) fn cut(&self, i: usize, j: usize) {
        self.cut_one_way(i, j);
        self.cut_one_way(j, i);
    }

    /// Drops every packet from node `i` to node `j` (at `j`, as it arrives).
    pub(crate) fn cut_one_way(&self, i: usize, j: usize) {
        assert_ne!(i, j, "a node cannot be cut from itself");
        let (ns, pref) = (self.ns(j), (DROP_PREF + i as u32).to_string());
        let _ = ip(&["-n", &ns, "rule", "del", "pref", &pref]); // at most one rule per pair
        let from = self.addr(i).to_string();
        if let Err(e) = ip(&["-n", &ns, "rule", "add", "pref", &pref, "from", &from, "iif", "eth0", "blackhole"]) {
            panic!("cutting {i}→{j}: {e}");
        }
    }

    /// Restores the link between `i` and `j`, both ways (whatever was cut).
    pub(crate) fn heal(&self, i: usize, j: usize) {
        for (from, to) in [(i, j), (j, i)] {
            let pref = (DROP_PREF + from as u32).to_string();
            // absent when that direction was not cut: the only error expected
            let _ = ip(&["-n", &self.ns(to), "rule", "del", "pref", &pref]);
        }
    }

    /// A UDP socket bound at node `i`'s address, made inside its namespace (by a
    /// thread that enters it): sockets keep their namespace, so the test's own
    /// threads can probe the lab's links with it.
    pub(crate) fn udp(&self, i: usize) -> std::net::UdpSocket {
        udp_in(&self.ns(i), self.addr(i))
    }

    /// Limits what node `i` receives to `rate` (tc's units: `4mbit`), as a slow
    /// downlink does: a token bucket on its port of the switch.
    pub(crate) fn slow_down(&self, i: usize, rate: &str) {
        let _ = self.ns(i); // checks i
        let port = format!("p{i}");
        let tc = Command::new("tc")
            .args(["-n", &self.switch(), "qdisc", "replace", "dev", &port, "root", "tbf", "rate", rate])
            .args(["burst", "16kb", "latency", "1s"])
            .output();
        match tc {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!("limiting node {i} to {rate}: tc: {}", String::from_utf8_lossy(&out.stderr).trim()),
            Err(e) => panic!("limiting node {i} to {rate}: cannot run tc: {e}"),
        }
    }
}
