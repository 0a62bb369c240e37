//! How much memory a training step needs, and how many micro-batches a batch
//! is split into so that the step fits the device.
//!
//! A step holds the parameters and AdamW state (and their next values, which the
//! step returns before the old ones are freed), the gradients, an accumulator when
//! micro-batches are used, and the activations the backward reads. The first
//! kinds scale with the parameters; the last with the micro-batch. The
//! activations are counted from the step's own IR (every forward value a backward
//! op reads, so `--recompute` shows in them), and IREE's transient buffers are
//! accounted for by a factor measured on the cpu backend (`bench/memory.sh`).
//! When not even one sequence per micro-batch fits, stronger recomputation is
//! tried (`attention`, `elementwise`, then `blocks`) before giving up with a
//! warning. `train` plans for its own device; a shepherd plans for each worker
//! from the free memory in its hello ([`Footprint`]).
//!
//! On the cpu a batch may also be split for speed ([`cache_micro_batch`]): a
//! batch whose activations spill the last-level cache runs as micro-batches
//! whose activations fit the cores' L2 caches, when one sequence does.
//! nanogpt-medium (64 × 128, a 32 MiB MLP activation) then runs as 16 of 4
//! sequences; `bench step --steps 20` runs back to back on a 2-core EPYC (1 MiB L2
//! a core, 32 MiB L3), recompute `elementwise`: 4,717–5,078 tokens/s whole,
//! 5,841–6,280 as 16 × 4, with 322 MiB peak instead of 734 (`none` at 16 × 4:
//! 5,515–6,113 and 459 MiB). (The 16 × 4 step then had the plain flags, IREE having
//! refused the tuned ones; with the tuned ones, which now compile it, 4 sequences
//! still ran at least as fast as 8, 16 or 32: `docs/getting-started.md`.)
//! gpt2-124m is left whole: one sequence's 12 MiB MLP activation fits no L2, and
//! 8 × 1 ran 3.6% slower (215 against 223 tokens/s). nanogpt-small's whole batch
//! (2 MiB) already fits the L3.

use std::collections::HashMap;

use pcp_graph::Recompute;

use crate::training::model::Model;

/// Bytes per parameter a step holds besides activations: parameters, m and v
/// (in and out), the gradient, and an accumulator (in and out).
const STATE_BYTES_PER_PARAM: u64 = 4 * 9;

/// Peak step memory per byte of kept activations, IREE's transients included;
/// measured on the cpu backend: 1.0 for nanogpt-medium (1.59 GiB peak, 1.48 GiB
/// kept), 1.07–1.2 for gpt2-124m (7.0 GiB at one sequence, 10.15 GiB at two).
const ACTIVATION_FACTOR: f64 = 1.25;

/// The process and runtime themselves (code, the loaded module, the corpus),
/// which share the host's memory with a step on the cpu backend.
pub(crate) const PROCESS_BYTES: u64 = 256 << 20;

/// What one call of `step`'s `train_step` is expected to need at its peak.
pub(crate) fn step_bytes(step: &pcp_graph::TrainModule) -> u64 {
    let params = step.signature.parameter_count().max(0) as u64;
    params * STATE_BYTES_PER_PARAM + (step.saved_activation_bytes as f64 * ACTIVATION_FACTOR) as u64
}

/// How a batch is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    /// Sequences per optimizer step.
    pub(crate) batch: usize,
    /// Micro-batches per step (1: no accumulation).
    pub(crate) micro_batches: usize,
    /// The expected peak of one micro-batch's step, in bytes.
    pub(crate) estimate_bytes: u64,
    /// Whether even the smallest split is expected to exceed the free memory.
    pub(crate) over: bool,
}

impl Split {
    /// The whole batch at once, expected to need `estimate_bytes`.
    pub(crate) fn whole(batch: usize, estimate_bytes: u64) -> Self {
        Self { batch, micro_batches: 1, estimate_bytes, over: false }
    }
}

