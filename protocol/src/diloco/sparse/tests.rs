#[test]
fn a_reseeded_top_k_message_is_the_one_encoded_with_that_seed() {
    use super::*;
    let t: Tensors = vec![(0..300).map(|i| ((i * 37) % 101) as f32 - 50.0).collect(), vec![1.0, -2.0, 3.0]];
    let top_k = Layout { chunk: 64, k: 2, bits: 2, strided: false };
    let (mut bytes, _) = encode_seeded(&t, top_k, 3);
    assert!(reseed(&mut bytes, 9));
    assert_eq!(bytes, encode_seeded(&t, top_k, 9).0);
    assert!(decode_seeded(&bytes, &[300, 3], top_k, 9).is_ok());
    let strided = Layout { strided: true, ..top_k };
    let (mut bytes, _) = encode_seeded(&t, strided, 3);
    let before = bytes.clone();
    assert!(!reseed(&mut bytes, 9), "a strided message's entries depend on its seed");
    assert_eq!(bytes, before);
    assert!(!reseed(&mut [0u8; 8], 1), "too short");
}

use super::*;
use proptest::prelude::*;

const LAYOUT: Layout = Layout { chunk: 4096, k: 64, bits: 2, strided: false };
const VECTOR: &str = "50435053010400000001000000020007000000000000000100000006000000003f00c0003f404065";

fn wave(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 * 0.731 + seed).sin() * (i as f32 * 0.017).cos()) * 1e-3).collect()
}

#[test]
fn keeps_the_largest_entry_of_every_chunk_and_round_trips() {
    let t: Tensors = vec![wave(10_000, 0.3), wave(130, 1.0), vec![], vec![5.0]];
    let (bytes, sent) = encode(&t, LAYOUT);
    assert_eq!(bytes.len(), LAYOUT.encoded_len(&[10_000, 130, 0, 1]));
    assert_eq!(decode(&bytes, &[10_000, 130, 0, 1], LAYOUT).as_ref(), Ok(&sent));
    // 64 + 64 + ceil(1808 × 64 / 4096) = 29 kept in the first tensor, ceil(130/64) = 3 in the second
    assert_eq!(sent[0].indices.len(), 64 + 64 + 29);
    assert_eq!(sent[1].indices.len(), 3);
    assert_eq!(sent[3].indices, vec![0]);
    for (start, len) in LAYOUT.chunks(10_000) {
        let chunk = &t[0][start..start + len];
        let max = chunk.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).map(|(i, _)| i);
        assert!(sent[0].indices.contains(&((start + max.unwrap_or(0)) as u32)), "chunk at {start}");
    }
}

#[test]
fn sparse_layouts_are_over_fifty_and_a_hundred_times_smaller_than_fp32() {
    let sizes = [768 * 3072, 50_304 * 768, 768];
    let fp32 = 4 * sizes.iter().sum::<usize>();
    let ratio = fp32 as f64 / LAYOUT.encoded_len(&sizes) as f64;
    assert!(ratio > 140.0, "{ratio}");
    // the shepherd's update: k 256, 8 bits
    let down = Layout { chunk: 4096, k: 256, bits: 8, strided: false };
    assert!(fp32 as f64 / down.encoded_len(&sizes) as f64 > 25.0);
    // nanogpt-small's 29 tensors, most of them small: the defaults (k 4) are still
    // over 55× (up) and 20× (down) smaller, `sparse:k=2` over 100× up
    let small = [4160, 2048, 64, 64, 12288, 192, 4096, 64, 64, 64, 16384, 256, 16384, 64];
    let sizes: Vec<usize> = small.iter().chain(&small[2..]).chain(&[64, 64, 4160]).copied().collect();
    let fp32 = 4 * sizes.iter().sum::<usize>();
    let d = Settings::default();
    assert!(fp32 as f64 / d.up.encoded_len(&sizes) as f64 > 55.0, "{}", d.up.encoded_len(&sizes));
    assert!(fp32 as f64 / d.down().encoded_len(&sizes) as f64 > 23.0, "{}", d.down().encoded_len(&sizes));
    let k2 = Settings::parse("sparse:k=2").expect("parses");
    assert!(fp32 as f64 / k2.up.encoded_len(&sizes) as f64 > 110.0, "{}", k2.up.encoded_len(&sizes));
}

