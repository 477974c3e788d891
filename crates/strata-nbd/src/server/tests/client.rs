//! A small hand-written NBD client for the tests. It frames and parses bytes itself
//! (only the numeric constants come from `proto`), so a framing bug in `proto` is not
//! mirrored here; the qemu-io / nbdinfo tests check against independent clients.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::proto::{chunk, client_flags, cmd, info, opt, rep};

/// Every read gives up after this, so a broken server fails a test instead of hanging it.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct OptReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

impl OptReply {
    pub fn is_final(&self) -> bool {
        self.reply_type == rep::ACK || self.reply_type & (1 << 31) != 0
    }

    pub fn info_type(&self) -> u16 {
        u16::from_be_bytes([self.data[0], self.data[1]])
    }
}

/// What a GO or INFO reported.
#[derive(Debug, Clone, Default)]
pub struct ExportFacts {
    pub size: u64,
    pub flags: u16,
    pub name: Option<String>,
    pub description: Option<String>,
    pub block_size: Option<(u32, u32, u32)>,
}

/// One complete reply in the transmission phase.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    pub cookie: u64,
    pub error: u32,
    pub data: Vec<u8>,
    pub message: String,
    pub chunk_types: Vec<u16>,
    pub context_id: Option<u32>,
    pub extents: Vec<(u32, u32)>,
}

pub struct Client {
    s: TcpStream,
    /// Cookie -> (command, offset, length) of requests not yet answered.
    pending: HashMap<u64, (u16, u64, u32)>,
    partial: HashMap<u64, Reply>,
    next_cookie: u64,
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

impl Client {
    /// Connects, checks the greeting and sends FIXED_NEWSTYLE | NO_ZEROES.
    pub async fn connect(addr: SocketAddr) -> Client {
        Self::connect_with_flags(addr, client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES)
            .await
            .expect("handshake start")
    }

    pub async fn connect_with_flags(addr: SocketAddr, flags: u32) -> io::Result<Client> {
        let s = TcpStream::connect(addr).await?;
        let mut c = Client {
            s,
            pending: HashMap::new(),
            partial: HashMap::new(),
            next_cookie: 1,
        };
        let greeting = c.read_n(18).await?;
        assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
        assert_eq!(be16(&greeting[16..]), 3, "FIXED_NEWSTYLE | NO_ZEROES");
        c.s.write_all(&flags.to_be_bytes()).await?;
        Ok(c)
    }

    /// A plain TCP connection with nothing sent, for tests of refused connections.
    pub async fn raw(addr: SocketAddr) -> TcpStream {
        TcpStream::connect(addr).await.unwrap()
    }

