//! A small NBD client: fixed-newstyle handshake with NBD_OPT_GO, then pipelined requests with
//! simple replies (no structured replies are negotiated, so a reply is a 16-byte header and, for
//! a successful read, exactly the bytes asked for). It speaks to any NBD server.
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::workload::TargetUri;
use crate::BenchError;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const INFO_EXPORT: u16 = 0;
const TRANSMISSION_READ_ONLY: u16 = 1 << 1;
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
/// Longest option reply we read; real ones are a few dozen bytes.
const MAX_OPTION_REPLY_BYTES: u32 = 64 << 10;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
pub const REQUEST_HEADER_LEN: usize = 28;
pub const REPLY_HEADER_LEN: usize = 16;
const READ_BUFFER_BYTES: usize = 256 << 10;

/// One negotiated connection, split so that one task can send while another reads replies.
pub struct Connection {
    pub reader: BufReader<OwnedReadHalf>,
    pub writer: OwnedWriteHalf,
    pub size_bytes: u64,
    pub read_only: bool,
}

/// A reply header: the request's cookie and the NBD errno (0 for success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    pub cookie: u64,
    pub error: u32,
}

fn protocol(target: &TargetUri, what: &str) -> BenchError {
    BenchError::Target(format!("{}: {what}", target.uri))
}

fn io_error(target: &TargetUri, e: std::io::Error) -> BenchError {
    BenchError::Target(format!("{}: {}", target.uri, short_io(&e)))
}

/// "connection refused", not "Connection refused (os error 111)".
pub fn short_io(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = text.split(" (os error").next().unwrap_or(&text).to_string();
    let mut chars = text.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

/// Connects and negotiates `target`'s export, within [`HANDSHAKE_TIMEOUT`].
pub async fn connect(target: &TargetUri) -> Result<Connection, BenchError> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(target)).await {
        Ok(r) => r,
        Err(_) => Err(protocol(target, "the handshake timed out")),
    }
}

async fn handshake(target: &TargetUri) -> Result<Connection, BenchError> {
    let mut s = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| io_error(target, e))?;
    let _ = s.set_nodelay(true);
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting)
        .await
        .map_err(|e| io_error(target, e))?;
    let magic = u64::from_be_bytes(greeting[..8].try_into().unwrap_or_default());
    let opt = u64::from_be_bytes(greeting[8..16].try_into().unwrap_or_default());
    let flags = u16::from_be_bytes([greeting[16], greeting[17]]);
    if magic != NBDMAGIC || opt != IHAVEOPT || flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(protocol(
            target,
            "not an NBD server with fixed-newstyle negotiation",
        ));
    }
    let client_flags = u32::from(flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
    let mut msg = client_flags.to_be_bytes().to_vec();
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&OPT_GO.to_be_bytes());
    let name = target.export.as_bytes();
    msg.extend_from_slice(&(4 + name.len() as u32 + 2).to_be_bytes());
    msg.extend_from_slice(&(name.len() as u32).to_be_bytes());
    msg.extend_from_slice(name);
    msg.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&msg).await.map_err(|e| io_error(target, e))?;
    let (size_bytes, transmission_flags) = read_go_replies(&mut s, target).await?;
    let (r, w) = s.into_split();
    Ok(Connection {
        reader: BufReader::with_capacity(READ_BUFFER_BYTES, r),
        writer: w,
        size_bytes,
        read_only: transmission_flags & TRANSMISSION_READ_ONLY != 0,
    })
}

/// Reads option replies up to the ACK; returns the export's size and transmission flags.
async fn read_go_replies(s: &mut TcpStream, target: &TargetUri) -> Result<(u64, u16), BenchError> {
    let mut export = None;
    loop {
        let mut head = [0u8; 20];
        s.read_exact(&mut head)
            .await
            .map_err(|e| io_error(target, e))?;
        let be32 = |i: usize| u32::from_be_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
        let magic = u64::from_be_bytes(head[..8].try_into().unwrap_or_default());
        let (reply_type, len) = (be32(12), be32(16));
        if magic != OPTION_REPLY_MAGIC || len > MAX_OPTION_REPLY_BYTES {
            return Err(protocol(target, "malformed option reply"));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)
            .await
            .map_err(|e| io_error(target, e))?;
        match reply_type {
            REP_ACK => {
                return export.ok_or_else(|| protocol(target, "the server sent no export size"))
            }
            REP_INFO
                if data.len() >= 12 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT =>
            {
                let size = u64::from_be_bytes(data[2..10].try_into().unwrap_or_default());
                export = Some((size, u16::from_be_bytes([data[10], data[11]])));
            }
            REP_INFO => {}
            REP_ERR_UNKNOWN => {
                return Err(protocol(
                    target,
                    &format!("no export named {:?}", target.export),
                ))
            }
            t if t & (1 << 31) != 0 => {
                let text = String::from_utf8_lossy(&data);
                return Err(protocol(
                    target,
                    &format!("export refused (error {:#x}) {text}", t),
                ));
            }
            _ => return Err(protocol(target, "unexpected option reply")),
        }
    }
}

/// Appends a request header (and nothing else: a write's payload follows separately).
pub fn encode_request(out: &mut Vec<u8>, command: u16, cookie: u64, offset: u64, len: u32) {
    out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&command.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// Reads one simple reply header.
pub async fn read_reply(r: &mut BufReader<OwnedReadHalf>) -> std::io::Result<Reply> {
    let mut head = [0u8; REPLY_HEADER_LEN];
    r.read_exact(&mut head).await?;
    let magic = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected reply magic {magic:#x}"),
        ));
    }
    Ok(Reply {
        error: u32::from_be_bytes([head[4], head[5], head[6], head[7]]),
        cookie: u64::from_be_bytes(head[8..16].try_into().unwrap_or_default()),
    })
}
