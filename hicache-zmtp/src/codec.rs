//! The bytes of ZMTP 3.0 / 3.1 (rfc.zeromq.org specs 23 and 37): the greeting, frames, and the
//! commands a NULL-mechanism server meets (READY, ERROR, PING/PONG, SUBSCRIBE/CANCEL).
//!
//! Pure functions over buffers, no I/O. Decoding is incremental: [`decode_frame`] answers
//! `Ok(None)` when more bytes are needed, and checks a frame's claimed length against the
//! caller's maximum *before* anything is reserved, so a header that claims 2**40 bytes is an
//! error, never an allocation. No input makes these functions panic.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::ZmtpError;

/// The length of a ZMTP 3 greeting.
pub const GREETING_LEN: usize = 64;
/// The length of the greeting's signature (its first part, the one version detection reads).
pub const SIGNATURE_LEN: usize = 10;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
const MECHANISM_NULL: &[u8] = b"NULL";

/// Our greeting: ZMTP 3.1, the NULL mechanism, as-server 0.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    // Padding: libzmq puts 1 (a 2.x-compatible length) in the last padding byte.
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..12 + MECHANISM_NULL.len()].copy_from_slice(MECHANISM_NULL);
    g
}

/// Checks the first [`SIGNATURE_LEN`] bytes of a peer's greeting (`0xFF`, padding, `0x7F`).
pub fn check_signature(sig: &[u8]) -> Result<(), ZmtpError> {
    match sig {
        [0xFF, _, _, _, _, _, _, _, _, 0x7F, ..] => Ok(()),
        _ => Err(ZmtpError::BadSignature),
    }
}

/// A peer's greeting, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Greeting {
    /// The peer's minor version (0 for ZMTP 3.0, 1 for 3.1; later ones speak 3.1 to us).
    pub minor: u8,
}

/// Parses a whole greeting: signature, version 3 or later, the NULL mechanism.
pub fn parse_greeting(g: &[u8]) -> Result<Greeting, ZmtpError> {
    if g.len() < GREETING_LEN {
        return Err(ZmtpError::BadSignature);
    }
    check_signature(&g[..SIGNATURE_LEN])?;
    let (major, minor) = (g[10], g[11]);
    if major < 3 {
        return Err(ZmtpError::Version(major, minor));
    }
    let mechanism = &g[12..32];
    let name_len = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    let (name, pad) = mechanism.split_at(name_len);
    if name != MECHANISM_NULL || pad.iter().any(|&b| b != 0) {
        return Err(ZmtpError::Mechanism(
            String::from_utf8_lossy(name).into_owned(),
        ));
    }
    Ok(Greeting { minor })
}

/// One decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A message frame; `more` says another frame of the same message follows.
    Message {
        /// The MORE flag.
        more: bool,
        /// The frame's body.
        body: Bytes,
    },
    /// A command frame's body (name length, name, data).
    Command(Bytes),
}

/// Decodes one frame from the front of `buf`, or `Ok(None)` when `buf` does not hold a whole
/// one yet. A claimed length over `max_len`, reserved flag bits, or a command with MORE are
/// errors, found from the header alone.
pub fn decode_frame(buf: &mut BytesMut, max_len: usize) -> Result<Option<Frame>, ZmtpError> {
    let Some(&flags) = buf.first() else {
        return Ok(None);
    };
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::Flags(flags));
    }
    let command = flags & FLAG_COMMAND != 0;
    let more = flags & FLAG_MORE != 0;
    if command && more {
        return Err(ZmtpError::CommandWithMore);
    }
    let (header, len) = if flags & FLAG_LONG != 0 {
        let Some(size) = buf.get(1..9) else {
            return Ok(None);
        };
        let mut size_bytes = [0u8; 8];
        size_bytes.copy_from_slice(size);
        (9, u64::from_be_bytes(size_bytes))
    } else {
        let Some(&size) = buf.get(1) else {
            return Ok(None);
        };
        (2, u64::from(size))
    };
    if len > max_len as u64 {
        return Err(ZmtpError::TooLong { len, max: max_len });
    }
    // len <= max_len, a usize.
    let len = len as usize;
    if buf.len() < header + len {
        return Ok(None);
    }
    buf.advance(header);
    let body = buf.split_to(len).freeze();
    Ok(Some(if command {
        Frame::Command(body)
    } else {
        Frame::Message { more, body }
    }))
}

/// Whether a frame whose first byte is `flags` is a command.
pub fn is_command(flags: u8) -> bool {
    flags & FLAG_COMMAND != 0
}

