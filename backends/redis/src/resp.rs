//! A small RESP2 / RESP3 reader and the encoding of commands, for the data path's own
//! connections ([`conn`](crate::conn)).
//!
//! [`parse`] reads one complete reply from the front of a byte buffer and says how many bytes
//! it took, or that more bytes are needed (`Ok(None)`); it never reads past the reply and
//! never trusts a length: bulk strings above [`Limits::max_bulk`], aggregates above
//! [`Limits::max_elements`], nesting deeper than [`Limits::max_depth`] and lines longer than
//! [`MAX_LINE`] are errors, as are unknown type bytes, lines not ended by CRLF and numbers that
//! do not parse. [`parse_bulk_head`] reads only the `$len` line in front of a bulk string, so a
//! page's bytes can be read straight into the caller's buffer instead of into a frame.
//!
//! Invariant: no length read from the wire sizes an allocation. A claimed length is checked
//! against its [`Limits`] bound before anything is buffered for it, aggregates get a capacity
//! of at most 1024 up front and grow only with the elements that actually arrived, and the
//! connection ([`conn`](crate::conn)) buffers at most [`Limits::max_reply`] bytes of one reply.
//! Each command's reply is read with the limits of what that command can legitimately return
//! ([`Limits::reply`], [`Limits::control`], [`Limits::scan`]).

use thiserror::Error;

/// Longest line (simple string, error, number) accepted, CRLF excluded.
pub const MAX_LINE: usize = 64 * 1024;

/// Bounds on what a reply may claim.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest bulk string.
    pub max_bulk: usize,
    /// Most elements of one array, set, push or map (a map's pairs count twice).
    pub max_elements: usize,
    /// Deepest nesting of aggregates.
    pub max_depth: usize,
    /// Most bytes of one reply held in the connection's buffer at once (a page body read
    /// straight into the caller's buffer is not held there).
    pub max_reply: usize,
}

/// Largest bulk string of a reply that carries no page value (a `GETRANGE` header, an error, a
/// key of `SCAN`, `INFO`, `CONFIG GET`).
pub const SMALL_BULK: usize = 1 << 20;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_bulk: 512 << 20,
            max_elements: 1 << 20,
            max_depth: 16,
            max_reply: (512 << 20) + (64 << 10),
        }
    }
}

impl Limits {
    /// A reply to a data command that carries no page (`EXISTS`, `DEL`, `SET`, `GETRANGE`,
    /// `WAIT`, `ASKING`, or an error reply instead of a page): no aggregate of more than 16
    /// elements, bulks of at most [`SMALL_BULK`].
    pub const fn reply() -> Self {
        Self {
            max_bulk: SMALL_BULK,
            max_elements: 16,
            max_depth: 4,
            max_reply: SMALL_BULK + (64 << 10),
        }
    }

    /// A control reply (`INFO`, `CONFIG GET`, `CLUSTER SLOTS`, `AUTH`): a slot map has at most
    /// 16384 ranges of a few nodes each.
    pub const fn control() -> Self {
        Self {
            max_bulk: SMALL_BULK,
            max_elements: 16384 + 64,
            max_depth: 6,
            max_reply: 16 << 20,
        }
    }

    /// A reply to `SCAN … COUNT count`: a cursor and an array of keys. `COUNT` is a hint the
    /// server may exceed by the keys of the buckets it visited; 16 times it is allowed.
    pub const fn scan(count: usize) -> Self {
        Self {
            max_bulk: 64 << 10,
            max_elements: count.saturating_mul(16),
            max_depth: 3,
            max_reply: 16 << 20,
        }
    }
}

/// One reply.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    /// `+…` (RESP3 big numbers `(…` and doubles `,…` are kept as their text too).
    Simple(String),
    /// `-…` or a RESP3 blob error `!len`.
    Error(String),
    /// `:…`.
    Int(i64),
    /// `$len` (and RESP3 verbatim strings `=len`, without their 3-letter format).
    Bulk(Vec<u8>),
    /// `$-1`, `*-1` or RESP3 `_`.
    Nil,
    /// RESP3 `#t` / `#f`.
    Bool(bool),
    /// `*n`, RESP3 sets `~n` and pushes `>n`.
    Array(Vec<Frame>),
    /// RESP3 `%n`.
    Map(Vec<(Frame, Frame)>),
}

