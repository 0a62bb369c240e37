//! The shepherd's CPU costs, as a table: what a contribution, a heartbeat, a
//! screen and a round's close cost a core of the machine the table was measured
//! on. The simulator reads the table ([`Calibration::embedded`], committed as
//! `simulations/calibration.json`, or `--calibration FILE`) and measures nothing
//! at start-up, so the same seed and the same inputs give the same report, byte
//! for byte. `simulate --calibrate` measures what this crate can measure
//! ([`Calibration::measure`]) and writes a new table.
//!
//! Costs are per unit of work, so one table serves every model size:
//!
//! * decode and check (`compress::decode_delta` and `Delta::validate`): per kept
//!   entry for sparse contributions (`sparse::Packed::check` goes entry by
//!   entry), per value for dense ones, by encoding;
//! * the add to the round's sum (`RunningMean::push`): per kept entry for sparse
//!   contributions, added in batches of [`DEFAULT_BATCH`] as the shepherd adds
//!   them, per value for dense ones; core-seconds (the shepherd splits it over its
//!   aggregate threads);
//! * blake3 and ChaCha20-Poly1305 (the transport's cipher) per byte, one core;
//! * an ed25519 signature check and a signature (a heartbeat's envelope and its answer).
//!
//! Some figures are not measured here, because only the node can (its IREE
//! engine, its state directory, its transport): the shepherd's forward-pass FLOP
//! rate per core (the screen's and the validation's forward passes); a round's
//! close and a checkpoint per parameter (every round: the outer step, the
//! parameters' shards and the state blob hashed and written; every
//! `--checkpoint-rounds`: the checkpoint); and what receiving a contribution
//! costs the receiver's cores beyond the table's other figures, per byte (the TCP
//! stack, TLS, yamux and the frame's copies). `--calibrate` copies them from the table it started from;
//! the committed figures are named in `notes` with where they came from.
//!
//! A measurement takes each figure in the measuring thread's CPU time
//! ([`Stopwatch`]), the faster of two passes after a warm-up.

use std::collections::BTreeMap;
use std::path::Path;

use pcp_protocol::diloco::aggregate::{DEFAULT_BATCH, RunningMean};
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::sparse::Settings;
use serde::{Deserialize, Serialize};

use crate::args::WireEncoding;
use crate::decode::Stopwatch;
use crate::error::Error;

/// The committed table, measured once on the machine it names.
const EMBEDDED: &str = include_str!("../calibration.json");

/// Parameters of the synthetic contribution the decode and add are timed on.
const SAMPLE_PARAMS: usize = 1 << 22;
/// Bytes hashed and encrypted per timing pass.
const CIPHER_BYTES: usize = 1 << 26;
/// A transport frame's largest payload (a noise message is at most 65,535 bytes).
const FRAME: usize = 65_519;
/// Signatures signed and checked per timing pass.
const SIGNATURES: usize = 2_000;

