//! One entry point that runs every parser of client input over arbitrary bytes, shared by
//! the cargo-fuzz target (fuzz/fuzz_targets/nbd_proto.rs) and a seeded test that runs on
//! stable Rust in CI.

use super::*;

/// Runs every client-input parser over `data` (whole, and split as header + payload the way
/// the server reads it). Parsers may reject anything, but must not panic, and whatever they
/// accept must re-encode to the same bytes: a parser that "accepts" something it cannot
/// represent would be silently misreading the client.
pub fn fuzz_parsers(data: &[u8]) {
    let _ = parse_client_flags(data);
    fuzz_option(data);
    fuzz_request(data);
    // The payload parsers also see raw input, not only what follows a valid header.
    check_info_request(data);
    check_meta_context_request(data);
    let _ = parse_export_name(data);
}

fn fuzz_option(data: &[u8]) {
    let (head, payload) = data.split_at(data.len().min(OPTION_HEADER_LEN));
    let Ok(header) = parse_option_header(head) else {
        return;
    };
    assert!(header.len_bytes <= MAX_OPTION_BYTES);
    let payload = &payload[..payload.len().min(header.len_bytes as usize)];
    match header.option {
        opt::EXPORT_NAME => {
            let _ = parse_export_name(payload);
        }
        opt::INFO | opt::GO => check_info_request(payload),
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => check_meta_context_request(payload),
        _ => {}
    }
}

fn fuzz_request(data: &[u8]) {
    let head = &data[..data.len().min(REQUEST_HEADER_LEN)];
    let max_payload_bytes = 32 << 20;
    let Ok(req) = parse_request_header(head, max_payload_bytes) else {
        return;
    };
    assert!(req.payload_len() <= max_payload_bytes);
    let mut again = Vec::new();
    encode_request(&mut again, &req);
    assert_eq!(again, head, "request header did not round-trip");
}

fn check_info_request(payload: &[u8]) {
    let Ok(req) = parse_info_request(payload) else {
        return;
    };
    assert!(req.name.len() <= MAX_STRING_BYTES);
    let mut again = Vec::new();
    encode_info_request(&mut again, &req);
    assert_eq!(again, payload, "info request did not round-trip");
}

fn check_meta_context_request(payload: &[u8]) {
    let Ok(req) = parse_meta_context_request(payload) else {
        return;
    };
    assert!(req.queries.iter().all(|q| q.len() <= MAX_STRING_BYTES));
    let mut again = Vec::new();
    encode_meta_context_request(&mut again, &req);
    assert_eq!(again, payload, "meta context request did not round-trip");
}
