//! Arbitrary bytes into every NBD parser of client input: option headers and payloads
//! (EXPORT_NAME, INFO/GO, LIST/SET_META_CONTEXT), client flags and request headers.
//! Parsers may reject anything but must not panic, must not allocate what a length field
//! claims before checking it, and must re-encode whatever they accept to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    strata_nbd::proto::fuzz_parsers(data);
});