/// Writes the header of a frame of `len` bytes (the short form up to 255 bytes).
fn put_header(out: &mut BytesMut, flags: u8, len: usize) {
    if len <= usize::from(u8::MAX) {
        out.reserve(2 + len);
        out.put_u8(flags);
        out.put_u8(len as u8);
    } else {
        out.reserve(9 + len);
        out.put_u8(flags | FLAG_LONG);
        out.put_u64(len as u64);
    }
}

/// Writes the header of a message frame of `len` bytes (MORE when `more`); its body follows
/// separately (so that a shared body is never copied).
pub fn encode_frame_header(more: bool, len: usize, out: &mut BytesMut) {
    let flags = if more { FLAG_MORE } else { 0 };
    if len <= usize::from(u8::MAX) {
        out.put_u8(flags);
        out.put_u8(len as u8);
    } else {
        out.put_u8(flags | FLAG_LONG);
        out.put_u64(len as u64);
    }
}

/// Writes one frame's header and body.
fn put_frame(out: &mut BytesMut, flags: u8, body: &[u8]) {
    put_header(out, flags, body.len());
    out.put_slice(body);
}

/// Appends a message (one frame per element, MORE on all but the last) to `out`. An empty
/// slice appends nothing.
pub fn encode_message<B: AsRef<[u8]>>(frames: &[B], out: &mut BytesMut) {
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        put_frame(out, more, f.as_ref());
    }
}

/// Appends a command frame (`name` at most 255 bytes) with `data` to `out`.
pub fn encode_command(name: &str, data: &[u8], out: &mut BytesMut) {
    let name = &name.as_bytes()[..name.len().min(255)];
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(data);
    put_frame(out, FLAG_COMMAND, &body);
}

/// The READY command with its metadata (`Socket-Type`, and `Identity` when given).
pub fn encode_ready(socket_type: &str, identity: Option<&[u8]>, out: &mut BytesMut) {
    let mut data = Vec::new();
    let mut prop = |name: &str, value: &[u8]| {
        data.push(name.len() as u8);
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&(value.len() as u32).to_be_bytes());
        data.extend_from_slice(value);
    };
    prop("Socket-Type", socket_type.as_bytes());
    if let Some(id) = identity {
        prop("Identity", id);
    }
    encode_command("READY", &data, out);
}

/// A command the servers understand; anything else is [`Command::Other`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// The handshake's READY: its metadata properties.
    Ready(Metadata),
    /// The peer gave up: its reason.
    Error(String),
    /// A heartbeat (3.1): the context to echo in the PONG.
    Ping(Bytes),
    /// A heartbeat's answer.
    Pong,
    /// A topic-prefix subscription (3.1).
    Subscribe(Bytes),
    /// A subscription withdrawn (3.1).
    Cancel(Bytes),
    /// A command these servers ignore (its name).
    Other(Bytes),
}

/// The metadata properties of a READY command.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Metadata {
    /// `Socket-Type` (ASCII, e.g. `SUB`, `DEALER`).
    pub socket_type: Option<String>,
    /// `Identity` (a ROUTER's routing id for this peer; may be empty).
    pub identity: Option<Bytes>,
}

/// Parses a command frame's body.
pub fn parse_command(body: &Bytes) -> Result<Command, ZmtpError> {
    let Some(&name_len) = body.first() else {
        return Err(ZmtpError::Command("empty command frame"));
    };
    let name_end = 1 + usize::from(name_len);
    if body.len() < name_end {
        return Err(ZmtpError::Command("command name runs past the frame"));
    }
    let name = &body[1..name_end];
    let data = body.slice(name_end..);
    Ok(match name {
        b"READY" => Command::Ready(parse_metadata(&data)?),
        b"ERROR" => {
            let reason = match data.split_first() {
                Some((&n, rest)) if rest.len() >= usize::from(n) => &rest[..usize::from(n)],
                _ => return Err(ZmtpError::Command("ERROR reason runs past the frame")),
            };
            Command::Error(String::from_utf8_lossy(reason).into_owned())
        }
        b"PING" => {
            if data.len() < 2 {
                return Err(ZmtpError::Command("PING without its TTL"));
            }
            let context = data.slice(2..);
            if context.len() > 16 {
                return Err(ZmtpError::Command("PING context over 16 bytes"));
            }
            Command::Ping(context)
        }
        b"PONG" => Command::Pong,
        b"SUBSCRIBE" => Command::Subscribe(data),
        b"CANCEL" => Command::Cancel(data),
        _ => Command::Other(body.slice(1..name_end)),
    })
}

