//! Blob requests and responses on arbitrary bytes: must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pcp_schema::{BlobRequest, BlobResponse, Message};

fuzz_target!(|data: &[u8]| {
    let _ = BlobRequest::decode(data);
    let _ = BlobResponse::decode(data);
});