/// What the shepherd's CPU work costs, per unit (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The CPU the table was measured on (`/proc/cpuinfo`'s model name).
    pub cpu: String,
    /// Its cores: the simulator's default `--aggregate-threads`.
    pub cores: usize,
    /// Where each figure came from.
    pub notes: Vec<String>,
    /// Seconds of a core to decode and check one kept entry of a sparse contribution.
    pub sparse_check_s_per_entry: f64,
    /// Core-seconds to add one kept entry of a sparse contribution, in batches of 32.
    pub sparse_add_s_per_entry: f64,
    /// Seconds of a core to decode and check one value of a dense contribution, by
    /// encoding (`fp32`, `bf16`, `int8`).
    pub dense_decode_s_per_value: BTreeMap<String, f64>,
    /// Core-seconds to add one value of a dense contribution.
    pub dense_add_s_per_value: f64,
    /// Seconds of a core to blake3 one byte.
    pub blake3_s_per_byte: f64,
    /// Seconds of a core to encrypt or decrypt one byte with ChaCha20-Poly1305.
    pub chacha20poly1305_s_per_byte: f64,
    /// Core-seconds per byte a contribution costs its receiver beyond decode, check,
    /// add, blake3 and the cipher: the TCP stack, TLS, yamux and the frame's copies
    /// (not measured here).
    pub transport_s_per_byte: f64,
    /// Seconds of a core to hold one kept entry of a sparse contribution to the copy
    /// check (its sketch and its share on the last update's support).
    pub copy_sparse_s_per_entry: f64,
    /// Seconds of a core to hold one value of a dense contribution to the copy check
    /// (its sketch).
    pub copy_dense_s_per_value: f64,
    /// Seconds of a core to check one ed25519 signature.
    pub ed25519_verify_s: f64,
    /// Seconds of a core to make one ed25519 signature.
    pub ed25519_sign_s: f64,
    /// Forward-pass FLOP/s of one of the shepherd's cores (not measured here).
    pub forward_flops_per_core: f64,
    /// Seconds of the shepherd's event loop per parameter to close a round, up to
    /// the next announcement: the outer step and the update's encoding, the
    /// parameters and their shards hashed, and the state blob stored (not measured
    /// here).
    pub close_s_per_param: f64,
    /// Seconds of the shepherd's event loop per parameter to write the parameters'
    /// shards, after the announcement (not measured here).
    pub shards_s_per_param: f64,
    /// Seconds of the shepherd's event loop per parameter to write a checkpoint,
    /// after every `--checkpoint-rounds` rounds (not measured here).
    pub checkpoint_s_per_param: f64,
}

impl Calibration {
    /// The committed table.
    pub fn embedded() -> Self {
        // the committed file is checked by a test
        serde_json::from_str(EMBEDDED).unwrap_or_else(|e| panic!("simulations/calibration.json: {e}"))
    }

