//! A minimal NBD client written from the protocol document, for the tests that must send
//! what no well-behaved client sends (bad magic, huge lengths, unknown commands) or hold a
//! connection open at a precise point. Everything else uses real clients.
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const REPLY_MAGIC_OPT: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;

pub const INFO_EXPORT: u16 = 0;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

pub const CHUNK_FLAG_DONE: u16 = 1 << 0;
pub const CHUNK_NONE: u16 = 0;
pub const CHUNK_OFFSET_DATA: u16 = 1;
pub const CHUNK_OFFSET_HOLE: u16 = 2;
pub const CHUNK_BLOCK_STATUS: u16 = 5;
pub const CHUNK_ERROR: u16 = (1 << 15) + 1;
pub const CHUNK_ERROR_OFFSET: u16 = (1 << 15) + 2;

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// The metadata context BLOCK_STATUS reports on.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// Larger option replies than this are a server bug for our purposes; never allocate more.
const MAX_OPTION_REPLY_BYTES: u32 = 1 << 20;
/// The same bound for one structured reply chunk (the tests read at most 1 MiB at once).
const MAX_CHUNK_BYTES: u32 = 2 << 20;
const IO_TIMEOUT: Duration = Duration::from_secs(10);

pub fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .expect("read timeout");
    stream
        .set_write_timeout(Some(IO_TIMEOUT))
        .expect("write timeout");
    stream.set_nodelay(true).expect("nodelay");
    stream
}

fn read_u16(s: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(s: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Reads the server greeting and answers with the client flags; returns the server flags.
pub fn greet(stream: &mut TcpStream) -> io::Result<u16> {
    let magic = read_u64(stream)?;
    assert_eq!(magic, NBDMAGIC, "bad NBDMAGIC in greeting");
    let opt_magic = read_u64(stream)?;
    assert_eq!(
        opt_magic, IHAVEOPT,
        "server does not speak newstyle negotiation"
    );
    let server_flags = read_u16(stream)?;
    assert!(
        server_flags & FLAG_FIXED_NEWSTYLE != 0,
        "server must offer fixed newstyle"
    );
    let client_flags = u32::from(server_flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
    stream.write_all(&client_flags.to_be_bytes())?;
    Ok(server_flags)
}

pub fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(16 + data.len());
    msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&option.to_be_bytes());
    msg.extend_from_slice(&(data.len() as u32).to_be_bytes());
    msg.extend_from_slice(data);
    msg
}

pub fn send_option(stream: &mut TcpStream, option: u32, data: &[u8]) -> io::Result<()> {
    stream.write_all(&option_bytes(option, data))
}

#[derive(Debug)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

pub fn read_option_reply(stream: &mut TcpStream) -> io::Result<OptionReply> {
    let magic = read_u64(stream)?;
    assert_eq!(magic, REPLY_MAGIC_OPT, "bad option reply magic");
    let option = read_u32(stream)?;
    let reply_type = read_u32(stream)?;
    let len = read_u32(stream)?;
    assert!(len <= MAX_OPTION_REPLY_BYTES, "option reply of {len} bytes");
    let mut data = vec![0u8; len as usize];
    stream.read_exact(&mut data)?;
    Ok(OptionReply {
        option,
        reply_type,
        data,
    })
}

/// Payload of NBD_OPT_GO / NBD_OPT_INFO: the export name and no information requests.
pub fn go_payload(export: &str) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    data
}

/// A connection in the transmission phase, speaking simple replies only.
pub struct Client {
    pub stream: TcpStream,
    pub size_bytes: u64,
    pub transmission_flags: u16,
    next_cookie: u64,
}

#[derive(Debug)]
pub enum GoError {
    Io(io::Error),
    /// The server answered NBD_OPT_GO with this error reply type.
    Refused(u32),
}

impl From<io::Error> for GoError {
    fn from(e: io::Error) -> Self {
        GoError::Io(e)
    }
}

/// Full handshake with NBD_OPT_GO for `export`.
pub fn go(addr: SocketAddr, export: &str) -> Result<Client, GoError> {
    let mut stream = connect(addr);
    greet(&mut stream)?;
    go_on(stream, export)
}

