//! The round table the shepherd prints on stdout (when the dashboard does not own it).

use std::io::Write as _;

use super::Host;

impl Host {
    /// A line in the round table (elections and step-downs).
    pub(super) fn table_line(&mut self, line: &str) -> anyhow::Result<()> {
        if self.plan.table {
            writeln!(self.out.lock(), "{:>5} {line}", "--")?;
        }
        Ok(())
    }

    pub(super) fn print_header(&mut self, resumed_at: u64) -> anyhow::Result<()> {
        if !self.plan.table {
            return Ok(());
        }
        let params: usize = self.layout.sizes.iter().sum();
        let mut out = self.out.lock();
        writeln!(
            out,
            "shepherd of run {} ({}): {} rounds of τ={}{}, {} parameters ({:.2} MB), {} pseudo-gradients, {} screen{}{}",
            self.run,
            self.manifest.name,
            self.plan.rounds,
            self.plan.tau,
            if self.plan.overlap { " overlapped" } else { "" },
            params,
            4.0 * params as f64 / 1e6,
            self.plan.encoding.spec(),
            self.plan.screen.name(),
            if self.plan.trim > 0.0 { format!(", mean trimmed by {}", self.plan.trim) } else { String::new() },
            if resumed_at > 0 { format!(", resumed after round {resumed_at}") } else { String::new() }
        )?;
        writeln!(
            out,
            "{:>5} {:>12} {:>10} {:>10} {:>8} {:>10} {:>10}",
            "round", "contributors", "mean loss", "val loss", "seconds", "kB up", "kB down"
        )?;
        Ok(())
    }
}
