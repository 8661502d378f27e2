//! Plugin-side logging: a `tracing` subscriber that forwards events to the host's log
//! callback.
//!
//! A plugin library has its own copy of `tracing` and so its own dispatcher; without this, its
//! events would go nowhere. The SDK installs a [`Forwarder`] as the thread's default dispatcher
//! for the duration of every ABI call, and on the threads of the plugin's runtime. Spans are
//! not forwarded (the host's spans cannot be reached from here); events are, with their fields
//! rendered as ` name=value` after the message.
//!
//! Invariants:
//! 1. The host callback and its context are valid for the life of the process and callable
//!    from any thread (header §2–3), so a [`HostSink`] may be shared and kept anywhere.
//! 2. No recursion: when the SDK is linked into the host itself (tests), the host callback
//!    re-emits the record through `tracing`, which would reach the forwarder again; a
//!    thread-local flag drops such nested records.

use std::cell::Cell;
use std::ffi::{c_char, c_void};
use std::fmt::Write as _;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use crate::abi;

/// The host's log callback, its context and the most verbose level it records.
#[derive(Copy, Clone, Debug)]
pub(crate) struct HostSink {
    log: abi::LogFn,
    ctx: *mut c_void,
    max_level: i32,
}

// SAFETY: invariant 1: the callback is thread-safe and its context lives for the whole process.
unsafe impl Send for HostSink {}
// SAFETY: as above.
unsafe impl Sync for HostSink {}

thread_local! {
    static FORWARDING: Cell<bool> = const { Cell::new(false) };
}

fn level_code(l: &Level) -> i32 {
    match *l {
        Level::ERROR => abi::LOG_ERROR,
        Level::WARN => abi::LOG_WARN,
        Level::INFO => abi::LOG_INFO,
        Level::DEBUG => abi::LOG_DEBUG,
        _ => abi::LOG_TRACE,
    }
}

impl HostSink {
    pub(crate) fn new(log: abi::LogFn, ctx: *mut c_void, max_level: i32) -> Self {
        Self {
            log,
            ctx,
            max_level,
        }
    }

    /// Sends one record to the host.
    pub(crate) fn send(&self, level: i32, target: &str, message: &str) {
        if level > self.max_level {
            return;
        }
        // SAFETY: invariant 1; the strings are valid for their lengths during the call.
        unsafe {
            (self.log)(
                self.ctx,
                level,
                target.as_ptr().cast::<c_char>(),
                target.len() as u64,
                message.as_ptr().cast::<c_char>(),
                message.len() as u64,
            );
        }
    }
}

/// The subscriber that forwards events to a [`HostSink`].
pub(crate) struct Forwarder {
    sink: HostSink,
}

impl Forwarder {
    pub(crate) fn new(sink: HostSink) -> Self {
        Self { sink }
    }
}

struct Render(String);

impl Visit for Render {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.insert_str(0, value);
        } else {
            let _ = write!(self.0, " {}={}", field.name(), value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0.insert_str(0, &format!("{value:?}"));
        } else {
            let _ = write!(self.0, " {}={:?}", field.name(), value);
        }
    }
}

impl Subscriber for Forwarder {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        level_code(metadata.level()) <= self.sink.max_level
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(match self.sink.max_level {
            i32::MIN..=0 => LevelFilter::OFF,
            abi::LOG_ERROR => LevelFilter::ERROR,
            abi::LOG_WARN => LevelFilter::WARN,
            abi::LOG_INFO => LevelFilter::INFO,
            abi::LOG_DEBUG => LevelFilter::DEBUG,
            _ => LevelFilter::TRACE,
        })
    }

    fn new_span(&self, _span: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _span: &Id, _values: &Record<'_>) {}

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        if FORWARDING.with(|f| f.replace(true)) {
            return; // invariant 2
        }
        let mut r = Render(String::new());
        event.record(&mut r);
        let m = event.metadata();
        self.sink.send(level_code(m.level()), m.target(), &r.0);
        FORWARDING.with(|f| f.set(false));
    }

    fn enter(&self, _span: &Id) {}

    fn exit(&self, _span: &Id) {}
}