/// Parses READY's properties: `name-len name value-len(4 BE) value`, repeated. Names compare
/// case-insensitively; unknown ones are skipped.
fn parse_metadata(mut data: &[u8]) -> Result<Metadata, ZmtpError> {
    let mut m = Metadata::default();
    while let Some((&n, rest)) = data.split_first() {
        let n = usize::from(n);
        if n == 0 || rest.len() < n + 4 {
            return Err(ZmtpError::Command("READY property runs past the frame"));
        }
        let (name, rest) = rest.split_at(n);
        let (len, rest) = rest.split_at(4);
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        if rest.len() < len {
            return Err(ZmtpError::Command(
                "READY property value runs past the frame",
            ));
        }
        let (value, rest) = rest.split_at(len);
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            m.socket_type = Some(String::from_utf8_lossy(value).into_owned());
        } else if name.eq_ignore_ascii_case(b"Identity") {
            m.identity = Some(Bytes::copy_from_slice(value));
        }
        data = rest;
    }
    Ok(m)
}

/// A PING (ZMTP 3.1) asking the peer to consider us dead after `ttl` (in tenths of a second,
/// at most 6553.5 s) without traffic, with `context` (at most 16 bytes) to echo.
pub fn encode_ping(ttl: std::time::Duration, context: &[u8], out: &mut BytesMut) {
    let tenths = u16::try_from(ttl.as_millis() / 100).unwrap_or(u16::MAX);
    let mut data = tenths.to_be_bytes().to_vec();
    data.extend_from_slice(&context[..context.len().min(16)]);
    encode_command("PING", &data, out);
}