/// Full handshake that negotiates structured replies (NBD_OPT_STRUCTURED_REPLY) before
/// NBD_OPT_GO for `export`: read with [`Client::read_structured`].
pub fn go_structured(addr: SocketAddr, export: &str) -> Result<Client, GoError> {
    let mut stream = connect(addr);
    greet(&mut stream)?;
    send_option(&mut stream, OPT_STRUCTURED_REPLY, &[])?;
    let reply = read_option_reply(&mut stream)?;
    assert_eq!(
        reply.option, OPT_STRUCTURED_REPLY,
        "reply to the wrong option"
    );
    if reply.reply_type != REP_ACK {
        return Err(GoError::Refused(reply.reply_type));
    }
    go_on(stream, export)
}

/// Payload of NBD_OPT_SET_META_CONTEXT / NBD_OPT_LIST_META_CONTEXT: the export name, then
/// the queries.
pub fn meta_context_payload(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// NBD_OPT_SET_META_CONTEXT for `query` on `export`: the id of the context the server
/// selected (None if it selected none), or the error reply type it answered with.
pub fn set_meta_context(
    stream: &mut TcpStream,
    export: &str,
    query: &str,
) -> Result<Option<u32>, GoError> {
    send_option(
        stream,
        OPT_SET_META_CONTEXT,
        &meta_context_payload(export, &[query]),
    )?;
    let mut selected = None;
    loop {
        let reply = read_option_reply(stream)?;
        assert_eq!(
            reply.option, OPT_SET_META_CONTEXT,
            "reply to the wrong option"
        );
        match reply.reply_type {
            REP_ACK => return Ok(selected),
            REP_META_CONTEXT => {
                assert!(reply.data.len() >= 4, "NBD_REP_META_CONTEXT without an id");
                let id = u32::from_be_bytes(reply.data[0..4].try_into().expect("4 bytes"));
                assert_eq!(&reply.data[4..], query.as_bytes(), "context name");
                assert!(selected.is_none(), "two contexts selected for one query");
                selected = Some(id);
            }
            t if t & REP_FLAG_ERROR != 0 => return Err(GoError::Refused(t)),
            t => panic!("unexpected reply type {t:#x} to NBD_OPT_SET_META_CONTEXT"),
        }
    }
}

/// Full handshake with structured replies and the `base:allocation` metadata context, then
/// NBD_OPT_GO for `export`: the client and the context's id, for NBD_CMD_BLOCK_STATUS.
pub fn go_structured_block_status(
    addr: SocketAddr,
    export: &str,
) -> Result<(Client, u32), GoError> {
    let mut stream = connect(addr);
    greet(&mut stream)?;
    send_option(&mut stream, OPT_STRUCTURED_REPLY, &[])?;
    let reply = read_option_reply(&mut stream)?;
    if reply.reply_type != REP_ACK {
        return Err(GoError::Refused(reply.reply_type));
    }
    let id = set_meta_context(&mut stream, export, BASE_ALLOCATION)?
        .expect("the server selected no context for base:allocation");
    Ok((go_on(stream, export)?, id))
}

/// NBD_OPT_GO on a stream that already completed the greeting.
pub fn go_on(mut stream: TcpStream, export: &str) -> Result<Client, GoError> {
    send_option(&mut stream, OPT_GO, &go_payload(export))?;
    let mut export_info = None;
    loop {
        let reply = read_option_reply(&mut stream)?;
        assert_eq!(reply.option, OPT_GO, "reply to the wrong option");
        match reply.reply_type {
            REP_ACK => break,
            REP_INFO => {
                let info_type = u16::from_be_bytes([reply.data[0], reply.data[1]]);
                if info_type == INFO_EXPORT {
                    assert_eq!(reply.data.len(), 12, "NBD_INFO_EXPORT is 12 bytes");
                    let size = u64::from_be_bytes(reply.data[2..10].try_into().expect("8 bytes"));
                    let flags = u16::from_be_bytes([reply.data[10], reply.data[11]]);
                    export_info = Some((size, flags));
                }
            }
            t if t & REP_FLAG_ERROR != 0 => return Err(GoError::Refused(t)),
            t => panic!("unexpected reply type {t:#x} to NBD_OPT_GO"),
        }
    }
    let (size_bytes, transmission_flags) =
        export_info.expect("NBD_OPT_GO must send NBD_INFO_EXPORT before ACK");
    Ok(Client {
        stream,
        size_bytes,
        transmission_flags,
        next_cookie: 1,
    })
}

pub fn request_bytes(flags: u16, command: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut msg = [0u8; 28];
    msg[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    msg[4..6].copy_from_slice(&flags.to_be_bytes());
    msg[6..8].copy_from_slice(&command.to_be_bytes());
    msg[8..16].copy_from_slice(&cookie.to_be_bytes());
    msg[16..24].copy_from_slice(&offset.to_be_bytes());
    msg[24..28].copy_from_slice(&len.to_be_bytes());
    msg
}

impl Client {
    /// Wraps a stream already in the transmission phase (e.g. after NBD_OPT_EXPORT_NAME).
    pub fn from_stream(stream: TcpStream, size_bytes: u64) -> Client {
        Client {
            stream,
            size_bytes,
            transmission_flags: 0,
            next_cookie: 1,
        }
    }

    /// Sends one request header (and payload, if any); returns its cookie.
    pub fn send(&mut self, command: u16, offset: u64, len: u32, payload: &[u8]) -> io::Result<u64> {
        self.send_flags(0, command, offset, len, payload)
    }

    /// [`Client::send`] with command flags (FUA, NO_HOLE, DF, REQ_ONE, FAST_ZERO).
    pub fn send_flags(
        &mut self,
        flags: u16,
        command: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<u64> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        self.stream.write_all(&request_with_payload(
            flags, command, cookie, offset, len, payload,
        ))?;
        Ok(cookie)
    }

    /// Reads a simple reply header: (errno, cookie).
    pub fn read_reply_header(&mut self) -> io::Result<(u32, u64)> {
        let magic = read_u32(&mut self.stream)?;
        assert_eq!(
            magic, SIMPLE_REPLY_MAGIC,
            "expected a simple reply (structured replies were not negotiated)"
        );
        let errno = read_u32(&mut self.stream)?;
        let cookie = read_u64(&mut self.stream)?;
        Ok((errno, cookie))
    }

    /// READ; Err(errno) when the server refuses it.
    pub fn read(&mut self, offset: u64, len: u32) -> io::Result<Result<Vec<u8>, u32>> {
        let cookie = self.send(CMD_READ, offset, len, &[])?;
        let (errno, got) = self.read_reply_header()?;
        assert_eq!(got, cookie, "reply cookie");
        if errno != 0 {
            return Ok(Err(errno));
        }
        let mut data = vec![0u8; len as usize];
        self.stream.read_exact(&mut data)?;
        Ok(Ok(data))
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<Result<(), u32>> {
        let cookie = self.send(CMD_WRITE, offset, data.len() as u32, data)?;
        let (errno, got) = self.read_reply_header()?;
        assert_eq!(got, cookie, "reply cookie");
        Ok(if errno == 0 { Ok(()) } else { Err(errno) })
    }

    /// Reads every chunk of the reply to `cookie` up to the one flagged DONE. A simple reply
    /// (which the spec allows for commands other than READ) comes back as one final chunk:
    /// NONE, or ERROR carrying its errno.
    pub fn read_reply_chunks(&mut self, cookie: u64) -> io::Result<Vec<Chunk>> {
        let mut chunks = Vec::new();
        loop {
            let magic = read_u32(&mut self.stream)?;
            if magic == SIMPLE_REPLY_MAGIC {
                assert!(chunks.is_empty(), "a simple reply amid structured chunks");
                let errno = read_u32(&mut self.stream)?;
                assert_eq!(read_u64(&mut self.stream)?, cookie, "reply cookie");
                return Ok(vec![Chunk::simple(cookie, errno)]);
            }
            assert_eq!(
                magic, STRUCTURED_REPLY_MAGIC,
                "neither a simple reply nor a structured chunk"
            );
            let chunk = Chunk {
                flags: read_u16(&mut self.stream)?,
                chunk_type: read_u16(&mut self.stream)?,
                cookie: read_u64(&mut self.stream)?,
                payload: Vec::new(),
            };
            let len = read_u32(&mut self.stream)?;
            assert!(len <= MAX_CHUNK_BYTES, "a chunk of {len} bytes");
            let mut chunk = Chunk {
                payload: vec![0u8; len as usize],
                ..chunk
            };
            self.stream.read_exact(&mut chunk.payload)?;
            assert_eq!(chunk.cookie, cookie, "reply cookie");
            let done = chunk.flags & CHUNK_FLAG_DONE != 0;
            chunks.push(chunk);
            if done {
                return Ok(chunks);
            }
        }
    }

    /// Sends a request (with its payload) and reads its whole reply, simple or structured:
    /// Ok, or the (errno, message) of its error (the message is empty in a simple reply).
    pub fn outcome(
        &mut self,
        command: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<Result<(), (u32, String)>> {
        let cookie = self.send(command, offset, len, payload)?;
        let chunks = self.read_reply_chunks(cookie)?;
        Ok(chunks.iter().find_map(Chunk::error).map_or(Ok(()), Err))
    }

    /// READ on a connection with structured replies: the data put together from its
    /// OFFSET_DATA and OFFSET_HOLE chunks, or the (errno, message) of its error chunk.
    pub fn read_structured(
        &mut self,
        offset: u64,
        len: u32,
    ) -> io::Result<Result<Vec<u8>, (u32, String)>> {
        let cookie = self.send(CMD_READ, offset, len, &[])?;
        let chunks = self.read_reply_chunks(cookie)?;
        let mut data = vec![0u8; len as usize];
        for chunk in &chunks {
            if let Some(error) = chunk.error() {
                return Ok(Err(error));
            }
            chunk.place(offset, &mut data);
        }
        Ok(Ok(data))
    }

    pub fn disconnect(mut self) {
        let _ = self.send(CMD_DISC, 0, 0, &[]);
    }
}

/// One chunk of a structured reply.
#[derive(Debug)]
pub struct Chunk {
    pub flags: u16,
    pub chunk_type: u16,
    pub cookie: u64,
    pub payload: Vec<u8>,
}

impl Chunk {
    /// A simple reply seen as the one final chunk of its reply.
    fn simple(cookie: u64, errno: u32) -> Chunk {
        let (chunk_type, payload) = match errno {
            0 => (CHUNK_NONE, Vec::new()),
            _ => (CHUNK_ERROR, [&errno.to_be_bytes()[..], &[0, 0]].concat()),
        };
        Chunk {
            flags: CHUNK_FLAG_DONE,
            chunk_type,
            cookie,
            payload,
        }
    }

    /// The errno and message of an ERROR or ERROR_OFFSET chunk.
    pub fn error(&self) -> Option<(u32, String)> {
        if !matches!(self.chunk_type, CHUNK_ERROR | CHUNK_ERROR_OFFSET) {
            return None;
        }
        let p = &self.payload;
        assert!(p.len() >= 6, "an error chunk of {} bytes", p.len());
        let errno = u32::from_be_bytes(p[0..4].try_into().expect("4 bytes"));
        let message_len = usize::from(u16::from_be_bytes([p[4], p[5]]));
        assert!(p.len() >= 6 + message_len, "error message past the chunk");
        let message = String::from_utf8_lossy(&p[6..6 + message_len]).into_owned();
        Some((errno, message))
    }

    /// Copies an OFFSET_DATA chunk's data (or an OFFSET_HOLE's zeros) into `buf`, the
    /// buffer of a read at `read_offset`; the chunk must lie inside it.
    fn place(&self, read_offset: u64, buf: &mut [u8]) {
        let p = &self.payload;
        let (at, len) = match self.chunk_type {
            CHUNK_OFFSET_DATA => (p[..8].try_into().expect("8 bytes"), p.len() - 8),
            CHUNK_OFFSET_HOLE => (
                p[..8].try_into().expect("8 bytes"),
                u32::from_be_bytes(p[8..12].try_into().expect("4 bytes")) as usize,
            ),
            CHUNK_NONE => return,
            t => panic!("unexpected chunk type {t:#x} in a read reply"),
        };
        let start = u64::from_be_bytes(at)
            .checked_sub(read_offset)
            .expect("a chunk before the read's offset") as usize;
        let end = start + len;
        assert!(end <= buf.len(), "a chunk past the read's end");
        match self.chunk_type {
            CHUNK_OFFSET_DATA => buf[start..end].copy_from_slice(&p[8..]),
            _ => buf[start..end].fill(0),
        }
    }
}

/// One message from the server in the transmission phase: a simple reply's header (its
/// data, for a READ, follows and is the caller's to read) or one structured chunk.
#[derive(Debug)]
pub enum ReplyPiece {
    Simple { cookie: u64, errno: u32 },
    Chunk(Chunk),
}

/// Reads the next [`ReplyPiece`], whichever request it answers: for clients with many
/// requests in flight, whose replies come in any order.
pub fn read_reply_piece(stream: &mut impl Read) -> io::Result<ReplyPiece> {
    let magic = read_u32(stream)?;
    if magic == SIMPLE_REPLY_MAGIC {
        let errno = read_u32(stream)?;
        let cookie = read_u64(stream)?;
        return Ok(ReplyPiece::Simple { cookie, errno });
    }
    assert_eq!(
        magic, STRUCTURED_REPLY_MAGIC,
        "neither a simple reply nor a structured chunk"
    );
    let flags = read_u16(stream)?;
    let chunk_type = read_u16(stream)?;
    let cookie = read_u64(stream)?;
    let len = read_u32(stream)?;
    assert!(
        len <= MAX_CHUNK_BYTES,
        "a chunk of {len} bytes (type {chunk_type:#x}, flags {flags:#x}, cookie {cookie:#x})"
    );
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload)?;
    Ok(ReplyPiece::Chunk(Chunk {
        flags,
        chunk_type,
        cookie,
        payload,
    }))
}

/// A request header with flags, followed by its payload (a WRITE's data), as one message.
pub fn request_with_payload(
    flags: u16,
    command: u16,
    cookie: u64,
    offset: u64,
    len: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut msg = request_bytes(flags, command, cookie, offset, len).to_vec();
    msg.extend_from_slice(payload);
    msg
}

impl Chunk {
    /// The (offset, data) of an OFFSET_DATA chunk, or the (offset, length) of an
    /// OFFSET_HOLE's zeros as a vector of zeros; None for other chunk types.
    pub fn read_data(&self) -> Option<(u64, Vec<u8>)> {
        let p = &self.payload;
        match self.chunk_type {
            CHUNK_OFFSET_DATA => {
                assert!(p.len() > 8, "an OFFSET_DATA chunk without data");
                let at = u64::from_be_bytes(p[..8].try_into().expect("8 bytes"));
                Some((at, p[8..].to_vec()))
            }
            CHUNK_OFFSET_HOLE => {
                assert_eq!(p.len(), 12, "an OFFSET_HOLE chunk is 12 bytes");
                let at = u64::from_be_bytes(p[..8].try_into().expect("8 bytes"));
                let len = u32::from_be_bytes(p[8..12].try_into().expect("4 bytes"));
                Some((at, vec![0u8; len as usize]))
            }
            _ => None,
        }
    }

    /// The context id and the (length, flags) descriptors of a BLOCK_STATUS chunk.
    pub fn block_status(&self) -> Option<(u32, Vec<(u32, u32)>)> {
        if self.chunk_type != CHUNK_BLOCK_STATUS {
            return None;
        }
        let p = &self.payload;
        assert!(
            p.len() >= 4 && (p.len() - 4).is_multiple_of(8),
            "a BLOCK_STATUS chunk of {} bytes",
            p.len()
        );
        let id = u32::from_be_bytes(p[0..4].try_into().expect("4 bytes"));
        let extents = p[4..]
            .chunks_exact(8)
            .map(|d| {
                let len = u32::from_be_bytes(d[0..4].try_into().expect("4 bytes"));
                let flags = u32::from_be_bytes(d[4..8].try_into().expect("4 bytes"));
                (len, flags)
            })
            .collect();
        Some((id, extents))
    }
}

/// How a connection ended up after we provoked the server.
#[derive(Debug, PartialEq, Eq)]
pub enum Closed {
    /// The server closed the connection (EOF or reset), after sending this many bytes.
    Yes { bytes_before_close: usize },
    /// Still open when the timeout ran out.
    StillOpen,
}

/// Reads and discards whatever the server sends until it closes the connection or
/// `timeout` passes. Bounded: gives up after 64 MiB, which no error reply needs.
pub fn wait_closed(stream: &mut TcpStream, timeout: Duration) -> Closed {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 64 * 1024];
    let mut total = 0usize;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || total > 64 << 20 {
            return Closed::StillOpen;
        }
        stream.set_read_timeout(Some(left)).expect("read timeout");
        match stream.read(&mut buf) {
            Ok(0) => {
                return Closed::Yes {
                    bytes_before_close: total,
                }
            }
            Ok(n) => total += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Closed::StillOpen
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                return Closed::Yes {
                    bytes_before_close: total,
                }
            }
        }
    }
}
