//! Stable-Rust fuzzing of the pseudo-gradient decoders a stranger reaches: the
//! dense `PCPG` format and the sparse `PCPS` format, on arbitrary bytes and on
//! valid encodings with bytes overwritten. Neither may panic, allocate beyond
//! what the expected sizes imply, or return tensors of other sizes. 4,096 cases
//! each in CI (well under a second; see the time budget in docs/threat-model.md).

use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::diloco::sparse::{self, Layout, Settings};
use std::sync::LazyLock;

use proptest::collection::vec;
use proptest::prelude::*;

const SIZES: [usize; 3] = [300, 7, 4100];

fn layouts() -> [Layout; 3] {
    let s = Settings::default();
    [s.up, s.down(), Layout { chunk: 8, k: 1, bits: 2, strided: true }]
}

/// Valid encodings to mutate: every dense encoding and every layout.
static SEEDS: LazyLock<Vec<Vec<u8>>> = LazyLock::new(seeds);

fn seeds() -> Vec<Vec<u8>> {
    let tensors: Vec<Vec<f32>> =
        SIZES.iter().map(|n| (0..*n).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect()).collect();
    let mut seeds: Vec<Vec<u8>> =
        [Encoding::F32, Encoding::Bf16, Encoding::Int8].iter().map(|e| compress::encode(&tensors, *e)).collect();
    seeds.extend(layouts().iter().map(|l| sparse::encode(&tensors, *l).0));
    seeds
}

/// Every decoder on `bytes`: what decodes has exactly the expected sizes.
fn every_decoder(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok((t, _)) = compress::decode(bytes, &SIZES) {
        prop_assert_eq!(t.iter().map(Vec::len).collect::<Vec<_>>(), SIZES.to_vec());
    }
    for layout in layouts() {
        if let Ok(t) = sparse::decode(bytes, &SIZES, layout) {
            prop_assert_eq!(t.len(), SIZES.len());
            for (s, n) in t.iter().zip(SIZES) {
                prop_assert_eq!(s.indices.len(), layout.kept_in(n));
                prop_assert!(s.indices.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(s.indices.iter().all(|i| (*i as usize) < n));
            }
        }
        let _ = compress::decode_delta(bytes, &SIZES, Encoding::Sparse(Settings { up: layout, ..Settings::default() }));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(bytes in vec(any::<u8>(), 0..512)) {
        every_decoder(&bytes)?;
    }

    #[test]
    fn mutated_encodings(seed in 0usize..6, edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut bytes = SEEDS[seed].clone();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        every_decoder(&bytes)?;
    }
}
