//! Envelope and frame-head decoding and verification on arbitrary bytes: must never panic, and must
//! never accept (a valid signature cannot arise by chance).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pcp_schema::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(envelope) = pcp_schema::SignedEnvelope::decode(data) {
        // whatever decodes must re-encode and decode to the same value
        let again = pcp_schema::SignedEnvelope::decode(&envelope.encode());
        assert_eq!(again.ok().as_ref(), Some(&envelope));
    }
    assert!(pcp_protocol::open(data).is_err());
    // the head of a request-response frame, read before its payload
    if let Ok(head) = pcp_schema::FrameHead::decode(data) {
        let again = pcp_schema::FrameHead::decode(&head.encode());
        assert_eq!(again.ok().as_ref(), Some(&head));
        assert!(pcp_protocol::verify_head(&head).is_err());
    }
});
