//! The dense (`PCPG`) and sparse (`PCPS`) pseudo-gradient decoders on arbitrary
//! bytes: must never panic, and what decodes has exactly the expected sizes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pcp_protocol::diloco::compress;
use pcp_protocol::diloco::sparse::{self, Settings};

const SIZES: [usize; 3] = [300, 7, 4100];

fuzz_target!(|data: &[u8]| {
    if let Ok((t, _)) = compress::decode(data, &SIZES) {
        assert!(t.iter().map(Vec::len).eq(SIZES));
    }
    let s = Settings::default();
    for layout in [s.up, s.down()] {
        if let Ok(t) = sparse::decode(data, &SIZES, layout) {
            for (s, n) in t.iter().zip(SIZES) {
                assert_eq!(s.indices.len(), layout.kept_in(n));
                assert!(s.indices.windows(2).all(|w| w[0] < w[1]) && s.indices.iter().all(|i| (*i as usize) < n));
            }
        }
    }
});