    /// The table at `path`.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let bad = |reason: String| Error::Calibration { path: path.to_path_buf(), reason };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let table: Self = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        table.check().map_err(bad)?;
        Ok(table)
    }

    /// Every figure finite and positive, and the dense encodings present.
    fn check(&self) -> Result<(), String> {
        let figures = [
            self.sparse_check_s_per_entry,
            self.sparse_add_s_per_entry,
            self.dense_add_s_per_value,
            self.blake3_s_per_byte,
            self.chacha20poly1305_s_per_byte,
            self.transport_s_per_byte,
            self.copy_sparse_s_per_entry,
            self.copy_dense_s_per_value,
            self.ed25519_verify_s,
            self.ed25519_sign_s,
            self.forward_flops_per_core,
            self.close_s_per_param,
            self.shards_s_per_param,
            self.checkpoint_s_per_param,
        ];
        if figures.iter().chain(self.dense_decode_s_per_value.values()).any(|f| !(f.is_finite() && *f > 0.0)) {
            return Err("every cost must be a positive number".into());
        }
        if self.cores == 0 {
            return Err("cores must be at least 1".into());
        }
        for e in ["fp32", "bf16", "int8"] {
            if !self.dense_decode_s_per_value.contains_key(e) {
                return Err(format!("dense_decode_s_per_value has no {e}"));
            }
        }
        Ok(())
    }

    /// Seconds of a core to decode and check a contribution of `sizes` in `encoding`.
    pub fn decode_s(&self, sizes: &[usize], encoding: WireEncoding) -> f64 {
        match encoding.encoding() {
            Encoding::Sparse(s) => self.sparse_check_s_per_entry * kept(sizes, s) as f64,
            _ => {
                let per = self.dense_decode_s_per_value.get(encoding_key(encoding)).copied().unwrap_or(0.0);
                per * sizes.iter().sum::<usize>() as f64
            }
        }
    }

    /// Core-seconds to add a contribution of `sizes` in `encoding` to the round's sum.
    pub fn add_s(&self, sizes: &[usize], encoding: WireEncoding) -> f64 {
        match encoding.encoding() {
            Encoding::Sparse(s) => self.sparse_add_s_per_entry * kept(sizes, s) as f64,
            _ => self.dense_add_s_per_value * sizes.iter().sum::<usize>() as f64,
        }
    }

    /// Core-seconds to hold a contribution of `sizes` in `encoding` to the copy check.
    pub fn copy_check_s(&self, sizes: &[usize], encoding: WireEncoding) -> f64 {
        match encoding.encoding() {
            Encoding::Sparse(s) => self.copy_sparse_s_per_entry * kept(sizes, s) as f64,
            _ => self.copy_dense_s_per_value * sizes.iter().sum::<usize>() as f64,
        }
    }

    /// Measures what this crate can on this machine; the node's figures
    /// (forward FLOP/s, close per parameter) are copied from `base`.
    pub fn measure(base: &Self) -> Self {
        let sizes = sample_sizes();
        let sparse = Encoding::Sparse(Settings::default());
        let (check, add) = time_sparse(&sizes, sparse);
        let copy_sparse = time_copy_sparse(&sizes, sparse);
        let entries = kept(&sizes, Settings::default()) as f64;
        let values = sizes.iter().sum::<usize>() as f64;
        let mut dense_decode = BTreeMap::new();
        let mut dense_add = f64::INFINITY;
        for e in [WireEncoding::Fp32, WireEncoding::Bf16, WireEncoding::Int8] {
            let (decode, add) = time_dense(&sizes, e.encoding());
            dense_decode.insert(encoding_key(e).to_owned(), decode / values);
            if e == WireEncoding::Fp32 {
                dense_add = add / values;
            }
        }
        let (verify, sign) = time_ed25519();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu = cpu_name();
        Self {
            notes: vec![
                format!(
                    "measured with `simulate --calibrate` on {cpu}, {cores} cores: decode, check and add of a \
                     {SAMPLE_PARAMS}-parameter contribution (sparse in batches of {DEFAULT_BATCH}), blake3 and \
                     ChaCha20-Poly1305 of 64 MiB, ed25519 over a 256-byte message"
                ),
                "forward_flops_per_core, transport_s_per_byte, close_s_per_param, shards_s_per_param and \
                 checkpoint_s_per_param are not measured here: copied from the table --calibrate started from"
                    .into(),
            ]
            .into_iter()
            .chain(
                base.notes
                    .iter()
                    .filter(|n| {
                        ["forward_flops", "transport_s", "close_s", "shards_s", "checkpoint_s"]
                            .iter()
                            .any(|f| n.starts_with(f))
                    })
                    .cloned(),
            )
            .collect(),
            cpu,
            cores,
            sparse_check_s_per_entry: check / entries,
            sparse_add_s_per_entry: add / entries,
            dense_decode_s_per_value: dense_decode,
            dense_add_s_per_value: dense_add,
            blake3_s_per_byte: time_blake3() / CIPHER_BYTES as f64,
            chacha20poly1305_s_per_byte: time_chacha() / CIPHER_BYTES as f64,
            transport_s_per_byte: base.transport_s_per_byte,
            copy_sparse_s_per_entry: copy_sparse / entries,
            copy_dense_s_per_value: time_copy_dense(&sizes) / SAMPLE_PARAMS as f64,
            ed25519_verify_s: verify,
            ed25519_sign_s: sign,
            forward_flops_per_core: base.forward_flops_per_core,
            close_s_per_param: base.close_s_per_param,
            shards_s_per_param: base.shards_s_per_param,
            checkpoint_s_per_param: base.checkpoint_s_per_param,
        }
    }
}

/// The table's key for a dense encoding.
fn encoding_key(e: WireEncoding) -> &'static str {
    match e {
        WireEncoding::Fp32 => "fp32",
        WireEncoding::Bf16 => "bf16",
        WireEncoding::Int8 => "int8",
        WireEncoding::Sparse(_) => "sparse",
    }
}

/// Kept entries of a sparse contribution of `sizes`.
fn kept(sizes: &[usize], s: Settings) -> usize {
    sizes.iter().map(|n| s.up.kept_in(*n)).sum()
}

