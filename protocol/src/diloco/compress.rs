//! Pseudo-gradient encodings for the wire: fp32 (exact), bf16, int8 with one
//! scale per tensor, and SparseLoCo's chunked top-k ([`super::sparse`]).
//!
//! Dense layout: `b"PCPG"`, version `1`, encoding byte, tensor count (u32 LE), then
//! per tensor its element count (u32 LE), for int8 a scale (f32 LE), and the
//! elements. Decoding checks every count against the expected sizes before
//! allocating, so a hostile header cannot make the receiver allocate.

use std::ops::Range;

use super::Tensors;
use super::aggregate::Delta;
use super::bf16::{from_bf16, to_bf16};
use super::sparse::{self, Settings};

/// How values are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// 4 bytes per value, exact.
    F32,
    /// 2 bytes per value: the top half of the f32, rounded to nearest even.
    Bf16,
    /// 1 byte per value plus a scale per tensor: round(x / (max|x| / 127)).
    Int8,
    /// The chunked top-k of an error-feedback buffer, 2 to 8 bits per value
    /// ([`super::sparse`]).
    Sparse(Settings),
}

impl Encoding {
    fn tag(self) -> u8 {
        match self {
            Self::F32 => 0,
            Self::Bf16 => 1,
            Self::Int8 => 2,
            Self::Sparse(_) => 3,
        }
    }

    fn from_tag(tag: u8) -> Option<Self> {
        [Self::F32, Self::Bf16, Self::Int8].into_iter().find(|e| e.tag() == tag)
    }

    /// The name used in configs and events.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "fp32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::Sparse(_) => "sparse",
        }
    }

    /// The full spelling, as the signed manifest records it: the name, and for
    /// sparse its settings (`sparse:chunk=4096,k=64,bits=2,decay=0.95,down=256`).
    pub fn spec(self) -> String {
        match self {
            Self::Sparse(s) => s.spec(),
            dense => dense.name().to_owned(),
        }
    }

    /// Parses `fp32`, `bf16`, `int8`, `sparse` or `sparse:key=value,…`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::parse_spec(name).ok()
    }

    /// [`Encoding::parse`], saying what is wrong.
    pub fn parse_spec(name: &str) -> Result<Self, String> {
        if let Some(dense) = [Self::F32, Self::Bf16, Self::Int8].into_iter().find(|e| e.name() == name) {
            return Ok(dense);
        }
        if name.starts_with("sparse") {
            return Settings::parse(name).map(Self::Sparse).map_err(|e| format!("--encoding {name:?}: {e}"));
        }
        Err(format!(
            "unknown --encoding {name:?}; expected fp32, bf16, int8 or sparse[:chunk=N,k=N,bits=1|2|4|8,decay=F,down=N,downbits=B,select=top|stride]"
        ))
    }

    /// The sparse settings, for a sparse encoding.
    pub fn sparse(self) -> Option<Settings> {
        match self {
            Self::Sparse(s) => Some(s),
            _ => None,
        }
    }
}

/// Why bytes did not decode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not a pcp pseudo-gradient.
    #[error("bad magic or version")]
    Magic,
    /// An unknown encoding byte.
    #[error("unknown encoding {0}")]
    Encoding(u8),
    /// The tensor count or a size differs from the parameters'.
    #[error("expected {expected} elements in tensor {index}, header says {got}")]
    Size {
        /// Which tensor (or the count, as `usize::MAX`).
        index: usize,
        /// From the header.
        got: usize,
        /// Expected.
        expected: usize,
    },
    /// Fewer or more bytes than the header implies.
    #[error("truncated or oversized payload")]
    Length,
    /// A strided sparse message: its tensors' layout depends on their place in
    /// the whole, so it is not cut into slices.
    #[error("a strided sparse message cannot be cut into slices")]
    Strided,
    /// A sparse message that did not decode.
    #[error("sparse: {0}")]
    Sparse(#[from] sparse::DecodeError),
    /// Another encoding than the run's.
    #[error("encoded as {got}, the run uses {expected}")]
    Mismatch {
        /// What the bytes are.
        got: &'static str,
        /// The run's encoding.
        expected: &'static str,
    },
}

