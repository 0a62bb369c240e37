//! What the shepherd spends on each contribution: decoding it
//! ([`compress::decode_delta`]: for sparse runs `sparse::Packed::check`, which
//! checks and measures the message without unpacking it), validating it
//! (`Delta::validate`) and adding it to the round's running sum
//! ([`RunningMean::push`]), measured on one core of this machine, in the
//! measuring thread's CPU time ([`thread_cpu_seconds`]): what the work costs a
//! core, not how long it waited for one on a shared machine (wall time where
//! there is no such clock).
//!
//! Sparse contributions are added the way the shepherd adds them: held in a
//! batch of [`DEFAULT_BATCH`] and added together block by block of the sum
//! (`sparse::add_batch`), so the figure is a batch's check and add divided by
//! its contributions. Dense ones are added one at a time, as the shepherd does.
//!
//! The measurement is calibrated rather than made at the model's full size (which
//! would need three copies of gpt2-124m's 498 MB at start-up): a synthetic message
//! of the model's first tensors, cut to a sample of parameters, is encoded once and
//! then decoded, validated and added (a first time to allocate the sum, then twice
//! timed, keeping the faster). The sample starts at 2^16 parameters and grows 4× at
//! a time while one contribution takes under 20 ms, up to 2^24 parameters (a 64 MiB
//! sum, past a 32 MiB L3 cache) or the whole model. The time is then scaled
//! linearly to the model: by kept entries for sparse (decode, validation and the
//! add all go entry by entry), by values for dense encodings. Blake3
//! hashing of the contribution and the envelope's signature are not included,
//! nor the last batch's add when the round closes (at most [`DEFAULT_BATCH`]
//! contributions' adds, on the shepherd's add threads).
//! `--decode-seconds` replaces the measurement (and makes a run deterministic).

use std::time::Instant;

use pcp_protocol::diloco::aggregate::{DEFAULT_BATCH, RunningMean};
use pcp_protocol::diloco::compress::{self, Encoding};
use serde::Serialize;

/// The most parameters the calibration message holds.
pub const CALIBRATION_PARAMS: u64 = 1 << 24;
/// The fewest it starts with.
const FIRST_SAMPLE: u64 = 1 << 16;
/// A pass that takes this long ends the sample's growth.
const ENOUGH_SECONDS: f64 = 0.02;

/// Seconds the shepherd spends on one contribution, and where the figure came from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecodeCost {
    /// Seconds per contribution: decode, validate and add.
    pub seconds: f64,
    /// How it was obtained, for the report.
    pub source: String,
}

impl DecodeCost {
    /// A given figure (`--decode-seconds`).
    pub fn given(seconds: f64) -> Self {
        Self { seconds, source: "given (--decode-seconds)".into() }
    }

    /// Measures decode, validate and add for tensors of `sizes` in `encoding` (see the module docs).
    pub fn measure(sizes: &[u64], encoding: Encoding) -> Self {
        let params: u64 = sizes.iter().sum();
        let mut sample = FIRST_SAMPLE.min(params);
        loop {
            let cut = cut(sizes, sample);
            let seconds = time(&cut, encoding);
            let next = (sample * 4).min(CALIBRATION_PARAMS).min(params);
            if seconds >= ENOUGH_SECONDS || next == sample {
                let scale = work(&sizes.iter().map(|n| *n as usize).collect::<Vec<_>>(), encoding)
                    / work(&cut, encoding).max(1.0);
                return Self {
                    seconds: seconds * scale,
                    source: format!(
                        "measured: {:.2} ms of a core for {} of {params} parameters ({}{}), scaled {scale:.1}x",
                        seconds * 1e3,
                        cut.iter().sum::<usize>(),
                        encoding.name(),
                        if encoding.sparse().is_some() {
                            format!(", a contribution of a batch of {DEFAULT_BATCH}")
                        } else {
                            String::new()
                        },
                    ),
                };
            }
            sample = next;
        }
    }
}

