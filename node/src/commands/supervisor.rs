//! `pcp-node --scale N …`: N worker processes on one machine, each pinned to
//! device ordinal i (`--device-id i`) with its own data directory
//! (`<data-dir>/worker-i`, so it keeps its identity across restarts), restarted
//! with exponential backoff when one exits or crashes, and stopped together on
//! SIGINT or SIGTERM.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::Failure;
use crate::commands::join::{NetArgs, Usage};
use crate::diloco::{RetentionArgs, WorkerArgs};
use crate::observe::events::{Event, Events, SupervisorStopped, WorkerExited, WorkerSpawned};

/// The first restart waits this long; each quick exit doubles it.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait before a restart.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A worker that ran this long before it exited starts again from the first backoff.
const HEALTHY: Duration = Duration::from_secs(60);
/// How long stopping workers get after SIGTERM before they are killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The next wait before restarting a worker that ran for `ran` after waiting `last`.
pub(crate) fn next_backoff(last: Option<Duration>, ran: Duration) -> Duration {
    match last {
        Some(last) if ran < HEALTHY => (last * 2).min(MAX_BACKOFF),
        _ => FIRST_BACKOFF,
    }
}

/// One worker slot.
#[derive(Debug)]
struct Slot {
    pid: Option<u32>,
    started: Instant,
    backoff: Option<Duration>,
    restart_at: Option<Instant>,
    restarts: u64,
}

/// What a worker is started with.
#[derive(Debug)]
struct Spec {
    program: PathBuf,
    net: NetArgs,
    worker: WorkerArgs,
    retention: RetentionArgs,
}

impl Spec {
    fn command(&self, index: usize) -> Command {
        let mut c = Command::new(&self.program);
        for addr in &self.net.bootstrap {
            c.arg("--bootstrap").arg(addr.to_string());
        }
        for addr in &self.net.listen {
            c.arg("--listen").arg(addr.to_string());
        }
        c.args(self.net.nat.args());
        c.arg("--data-dir").arg(self.net.data_dir.join(format!("worker-{index}")));
        if let Some(events) = &self.net.events {
            c.arg("--events").arg(events);
        }
        c.arg("--backend").arg(&self.worker.backend);
        if let Some(target) = &self.worker.target {
            c.arg("--target").arg(target);
        }
        if let Some(run) = &self.worker.run {
            c.arg("--run").arg(run);
        }
        if let Some(k) = self.retention.keep_rounds {
            c.arg("--keep-rounds").arg(k.to_string());
        }
        c.arg("--device-id").arg(index.to_string());
        c.kill_on_drop(true);
        c
    }
}

/// Runs `n` workers until SIGINT or SIGTERM.
pub(crate) async fn run(n: usize, net: NetArgs, worker: WorkerArgs, retention: RetentionArgs) -> Result<(), Failure> {
    if n == 0 {
        return Err(Usage("--scale must be at least 1".into()).into());
    }
    if n > 1 && net.listen.iter().any(has_fixed_port) {
        return Err(Usage(format!("--scale {n} starts {n} workers: their --listen addresses need port 0")).into());
    }
    let program = std::env::current_exe().map_err(|e| anyhow::anyhow!("finding the pcp-node binary: {e}"))?;
    let events = Events::open(net.events.as_deref()).map_err(Failure::input)?;
    let spec = Spec { program, net, worker, retention };
    let mut slots: Vec<Slot> = (0..n)
        .map(|_| Slot { pid: None, started: Instant::now(), backoff: None, restart_at: None, restarts: 0 })
        .collect();
    let mut running: JoinSet<(usize, std::io::Result<ExitStatus>)> = JoinSet::new();
    for (index, slot) in slots.iter_mut().enumerate() {
        start(&spec, index, slot, &mut running, &events)?;
    }
    let mut terminate = crate::commands::join::terminate_signal()?;
    let stop = loop {
        let next_restart = slots.iter().filter_map(|s| s.restart_at).min();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break "SIGINT",
            _ = terminate.recv() => break "SIGTERM",
            Some(joined) = running.join_next(), if !running.is_empty() => {
                let Ok((index, status)) = joined else { continue };
                let slot = &mut slots[index];
                let pid = slot.pid.take();
                let ran = slot.started.elapsed();
                let backoff = next_backoff(slot.backoff, ran);
                slot.backoff = Some(backoff);
                slot.restart_at = Some(Instant::now() + backoff);
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                tracing::warn!("worker {index} (pid {pid:?}) exited ({status}) after {:.0} s; restarting in {} s",
                    ran.as_secs_f64(), backoff.as_secs());
                events.emit(Event::WorkerExited(WorkerExited { index: index as u64, pid, status,
                    ran_s: ran.as_secs_f64(), restart_in_s: backoff.as_secs_f64() }));
            }
            () = sleep_until(next_restart) => {
                let now = Instant::now();
                for (index, slot) in slots.iter_mut().enumerate() {
                    if slot.restart_at.is_some_and(|at| at <= now) {
                        slot.restart_at = None;
                        slot.restarts += 1;
                        start(&spec, index, slot, &mut running, &events)?;
                    }
                }
            }
        }
    };
    stop_all(&slots, &mut running).await;
    events.emit(Event::SupervisorStopped(SupervisorStopped { signal: stop.to_owned(), workers: n as u64 }));
    Ok(())
}

fn has_fixed_port(addr: &pcp_bootstrap::Multiaddr) -> bool {
    use pcp_bootstrap::multiaddr::Protocol;
    addr.iter().any(|p| matches!(p, Protocol::Tcp(port) | Protocol::Udp(port) if port != 0))
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn start(
    spec: &Spec,
    index: usize,
    slot: &mut Slot,
    running: &mut JoinSet<(usize, std::io::Result<ExitStatus>)>,
    events: &Events,
) -> Result<(), Failure> {
    let mut child: Child = spec.command(index).spawn().map_err(|e| anyhow::anyhow!("starting worker {index}: {e}"))?;
    slot.pid = child.id();
    slot.started = Instant::now();
    events.emit(Event::WorkerSpawned(WorkerSpawned {
        index: index as u64,
        pid: slot.pid,
        restarts: slot.restarts,
        data_dir: spec.net.data_dir.join(format!("worker-{index}")).display().to_string(),
    }));
    running.spawn(async move { (index, child.wait().await) });
    Ok(())
}

/// SIGTERM to every worker, then SIGKILL to those still running after the grace.
async fn stop_all(slots: &[Slot], running: &mut JoinSet<(usize, std::io::Result<ExitStatus>)>) {
    for pid in slots.iter().filter_map(|s| s.pid) {
        signal(pid, libc::SIGTERM);
    }
    let deadline = Instant::now() + STOP_GRACE;
    while !running.is_empty() {
        if tokio::time::timeout_at(deadline, running.join_next()).await.is_err() {
            break;
        }
    }
    // whatever is left is killed when its task (and `kill_on_drop` child) is dropped
    running.abort_all();
    while running.join_next().await.is_some() {}
}

fn signal(pid: u32, signal: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return };
    // SAFETY: kill(2) only sends a signal; the pid is one of our own children.
    unsafe {
        libc::kill(pid, signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_on_quick_exits_and_resets_after_a_healthy_run() {
        let quick = Duration::from_secs(2);
        let mut b = next_backoff(None, quick);
        assert_eq!(b, FIRST_BACKOFF);
        for expected in [2, 4, 8, 16, 32, 60, 60] {
            b = next_backoff(Some(b), quick);
            assert_eq!(b, Duration::from_secs(expected));
        }
        assert_eq!(next_backoff(Some(b), HEALTHY), FIRST_BACKOFF);
    }
}