const MAGIC: &[u8; 4] = b"PCPG";

/// Encodes `tensors` (sparse: their chunked top-k, with no error feedback).
pub fn encode(tensors: &Tensors, encoding: Encoding) -> Vec<u8> {
    if let Encoding::Sparse(s) = encoding {
        return sparse::encode(tensors, s.up).0;
    }
    let sizes: Vec<usize> = tensors.iter().map(Vec::len).collect();
    let mut out = Vec::with_capacity(encoded_len(&sizes, encoding));
    encode_dense_into(tensors, encoding, &mut out);
    out
}

/// Appends [`encode`]'s output for a dense `encoding` to `out` (a sparse encoding
/// appends nothing): a message built of several, sized once, without copies.
pub fn encode_dense_into(tensors: &[Vec<f32>], encoding: Encoding, out: &mut Vec<u8>) {
    encode_dense_with(tensors, encoding, &mut |bytes| out.extend_from_slice(bytes));
}

/// The most bytes [`encode_dense_with`] feeds its sink at once.
const PIECE: usize = 64 << 10;

/// Feeds [`encode`]'s output for a dense `encoding` to `sink`, in pieces of at most
/// 64 KiB, without building it (a hash of gpt2-124m's parameters blob without its
/// half a GB). A sparse encoding feeds nothing.
pub fn encode_dense_with(tensors: &[Vec<f32>], encoding: Encoding, sink: &mut dyn FnMut(&[u8])) {
    if let Encoding::Sparse(_) = encoding {
        return;
    }
    let mut out: Vec<u8> = Vec::with_capacity(PIECE + 16);
    out.extend_from_slice(MAGIC);
    out.push(1);
    out.push(encoding.tag());
    out.extend_from_slice(&(tensors.len() as u32).to_le_bytes());
    for t in tensors {
        out.extend_from_slice(&(t.len() as u32).to_le_bytes());
        match encoding {
            Encoding::F32 => feed_words(t, f32::to_le_bytes, &mut out, sink),
            Encoding::Bf16 => feed_words(t, |v| to_bf16(v).to_le_bytes(), &mut out, sink),
            Encoding::Sparse(_) => {}
            Encoding::Int8 => {
                let max = t.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let scale = if max > 0.0 && max.is_finite() { max / 127.0 } else { 0.0 };
                out.extend_from_slice(&scale.to_le_bytes());
                let quantized = |v: f32| {
                    let q = if scale > 0.0 { (v / scale).round().clamp(-127.0, 127.0) } else { 0.0 };
                    [q as i8 as u8]
                };
                feed_words(t, quantized, &mut out, sink);
            }
        }
    }
    if !out.is_empty() {
        sink(&out);
    }
}

/// Appends `values`, each as the `N` bytes `word` makes of it, to `out`, handing
/// `out` to `sink` whenever it holds a piece: a piece's words are written in one
/// loop over a slice (which the compiler vectorizes), not one push and one length
/// check a value.
fn feed_words<const N: usize>(
    values: &[f32],
    word: impl Fn(f32) -> [u8; N],
    out: &mut Vec<u8>,
    sink: &mut dyn FnMut(&[u8]),
) {
    let mut rest = values;
    while !rest.is_empty() {
        let room = (PIECE.saturating_sub(out.len()) / N).clamp(1, rest.len());
        let (now, later) = rest.split_at(room);
        let start = out.len();
        out.resize(start + now.len() * N, 0);
        for (bytes, v) in out[start..].chunks_exact_mut(N).zip(now) {
            bytes.copy_from_slice(&word(*v));
        }
        if out.len() >= PIECE {
            sink(out);
            out.clear();
        }
        rest = later;
    }
}

