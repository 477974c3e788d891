//! Handshake phase: fixed newstyle greeting and option haggling, ending in a [`Session`].

use std::io;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::debug;

use super::connection::ConnError;
use super::{Shared, PREFERRED_BLOCK_BYTES};
use crate::proto::{
    self, client_flags, handshake_flags, info, opt, rep, transmission_flags as tf, Info,
    OptionReply, ProtoError, BASE_ALLOCATION, CLIENT_FLAGS_LEN, MAX_OPTION_DISCARD_BYTES,
    OPTION_HEADER_LEN,
};
use crate::{Backend, Export};

/// Context id we hand out for `base:allocation` (ids are opaque to clients; any works).
pub(super) const BASE_ALLOCATION_ID: u32 = 1;

/// What the handshake settled for the transmission phase.
pub(super) struct Session {
    pub export: Arc<dyn Export>,
    pub name: String,
    pub size_bytes: u64,
    pub read_only: bool,
    /// NBD_OPT_STRUCTURED_REPLY was acknowledged.
    pub structured: bool,
    /// `base:allocation` was selected by SET_META_CONTEXT for this very export.
    pub base_allocation: bool,
}

/// Transmission flags for an export; DF only makes sense with structured replies.
pub(super) fn transmission_flags(read_only: bool, structured: bool) -> u16 {
    let mut flags = tf::HAS_FLAGS | tf::SEND_FLUSH | tf::SEND_FUA | tf::SEND_CACHE;
    // Every replied write is durable and visible to all connections (see docs/NBD.md).
    flags |= tf::CAN_MULTI_CONN;
    if read_only {
        flags |= tf::READ_ONLY;
    } else {
        flags |= tf::SEND_TRIM | tf::SEND_WRITE_ZEROES | tf::SEND_FAST_ZERO;
    }
    if structured {
        flags |= tf::SEND_DF;
    }
    flags
}

/// An export opened by INFO or GO, with the facts they report.
struct Opened {
    name: String,
    export: Arc<dyn Export>,
    size_bytes: u64,
    read_only: bool,
}

/// The last SET_META_CONTEXT: it applies only if GO names the same export.
struct MetaSelection {
    export_name: String,
    base_allocation: bool,
}

enum Step {
    Continue,
    Abort,
    Go(Session),
}

/// Runs the handshake. `Ok(None)` means the client aborted politely.
pub(super) async fn negotiate(
    stream: &mut TcpStream,
    shared: &Shared,
) -> Result<Option<Session>, ConnError> {
    let mut greeting = Vec::with_capacity(proto::GREETING_LEN);
    proto::encode_greeting(
        &mut greeting,
        handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES,
    );
    stream.write_all(&greeting).await?;
    let mut flags = [0u8; CLIENT_FLAGS_LEN];
    stream.read_exact(&mut flags).await?;
    let flags = proto::parse_client_flags(&flags)?;
    let mut haggle = Haggle {
        backend: shared.backend.clone(),
        max_payload_bytes: shared.cfg.max_payload_bytes,
        no_zeroes: flags & client_flags::NO_ZEROES != 0,
        structured: false,
        meta: None,
    };
    loop {
        let mut replies = Vec::new();
        let (option, payload) = match read_option(stream).await? {
            Incoming::Option(option, payload) => (option, payload),
            Incoming::TooBig(option) => {
                let why = "option data longer than 64 KiB";
                reply_error(&mut replies, option, rep::ERR_TOO_BIG, why);
                stream.write_all(&replies).await?;
                continue;
            }
        };
        let step = haggle.handle(option, &payload, &mut replies).await?;
        stream.write_all(&replies).await?;
        match step {
            Step::Continue => {}
            Step::Abort => return Ok(None),
            Step::Go(session) => return Ok(Some(session)),
        }
    }
}

/// The client's next option.
enum Incoming {
    /// An option and its payload.
    Option(u32, Vec<u8>),
    /// An option whose payload was too long to keep: it has been read and dropped.
    TooBig(u32),
}

/// One option: header, then a payload the header parser has already bounded. A payload
/// over that bound but within MAX_OPTION_DISCARD_BYTES is read and dropped, so the option
/// can be refused and haggling go on; beyond it, the connection is closed. So is an
/// NBD_OPT_EXPORT_NAME too long to keep, since it has no way to carry an error.
async fn read_option(stream: &mut TcpStream) -> Result<Incoming, ConnError> {
    let mut header = [0u8; OPTION_HEADER_LEN];
    stream.read_exact(&mut header).await?;
    let header = match proto::parse_option_header(&header) {
        Ok(header) => header,
        Err(ProtoError::OptionTooLong { option, len, .. })
            if len <= MAX_OPTION_DISCARD_BYTES && option != opt::EXPORT_NAME =>
        {
            discard(stream, len).await?;
            debug!(option, len, "NBD option too long: its data was dropped");
            return Ok(Incoming::TooBig(option));
        }
        Err(e) => return Err(e.into()),
    };
    let mut payload = vec![0u8; header.len_bytes as usize];
    stream.read_exact(&mut payload).await?;
    debug!(option = header.option, len = header.len_bytes, "NBD option");
    Ok(Incoming::Option(header.option, payload))
}