/// Why bytes are not a reply.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum RespError {
    /// A type byte RESP does not have (garbage on the connection).
    #[error("not a RESP reply: type byte 0x{byte:02x} ({}) at offset {offset} of the reply", show(*byte))]
    BadType {
        /// The byte.
        byte: u8,
        /// Where it is, from the start of the reply.
        offset: usize,
    },
    /// A line or length that is not what RESP says.
    #[error("malformed RESP {what}: {detail}")]
    Malformed {
        /// What was being read.
        what: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// A length above the configured bound.
    #[error("RESP {what} of {len} exceeds the limit of {max}")]
    TooLarge {
        /// What claimed the length.
        what: &'static str,
        /// The length claimed.
        len: u64,
        /// The bound.
        max: u64,
    },
    /// Aggregates nested too deep.
    #[error("RESP aggregates nested deeper than {0}")]
    TooDeep(usize),
}

/// A byte as a character where it prints, else `?`.
fn show(b: u8) -> String {
    if b.is_ascii_graphic() {
        format!("{:?}", b as char)
    } else {
        "non-printing".to_string()
    }
}

fn malformed(what: &'static str, detail: impl Into<String>) -> RespError {
    RespError::Malformed {
        what,
        detail: detail.into(),
    }
}

/// What the front of a buffer says about the next reply, for [`parse_bulk_head`] and
/// [`parse_array_head`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Head {
    /// A bulk string of this many bytes (then CRLF), or an array of this many elements,
    /// follows.
    Len(usize),
    /// A nil reply, whole (`$-1`, `*-1` or `_`): the bytes taken are the reply.
    Nil,
    /// Another kind of reply: nothing taken; read it with [`parse`].
    Other,
}

/// The name [`parse_bulk_head`]'s result had before arrays shared it; kept for callers.
pub type BulkHead = Head;

/// Reads the head of the next reply: for a bulk string its `$len` line (the bytes taken are
/// that line only), for a nil the whole nil. `Ok(None)`: more bytes are needed.
pub fn parse_bulk_head(buf: &[u8], limits: &Limits) -> Result<Option<(Head, usize)>, RespError> {
    parse_head(buf, b'$', "bulk length", limits.max_bulk, "bulk string")
}

/// Reads the head of the next reply: for an array (`*n`) its head line only (the elements
/// follow), for a nil the whole nil. `n` above [`Limits::max_elements`] is an error.
/// `Ok(None)`: more bytes are needed.
pub fn parse_array_head(buf: &[u8], limits: &Limits) -> Result<Option<(Head, usize)>, RespError> {
    parse_head(
        buf,
        b'*',
        "aggregate length",
        limits.max_elements,
        "aggregate",
    )
}

/// The head of a reply of type `marker` whose length line is `length_what` and bounded by
/// `max` (`bound_what` in the error), or a nil (`_` or a length of -1) whole; any other
/// reply is [`Head::Other`] with nothing taken.
fn parse_head(
    buf: &[u8],
    marker: u8,
    length_what: &'static str,
    max: usize,
    bound_what: &'static str,
) -> Result<Option<(Head, usize)>, RespError> {
    let Some(&t) = buf.first() else {
        return Ok(None);
    };
    if t != marker && t != b'_' {
        return Ok(Some((Head::Other, 0)));
    }
    let mut c = Cursor { buf, pos: 1 };
    let Some(line) = c.line()? else {
        return Ok(None);
    };
    if t == b'_' {
        if !line.is_empty() {
            return Err(malformed("null", "`_` followed by bytes"));
        }
        return Ok(Some((Head::Nil, c.pos)));
    }
    match length(line, length_what)? {
        None => Ok(Some((Head::Nil, c.pos))),
        Some(n) => {
            check(n, max, bound_what)?;
            Ok(Some((Head::Len(n as usize), c.pos)))
        }
    }
}