/// The model's first tensors, cut to `total` parameters.
fn cut(sizes: &[u64], total: u64) -> Vec<usize> {
    let mut left = total;
    let mut out = Vec::new();
    for n in sizes {
        if left == 0 {
            break;
        }
        let take = (*n).min(left);
        out.push(take as usize);
        left -= take;
    }
    out
}

/// What the shepherd's cost is proportional to: kept entries (sparse) or values.
fn work(sizes: &[usize], encoding: Encoding) -> f64 {
    match encoding {
        Encoding::Sparse(s) => sizes.iter().map(|n| s.up.kept_in(*n)).sum::<usize>() as f64,
        _ => sizes.iter().sum::<usize>() as f64,
    }
}

/// Seconds of one decode, validate and add of a synthetic message of `sizes`:
/// for sparse encodings, a batch of [`DEFAULT_BATCH`] copies (each in its own
/// allocation, as received messages are) checked and added, divided by the batch.
fn time(sizes: &[usize], encoding: Encoding) -> f64 {
    // cheap, spread values: a multiplicative hash of the index
    let tensors: Vec<Vec<f32>> = sizes
        .iter()
        .map(|n| {
            (0..*n as u32).map(|i| (i.wrapping_mul(2_654_435_761) as f32 / u32::MAX as f32 - 0.5) * 1e-3).collect()
        })
        .collect();
    let bytes = compress::encode(&tensors, encoding);
    drop(tensors);
    let batch = if encoding.sparse().is_some() { DEFAULT_BATCH } else { 1 };
    let copies: Vec<Vec<u8>> = (0..batch).map(|_| bytes.clone()).collect();
    drop(bytes);
    let mut mean = RunningMean::with_batch(1, batch);
    let mut best = f64::INFINITY;
    for pass in 0..3 {
        let started = Stopwatch::start();
        for b in &copies {
            // the encoder's own message always decodes; a failure would only cost nothing
            let Ok(delta) = compress::decode_delta(b, sizes, encoding) else { return 0.0 };
            let norm = delta.validate(sizes).unwrap_or(0.0);
            mean.push(delta, 1.0, norm, f64::INFINITY, sizes);
        }
        mean.flush();
        if pass > 0 {
            best = best.min(started.seconds() / batch as f64);
        }
    }
    best
}

/// This thread's CPU time (user and system), seconds, or `None` where the
/// clock is missing.
pub fn thread_cpu_seconds() -> Option<f64> {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes one timespec through a valid, exclusive pointer.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(unix))]
    None
}

/// Times work in this thread's CPU time, or in wall time without that clock.
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch {
    wall: Instant,
    cpu: Option<f64>,
}

impl Stopwatch {
    /// Starts now.
    pub fn start() -> Self {
        Self { wall: Instant::now(), cpu: thread_cpu_seconds() }
    }

    /// Seconds since the start: CPU time if both readings have it, else wall time.
    pub fn seconds(&self) -> f64 {
        match (self.cpu, thread_cpu_seconds()) {
            (Some(then), Some(now)) => (now - then).max(0.0),
            _ => self.wall.elapsed().as_secs_f64(),
        }
    }

    /// Wall seconds since the start.
    pub fn wall_seconds(&self) -> f64 {
        self.wall.elapsed().as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_protocol::diloco::sparse;

    #[test]
    fn the_sample_is_the_model_cut_and_costs_scale_with_kept_entries() {
        assert_eq!(cut(&[10, 20, 30], 25), vec![10, 15]);
        assert_eq!(cut(&[10, 20], 100), vec![10, 20]);
        let sparse = Encoding::Sparse(sparse::Settings::parse("sparse:chunk=4096,k=64").expect("parses"));
        // 64 of every 4096, at least one per chunk
        assert_eq!(work(&[8192, 10], sparse), 129.0);
        assert_eq!(work(&[8192, 10], Encoding::F32), 8202.0);
        let small = DecodeCost::measure(&[1000, 24], sparse);
        assert!(small.seconds > 0.0 && small.seconds < 1.0, "{small:?}");
        assert!(small.source.contains("1024 of 1024"), "{}", small.source);
    }
}