/// Reads `len` bytes and drops them, a buffer at a time.
async fn discard(stream: &mut TcpStream, len: u32) -> Result<(), ConnError> {
    let mut payload = (&mut *stream).take(len.into());
    let copied = tokio::io::copy(&mut payload, &mut tokio::io::sink()).await?;
    if copied < u64::from(len) {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    Ok(())
}

struct Haggle {
    backend: Arc<dyn Backend>,
    max_payload_bytes: u32,
    no_zeroes: bool,
    structured: bool,
    meta: Option<MetaSelection>,
}

fn reply_error(out: &mut Vec<u8>, option: u32, kind: u32, message: &str) {
    OptionReply::Error { kind, message }.encode(option, out);
}

impl Haggle {
    async fn handle(
        &mut self,
        option: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<Step, ConnError> {
        match option {
            opt::EXPORT_NAME => self.export_name(payload, out).await,
            opt::ABORT => {
                OptionReply::Ack.encode(option, out);
                Ok(Step::Abort)
            }
            opt::LIST => self.list(payload, out).await,
            opt::INFO | opt::GO => self.info_or_go(option, payload, out).await,
            opt::STRUCTURED_REPLY => Ok(self.structured_reply(payload, out)),
            opt::LIST_META_CONTEXT => Ok(self.list_meta_context(payload, out)),
            opt::SET_META_CONTEXT => Ok(self.set_meta_context(payload, out)),
            _ => {
                reply_error(
                    out,
                    option,
                    rep::ERR_UNSUP,
                    "option not supported by Strata",
                );
                Ok(Step::Continue)
            }
        }
    }

    /// The old way into transmission: it cannot report errors, so an unknown export
    /// closes the connection (as the spec requires).
    async fn export_name(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Result<Step, ConnError> {
        let name = proto::parse_export_name(payload)?;
        let Some(opened) = self.open(&name).await? else {
            return Err(ConnError::UnknownExport(name));
        };
        let flags = transmission_flags(opened.read_only, self.structured);
        proto::encode_export_name_reply(out, opened.size_bytes, flags, self.no_zeroes);
        Ok(Step::Go(self.session(opened)))
    }

    async fn list(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Result<Step, ConnError> {
        if !payload.is_empty() {
            reply_error(
                out,
                opt::LIST,
                rep::ERR_INVALID,
                "NBD_OPT_LIST takes no data",
            );
            return Ok(Step::Continue);
        }
        let backend = self.backend.clone();
        let exports = blocking("listing exports", move || backend.list()).await?;
        for e in &exports {
            OptionReply::Server {
                name: &e.name,
                description: &e.description,
            }
            .encode(opt::LIST, out);
        }
        OptionReply::Ack.encode(opt::LIST, out);
        Ok(Step::Continue)
    }

    async fn info_or_go(
        &mut self,
        option: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<Step, ConnError> {
        let Ok(req) = proto::parse_info_request(payload) else {
            reply_error(
                out,
                option,
                rep::ERR_INVALID,
                "malformed NBD_OPT_INFO/NBD_OPT_GO data",
            );
            return Ok(Step::Continue);
        };
        let Some(opened) = self.open(&req.name).await? else {
            reply_error(out, option, rep::ERR_UNKNOWN, "no export of that name");
            return Ok(Step::Continue);
        };
        let flags = transmission_flags(opened.read_only, self.structured);
        let export = Info::Export {
            size_bytes: opened.size_bytes,
            transmission_flags: flags,
        };
        OptionReply::Info(export).encode(option, out);
        if req.requests.contains(&info::NAME) {
            OptionReply::Info(Info::Name(&opened.name)).encode(option, out);
        }
        if req.requests.contains(&info::DESCRIPTION) {
            let description = self.description(&opened.name).await?;
            OptionReply::Info(Info::Description(&description)).encode(option, out);
        }
        // Sent even unasked: our constraints are the defaults, so a client that ignores
        // them loses nothing, and one that reads them learns our maximum.
        let sizes = Info::BlockSize {
            min_bytes: 1,
            preferred_bytes: PREFERRED_BLOCK_BYTES,
            max_bytes: self.max_payload_bytes,
        };
        OptionReply::Info(sizes).encode(option, out);
        OptionReply::Ack.encode(option, out);
        if option == opt::GO {
            return Ok(Step::Go(self.session(opened)));
        }
        // INFO's handle is not kept for a GO that may never come: held, it counted as a
        // client of the export (a plain delete refused meanwhile), and one deleted and
        // created again under the same name left GO a handle to the old, dead one.
        Ok(Step::Continue)
    }

    fn structured_reply(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Step {
        if payload.is_empty() {
            self.structured = true;
            OptionReply::Ack.encode(opt::STRUCTURED_REPLY, out);
        } else {
            reply_error(
                out,
                opt::STRUCTURED_REPLY,
                rep::ERR_INVALID,
                "NBD_OPT_STRUCTURED_REPLY takes no data",
            );
        }
        Step::Continue
    }

    /// Lists `base:allocation` for an empty query list, for `base:` and for
    /// `base:allocation`; other namespaces are ignored, as the spec requires.
    fn list_meta_context(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Step {
        let option = opt::LIST_META_CONTEXT;
        let listed = match parse_queries(payload) {
            Ok(req) => {
                req.queries.is_empty()
                    || req
                        .queries
                        .iter()
                        .any(|q| q == "base:" || q == BASE_ALLOCATION)
            }
            Err(why) => {
                reply_error(out, option, rep::ERR_INVALID, why);
                return Step::Continue;
            }
        };
        if listed {
            OptionReply::MetaContext {
                id: 0,
                name: BASE_ALLOCATION,
            }
            .encode(option, out);
        }
        OptionReply::Ack.encode(option, out);
        Step::Continue
    }

    /// Selects `base:allocation` if asked for by its full name. The selection is replaced
    /// even when the option fails, as the spec says.
    fn set_meta_context(&mut self, payload: &[u8], out: &mut Vec<u8>) -> Step {
        let option = opt::SET_META_CONTEXT;
        self.meta = None;
        if !self.structured {
            reply_error(
                out,
                option,
                rep::ERR_INVALID,
                "negotiate NBD_OPT_STRUCTURED_REPLY first",
            );
            return Step::Continue;
        }
        let req = match parse_queries(payload) {
            Ok(req) => req,
            Err(why) => {
                reply_error(out, option, rep::ERR_INVALID, why);
                return Step::Continue;
            }
        };
        let base_allocation = req.queries.iter().any(|q| q == BASE_ALLOCATION);
        if base_allocation {
            OptionReply::MetaContext {
                id: BASE_ALLOCATION_ID,
                name: BASE_ALLOCATION,
            }
            .encode(option, out);
        }
        OptionReply::Ack.encode(option, out);
        self.meta = Some(MetaSelection {
            export_name: req.export_name,
            base_allocation,
        });
        Step::Continue
    }

    /// Opens `name` (None: no such export).
    async fn open(&self, name: &str) -> Result<Option<Opened>, ConnError> {
        let backend = self.backend.clone();
        let owned = name.to_string();
        blocking("opening an export", move || {
            backend.open(&owned).map(|export| Opened {
                size_bytes: export.size_bytes(),
                read_only: export.read_only(),
                export,
                name: owned,
            })
        })
        .await
    }

    async fn description(&self, name: &str) -> Result<String, ConnError> {
        let backend = self.backend.clone();
        let name = name.to_string();
        let found = blocking("listing exports", move || {
            backend
                .list()
                .into_iter()
                .find(|e| e.name == name)
                .map(|e| e.description)
        });
        Ok(found.await?.unwrap_or_default())
    }

    fn session(&mut self, opened: Opened) -> Session {
        let base_allocation = self
            .meta
            .as_ref()
            .is_some_and(|m| m.base_allocation && m.export_name == opened.name);
        Session {
            export: opened.export,
            name: opened.name,
            size_bytes: opened.size_bytes,
            read_only: opened.read_only,
            structured: self.structured,
            base_allocation,
        }
    }
}

/// A LIST/SET_META_CONTEXT payload whose queries each name a namespace. Whether the export
/// exists is left to GO: `base:allocation` is available on every export.
fn parse_queries(payload: &[u8]) -> Result<proto::MetaContextRequest, &'static str> {
    let req = proto::parse_meta_context_request(payload)
        .map_err(|_| "malformed metadata context request")?;
    if req.queries.iter().any(|q| !q.contains(':')) {
        return Err("a metadata context query must start with a namespace and a colon");
    }
    Ok(req)
}

/// Backend calls may block (they reach the engine), so they run off the async runtime.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ConnError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| ConnError::BackendPanic(what))
}