/// The fewest micro-batches (a divisor of `batch`) whose step fits in `free`
/// bytes, leaving a tenth spare; `estimate(m)` is the peak at micro-batch `m`.
pub(crate) fn split(batch: usize, free: u64, mut estimate: impl FnMut(usize) -> u64) -> Split {
    let budget = free - free / 10;
    let mut last = Split { batch, micro_batches: 1, estimate_bytes: 0, over: true };
    for k in (1..=batch.max(1)).filter(|k| batch.is_multiple_of(*k)) {
        let bytes = estimate(batch / k);
        last = Split { batch, micro_batches: k, estimate_bytes: bytes, over: bytes > budget };
        if !last.over {
            break;
        }
    }
    last
}

/// The split and recomputation for a step of `batch` sequences in `free` bytes:
/// the fewest micro-batches with the run's recomputation `run`; when not even
/// one sequence fits, the mildest stronger recomputation that fits, with its
/// fewest micro-batches; when none fits, the run's answer (marked `over`).
/// `estimate(mode, m)` is the peak at micro-batch `m`.
pub(crate) fn plan(
    batch: usize,
    free: u64,
    run: Recompute,
    mut estimate: impl FnMut(Recompute, usize) -> u64,
) -> (Split, Recompute) {
    let first = split(batch, free, |m| estimate(run, m));
    if !first.over {
        return (first, run);
    }
    for mode in run.stronger() {
        let s = split(batch, free, |m| estimate(mode, m));
        if !s.over {
            return (s, mode);
        }
    }
    (first, run)
}

/// The expected peak of a built-in model's step (see [`step_bytes`]) at
/// micro-batch `m` with `recompute`; `u64::MAX` if it does not build.
pub(crate) fn preset_step_bytes(
    source: &str,
    vocab: usize,
    config: &pcp_graph::StepConfig,
    recompute: Recompute,
    m: usize,
) -> u64 {
    let config = pcp_graph::StepConfig { recompute, accumulate: false, ..config.clone() };
    let built = Model::load_with_batch(source, vocab, Some(m)).ok();
    let step = built.and_then(|b| pcp_graph::train_step(&b.module, "main", &config).ok());
    step.map_or(u64::MAX, |s| step_bytes(&s))
}

/// A built-in model's expected step peak at every recomputation from the run's
/// up and every micro-batch that divides the batch: measured once by a shepherd,
/// which plans each worker's split from it.
#[derive(Debug, Clone)]
pub(crate) struct Footprint {
    batch: usize,
    run: Recompute,
    bytes: HashMap<(Recompute, usize), u64>,
}

impl Footprint {
    /// Builds the step for every (mode, micro-batch): about 20 ms each for
    /// nanogpt-small, 0.2 s for gpt2-124m.
    pub(crate) fn measure(batch: usize, run: Recompute, mut estimate: impl FnMut(Recompute, usize) -> u64) -> Self {
        let mut bytes = HashMap::new();
        for mode in std::iter::once(run).chain(run.stronger()) {
            for m in (1..=batch).filter(|m| batch.is_multiple_of(*m)) {
                bytes.insert((mode, m), estimate(mode, m));
            }
        }
        Self { batch, run, bytes }
    }

    /// The split and recomputation for a device with `free` bytes (see [`plan`]).
    pub(crate) fn plan(&self, free: u64) -> (Split, Recompute) {
        plan(self.batch, free, self.run, |mode, m| self.bytes.get(&(mode, m)).copied().unwrap_or(u64::MAX))
    }
}

/// The caches of the cpu a step runs on, in bytes: the L2 caches of the cores it
/// may use (each counted once) and the last level's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CpuCache {
    pub(crate) l2: u64,
    pub(crate) last: u64,
}