/// A sample shaped like a transformer's: square and 4× matrices of width 768, and biases.
fn sample_sizes() -> Vec<usize> {
    let d = 768;
    let mut sizes = Vec::new();
    while sizes.iter().sum::<usize>() + 9 * d * d <= SAMPLE_PARAMS {
        sizes.extend([3 * d * d, d * d, d, 4 * d * d, 4 * d]);
    }
    sizes.push(SAMPLE_PARAMS - sizes.iter().sum::<usize>());
    sizes
}

/// Cheap, spread values: a multiplicative hash of the index.
fn tensors(sizes: &[usize]) -> Vec<Vec<f32>> {
    sizes
        .iter()
        .map(|n| {
            (0..*n as u32).map(|i| (i.wrapping_mul(2_654_435_761) as f32 / u32::MAX as f32 - 0.5) * 1e-3).collect()
        })
        .collect()
}

/// The faster of two timed passes of `f`, after one untimed.
fn best(mut f: impl FnMut() -> f64) -> f64 {
    f();
    f().min(f())
}

/// Seconds of a core to decode and check, and to add, one sparse contribution
/// (a batch of [`DEFAULT_BATCH`], divided by it).
fn time_sparse(sizes: &[usize], encoding: Encoding) -> (f64, f64) {
    let bytes = compress::encode(&tensors(sizes), encoding);
    let copies: Vec<Vec<u8>> = (0..DEFAULT_BATCH).map(|_| bytes.clone()).collect();
    let mut check = f64::INFINITY;
    let mut add = f64::INFINITY;
    let mut mean = RunningMean::with_batch(1, DEFAULT_BATCH);
    for pass in 0..3 {
        let started = Stopwatch::start();
        let deltas: Vec<_> = copies
            .iter()
            .filter_map(|b| compress::decode_delta(b, sizes, encoding).ok())
            .map(|d| {
                let norm = d.validate(sizes).unwrap_or(0.0);
                (d, norm)
            })
            .collect();
        let checked = started.seconds();
        let started = Stopwatch::start();
        for (d, norm) in deltas {
            mean.push(d, 1.0, norm, f64::INFINITY, sizes);
        }
        mean.flush();
        if pass > 0 {
            check = check.min(checked / DEFAULT_BATCH as f64);
            add = add.min(started.seconds() / DEFAULT_BATCH as f64);
        }
    }
    (check, add)
}

/// Seconds of a core to hold one sparse contribution to the copy check: its sketch
/// and its share on an update's support (the sample's own top-k at the update's layout).
fn time_copy_sparse(sizes: &[usize], encoding: Encoding) -> f64 {
    let Encoding::Sparse(settings) = encoding else { return 0.0 };
    let tensors = tensors(sizes);
    let Ok(delta) = compress::decode_delta(&compress::encode(&tensors, encoding), sizes, encoding) else {
        return 0.0;
    };
    let (_, update) = pcp_protocol::diloco::sparse::encode(&tensors, settings.down());
    best(|| {
        let started = Stopwatch::start();
        std::hint::black_box(pcp_protocol::diloco::sketch::sketch_and_share(0x5eed, &delta, Some(&update), 1));
        started.seconds()
    })
}

/// Seconds of a core to hold one dense contribution to the copy check (its sketch).
fn time_copy_dense(sizes: &[usize]) -> f64 {
    let delta = pcp_protocol::diloco::aggregate::Delta::Dense(tensors(sizes));
    best(|| {
        let started = Stopwatch::start();
        std::hint::black_box(pcp_protocol::diloco::sketch::sketch_and_share(0x5eed, &delta, None, 1));
        started.seconds()
    })
}

/// Seconds of a core to decode and check, and to add, one dense contribution.
fn time_dense(sizes: &[usize], encoding: Encoding) -> (f64, f64) {
    let bytes = compress::encode(&tensors(sizes), encoding);
    let mut decode = f64::INFINITY;
    let mut add = f64::INFINITY;
    let mut mean = RunningMean::with_batch(1, 1);
    for pass in 0..3 {
        let started = Stopwatch::start();
        let Ok(delta) = compress::decode_delta(&bytes, sizes, encoding) else { return (0.0, 0.0) };
        let norm = delta.validate(sizes).unwrap_or(0.0);
        let decoded = started.seconds();
        let started = Stopwatch::start();
        mean.push(delta, 1.0, norm, f64::INFINITY, sizes);
        mean.flush();
        if pass > 0 {
            decode = decode.min(decoded);
            add = add.min(started.seconds());
        }
    }
    (decode, add)
}