    pub async fn read_n(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; n];
        match tokio::time::timeout(READ_TIMEOUT, self.s.read_exact(&mut buf)).await {
            Ok(r) => r.map(|_| buf),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "server did not answer",
            )),
        }
    }

    pub async fn write_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.s.write_all(bytes).await
    }

    /// True if the server closes the connection (EOF or reset) within the read timeout;
    /// any bytes still in flight before the close are skipped.
    pub async fn is_closed(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout(READ_TIMEOUT, self.s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }

    pub async fn send_option(&mut self, option: u32, payload: &[u8]) {
        let mut msg = b"IHAVEOPT".to_vec();
        msg.extend_from_slice(&option.to_be_bytes());
        msg.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        msg.extend_from_slice(payload);
        self.s.write_all(&msg).await.unwrap();
    }

    pub async fn read_option_reply(&mut self) -> io::Result<OptReply> {
        let head = self.read_n(20).await?;
        assert_eq!(be64(&head), 0x0003_e889_0455_65a9, "option reply magic");
        let data = self.read_n(be32(&head[16..]) as usize).await?;
        Ok(OptReply {
            option: be32(&head[8..]),
            reply_type: be32(&head[12..]),
            data,
        })
    }

    /// Sends an option and collects replies up to the final one (ACK or an error).
    pub async fn option(&mut self, option: u32, payload: &[u8]) -> Vec<OptReply> {
        self.send_option(option, payload).await;
        let mut replies = Vec::new();
        loop {
            let reply = self.read_option_reply().await.expect("option reply");
            assert_eq!(reply.option, option, "reply names the option");
            let done = reply.is_final();
            replies.push(reply);
            if done {
                return replies;
            }
        }
    }

    pub async fn structured_replies(&mut self) {
        let replies = self.option(opt::STRUCTURED_REPLY, &[]).await;
        assert_eq!(replies[0].reply_type, rep::ACK);
    }

    pub fn info_payload(name: &str, requests: &[u16]) -> Vec<u8> {
        let mut p = (name.len() as u32).to_be_bytes().to_vec();
        p.extend_from_slice(name.as_bytes());
        p.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for r in requests {
            p.extend_from_slice(&r.to_be_bytes());
        }
        p
    }

    pub fn meta_payload(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut p = (name.len() as u32).to_be_bytes().to_vec();
        p.extend_from_slice(name.as_bytes());
        p.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            p.extend_from_slice(&(q.len() as u32).to_be_bytes());
            p.extend_from_slice(q.as_bytes());
        }
        p
    }

    /// Parses the NBD_REP_INFO replies of a GO or INFO that ended in ACK.
    pub fn facts(replies: &[OptReply]) -> ExportFacts {
        assert_eq!(replies.last().unwrap().reply_type, rep::ACK, "{replies:?}");
        let mut f = ExportFacts::default();
        for r in replies.iter().filter(|r| r.reply_type == rep::INFO) {
            let d = &r.data[2..];
            match r.info_type() {
                info::EXPORT => (f.size, f.flags) = (be64(d), be16(&d[8..])),
                info::NAME => f.name = Some(String::from_utf8(d.to_vec()).unwrap()),
                info::DESCRIPTION => f.description = Some(String::from_utf8(d.to_vec()).unwrap()),
                info::BLOCK_SIZE => f.block_size = Some((be32(d), be32(&d[4..]), be32(&d[8..]))),
                other => panic!("unexpected info type {other}"),
            }
        }
        f
    }

    /// NBD_OPT_GO that must succeed.
    pub async fn go(&mut self, name: &str) -> ExportFacts {
        let replies = self.option(opt::GO, &Self::info_payload(name, &[])).await;
        Self::facts(&replies)
    }

    /// Connects and enters transmission on `name` with simple replies only.
    pub async fn simple(addr: SocketAddr, name: &str) -> (Client, ExportFacts) {
        let mut c = Client::connect(addr).await;
        let facts = c.go(name).await;
        (c, facts)
    }

    /// Connects with structured replies and `base:allocation` selected.
    pub async fn structured(addr: SocketAddr, name: &str) -> (Client, ExportFacts) {
        let mut c = Client::connect(addr).await;
        c.structured_replies().await;
        let replies = c
            .option(
                opt::SET_META_CONTEXT,
                &Self::meta_payload(name, &["base:allocation"]),
            )
            .await;
        assert_eq!(replies[0].reply_type, rep::META_CONTEXT);
        let facts = c.go(name).await;
        (c, facts)
    }

    /// Sends a request header (and payload) with a fresh cookie, which it returns.
    pub async fn send(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        self.send_with_cookie(cookie, command, flags, offset, len, payload)
            .await;
        cookie
    }

    pub async fn send_with_cookie(
        &mut self,
        cookie: u64,
        command: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) {
        let mut msg = 0x2560_9513u32.to_be_bytes().to_vec();
        msg.extend_from_slice(&flags.to_be_bytes());
        msg.extend_from_slice(&command.to_be_bytes());
        msg.extend_from_slice(&cookie.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(payload);
        self.pending.insert(cookie, (command, offset, len));
        self.s.write_all(&msg).await.unwrap();
    }

    /// Sends WRITE requests in one socket write, so the server finds them queued behind one
    /// another; returns their cookies.
    pub async fn send_writes_at_once(&mut self, writes: &[(u64, Vec<u8>)]) -> Vec<u64> {
        let requests: Vec<_> = writes
            .iter()
            .map(|(offset, payload)| (cmd::WRITE, *offset, payload.len() as u32, payload.clone()))
            .collect();
        self.send_at_once(&requests).await
    }

    /// Sends (command, offset, length, payload) requests in one socket write; returns their
    /// cookies.
    pub async fn send_at_once(&mut self, requests: &[(u16, u64, u32, Vec<u8>)]) -> Vec<u64> {
        let mut msg = Vec::new();
        let mut cookies = Vec::new();
        for (command, offset, len, payload) in requests {
            let cookie = self.next_cookie;
            self.next_cookie += 1;
            msg.extend_from_slice(&0x2560_9513u32.to_be_bytes());
            msg.extend_from_slice(&0u16.to_be_bytes());
            msg.extend_from_slice(&command.to_be_bytes());
            msg.extend_from_slice(&cookie.to_be_bytes());
            msg.extend_from_slice(&offset.to_be_bytes());
            msg.extend_from_slice(&len.to_be_bytes());
            msg.extend_from_slice(payload);
            self.pending.insert(cookie, (*command, *offset, *len));
            cookies.push(cookie);
        }
        self.s.write_all(&msg).await.unwrap();
        cookies
    }

    /// Sends one request and waits for its reply (no other request may be pending).
    pub async fn request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> Reply {
        let cookie = self.send(command, flags, offset, len, payload).await;
        let reply = self.reply().await.expect("reply");
        assert_eq!(reply.cookie, cookie);
        reply
    }

    pub async fn read(&mut self, offset: u64, len: u32) -> Reply {
        self.request(cmd::READ, 0, offset, len, &[]).await
    }

    pub async fn write(&mut self, offset: u64, data: &[u8]) -> Reply {
        self.request(cmd::WRITE, 0, offset, data.len() as u32, data)
            .await
    }

    /// Reads the next complete reply, whatever request it answers.
    pub async fn reply(&mut self) -> io::Result<Reply> {
        loop {
            let magic = be32(&self.read_n(4).await?);
            let done = match magic {
                0x6744_6698 => Some(self.simple_reply().await?),
                0x668e_33ef => self.chunk().await?,
                other => panic!("bad reply magic {other:#x}"),
            };
            if let Some(reply) = done {
                self.pending.remove(&reply.cookie);
                return Ok(reply);
            }
        }
    }

    async fn simple_reply(&mut self) -> io::Result<Reply> {
        let head = self.read_n(12).await?;
        let (error, cookie) = (be32(&head), be64(&head[4..]));
        let (command, _, len) = self.pending[&cookie];
        let data = if command == cmd::READ && error == 0 {
            self.read_n(len as usize).await?
        } else {
            Vec::new()
        };
        Ok(Reply {
            cookie,
            error,
            data,
            ..Reply::default()
        })
    }

    /// Reads one structured chunk; returns the reply once its DONE chunk arrives.
    async fn chunk(&mut self) -> io::Result<Option<Reply>> {
        let head = self.read_n(16).await?;
        let (flags, kind, cookie, len) = (
            be16(&head),
            be16(&head[2..]),
            be64(&head[4..]),
            be32(&head[12..]),
        );
        let payload = self.read_n(len as usize).await?;
        let (_, req_offset, req_len) = self.pending[&cookie];
        let reply = self.partial.entry(cookie).or_insert_with(|| Reply {
            cookie,
            ..Reply::default()
        });
        reply.chunk_types.push(kind);
        match kind {
            chunk::NONE => assert_eq!(len, 0),
            chunk::OFFSET_DATA => {
                let at = (be64(&payload) - req_offset) as usize;
                reply.data.resize(req_len as usize, 0);
                reply.data[at..at + payload.len() - 8].copy_from_slice(&payload[8..]);
            }
            chunk::BLOCK_STATUS => {
                reply.context_id = Some(be32(&payload));
                assert_eq!((payload.len() - 4) % 8, 0);
                reply.extents = payload[4..]
                    .chunks(8)
                    .map(|e| (be32(e), be32(&e[4..])))
                    .collect();
            }
            chunk::ERROR => {
                reply.error = be32(&payload);
                let msg_len = be16(&payload[4..]) as usize;
                reply.message = String::from_utf8(payload[6..6 + msg_len].to_vec()).unwrap();
            }
            other => panic!("unexpected chunk type {other}"),
        }
        if flags & chunk::FLAG_DONE == 0 {
            return Ok(None);
        }
        Ok(self.partial.remove(&cookie))
    }
}
