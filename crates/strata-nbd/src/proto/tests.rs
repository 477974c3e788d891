use super::*;
use crate::BlockStatus;

fn option_bytes(option: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_option(&mut out, option, payload);
    out
}

#[test]
fn greeting_matches_spec_layout() {
    let mut out = Vec::new();
    encode_greeting(
        &mut out,
        handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES,
    );
    assert_eq!(out.len(), GREETING_LEN);
    assert_eq!(&out[..8], b"NBDMAGIC");
    assert_eq!(&out[8..16], b"IHAVEOPT");
    assert_eq!(&out[16..], &[0, 3]);
}

#[test]
fn client_flags_reject_unknown_bits_and_bad_length() {
    assert_eq!(parse_client_flags(&[0, 0, 0, 3]), Ok(3));
    assert_eq!(parse_client_flags(&[0, 0, 0, 0]), Ok(0));
    assert_eq!(
        parse_client_flags(&[0, 0, 0, 4]),
        Err(ProtoError::UnknownClientFlags(4))
    );
    assert!(matches!(
        parse_client_flags(&[0, 0, 1]),
        Err(ProtoError::Truncated { .. })
    ));
    assert!(matches!(
        parse_client_flags(&[0; 5]),
        Err(ProtoError::TrailingBytes { extra: 1 })
    ));
}

#[test]
fn option_header_round_trips() {
    let bytes = option_bytes(opt::GO, &[1, 2, 3]);
    let header = parse_option_header(&bytes[..OPTION_HEADER_LEN]).unwrap();
    assert_eq!(
        header,
        OptionHeader {
            option: opt::GO,
            len_bytes: 3
        }
    );
}

#[test]
fn option_header_rejects_bad_magic_and_oversized_length() {
    let mut bytes = option_bytes(opt::LIST, &[]);
    bytes[0] ^= 1;
    assert!(matches!(
        parse_option_header(&bytes),
        Err(ProtoError::BadMagic { .. })
    ));

    let mut bytes = option_bytes(opt::LIST, &[]);
    bytes[12..16].copy_from_slice(&(MAX_OPTION_BYTES + 1).to_be_bytes());
    assert_eq!(
        parse_option_header(&bytes),
        Err(ProtoError::OptionTooLong {
            option: opt::LIST,
            len: MAX_OPTION_BYTES + 1,
            max: MAX_OPTION_BYTES
        })
    );
    bytes[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(
        parse_option_header(&bytes),
        Err(ProtoError::OptionTooLong { .. })
    ));
}

#[test]
fn info_request_round_trips() {
    let req = InfoRequest {
        name: "disk0".into(),
        requests: vec![info::NAME, info::BLOCK_SIZE],
    };
    let mut bytes = Vec::new();
    encode_info_request(&mut bytes, &req);
    assert_eq!(bytes.len(), 4 + 5 + 2 + 4);
    assert_eq!(parse_info_request(&bytes), Ok(req));
}

#[test]
fn info_request_rejects_lies_about_lengths() {
    // Name length claims more than the payload holds.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&100u32.to_be_bytes());
    bytes.extend_from_slice(b"abc");
    assert!(matches!(
        parse_info_request(&bytes),
        Err(ProtoError::Truncated { .. })
    ));
    // Name longer than the spec's 4096-byte limit is refused before it is read.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&4097u32.to_be_bytes());
    bytes.extend_from_slice(&[b'a'; 4097]);
    bytes.extend_from_slice(&0u16.to_be_bytes());
    assert!(matches!(
        parse_info_request(&bytes),
        Err(ProtoError::StringTooLong { .. })
    ));
    // Request count larger than what follows.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0u32.to_be_bytes());
    bytes.extend_from_slice(&u16::MAX.to_be_bytes());
    assert!(matches!(
        parse_info_request(&bytes),
        Err(ProtoError::Truncated { .. })
    ));
    // Extra bytes after the list.
    let mut bytes = Vec::new();
    encode_info_request(
        &mut bytes,
        &InfoRequest {
            name: String::new(),
            requests: vec![],
        },
    );
    bytes.push(0);
    assert_eq!(
        parse_info_request(&bytes),
        Err(ProtoError::TrailingBytes { extra: 1 })
    );
}

#[test]
fn strings_reject_nul_and_invalid_utf8() {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&2u32.to_be_bytes());
    bytes.extend_from_slice(&[b'a', 0]);
    bytes.extend_from_slice(&0u16.to_be_bytes());
    assert_eq!(parse_info_request(&bytes), Err(ProtoError::InvalidString));
    assert_eq!(
        parse_export_name(&[0xff, 0xfe]),
        Err(ProtoError::InvalidString)
    );
    assert_eq!(parse_export_name(b"disk0"), Ok("disk0".to_string()));
    assert!(matches!(
        parse_export_name(&[b'a'; 4097]),
        Err(ProtoError::StringTooLong { .. })
    ));
}