/// Parses one reply from the front of `buf`: the reply and the bytes it took, or `Ok(None)`
/// where `buf` holds only part of it.
pub fn parse(buf: &[u8], limits: &Limits) -> Result<Option<(Frame, usize)>, RespError> {
    let mut c = Cursor { buf, pos: 0 };
    Ok(c.frame(limits, 0)?.map(|f| (f, c.pos)))
}

/// `Some(n)` for a length `n ≥ 0`, `None` for `-1`, an error otherwise.
fn length(line: &[u8], what: &'static str) -> Result<Option<u64>, RespError> {
    if line == b"-1" {
        return Ok(None);
    }
    if line.is_empty() || line.len() > 19 || !line.iter().all(u8::is_ascii_digit) {
        return Err(malformed(
            what,
            format!("{:?} is not a length", String::from_utf8_lossy(line)),
        ));
    }
    // At most 19 ASCII digits: fits in a u64.
    Ok(Some(
        line.iter().fold(0u64, |a, d| a * 10 + u64::from(d - b'0')),
    ))
}

fn check(n: u64, max: usize, what: &'static str) -> Result<(), RespError> {
    if n > max as u64 {
        return Err(RespError::TooLarge {
            what,
            len: n,
            max: max as u64,
        });
    }
    Ok(())
}

fn text(line: &[u8]) -> String {
    String::from_utf8_lossy(line).into_owned()
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// The line at the cursor without its CRLF, and the cursor past it.
    fn line(&mut self) -> Result<Option<&'a [u8]>, RespError> {
        let rest = &self.buf[self.pos..];
        let window = &rest[..rest.len().min(MAX_LINE + 2)];
        match window.iter().position(|b| *b == b'\n') {
            Some(i) => {
                if i == 0 || rest[i - 1] != b'\r' {
                    return Err(malformed("line", "LF without CR"));
                }
                self.pos += i + 1;
                Ok(Some(&rest[..i - 1]))
            }
            None if window.len() > MAX_LINE + 1 => Err(RespError::TooLarge {
                what: "line",
                len: rest.len() as u64,
                max: MAX_LINE as u64,
            }),
            None => Ok(None),
        }
    }

    /// `n` bytes then CRLF.
    fn blob(&mut self, n: usize) -> Result<Option<&'a [u8]>, RespError> {
        let rest = &self.buf[self.pos..];
        if rest.len() < n + 2 {
            return Ok(None);
        }
        if &rest[n..n + 2] != b"\r\n" {
            return Err(malformed("bulk string", "not followed by CRLF"));
        }
        self.pos += n + 2;
        Ok(Some(&rest[..n]))
    }

    fn frame(&mut self, limits: &Limits, depth: usize) -> Result<Option<Frame>, RespError> {
        let Some(&t) = self.buf.get(self.pos) else {
            return Ok(None);
        };
        if !b"+-:$*_#,(!=%~>|".contains(&t) {
            return Err(RespError::BadType {
                byte: t,
                offset: self.pos,
            });
        }
        self.pos += 1;
        let Some(line) = self.line()? else {
            return Ok(None);
        };
        Ok(Some(match t {
            b'+' | b',' | b'(' => Frame::Simple(text(line)),
            b'-' => Frame::Error(text(line)),
            b':' => Frame::Int(
                std::str::from_utf8(line)
                    .ok()
                    .filter(|s| !s.starts_with('+'))
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| malformed("integer", format!("{:?}", text(line))))?,
            ),
            b'_' if line.is_empty() => Frame::Nil,
            b'_' => return Err(malformed("null", "`_` followed by bytes")),
            b'#' => match line {
                b"t" => Frame::Bool(true),
                b"f" => Frame::Bool(false),
                _ => return Err(malformed("boolean", format!("{:?}", text(line)))),
            },
            b'$' | b'!' | b'=' => {
                let Some(n) = length(line, "bulk length")? else {
                    if t == b'$' {
                        return Ok(Some(Frame::Nil));
                    }
                    return Err(malformed("blob length", "-1 is only valid for `$`"));
                };
                check(n, limits.max_bulk, "bulk string")?;
                let Some(b) = self.blob(n as usize)? else {
                    return Ok(None);
                };
                match t {
                    b'$' => Frame::Bulk(b.to_vec()),
                    b'!' => Frame::Error(text(b)),
                    _ if b.len() >= 4 && b[3] == b':' => Frame::Bulk(b[4..].to_vec()),
                    _ => return Err(malformed("verbatim string", "no `fmt:` prefix")),
                }
            }
            _ => {
                // Aggregates: `*` `~` `>` (n frames), `%` `|` (n pairs).
                let Some(n) = length(line, "aggregate length")? else {
                    if t == b'*' {
                        return Ok(Some(Frame::Nil));
                    }
                    return Err(malformed("aggregate length", "-1 is only valid for `*`"));
                };
                let pairs = matches!(t, b'%' | b'|');
                let count = if pairs { n.saturating_mul(2) } else { n };
                check(count, limits.max_elements, "aggregate")?;
                if depth + 1 > limits.max_depth {
                    return Err(RespError::TooDeep(limits.max_depth));
                }
                // Capacity grows with what arrives, not with what the length claims.
                let mut items = Vec::with_capacity((count as usize).min(1024));
                for _ in 0..count {
                    match self.frame(limits, depth + 1)? {
                        Some(f) => items.push(f),
                        None => return Ok(None),
                    }
                }
                match t {
                    b'%' | b'|' => {
                        let mut it = items.into_iter();
                        // Sized by what arrived (bounded by the buffer), not by the claim.
                        let mut map = Vec::with_capacity(it.len() / 2);
                        while let (Some(k), Some(v)) = (it.next(), it.next()) {
                            map.push((k, v));
                        }
                        if t == b'|' {
                            // An attribute annotates the reply that follows it: return that.
                            // Counted as a level of nesting, so a run of attributes cannot
                            // recurse deeper than `max_depth`.
                            return self.frame(limits, depth + 1);
                        }
                        Frame::Map(map)
                    }
                    _ => Frame::Array(items),
                }
            }
        }))
    }
}