impl CpuCache {
    /// This host's, from `/sys/devices/system/cpu/cpu*/cache`; `None` when sysfs
    /// does not say (another OS, a sandbox hiding it).
    pub(crate) fn host() -> Option<Self> {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let mut levels: HashMap<(u32, String), u64> = HashMap::new();
        for cpu in 0..cpus {
            let dir = format!("/sys/devices/system/cpu/cpu{cpu}/cache");
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                let read = |name: &str| std::fs::read_to_string(entry.path().join(name)).ok();
                let (Some(level), Some(kind), Some(size), Some(shared)) =
                    (read("level"), read("type"), read("size"), read("shared_cpu_list"))
                else {
                    continue;
                };
                let (Ok(level), Some(size)) = (level.trim().parse::<u32>(), parse_cache_size(size.trim())) else {
                    continue;
                };
                if kind.trim() != "Instruction" {
                    levels.insert((level, shared.trim().to_owned()), size);
                }
            }
        }
        let sum = |level: u32| levels.iter().filter(|((l, _), _)| *l == level).map(|(_, b)| *b).sum::<u64>();
        let last = levels.keys().map(|(l, _)| *l).max()?;
        let l2 = sum(2);
        (l2 > 0 && last >= 2).then(|| Self { l2, last: sum(last) })
    }
}

/// A sysfs cache size: `1024K`, `32M` or bytes.
fn parse_cache_size(text: &str) -> Option<u64> {
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let n: u64 = digits.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => Some(n << 10),
        "M" => Some(n << 20),
        "G" => Some(n << 30),
        _ => None,
    }
}

/// On a cpu with `cache`, the micro-batch (sequences) that keeps a step's
/// activations in cache, when splitting the batch should pay (module docs):
/// the batch's widest activation (`sequence_bytes` a sequence) spills half the
/// last-level cache, and the largest smaller micro-batch whose widest activation
/// fits the L2 caches. `None`: the whole batch (it already fits, or not even one
/// sequence would).
pub(crate) fn cache_micro_batch(batch: usize, sequence_bytes: u64, cache: CpuCache) -> Option<usize> {
    if (batch as u64).saturating_mul(sequence_bytes) <= cache.last / 2 {
        return None;
    }
    (1..batch)
        .rev()
        .filter(|m| batch.is_multiple_of(*m))
        .find(|m| (*m as u64).saturating_mul(sequence_bytes) <= cache.l2)
}

/// The memory available to a step on the cpu backend: the kernel's
/// `MemAvailable`, less what the process itself takes.
pub(crate) fn host_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some((kb * 1024).saturating_sub(PROCESS_BYTES))
}

/// What a GPU driver's context takes from the memory the tools report free.
const GPU_CONTEXT_BYTES: u64 = 512 << 20;

/// How long a driver tool may take to answer.
const TOOL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The memory a step may use on `device`, and where the figure came from:
/// the host's available memory on cpu (`host`); a GPU's free memory as its
/// driver's tool reports it (`nvidia-smi` for cuda, `rocm-smi` for rocm), less
/// what the runtime's context takes; `unknown` for other backends, or when the
/// tool is missing, fails or takes over 5 s.
pub(crate) fn device_free(device: pcp_runtime::Device) -> (Option<u64>, &'static str) {
    use pcp_runtime::Device;
    let gpu = |tool: &'static str, args: &[&str], parse: fn(&str, usize) -> Option<u64>| {
        let free = run_tool(tool, args).and_then(|out| parse(&out, visible_ordinal()));
        match free {
            Some(bytes) => (Some(bytes.saturating_sub(GPU_CONTEXT_BYTES)), tool),
            None => (None, "unknown"),
        }
    };
    match device {
        Device::Cpu => (host_available(), "host"),
        Device::Cuda => {
            gpu("nvidia-smi", &["--query-gpu=memory.free", "--format=csv,noheader,nounits"], parse_nvidia_smi)
        }
        Device::Rocm => gpu("rocm-smi", &["--showmeminfo", "vram", "--json"], parse_rocm_smi),
        Device::Vulkan | Device::Metal => (None, "unknown"),
    }
}