#[test]
fn two_bit_values_keep_the_sign_and_most_of_the_magnitude() {
    let t: Tensors = vec![wave(40_960, 0.0)];
    let (_, sent) = encode(&t, LAYOUT);
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for (i, v) in sent[0].indices.iter().zip(&sent[0].values) {
        let x = t[0][*i as usize];
        assert_eq!(x.signum(), v.signum(), "{x} decoded as {v}");
        err += f64::from(x - v).powi(2);
        norm += f64::from(x).powi(2);
    }
    assert!(err / norm < 0.1, "relative squared error {}", err / norm);
}

#[test]
fn error_feedback_sends_everything_eventually() {
    // a constant Δ: with decay 1, what has been sent converges to rounds × Δ
    let delta: Tensors = vec![wave(8192, 2.0)];
    let mut ef = ErrorFeedback::new(&[8192], 1.0, LAYOUT);
    let mut sent_sum = vec![vec![0.0f32; 8192]];
    let rounds = 200;
    for _ in 0..rounds {
        let (_, sent) = ef.compress(&delta, 1.0);
        subtract(&mut sent_sum, &sent, -1.0);
    }
    // e = rounds·Δ − sent, so sent/rounds → Δ
    let err: f64 =
        sent_sum[0].iter().zip(&delta[0]).map(|(s, d)| f64::from(s / rounds as f32 - d).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = delta[0].iter().map(|d| f64::from(*d).powi(2)).sum::<f64>().sqrt();
    assert!(err / norm < 0.25, "{}", err / norm);
    let left: f64 = ef.buffer[0].iter().zip(&sent_sum[0]).map(|(e, s)| f64::from(*e + s)).sum();
    let total: f64 = delta[0].iter().map(|d| f64::from(*d) * rounds as f64).sum();
    assert!((left - total).abs() < 1e-3 * total.abs().max(1e-3), "e + sent = Σ Δ: {left} vs {total}");
}

#[test]
fn hostile_messages_are_refused_before_allocating() {
    let t: Tensors = vec![wave(5000, 0.5)];
    let (bytes, _) = encode(&t, LAYOUT);
    assert!(matches!(decode(&bytes, &[5001], LAYOUT), Err(DecodeError::Length { .. } | DecodeError::Size { .. })));
    assert!(matches!(decode(&bytes, &[5000], Layout { k: 32, ..LAYOUT }), Err(DecodeError::Layout { .. })));
    assert!(matches!(decode(&bytes[..bytes.len() - 1], &[5000], LAYOUT), Err(DecodeError::Length { .. })));
    assert_eq!(decode(b"PCPG\x01", &[5000], LAYOUT), Err(DecodeError::Magic));
    let mut count = bytes.clone();
    count[23..27].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(decode(&count, &[5000], LAYOUT), Err(DecodeError::Size { .. })));
    // a repeated offset: the first two offsets of the first chunk made equal
    let mut repeated = bytes.clone();
    let body = HEADER + 4 + 8; // elements, then a 2-bit table of 4 bf16
    let first = u16::from_le_bytes([repeated[body], repeated[body + 1]]) & 0x0fff;
    let second_low = (first & 0xf) << 4;
    repeated[body + 1] = (repeated[body + 1] & 0x0f) | second_low as u8;
    repeated[body + 2] = (first >> 4) as u8;
    assert!(matches!(decode(&repeated, &[5000], LAYOUT), Err(DecodeError::Offset { .. })));
}

#[test]
fn settings_parse_and_print_canonically() {
    let d = Settings::default();
    assert_eq!(Settings::parse("sparse"), Ok(d));
    assert_eq!(d.spec(), "sparse:chunk=64,k=4,bits=2,decay=0.5,down=8,downbits=4");
    assert_eq!(Settings::parse(&d.spec()), Ok(d));
    let s = Settings::parse("sparse:chunk=4096,k=32,bits=4").expect("parses");
    assert_eq!((s.up.k, s.up.bits, s.up.chunk), (32, 4, 4096));
    assert!(Settings::parse("sparse:k=0").is_err());
    assert!(Settings::parse("sparse:bits=3").is_err());
    let strided = Settings::parse("sparse:stride=8,bits=2,downbits=4").expect("parses");
    assert!(strided.up.strided && strided.up.k == 1 && strided.up.chunk == 8);
    assert_eq!(Settings::parse(&strided.spec()), Ok(strided));
    assert!(Settings::parse("sparse:select=stride,chunk=10,k=3").is_err());
    assert!(Settings::parse("sparse:decay=2").is_err());
    assert!(Settings::parse("sparse:what=1").is_err());
    assert!(Settings::parse("sparsely").is_err());
    assert!(Settings::parse("int8").is_err());
}