/// Appends `*n` (the head of a command of `n` arguments).
pub fn put_array_head(out: &mut Vec<u8>, n: usize) {
    out.push(b'*');
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends the head of a bulk string argument of `len` bytes (`$len` CRLF); its bytes and a
/// CRLF must follow.
pub fn put_bulk_head(out: &mut Vec<u8>, len: usize) {
    out.push(b'$');
    out.extend_from_slice(len.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends one whole bulk string argument.
pub fn put_bulk(out: &mut Vec<u8>, arg: &[u8]) {
    put_bulk_head(out, arg.len());
    out.extend_from_slice(arg);
    out.extend_from_slice(b"\r\n");
}

/// Appends a whole command.
pub fn put_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    put_array_head(out, args.len());
    for a in args {
        put_bulk(out, a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode(f: &Frame, out: &mut Vec<u8>) {
        match f {
            Frame::Simple(s) => out.extend_from_slice(format!("+{s}\r\n").as_bytes()),
            Frame::Error(s) => out.extend_from_slice(format!("-{s}\r\n").as_bytes()),
            Frame::Int(i) => out.extend_from_slice(format!(":{i}\r\n").as_bytes()),
            Frame::Bulk(b) => put_bulk(out, b),
            Frame::Nil => out.extend_from_slice(b"$-1\r\n"),
            Frame::Bool(b) => out.extend_from_slice(if *b { b"#t\r\n" } else { b"#f\r\n" }),
            Frame::Array(a) => {
                put_array_head(out, a.len());
                for x in a {
                    encode(x, out);
                }
            }
            Frame::Map(m) => {
                out.extend_from_slice(format!("%{}\r\n", m.len()).as_bytes());
                for (k, v) in m {
                    encode(k, out);
                    encode(v, out);
                }
            }
        }
    }

    fn frame() -> impl Strategy<Value = Frame> {
        let line = "[a-zA-Z0-9 :._-]{0,40}";
        let leaf = prop_oneof![
            line.prop_map(Frame::Simple),
            line.prop_map(Frame::Error),
            any::<i64>().prop_map(Frame::Int),
            proptest::collection::vec(any::<u8>(), 0..300).prop_map(Frame::Bulk),
            Just(Frame::Nil),
            any::<bool>().prop_map(Frame::Bool),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Frame::Array),
                proptest::collection::vec((inner.clone(), inner), 0..4).prop_map(Frame::Map),
            ]
        })
    }

    /// Feeds `bytes` in pieces cut at `cuts`, as a connection receives them, and parses
    /// every reply as soon as it is whole.
    fn parse_in_pieces(bytes: &[u8], cuts: &[usize]) -> Result<Vec<Frame>, RespError> {
        let mut ends: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        ends.push(bytes.len());
        ends.sort_unstable();
        let mut have = 0;
        let mut start = 0;
        let mut out = Vec::new();
        for end in ends {
            have = have.max(end);
            while let Some((f, n)) = parse(&bytes[start..have], &Limits::default())? {
                out.push(f);
                start += n;
            }
        }
        assert_eq!(start, bytes.len(), "every byte belongs to a reply");
        Ok(out)
    }

    proptest! {
        #[test]
        fn any_split_of_a_reply_stream_parses_to_the_same_replies(
            frames in proptest::collection::vec(frame(), 1..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut bytes = Vec::new();
            for f in &frames {
                encode(f, &mut bytes);
            }
            prop_assert_eq!(parse_in_pieces(&bytes, &cuts).unwrap(), frames);
        }

        #[test]
        fn a_truncated_reply_asks_for_more_and_never_misparses(
            f in frame(),
            cut in any::<usize>(),
        ) {
            let mut bytes = Vec::new();
            encode(&f, &mut bytes);
            let cut = cut % bytes.len();
            prop_assert_eq!(parse(&bytes[..cut], &Limits::default()), Ok(None));
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_never_overrun(
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            if let Ok(Some((_, n))) = parse(&bytes, &Limits::default()) {
                prop_assert!(n <= bytes.len());
            }
            if let Ok(Some((_, n))) = parse_bulk_head(&bytes, &Limits::default()) {
                prop_assert!(n <= bytes.len());
            }
        }
    }

    #[test]
    fn resp3_types_are_read() {
        let l = Limits::default();
        let cases: &[(&[u8], Frame)] = &[
            (b"_\r\n", Frame::Nil),
            (b"#t\r\n", Frame::Bool(true)),
            (b",3.25\r\n", Frame::Simple("3.25".into())),
            (
                b"(12345678901234567890\r\n",
                Frame::Simple("12345678901234567890".into()),
            ),
            (b"!5\r\nERR x\r\n", Frame::Error("ERR x".into())),
            (b"=7\r\ntxt:abc\r\n", Frame::Bulk(b"abc".to_vec())),
            (
                b"~2\r\n:1\r\n:2\r\n",
                Frame::Array(vec![Frame::Int(1), Frame::Int(2)]),
            ),
            (
                b">1\r\n+x\r\n",
                Frame::Array(vec![Frame::Simple("x".into())]),
            ),
            (b"|1\r\n+k\r\n+v\r\n:7\r\n", Frame::Int(7)),
            (b"*-1\r\n", Frame::Nil),
            (b"$0\r\n\r\n", Frame::Bulk(Vec::new())),
        ];
        for (bytes, want) in cases {
            assert_eq!(
                parse(bytes, &l),
                Ok(Some((want.clone(), bytes.len()))),
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
        assert_eq!(
            parse_bulk_head(b"$8\r\nabcdefgh\r\n", &l),
            Ok(Some((Head::Len(8), 4)))
        );
        assert_eq!(parse_bulk_head(b"$-1\r\n", &l), Ok(Some((Head::Nil, 5))));
        assert_eq!(parse_bulk_head(b"_\r\n", &l), Ok(Some((Head::Nil, 3))));
        assert_eq!(parse_bulk_head(b"-MOVED", &l), Ok(Some((Head::Other, 0))));
        assert_eq!(parse_bulk_head(b"$12", &l), Ok(None));
    }

    #[test]
    fn hostile_replies_are_clear_errors() {
        let l = Limits {
            max_bulk: 1 << 20,
            max_elements: 100,
            max_depth: 3,
            max_reply: 2 << 20,
        };
        let err = |b: &[u8]| parse(b, &l).unwrap_err().to_string();
        assert!(err(b"HTTP/1.1 400 Bad Request\r\n").contains("type byte 0x48"));
        assert!(err(b"\x00\x01").contains("type byte 0x00"));
        assert!(err(b"$99999999999\r\n").contains("exceeds the limit"));
        assert!(err(b"*101\r\n").contains("exceeds the limit"));
        assert!(err(b"%51\r\n").contains("exceeds the limit"));
        assert!(err(b"*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n").contains("deeper than 3"));
        assert!(err(b"$-2\r\n").contains("not a length"));
        assert!(err(b"$+5\r\nabcde\r\n").contains("not a length"));
        assert!(err(b"$99999999999999999999\r\n").contains("not a length"));
        assert!(err(b":12a\r\n").contains("integer"));
        assert!(err(b"+OK\n").contains("LF without CR"));
        assert!(err(b"$3\r\nabcXY").contains("CRLF"));
        assert!(err(b"#x\r\n").contains("boolean"));
        assert!(err(b"_x\r\n").contains("null"));
        assert!(err(b"~-1\r\n").contains("only valid"));
        let mut long = b"+".to_vec();
        long.extend(std::iter::repeat_n(b'a', MAX_LINE + 10));
        assert!(err(&long).contains("line"));
        assert!(
            parse_bulk_head(b"$2000000\r\n", &l)
                .unwrap_err()
                .to_string()
                .contains("exceeds the limit")
        );
        // A claimed length is not an allocation: a huge array that never arrives is Ok(None).
        let big = Limits::default();
        assert_eq!(parse(b"*1000000\r\n:1\r\n", &big), Ok(None));
        // A run of attributes is bounded by the depth, not by the stack.
        let attrs = b"|1\r\n+k\r\n+v\r\n".repeat(100_000);
        assert!(matches!(parse(&attrs, &big), Err(RespError::TooDeep(16))));
        // Garbage names its byte and where it is.
        assert_eq!(
            parse(b"*2\r\n:1\r\nX", &big).unwrap_err().to_string(),
            "not a RESP reply: type byte 0x58 ('X') at offset 8 of the reply"
        );
    }

    #[test]
    fn each_reply_kind_has_its_bound() {
        let tb = b"$1000000000000\r\n";
        for l in [Limits::reply(), Limits::control(), Limits::scan(1024)] {
            assert!(matches!(
                parse(tb, &l),
                Err(RespError::TooLarge {
                    len: 1_000_000_000_000,
                    ..
                })
            ));
        }
        assert!(matches!(
            parse(b"*17\r\n", &Limits::reply()),
            Err(RespError::TooLarge {
                what: "aggregate",
                ..
            })
        ));
        assert!(matches!(
            parse(b"*16385\r\n", &Limits::scan(1024)),
            Err(RespError::TooLarge {
                what: "aggregate",
                ..
            })
        ));
        assert_eq!(parse(b"*16384\r\n", &Limits::scan(1024)), Ok(None));
        assert!(parse(b"%9000\r\n", &Limits::control()).is_err());
    }

    #[test]
    fn commands_encode_as_resp_arrays() {
        let mut out = Vec::new();
        put_command(&mut out, &[b"GET", b"k1"]);
        assert_eq!(out, b"*2\r\n$3\r\nGET\r\n$2\r\nk1\r\n");
        let (f, n) = parse(&out, &Limits::default()).unwrap().unwrap();
        assert_eq!(n, out.len());
        assert_eq!(
            f,
            Frame::Array(vec![
                Frame::Bulk(b"GET".to_vec()),
                Frame::Bulk(b"k1".to_vec())
            ])
        );
    }
}