/// The GPU this process uses, as the driver tools number them: the first of
/// `CUDA_VISIBLE_DEVICES` or `HIP_VISIBLE_DEVICES` (set by `--device-id`), else 0.
fn visible_ordinal() -> usize {
    ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .find_map(|list| list.split(',').next().and_then(|first| first.trim().parse().ok()))
        .unwrap_or(0)
}

/// `tool args`' stdout, if it exits successfully within [`TOOL_TIMEOUT`].
fn run_tool(tool: &str, args: &[&str]) -> Option<String> {
    let mut child = std::process::Command::new(tool)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = std::time::Instant::now() + TOOL_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            _ => {
                tracing::debug!("{tool} did not answer; the GPU's free memory is unknown");
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take()?, &mut out).ok()?;
    Some(out)
}

/// `nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits`: one line
/// per GPU, in MiB.
fn parse_nvidia_smi(out: &str, ordinal: usize) -> Option<u64> {
    let mib: u64 = out.lines().filter(|l| !l.trim().is_empty()).nth(ordinal)?.trim().parse().ok()?;
    Some(mib << 20)
}

/// `rocm-smi --showmeminfo vram --json`: per card, the total and used bytes, as strings.
fn parse_rocm_smi(out: &str, ordinal: usize) -> Option<u64> {
    let json: serde_json::Value = serde_json::from_str(out).ok()?;
    let card = json.get(format!("card{ordinal}"))?;
    let bytes = |key: &str| card.get(key)?.as_str()?.trim().parse::<u64>().ok();
    Some(bytes("VRAM Total Memory (B)")?.saturating_sub(bytes("VRAM Total Used Memory (B)")?))
}