#[test]
fn meta_context_request_round_trips() {
    let req = MetaContextRequest {
        export_name: "disk0".into(),
        queries: vec!["base:allocation".into(), "qemu:dirty-bitmap:x".into()],
    };
    let mut bytes = Vec::new();
    encode_meta_context_request(&mut bytes, &req);
    assert_eq!(parse_meta_context_request(&bytes), Ok(req));
    let empty = MetaContextRequest {
        export_name: String::new(),
        queries: vec![],
    };
    let mut bytes = Vec::new();
    encode_meta_context_request(&mut bytes, &empty);
    assert_eq!(bytes, [0u8; 8]);
    assert_eq!(parse_meta_context_request(&bytes), Ok(empty));
}

#[test]
fn meta_context_request_rejects_huge_query_count_without_allocating() {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0u32.to_be_bytes());
    bytes.extend_from_slice(&u32::MAX.to_be_bytes());
    bytes.extend_from_slice(&[0u8; 12]);
    assert!(matches!(
        parse_meta_context_request(&bytes),
        Err(ProtoError::Truncated { .. })
    ));
    // A query whose length runs past the payload.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0u32.to_be_bytes());
    bytes.extend_from_slice(&1u32.to_be_bytes());
    bytes.extend_from_slice(&50u32.to_be_bytes());
    bytes.extend_from_slice(b"base:");
    assert!(matches!(
        parse_meta_context_request(&bytes),
        Err(ProtoError::Truncated { .. })
    ));
}

#[test]
fn request_header_round_trips() {
    let req = RequestHeader {
        flags: cmd_flags::FUA,
        command: cmd::WRITE,
        cookie: 0x0102_0304_0506_0708,
        offset: 1 << 40,
        len_bytes: 4096,
    };
    let mut bytes = Vec::new();
    encode_request(&mut bytes, &req);
    assert_eq!(bytes.len(), REQUEST_HEADER_LEN);
    assert_eq!(&bytes[..4], &[0x25, 0x60, 0x95, 0x13]);
    assert_eq!(parse_request_header(&bytes, 1 << 20), Ok(req));
}

#[test]
fn request_header_rejects_bad_magic_and_oversized_write() {
    let req = RequestHeader {
        flags: 0,
        command: cmd::WRITE,
        cookie: 1,
        offset: 0,
        len_bytes: 8192,
    };
    let mut bytes = Vec::new();
    encode_request(&mut bytes, &req);
    assert_eq!(
        parse_request_header(&bytes, 4096),
        Err(ProtoError::PayloadTooLarge {
            len: 8192,
            max: 4096
        })
    );
    // A READ of the same length carries no payload, so the header itself is fine; the
    // server answers it with EINVAL instead.
    bytes[6..8].copy_from_slice(&cmd::READ.to_be_bytes());
    assert!(parse_request_header(&bytes, 4096).is_ok());
    assert!(matches!(
        parse_request_header(&bytes[..27], 4096),
        Err(ProtoError::Truncated { .. })
    ));
    bytes[0] = 0;
    assert!(matches!(
        parse_request_header(&bytes, 4096),
        Err(ProtoError::BadMagic { .. })
    ));
}

#[test]
fn option_replies_match_spec_layout() {
    let mut out = Vec::new();
    OptionReply::Ack.encode(opt::GO, &mut out);
    assert_eq!(&out[..8], &magic::OPTION_REPLY.to_be_bytes());
    assert_eq!(&out[8..12], &opt::GO.to_be_bytes());
    assert_eq!(&out[12..16], &rep::ACK.to_be_bytes());
    assert_eq!(&out[16..20], &0u32.to_be_bytes());
    assert_eq!(out.len(), 20);

    let mut out = Vec::new();
    OptionReply::Info(Info::Export {
        size_bytes: 1 << 30,
        transmission_flags: 0x0105,
    })
    .encode(opt::INFO, &mut out);
    assert_eq!(&out[12..16], &rep::INFO.to_be_bytes());
    assert_eq!(&out[16..20], &12u32.to_be_bytes());
    assert_eq!(&out[20..22], &info::EXPORT.to_be_bytes());
    assert_eq!(&out[22..30], &(1u64 << 30).to_be_bytes());
    assert_eq!(&out[30..32], &[0x01, 0x05]);

    let mut out = Vec::new();
    OptionReply::Info(Info::BlockSize {
        min_bytes: 1,
        preferred_bytes: 4096,
        max_bytes: 1 << 25,
    })
    .encode(opt::GO, &mut out);
    assert_eq!(&out[16..20], &14u32.to_be_bytes());

    let mut out = Vec::new();
    OptionReply::Server {
        name: "a",
        description: "bc",
    }
    .encode(opt::LIST, &mut out);
    assert_eq!(&out[16..], &[0, 0, 0, 7, 0, 0, 0, 1, b'a', b'b', b'c']);

    let mut out = Vec::new();
    OptionReply::MetaContext {
        id: 9,
        name: BASE_ALLOCATION,
    }
    .encode(opt::SET_META_CONTEXT, &mut out);
    assert_eq!(
        &out[16..20],
        &(4 + BASE_ALLOCATION.len() as u32).to_be_bytes()
    );
    assert_eq!(&out[20..24], &9u32.to_be_bytes());

    let mut out = Vec::new();
    let long = "x".repeat(10_000);
    OptionReply::Error {
        kind: rep::ERR_UNSUP,
        message: &long,
    }
    .encode(99, &mut out);
    assert_eq!(&out[12..16], &rep::ERR_UNSUP.to_be_bytes());
    assert_eq!(
        &out[16..20],
        &(MAX_STRING_BYTES as u32).to_be_bytes(),
        "message is capped"
    );
}