/// The exact length of [`encode`]'s output for tensors of `sizes` elements: what a
/// receiver may expect at most, before any byte arrives.
pub fn encoded_len(sizes: &[usize], encoding: Encoding) -> usize {
    let (per, scale) = match encoding {
        Encoding::F32 => (4, 0),
        Encoding::Bf16 => (2, 0),
        Encoding::Int8 => (1, 4),
        Encoding::Sparse(s) => return s.up.encoded_len(sizes),
    };
    10 + sizes.iter().map(|n| 4 + scale + n * per).sum::<usize>()
}

/// Decodes a contribution that must be in the run's `encoding`, for tensors of
/// exactly `sizes` elements: dense encodings to dense tensors, sparse to a
/// checked, measured message added straight from its bytes ([`Delta::Packed`]).
pub fn decode_delta(bytes: &[u8], sizes: &[usize], encoding: Encoding) -> Result<Delta, DecodeError> {
    decode_delta_seeded(bytes, sizes, encoding, 0)
}

/// [`decode_delta`] for a contribution to round `round` (a sparse message must
/// be seeded with it).
pub fn decode_delta_seeded(
    bytes: &[u8],
    sizes: &[usize],
    encoding: Encoding,
    round: u64,
) -> Result<Delta, DecodeError> {
    match encoding {
        Encoding::Sparse(s) => {
            if bytes.starts_with(MAGIC) {
                return Err(DecodeError::Mismatch { got: "dense", expected: "sparse" });
            }
            Ok(Delta::Packed(sparse::Packed::check(bytes, sizes, s.up, round)?))
        }
        dense => {
            let (tensors, got) = decode(bytes, sizes)?;
            if got != dense {
                return Err(DecodeError::Mismatch { got: got.name(), expected: dense.name() });
            }
            Ok(Delta::Dense(tensors))
        }
    }
}