/// Parses a size: `8GB`, `8GiB`, `512MB`, `1.5G` or plain bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("{text:?} is not a size (e.g. 8GB, 512MiB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (B, KB, MB, GB, TB, KiB, MiB, GiB)")),
    };
    Ok((value * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The presets on this repository's 2-core EPYC (1 MiB of L2 a core, 32 MiB of
    /// L3), each sequence's widest activation being the MLP's (4 × width, f32).
    #[test]
    fn a_cpu_splits_only_batches_that_spill_its_cache() {
        let epyc = CpuCache { l2: 2 << 20, last: 32 << 20 };
        let widest = |block: u64, width: u64| block * 4 * width * 4;
        // nanogpt-medium: 64 × 128 at width 256 is 32 MiB; 4 sequences fill the L2
        assert_eq!(cache_micro_batch(64, widest(128, 256), epyc), Some(4));
        // nanogpt-small: 64 × 32 at width 64 is 2 MiB, in the L3 already
        assert_eq!(cache_micro_batch(64, widest(32, 64), epyc), None);
        // gpt2-124m: one sequence (12 MiB) fits no L2; splitting only re-reads the weights
        assert_eq!(cache_micro_batch(8, widest(1024, 768), epyc), None);
        // a larger L2 takes larger micro-batches; only divisors of the batch
        let big = CpuCache { l2: 8 << 20, last: 32 << 20 };
        assert_eq!(cache_micro_batch(64, widest(128, 256), big), Some(16));
        assert_eq!(cache_micro_batch(48, widest(128, 256), big), Some(16));
        assert_eq!(cache_micro_batch(40, widest(128, 256), big), Some(10));
        // a batch of one sequence has nothing to split
        assert_eq!(cache_micro_batch(1, 1 << 30, epyc), None);
    }

    #[test]
    fn sysfs_cache_sizes_parse() {
        assert_eq!(parse_cache_size("1024K"), Some(1 << 20));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("12 KB"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn the_fewest_micro_batches_that_fit_are_chosen() {
        // 1 GB per sequence plus 1 GB fixed
        let estimate = |m: usize| 1_000_000_000 * (m as u64 + 1);
        assert_eq!(split(8, 100_000_000_000, estimate).micro_batches, 1);
        assert_eq!(split(8, 8_000_000_000, estimate).micro_batches, 2); // 5 GB
        assert_eq!(split(8, 4_000_000_000, estimate).micro_batches, 4); // 3 GB
        assert_eq!(split(6, 4_000_000_000, estimate).micro_batches, 3); // 3 GB; 4 does not divide 6
        let over = split(8, 1_000_000_000, estimate);
        assert_eq!((over.micro_batches, over.over), (8, true));
    }

    #[test]
    fn stronger_recomputation_is_taken_only_when_one_sequence_does_not_fit() {
        // 1 GB fixed; per sequence 4 GB kept (none), 2 (attention), 1 (elementwise), 0.5 (blocks)
        let per = |mode: Recompute| match mode {
            Recompute::None => 4.0,
            Recompute::Attention => 2.0,
            Recompute::Elementwise => 1.0,
            Recompute::Blocks => 0.5,
        };
        let estimate = |mode: Recompute, m: usize| ((1.0 + per(mode) * m as f64) * 1e9) as u64;
        let footprint = Footprint::measure(8, Recompute::None, estimate);
        let at = |gb: f64| {
            let (s, mode) = footprint.plan((gb * 1e9) as u64);
            (s.micro_batches, mode, s.over)
        };
        assert_eq!(at(100.0), (1, Recompute::None, false));
        assert_eq!(at(10.0), (4, Recompute::None, false)); // 9 GB budget: 2 sequences of 4 GB
        assert_eq!(at(6.0), (8, Recompute::None, false)); // 5.4 GB budget: one sequence, 5 GB
        assert_eq!(at(4.0), (8, Recompute::Attention, false)); // one sequence needs 5 GB kept, 3 recomputing attention
        assert_eq!(at(3.0), (8, Recompute::Elementwise, false));
        assert_eq!(at(2.0), (8, Recompute::Blocks, false)); // 1.8 GB budget: blocks take 1.5 GB
        assert_eq!(at(1.0), (8, Recompute::None, true));
        // a run that already recomputes blocks never weakens it
        let blocks = Footprint::measure(8, Recompute::Blocks, estimate);
        assert_eq!(blocks.plan(100e9 as u64).1, Recompute::Blocks);
    }

    #[test]
    fn driver_tools_free_memory_is_read_and_bad_output_is_unknown() {
        // an 8-GPU H100 node, the third one busy
        let nvidia = "81079\n81079\n1024\n81079\n";
        assert_eq!(parse_nvidia_smi(nvidia, 0), Some(81079 << 20));
        assert_eq!(parse_nvidia_smi(nvidia, 2), Some(1024 << 20));
        assert_eq!(parse_nvidia_smi(nvidia, 8), None);
        assert_eq!(parse_nvidia_smi("No devices were found\n", 0), None);
        let rocm = r#"{"card0": {"VRAM Total Memory (B)": "206141652992", "VRAM Total Used Memory (B)": "294129664"}}"#;
        assert_eq!(parse_rocm_smi(rocm, 0), Some(206_141_652_992 - 294_129_664));
        assert_eq!(parse_rocm_smi(rocm, 1), None);
        assert_eq!(parse_rocm_smi("not json", 0), None);
        // a tool that is not installed answers nothing (not a panic or a hang)
        assert_eq!(run_tool("pcp-no-such-tool", &[]), None);
        assert_eq!(device_free(pcp_runtime::Device::Vulkan), (None, "unknown"));
    }

    #[test]
    fn sizes_parse_with_units_and_bad_ones_are_named() {
        assert_eq!(parse_size("8GB"), Ok(8_000_000_000));
        assert_eq!(parse_size("8 GiB"), Ok(8 << 30));
        assert_eq!(parse_size("1.5g"), Ok(1_500_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").unwrap_err().contains("is not a size"));
        assert!(parse_size("8XB").unwrap_err().contains("unknown unit"));
    }
}