#[test]
fn strided_layouts_cycle_through_every_element_and_send_no_offsets() {
    let layout = Layout { chunk: 4, k: 1, bits: 1, strided: true };
    let t: Tensors = vec![wave(10, 0.1), wave(3, 0.2)];
    let mut seen = [vec![0; 10], vec![0; 3]];
    for round in 0..4 {
        let (bytes, sent) = encode_seeded(&t, layout, round);
        assert_eq!(decode_seeded(&bytes, &[10, 3], layout, round).as_ref(), Ok(&sent));
        assert!(bytes.len() <= layout.encoded_len(&[10, 3]));
        assert!(matches!(decode_seeded(&bytes, &[10, 3], layout, round + 1), Err(DecodeError::Seed { .. })));
        for (s, count) in sent.iter().zip(seen.iter_mut()) {
            s.indices.iter().for_each(|i| count[*i as usize] += 1);
            // one bit per value: the sign of its difference from the mean
            assert!(s.values.iter().all(|v| v.is_finite()));
        }
    }
    assert_eq!(seen, [vec![1; 10], vec![1; 3]], "every element once in `stride` rounds");
    // 1/stride of the elements at `bits` each: 25 000 elements at stride 8, 2 bits
    let big = Layout { chunk: 8, k: 1, bits: 2, strided: true };
    assert!(big.encoded_len(&[25_000]) < HEADER + 4 + 8 + 25_000 / 8 * 2 / 8 + 2);
}

#[test]
fn a_published_vector_decodes_to_its_values() {
    // the test vector of docs/diloco.md: one tensor of 6, chunk 4, k 1, 2 bits, round 7
    let layout = Layout { chunk: 4, k: 1, bits: 2, strided: false };
    let t: Tensors = vec![vec![0.5, -2.0, 0.25, 1.0, 3.0, -0.5]];
    let (bytes, sent) = encode_seeded(&t, layout, 7);
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, VECTOR);
    assert_eq!(sent[0].indices, vec![1, 4]);
    assert_eq!(decode_seeded(&bytes, &[6], layout, 7), Ok(sent.clone()));
    // -2 and 3 are kept; 2-bit codes decode through the table to the bin means
    assert_eq!(sent[0].values, vec![-2.0, 3.0]);
}

#[test]
fn layouts_are_checked() {
    assert!(LAYOUT.check().is_ok());
    assert!(Layout { k: 0, ..LAYOUT }.check().is_err());
    assert!(Layout { k: 5000, ..LAYOUT }.check().is_err());
    assert!(Layout { bits: 3, ..LAYOUT }.check().is_err());
    assert!(Layout { chunk: MAX_CHUNK + 1, k: 1, bits: 2, strided: false }.check().is_err());
    assert!(Layout { chunk: 10, k: 3, bits: 2, strided: true }.check().is_err());
}