/// Decodes dense bytes that must hold tensors of exactly `sizes` elements.
pub fn decode(bytes: &[u8], sizes: &[usize]) -> Result<(Tensors, Encoding), DecodeError> {
    if bytes.len() < 10 || &bytes[..4] != MAGIC || bytes[4] != 1 {
        return Err(DecodeError::Magic);
    }
    let encoding = Encoding::from_tag(bytes[5]).ok_or(DecodeError::Encoding(bytes[5]))?;
    let count = u32::from_le_bytes([bytes[6], bytes[7], bytes[8], bytes[9]]) as usize;
    if count != sizes.len() {
        return Err(DecodeError::Size { index: usize::MAX, got: count, expected: sizes.len() });
    }
    let mut at: usize = 10;
    let mut take = |n: usize| -> Result<&[u8], DecodeError> {
        let end = at.checked_add(n).filter(|e| *e <= bytes.len()).ok_or(DecodeError::Length)?;
        let s = &bytes[at..end];
        at = end;
        Ok(s)
    };
    let mut tensors = Vec::with_capacity(sizes.len());
    for (index, expected) in sizes.iter().enumerate() {
        let h = take(4)?;
        let got = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        if got != *expected {
            return Err(DecodeError::Size { index, got, expected: *expected });
        }
        let t: Vec<f32> = match encoding {
            Encoding::F32 => {
                take(4 * got)?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            Encoding::Bf16 => {
                take(2 * got)?.chunks_exact(2).map(|c| from_bf16(u16::from_le_bytes([c[0], c[1]]))).collect()
            }
            Encoding::Sparse(_) => return Err(DecodeError::Encoding(3)),
            Encoding::Int8 => {
                let s = take(4)?;
                let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                take(got)?.iter().map(|q| f32::from(*q as i8) * scale).collect()
            }
        };
        tensors.push(t);
    }
    if at != bytes.len() {
        return Err(DecodeError::Length);
    }
    Ok((tensors, encoding))
}

/// The tensors `tensors` of a message for tensors of `sizes` elements in
/// `encoding`, as a message of their own (a sparse one seeded 0): what a worker
/// sends each parameter shard's aggregators ([`super::aggregation`]). Every
/// tensor's part of a message is byte-aligned and its length follows from its
/// size alone, so the slice is the header and those parts, copied; a strided
/// sparse layout, whose parts depend on their place, is refused. The whole
/// message's length is checked; its contents are the receiver's to check.
pub fn slice(bytes: &[u8], sizes: &[usize], encoding: Encoding, tensors: Range<usize>) -> Result<Vec<u8>, DecodeError> {
    let (header, part): (usize, Box<dyn Fn(usize) -> usize>) = match encoding {
        Encoding::Sparse(s) if s.up.strided => return Err(DecodeError::Strided),
        Encoding::Sparse(s) => {
            let empty = s.up.encoded_len(&[]);
            (empty, Box::new(move |n| s.up.encoded_len(&[n]) - empty))
        }
        dense => {
            let empty = encoded_len(&[], dense);
            (empty, Box::new(move |n| encoded_len(&[n], dense) - empty))
        }
    };
    let parts: Vec<usize> = sizes.iter().map(|n| part(*n)).collect();
    if bytes.len() != header + parts.iter().sum::<usize>() {
        return Err(DecodeError::Length);
    }
    if tensors.start > tensors.end || tensors.end > sizes.len() {
        return Err(DecodeError::Size { index: usize::MAX, got: tensors.end, expected: sizes.len() });
    }
    let start = header + parts[..tensors.start].iter().sum::<usize>();
    let len: usize = parts[tensors.clone()].iter().sum();
    let mut out = Vec::with_capacity(header + len);
    out.extend_from_slice(&bytes[..header]);
    // the tensor count ends both headers; a sparse one's seed is the 8 bytes before it
    out[header - 4..].copy_from_slice(&(tensors.len() as u32).to_le_bytes());
    if encoding.sparse().is_some() {
        out[header - 12..header - 4].copy_from_slice(&0u64.to_le_bytes());
    }
    out.extend_from_slice(&bytes[start..start + len]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_slice_decodes_to_the_whole_messages_tensors() {
        let sizes = [300usize, 0, 7, 1000, 64];
        let t: Tensors = sizes
            .iter()
            .enumerate()
            .map(|(j, n)| (0..*n).map(|i| ((i * 7 + j) % 23) as f32 - 11.0).collect())
            .collect();
        let topk = Encoding::parse_spec("sparse:chunk=64,k=4,bits=4").expect("parses");
        let strided = Encoding::parse_spec("sparse:chunk=64,k=4,select=stride").expect("parses");
        for encoding in [Encoding::F32, Encoding::Bf16, Encoding::Int8, topk] {
            let whole = match encoding {
                Encoding::Sparse(s) => sparse::encode_seeded(&t, s.up, 9).0,
                dense => encode(&t, dense),
            };
            let all = decode_delta_seeded(&whole, &sizes, encoding, 9).expect("decodes").to_dense(&sizes);
            for range in [0..5, 0..1, 1..4, 3..5, 2..2] {
                let cut = slice(&whole, &sizes, encoding, range.clone()).expect("slices");
                let part = decode_delta(&cut, &sizes[range.clone()], encoding).expect("a slice decodes");
                assert_eq!(part.to_dense(&sizes[range.clone()]), all[range.clone()].to_vec(), "{encoding:?} {range:?}");
            }
            let short = &whole[..whole.len() - 1];
            assert_eq!(slice(short, &sizes, encoding, 0..1), Err(DecodeError::Length));
            assert!(slice(&whole, &sizes, encoding, 4..6).is_err(), "past the last tensor");
        }
        let Encoding::Sparse(s) = strided else { unreachable!() };
        let whole = sparse::encode_seeded(&t, s.up, 9).0;
        assert_eq!(slice(&whole, &sizes, strided, 0..1), Err(DecodeError::Strided));
    }

    #[test]
    fn fp32_is_exact_and_within_five_percent_of_raw_size() {
        let t: Tensors = vec![(0..1000).map(|i| i as f32 * 0.37 - 100.0).collect(), vec![1.5; 64]];
        let bytes = encode(&t, Encoding::F32);
        assert!(bytes.len() as f64 <= 1.05 * 4.0 * 1064.0);
        assert_eq!(decode(&bytes, &[1000, 64]), Ok((t, Encoding::F32)));
    }

    #[test]
    fn a_message_fed_in_pieces_is_the_message() {
        let t: Tensors = vec![(0..100_000).map(|i| i as f32 * 0.25 - 7.0).collect(), vec![], vec![3.5; 9]];
        for encoding in [Encoding::F32, Encoding::Bf16, Encoding::Int8] {
            let mut fed = Vec::new();
            let mut pieces = 0;
            encode_dense_with(&t, encoding, &mut |b| {
                assert!(b.len() <= (64 << 10) + 16);
                pieces += 1;
                fed.extend_from_slice(b);
            });
            assert_eq!(fed, encode(&t, encoding), "{encoding:?}");
            assert!(pieces > 1, "{encoding:?} in pieces");
            if encoding == Encoding::F32 {
                assert_eq!(decode(&fed, &[100_000, 0, 9]), Ok((t.clone(), encoding)), "fp32 pieces decode exactly");
            }
        }
    }

    #[test]
    fn encoded_len_is_exact() {
        let t: Tensors = vec![vec![0.5; 7], vec![], vec![-2.0; 300]];
        for enc in [Encoding::F32, Encoding::Bf16, Encoding::Int8] {
            assert_eq!(encode(&t, enc).len(), encoded_len(&[7, 0, 300], enc), "{enc:?}");
        }
    }

    #[test]
    fn lossy_encodings_are_close() {
        let t: Tensors = vec![(0..500).map(|i| ((i as f32) * 0.113).sin()).collect()];
        for (enc, tol) in [(Encoding::Bf16, 4e-3), (Encoding::Int8, 1.0 / 127.0)] {
            let (back, e) = decode(&encode(&t, enc), &[500]).expect("decodes");
            assert_eq!(e, enc);
            for (a, b) in t[0].iter().zip(&back[0]) {
                assert!((a - b).abs() <= tol, "{enc:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn hostile_headers_are_refused_without_allocating() {
        let mut bytes = encode(&vec![vec![1.0; 4]], Encoding::F32);
        assert_eq!(decode(&bytes, &[5]), Err(DecodeError::Size { index: 0, got: 4, expected: 5 }));
        // Claims u32::MAX elements: refused by the size check, not by allocation.
        bytes[10..14].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&bytes, &[4]), Err(DecodeError::Size { .. })));
        let good = encode(&vec![vec![1.0; 4]], Encoding::F32);
        assert_eq!(decode(&good[..good.len() - 1], &[4]), Err(DecodeError::Length));
        assert_eq!(decode(b"nope", &[4]), Err(DecodeError::Magic));
    }

    proptest! {
        #[test]
        fn round_trips(values in proptest::collection::vec(-1e6f32..1e6, 0..200), split in 0usize..200) {
            let split = split.min(values.len());
            let t: Tensors = vec![values[..split].to_vec(), values[split..].to_vec()];
            let sizes = [t[0].len(), t[1].len()];
            prop_assert_eq!(decode(&encode(&t, Encoding::F32), &sizes), Ok((t.clone(), Encoding::F32)));
            let (b, _) = decode(&encode(&t, Encoding::Bf16), &sizes).expect("bf16");
            for (x, y) in t.iter().flatten().zip(b.iter().flatten()) {
                prop_assert!((x - y).abs() <= x.abs() / 128.0 + 1e-30);
            }
            // int8: each value within half a step of its tensor's scale (its largest / 127)
            let (q, _) = decode(&encode(&t, Encoding::Int8), &sizes).expect("int8");
            for (tensor, decoded) in t.iter().zip(&q) {
                let step = tensor.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
                for (x, y) in tensor.iter().zip(decoded) {
                    prop_assert!((x - y).abs() <= step * 0.501 + 1e-3, "{} decoded as {}", x, y);
                }
            }
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&bytes, &[3, 2]);
        }
    }
}