/// A PONG answering a PING's `context`.
pub fn encode_pong(context: &[u8], out: &mut BytesMut) {
    encode_command("PONG", context, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(buf: &mut BytesMut, max: usize) -> Result<Vec<Frame>, ZmtpError> {
        let mut out = Vec::new();
        while let Some(f) = decode_frame(buf, max)? {
            out.push(f);
        }
        Ok(out)
    }

    #[test]
    fn our_greeting_parses_and_bad_ones_do_not() {
        assert_eq!(parse_greeting(&greeting()).unwrap(), Greeting { minor: 1 });
        let mut g = greeting();
        g[0] = 0x00;
        assert!(matches!(parse_greeting(&g), Err(ZmtpError::BadSignature)));
        let mut g = greeting();
        g[10] = 2;
        assert!(matches!(parse_greeting(&g), Err(ZmtpError::Version(2, 1))));
        let mut g = greeting();
        g[12..17].copy_from_slice(b"PLAIN");
        assert!(matches!(parse_greeting(&g), Err(ZmtpError::Mechanism(m)) if m == "PLAIN"));
        let mut g = greeting();
        g[20] = b'X';
        assert!(matches!(parse_greeting(&g), Err(ZmtpError::Mechanism(_))));
        assert!(parse_greeting(&g[..63]).is_err());
    }

    #[test]
    fn a_header_claiming_a_terabyte_is_refused_before_any_reservation() {
        let mut buf = BytesMut::new();
        buf.put_u8(FLAG_LONG);
        buf.put_u64(1 << 40);
        let before = buf.capacity();
        let e = decode_frame(&mut buf, 4096).unwrap_err();
        assert!(
            matches!(e, ZmtpError::TooLong { len, max: 4096 } if len == 1 << 40),
            "{e}"
        );
        assert_eq!(buf.capacity(), before);
        let mut buf = BytesMut::from(&[FLAG_LONG | FLAG_COMMAND, 0xFF, 0xFF, 0xFF][..]);
        // A header cut short: more bytes needed, not yet an error.
        assert_eq!(decode_frame(&mut buf, 4096).unwrap(), None);
        buf.put_slice(&[0xFF; 5]);
        assert!(decode_frame(&mut buf, 4096).is_err());
    }

    #[test]
    fn reserved_flags_and_commands_with_more_are_errors() {
        let mut buf = BytesMut::from(&[0x08u8, 0][..]);
        assert!(matches!(
            decode_frame(&mut buf, 10),
            Err(ZmtpError::Flags(8))
        ));
        let mut buf = BytesMut::from(&[FLAG_COMMAND | FLAG_MORE, 0][..]);
        assert!(matches!(
            decode_frame(&mut buf, 10),
            Err(ZmtpError::CommandWithMore)
        ));
    }

    #[test]
    fn commands_parse() {
        let mut buf = BytesMut::new();
        encode_ready("DEALER", Some(b"me"), &mut buf);
        encode_command("PING", &[0, 10, b'c', b'x'], &mut buf);
        encode_command("SUBSCRIBE", b"kv", &mut buf);
        encode_command("CANCEL", b"kv", &mut buf);
        encode_command("ERROR", &[3, b'b', b'a', b'd'], &mut buf);
        encode_command("HELLO", b"", &mut buf);
        let cmds: Vec<Command> = decode_all(&mut buf, 4096)
            .unwrap()
            .into_iter()
            .map(|f| match f {
                Frame::Command(b) => parse_command(&b).unwrap(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            cmds,
            vec![
                Command::Ready(Metadata {
                    socket_type: Some("DEALER".into()),
                    identity: Some(Bytes::from_static(b"me")),
                }),
                Command::Ping(Bytes::from_static(b"cx")),
                Command::Subscribe(Bytes::from_static(b"kv")),
                Command::Cancel(Bytes::from_static(b"kv")),
                Command::Error("bad".into()),
                Command::Other(Bytes::from_static(b"HELLO")),
            ]
        );
        // Metadata names are case-insensitive.
        let mut data = vec![11u8];
        data.extend_from_slice(b"socket-type");
        data.extend_from_slice(&3u32.to_be_bytes());
        data.extend_from_slice(b"SUB");
        let mut buf = BytesMut::new();
        encode_command("READY", &data, &mut buf);
        let Some(Frame::Command(b)) = decode_frame(&mut buf, 4096).unwrap() else {
            panic!()
        };
        assert_eq!(
            parse_command(&b).unwrap(),
            Command::Ready(Metadata {
                socket_type: Some("SUB".into()),
                identity: None
            })
        );
    }

    #[test]
    fn split_headers_encode_like_whole_frames_and_pings_parse() {
        for len in [0usize, 1, 255, 256, 70_000] {
            let body = vec![7u8; len];
            let mut whole = BytesMut::new();
            encode_message(&[&body[..], &body[..]], &mut whole);
            let mut split = BytesMut::new();
            encode_frame_header(true, len, &mut split);
            split.put_slice(&body);
            encode_frame_header(false, len, &mut split);
            split.put_slice(&body);
            assert_eq!(whole, split, "{len}");
        }
        let mut buf = BytesMut::new();
        encode_ping(std::time::Duration::from_secs(15), b"ctx", &mut buf);
        let Some(Frame::Command(b)) = decode_frame(&mut buf, 64).unwrap() else {
            panic!()
        };
        assert!(is_command(0x04) && !is_command(0x01));
        assert_eq!(
            parse_command(&b).unwrap(),
            Command::Ping(Bytes::from_static(b"ctx"))
        );
    }

    #[test]
    fn every_truncation_of_a_ready_body_is_an_error_or_a_command() {
        let mut buf = BytesMut::new();
        encode_ready("SUB", Some(&[7; 40]), &mut buf);
        let Some(Frame::Command(body)) = decode_frame(&mut buf, 4096).unwrap() else {
            panic!()
        };
        for n in 0..body.len() {
            let _ = parse_command(&body.slice(..n));
        }
    }

    fn frames_strategy() -> impl Strategy<Value = Vec<Vec<u8>>> {
        prop::collection::vec(
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..8),
                prop::collection::vec(any::<u8>(), 250..260),
                prop::collection::vec(any::<u8>(), 0..600),
            ],
            1..6,
        )
    }

    proptest! {
        #[test]
        fn messages_round_trip(frames in frames_strategy()) {
            let mut buf = BytesMut::new();
            encode_message(&frames, &mut buf);
            let got = decode_all(&mut buf, 1024).unwrap();
            prop_assert!(buf.is_empty());
            prop_assert_eq!(got.len(), frames.len());
            for (i, (f, want)) in got.iter().zip(&frames).enumerate() {
                let Frame::Message { more, body } = f else {
                    return Err(TestCaseError::fail("a command"));
                };
                prop_assert_eq!(*more, i + 1 < frames.len());
                prop_assert_eq!(&body[..], &want[..]);
            }
        }

        #[test]
        fn every_truncation_needs_more_or_decodes_a_prefix(frames in frames_strategy()) {
            let mut whole = BytesMut::new();
            encode_ready("SUB", None, &mut whole);
            encode_message(&frames, &mut whole);
            for cut in 0..whole.len() {
                let mut buf = BytesMut::from(&whole[..cut]);
                let got = decode_all(&mut buf, 1024).unwrap();
                // Never the whole stream, never a partial frame.
                prop_assert!(got.len() < frames.len() + 1);
                for f in got {
                    if let Frame::Command(b) = f {
                        prop_assert!(parse_command(&b).is_ok());
                    }
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut buf = BytesMut::from(&data[..]);
            while let Ok(Some(f)) = decode_frame(&mut buf, 64) {
                if let Frame::Command(b) = f {
                    let _ = parse_command(&b);
                }
            }
            let _ = parse_greeting(&data);
            let _ = parse_command(&Bytes::from(data));
        }

        #[test]
        fn frames_over_the_limit_are_refused(len in 65usize..5000) {
            let mut buf = BytesMut::new();
            encode_message(&[vec![0u8; len]], &mut buf);
            let is_too_long = matches!(decode_frame(&mut buf, 64), Err(ZmtpError::TooLong { .. }));
            prop_assert!(is_too_long);
        }
    }
}