#[test]
fn export_name_reply_pads_unless_no_zeroes() {
    let mut out = Vec::new();
    encode_export_name_reply(&mut out, 512, 1, false);
    assert_eq!(out.len(), 8 + 2 + EXPORT_NAME_REPLY_ZEROES);
    let mut out = Vec::new();
    encode_export_name_reply(&mut out, 512, 1, true);
    assert_eq!(out, [0, 0, 0, 0, 0, 0, 2, 0, 0, 1]);
}

#[test]
fn transmission_replies_match_spec_layout() {
    let mut out = Vec::new();
    encode_simple_reply(&mut out, 7, 22);
    assert_eq!(
        out,
        [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0, 7]
    );

    let mut out = Vec::new();
    encode_offset_data_prefix(&mut out, 7, 4096, 512, true).unwrap();
    assert_eq!(&out[..4], &magic::STRUCTURED_REPLY.to_be_bytes());
    assert_eq!(&out[4..6], &chunk::FLAG_DONE.to_be_bytes());
    assert_eq!(&out[6..8], &chunk::OFFSET_DATA.to_be_bytes());
    assert_eq!(&out[16..20], &520u32.to_be_bytes());
    assert_eq!(&out[20..28], &4096u64.to_be_bytes());
    assert!(encode_offset_data_prefix(&mut out, 7, 0, u32::MAX, true).is_err());

    let mut out = Vec::new();
    encode_none_chunk(&mut out, 3);
    assert_eq!(out.len(), CHUNK_HEADER_LEN);
    assert_eq!(&out[4..8], &[0, 1, 0, 0]);

    let mut out = Vec::new();
    encode_error_chunk(&mut out, 3, 5, "bad");
    assert_eq!(&out[6..8], &chunk::ERROR.to_be_bytes());
    assert_eq!(&out[16..20], &9u32.to_be_bytes());
    assert_eq!(&out[20..], &[0, 0, 0, 5, 0, 3, b'b', b'a', b'd']);

    let mut out = Vec::new();
    let extents = [
        BlockStatus { len: 512, flags: 3 },
        BlockStatus {
            len: 1024,
            flags: 0,
        },
    ];
    encode_block_status_chunk(&mut out, 3, 1, &extents);
    assert_eq!(&out[16..20], &20u32.to_be_bytes());
    assert_eq!(
        &out[20..],
        &[0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 0, 3, 0, 0, 4, 0, 0, 0, 0, 0]
    );
}

/// SplitMix64: tiny, seedable, and ours, so the same seed replays the same inputs.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Valid messages to mutate: random bytes alone almost never get past a magic number.
fn seeds() -> Vec<Vec<u8>> {
    let mut info = Vec::new();
    encode_info_request(
        &mut info,
        &InfoRequest {
            name: "d".into(),
            requests: vec![3, 1],
        },
    );
    let mut meta = Vec::new();
    let req = MetaContextRequest {
        export_name: "d".into(),
        queries: vec!["base:".into()],
    };
    encode_meta_context_request(&mut meta, &req);
    let mut request = Vec::new();
    let header = RequestHeader {
        flags: 1,
        command: 1,
        cookie: 9,
        offset: 0,
        len_bytes: 512,
    };
    encode_request(&mut request, &header);
    vec![
        option_bytes(opt::GO, &info),
        option_bytes(opt::SET_META_CONTEXT, &meta),
        option_bytes(opt::EXPORT_NAME, b"disk"),
        info,
        meta,
        request,
        vec![0, 0, 0, 3],
    ]
}

fn mutate(rng: &mut SplitMix64, input: &mut Vec<u8>) {
    for _ in 0..=rng.below(4) {
        match rng.below(4) {
            0 if !input.is_empty() => {
                let i = rng.below(input.len() as u64) as usize;
                input[i] ^= 1 << rng.below(8);
            }
            1 if !input.is_empty() => {
                let i = rng.below(input.len() as u64) as usize;
                input[i] = [0x00, 0xff, 0x7f, 0x80][rng.below(4) as usize];
            }
            2 => input.truncate(rng.below(input.len() as u64 + 1) as usize),
            _ => input.push(rng.next() as u8),
        }
    }
}

#[test]
fn parsers_survive_seeded_random_input() {
    let mut rng = SplitMix64(0x5747_4154_4131);
    let seeds = seeds();
    for round in 0..5000 {
        let mut input = if round % 3 == 0 {
            let len = rng.below(96) as usize;
            (0..len).map(|_| rng.next() as u8).collect()
        } else {
            seeds[rng.below(seeds.len() as u64) as usize].clone()
        };
        mutate(&mut rng, &mut input);
        fuzz_parsers(&input);
    }
    for seed in &seeds {
        fuzz_parsers(seed);
    }
}