/// Seconds of a core to blake3 [`CIPHER_BYTES`].
fn time_blake3() -> f64 {
    let data = vec![7u8; CIPHER_BYTES];
    best(|| {
        let started = Stopwatch::start();
        std::hint::black_box(blake3::hash(std::hint::black_box(&data)));
        started.seconds()
    })
}

/// Seconds of a core to encrypt [`CIPHER_BYTES`] in transport frames.
fn time_chacha() -> f64 {
    use chacha20poly1305::aead::{AeadInPlace, KeyInit};
    use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
    let cipher = ChaCha20Poly1305::new(Key::from_slice(&[9u8; 32]));
    let mut frame = vec![3u8; FRAME];
    best(|| {
        let started = Stopwatch::start();
        for i in 0..CIPHER_BYTES.div_ceil(FRAME) as u64 {
            let mut nonce = [0u8; 12];
            nonce[4..].copy_from_slice(&i.to_le_bytes());
            let tag = cipher.encrypt_in_place_detached(Nonce::from_slice(&nonce), b"", &mut frame);
            std::hint::black_box(tag.ok());
        }
        started.seconds()
    })
}

/// Seconds of a core to check, and to make, one ed25519 signature of a heartbeat-sized message.
fn time_ed25519() -> (f64, f64) {
    use ed25519_dalek::{Signer, SigningKey, Verifier};
    let key = SigningKey::from_bytes(&[5u8; 32]);
    let public = key.verifying_key();
    let message = [1u8; 256];
    let signature = key.sign(&message);
    let verify = best(|| {
        let started = Stopwatch::start();
        for _ in 0..SIGNATURES {
            std::hint::black_box(public.verify(std::hint::black_box(&message), &signature).is_ok());
        }
        started.seconds()
    });
    let sign = best(|| {
        let started = Stopwatch::start();
        for _ in 0..SIGNATURES {
            std::hint::black_box(key.sign(std::hint::black_box(&message)));
        }
        started.seconds()
    });
    (verify / SIGNATURES as f64, sign / SIGNATURES as f64)
}

/// This machine's CPU model, from `/proc/cpuinfo` (`unknown` elsewhere).
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_table_is_whole_and_scales_with_the_work() {
        let t = Calibration::embedded();
        assert_eq!(t.check(), Ok(()));
        assert!(t.cpu.contains("AMD EPYC"), "{}", t.cpu);
        assert_eq!(t.cores, 2);
        let sizes = [1 << 20, 1 << 20];
        let sparse = t.decode_s(&sizes, WireEncoding::Sparse(Settings::default()));
        let fp32 = t.decode_s(&sizes, WireEncoding::Fp32);
        assert!(sparse > 0.0 && fp32 > 0.0);
        // twice the parameters, twice the work
        let double = [1 << 20; 4];
        assert!((t.decode_s(&double, WireEncoding::Sparse(Settings::default())) / sparse - 2.0).abs() < 1e-9);
        assert!((t.add_s(&double, WireEncoding::Fp32) / t.add_s(&sizes, WireEncoding::Fp32) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn a_bad_table_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.json");
        let mut t = Calibration::embedded();
        t.ed25519_sign_s = 0.0;
        std::fs::write(&path, serde_json::to_string(&t).expect("json")).expect("write");
        match Calibration::load(&path) {
            Err(Error::Calibration { reason, .. }) => assert!(reason.contains("positive"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(Calibration::load(&dir.path().join("none.json")), Err(Error::Calibration { .. })));
    }

    #[test]
    fn the_sample_is_what_it_says() {
        assert_eq!(sample_sizes().iter().sum::<usize>(), SAMPLE_PARAMS);
    }
}
