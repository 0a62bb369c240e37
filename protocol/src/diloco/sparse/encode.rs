//! The sparse message's encoder on several threads: every tensor's part of a
//! message is byte-aligned, so tensors are encoded apart and their parts joined
//! in order.

use std::ops::Range;

use super::{BitWriter, Layout, MAGIC, SparseTensor, SparseTensors, VERSION, offset_bits, quantize};
use crate::diloco::Tensors;
use crate::diloco::bf16::to_bf16;

/// [`encode_seeded`] on `threads` threads: each tensor's part of the message is
/// byte-aligned, so tensors are encoded apart, in groups of about equal size, and
/// their parts joined in order. The bytes are the same on any number of threads.
pub fn encode_seeded_on(tensors: &Tensors, layout: Layout, seed: u64, threads: usize) -> (Vec<u8>, SparseTensors) {
    let sizes: Vec<usize> = tensors.iter().map(Vec::len).collect();
    let mut out = Vec::with_capacity(layout.seeded_len(&sizes, seed));
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&layout.chunk.to_le_bytes());
    out.extend_from_slice(&layout.k.to_le_bytes());
    out.push(layout.bits);
    out.push(u8::from(layout.strided));
    out.extend_from_slice(&seed.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u32).to_le_bytes());
    let groups = groups(&sizes, threads);
    let encode_group = |range: Range<usize>, out: &mut Vec<u8>| -> SparseTensors {
        let mut order: Vec<u32> = Vec::new();
        range.map(|index| encode_tensor(&tensors[index], index, layout, seed, &mut order, out)).collect()
    };
    if groups.len() <= 1 {
        let decoded = encode_group(0..tensors.len(), &mut out);
        return (out, decoded);
    }
    let parts: Vec<(Vec<u8>, SparseTensors)> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|range| {
                scope.spawn(move || {
                    let mut part = Vec::new();
                    let decoded = encode_group(range, &mut part);
                    (part, decoded)
                })
            })
            .collect();
        // a panic in an encoding thread is a bug here: it surfaces as one
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    let mut decoded = Vec::with_capacity(tensors.len());
    for (part, d) in parts {
        out.extend_from_slice(&part);
        decoded.extend(d);
    }
    (out, decoded)
}

/// Consecutive tensor ranges of about equal total size, at most `threads` of
/// them (none empty).
pub(crate) fn groups(sizes: &[usize], threads: usize) -> Vec<Range<usize>> {
    let total: usize = sizes.iter().sum();
    let threads = threads.max(1).min(sizes.len().max(1));
    let share = total.div_ceil(threads).max(1);
    let mut out = Vec::with_capacity(threads);
    let (mut start, mut filled) = (0, 0);
    for (i, n) in sizes.iter().enumerate() {
        filled += n;
        if filled >= share && out.len() + 1 < threads {
            out.push(start..i + 1);
            (start, filled) = (i + 1, 0);
        }
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// Appends tensor `index`'s part of the message to `out` and returns what it
/// decodes to (`order`: scratch space for the top-k).
fn encode_tensor(
    t: &[f32],
    index: usize,
    layout: Layout,
    seed: u64,
    order: &mut Vec<u32>,
    out: &mut Vec<u8>,
) -> SparseTensor {
    out.extend_from_slice(&(t.len() as u32).to_le_bytes());
    if layout.strided {
        let indices: Vec<u32> =
            (layout.first(seed, index)..t.len()).step_by(layout.stride()).map(|i| i as u32).collect();
        let values: Vec<f32> = indices.iter().map(|i| t[*i as usize]).collect();
        let (stored, table, codes) = quantize(&values, layout.bits);
        stored.iter().for_each(|v| out.extend_from_slice(&to_bf16(*v).to_le_bytes()));
        let mut bits = BitWriter::new(out);
        for c in &codes {
            bits.put(u64::from(*c), usize::from(layout.bits));
        }
        bits.finish();
        let values = codes.iter().map(|c| table[usize::from(*c)]).collect();
        return SparseTensor { indices, values };
    }
    // 1. the top-k offsets of every chunk, increasing
    let mut indices: Vec<u32> = Vec::with_capacity(layout.kept_in(t.len()));
    for (start, len) in layout.chunks(t.len()) {
        let keep = layout.kept(len);
        order.clear();
        order.extend(0..len as u32);
        let chunk = &t[start..start + len];
        let by_magnitude = |a: &u32, b: &u32| chunk[*b as usize].abs().total_cmp(&chunk[*a as usize].abs());
        if keep < len {
            order.select_nth_unstable_by(keep - 1, by_magnitude);
        }
        let kept = &mut order[..keep];
        kept.sort_unstable();
        indices.extend(kept.iter().map(|o| start as u32 + o));
    }
    // 2. the kept values, quantized
    let values: Vec<f32> = indices.iter().map(|i| t[*i as usize]).collect();
    let (stored, table, codes) = quantize(&values, layout.bits);
    stored.iter().for_each(|v| out.extend_from_slice(&to_bf16(*v).to_le_bytes()));
    // 3. offsets then codes, chunk by chunk
    let mut bits = BitWriter::new(out);
    let mut at = 0;
    for (start, len) in layout.chunks(t.len()) {
        let keep = layout.kept(len);
        let width = offset_bits(len);
        for i in &indices[at..at + keep] {
            bits.put(u64::from(*i) - start as u64, width);
        }
        for c in &codes[at..at + keep] {
            bits.put(u64::from(*c), usize::from(layout.bits));
        }
        at += keep;
    }
    bits.finish();
    let values = codes.iter().map(|c| table[usize::from(*c)]).collect();
    SparseTensor { indices, values }
}