#[test]
fn a_packed_message_adds_and_measures_like_its_unpacked_entries() {
    // a tensor past the parallel threshold, a small one, an empty one; top-k and strided
    let n = PARALLEL_ELEMENTS + 4099;
    let t: Tensors = vec![wave(n, 0.7), wave(300, 0.1), vec![]];
    let sizes = [n, 300, 0];
    for (layout, seed) in [
        (Layout { chunk: 64, k: 2, bits: 2, strided: false }, 0),
        (LAYOUT, 0),
        (Layout { chunk: 16, k: 1, bits: 4, strided: true }, 5),
    ] {
        let (bytes, sent) = encode_seeded(&t, layout, seed);
        let packed = Packed::check(&bytes, &sizes, layout, seed).expect("checks");
        assert_eq!(packed.unpack(), sent, "{layout:?}");
        let norm: f64 = sent.iter().flat_map(|s| &s.values).map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
        assert!((packed.norm() - norm).abs() <= 1e-9 * norm, "{layout:?}: {} vs {norm}", packed.norm());
        assert_eq!(packed.non_finite(), None);
        let mut expected: Tensors = vec![wave(n, 2.0), wave(300, 3.0), vec![]];
        let base = expected.clone();
        subtract(&mut expected, &sent, -0.25);
        for threads in [1, 2, 3, 8] {
            let mut sum = base.clone();
            packed.add_to(&mut sum, 0.25, threads);
            assert!(sum == expected, "{layout:?}, {threads} threads: not the same bits");
        }
    }
    // a NaN in a table is found without unpacking
    let (mut bytes, _) = encode(&vec![wave(500, 0.2)], LAYOUT);
    let table = HEADER + 4;
    bytes[table..table + 2].copy_from_slice(&to_bf16(f32::NAN).to_le_bytes());
    let packed = Packed::check(&bytes, &[500], LAYOUT, 0).expect("checks");
    let used = packed.unpack()[0].values.iter().any(|v| v.is_nan());
    assert_eq!(packed.non_finite(), used.then_some(0));
}

proptest! {
    #[test]
    fn round_trips_in_every_layout(
        values in proptest::collection::vec(-1e3f32..1e3, 0..300),
        split in 0usize..300,
        chunk in 1u32..70,
        k_frac in 0.0f64..1.0,
        bits in prop_oneof![Just(2u8), Just(4), Just(8)],
    ) {
        let split = split.min(values.len());
        let t: Tensors = vec![values[..split].to_vec(), values[split..].to_vec()];
        let sizes = [t[0].len(), t[1].len()];
        let layout = Layout { chunk, k: ((f64::from(chunk) * k_frac) as u32).max(1), bits, strided: false };
        let (bytes, sent) = encode(&t, layout);
        prop_assert_eq!(bytes.len(), layout.encoded_len(&sizes));
        prop_assert_eq!(decode(&bytes, &sizes, layout), Ok(sent));
    }

    #[test]
    fn random_bytes_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..200), n in 0usize..300) {
        let layout = Layout { chunk: 16, k: 3, bits: 2, strided: false };
        let _ = decode(&bytes, &[n, 7], layout);
        // with a valid header and length, the body is random
        let len = layout.encoded_len(&[n, 7]);
        bytes.resize(len, 0xa5);
        let (head, _) = encode(&vec![vec![0.0; n], vec![0.0; 7]], layout);
        bytes[..HEADER + 4].copy_from_slice(&head[..HEADER + 4]);
        let _ = decode(&bytes, &[n, 7], layout);
    }
}

#[test]
fn tensors_are_grouped_in_order_by_size_without_empty_groups() {
    assert_eq!(groups(&[10, 10, 10, 10], 2), vec![0..2, 2..4]);
    assert_eq!(groups(&[100, 1, 1, 1], 3), vec![0..1, 1..4]);
    assert_eq!(groups(&[5, 5], 8), vec![0..1, 1..2]);
    assert_eq!(groups(&[5, 5], 1), vec![0..2]);
    assert_eq!(groups(&[], 4), Vec::<std::ops::Range<usize>>::new());
    assert_eq!(groups(&[0, 0, 0], 2), vec![0..3], "nothing to share");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// The shepherd's update on several threads is the one-thread message, byte for
    /// byte, and leaves the same error feedback.
    #[test]
    fn the_message_and_the_feedback_are_the_same_on_any_number_of_threads(
        sizes in proptest::collection::vec(0usize..700, 0..7),
        seed in any::<u64>(),
        strided in any::<bool>(),
        threads in 2usize..6,
    ) {
        let layout = Layout { chunk: 64, k: 3, bits: 4, strided };
        let delta: Tensors = sizes.iter().enumerate().map(|(i, n)| wave(*n, i as f32 + seed as f32 * 1e-9)).collect();
        let mut one = ErrorFeedback::new(&sizes, 0.9, layout);
        let mut many = one.clone();
        for round in 0..3 {
            let a = one.compress_seeded(&delta, 0.5, seed.wrapping_add(round));
            let b = many.compress_seeded_on(&delta, 0.5, seed.wrapping_add(round), threads);
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(&one.buffer, &many.buffer);
        }
    }
}
