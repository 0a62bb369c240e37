//! Join certificate decoding and checking on arbitrary bytes: must never panic, whatever
//! decodes must encode to the same bytes, and nothing decoded may be admitted (a valid
//! signature cannot arise by chance).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pcp_protocol::Identity;
use pcp_protocol::admit::{Admit, JoinCertificate, Proof};

fuzz_target!(|data: &[u8]| {
    let Ok(certificate) = JoinCertificate::from_bytes(data) else { return };
    assert_eq!(certificate.to_bytes(), data);
    let authorizer = Identity::from_secret([7; 32]).public();
    let proof = Proof { certificate: Some(certificate), pow_nonce: 0 };
    let admitted = Admit::Authorizer(authorizer).check(&certificate.run, &certificate.key, &proof, 0);
    assert!(admitted.is_err());
});
