//! [`StorageConfig`]: the backend name plus the extra-config JSON document (SGLang's
//! `--hicache-storage-backend` and `--hicache-storage-backend-extra-config`).
//!
//! # Parsing rules
//!
//! 1. The extra-config is a JSON object, given inline or as `@path` to a file holding one.
//! 2. HiCache-level fields ([`CommonConfig`]) are taken out of it once, here. Everything left
//!    is handed to the chosen backend as [`ConfigFields`], which the backend reads with the
//!    same typed accessors and then [`finish`](ConfigFields::finish)es.
//! 3. Parsing is strict at both levels: an unknown field, a value of the wrong type or one out
//!    of range is an error naming the field and the value. Nothing is silently ignored.
//! 4. The document is strict JSON: a key given twice in one object is an error
//!    ([`parse_strict`](crate::strict_json::parse_strict)), and so is a field whose value is
//!    `null` in any object read field by field (leave a field out for its default). Opaque values
//!    handed on whole (a plugin's `plugin_config`) keep their nulls: they are the plugin's.
//! 5. The backend is named by the caller (the CLI flag) and/or by the extra-config's `backend`
//!    field. With both, they must agree, except that the caller's name `dynamic` (SGLang's
//!    "see extra-config") defers to the document. With neither, it is an error.

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Result, StorageError};

/// The name a caller passes to defer the backend choice to the extra-config's `backend` field.
pub const DYNAMIC_BACKEND: &str = "dynamic";

/// A JSON object whose fields are read one by one with typed, range-checked accessors. Every
/// accessor removes the field it reads; [`finish`](Self::finish) fails on any field left over.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConfigFields {
    scope: String,
    map: Map<String, Value>,
    known: Vec<&'static str>,
}

fn render(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 200 {
        format!("{}…", &s[..s.floor_char_boundary(200)])
    } else {
        s
    }
}

impl ConfigFields {
    /// Wraps an object; `scope` names it in errors (`extra-config`, `backend file`).
    pub fn new(scope: impl Into<String>, map: Map<String, Value>) -> Self {
        Self {
            scope: scope.into(),
            map,
            known: Vec::new(),
        }
    }

    /// The scope named in errors.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// Renames the scope (when the fields move from the document to a backend).
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self.known.clear();
        self
    }

    /// Whether no field is left.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Names of the fields not read yet.
    pub fn remaining(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    /// An error about `field` with value `value`.
    pub fn error(&self, field: &str, value: &Value, reason: impl Into<String>) -> StorageError {
        StorageError::config(&self.scope, field, render(value), reason)
    }

    fn take(&mut self, name: &'static str) -> Option<Value> {
        if !self.known.contains(&name) {
            self.known.push(name);
        }
        match self.map.remove(name) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    /// The raw value of a field, if present and not `null`.
    pub fn opt_value(&mut self, name: &'static str) -> Option<Value> {
        self.take(name)
    }

    /// An optional boolean.
    pub fn opt_bool(&mut self, name: &'static str) -> Result<Option<bool>> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(self.error(name, &v, "expected true or false")),
        }
    }

    /// A boolean with a default.
    pub fn bool(&mut self, name: &'static str, default: bool) -> Result<bool> {
        Ok(self.opt_bool(name)?.unwrap_or(default))
    }

    /// An optional unsigned integer within `range`.
    pub fn opt_u64(
        &mut self,
        name: &'static str,
        range: RangeInclusive<u64>,
    ) -> Result<Option<u64>> {
        let Some(v) = self.take(name) else {
            return Ok(None);
        };
        let n = v
            .as_u64()
            .ok_or_else(|| self.error(name, &v, "expected a non-negative integer"))?;
        if !range.contains(&n) {
            return Err(self.error(
                name,
                &v,
                format!("must be between {} and {}", range.start(), range.end()),
            ));
        }
        Ok(Some(n))
    }

    /// An unsigned integer within `range`, with a default.
    pub fn u64(
        &mut self,
        name: &'static str,
        default: u64,
        range: RangeInclusive<u64>,
    ) -> Result<u64> {
        Ok(self.opt_u64(name, range)?.unwrap_or(default))
    }

    /// An optional finite number within `range` (integers are accepted).
    pub fn opt_f64(
        &mut self,
        name: &'static str,
        range: RangeInclusive<f64>,
    ) -> Result<Option<f64>> {
        let Some(v) = self.take(name) else {
            return Ok(None);
        };
        let x = v
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| self.error(name, &v, "expected a number"))?;
        if !range.contains(&x) {
            return Err(self.error(
                name,
                &v,
                format!("must be between {} and {}", range.start(), range.end()),
            ));
        }
        Ok(Some(x))
    }

    /// A finite number within `range`, with a default.
    pub fn f64(
        &mut self,
        name: &'static str,
        default: f64,
        range: RangeInclusive<f64>,
    ) -> Result<f64> {
        Ok(self.opt_f64(name, range)?.unwrap_or(default))
    }

    /// An optional non-empty string.
    pub fn opt_string(&mut self, name: &'static str) -> Result<Option<String>> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s)),
            Some(v) => Err(self.error(name, &v, "expected a non-empty string")),
        }
    }

    /// A required non-empty string.
    pub fn string(&mut self, name: &'static str) -> Result<String> {
        self.opt_string(name)?
            .ok_or_else(|| StorageError::config(&self.scope, name, "<missing>", "required field"))
    }

    /// An optional filesystem path.
    pub fn opt_path(&mut self, name: &'static str) -> Result<Option<PathBuf>> {
        Ok(self.opt_string(name)?.map(PathBuf::from))
    }

    /// One of `allowed` (case-sensitive), with a default.
    pub fn choice(
        &mut self,
        name: &'static str,
        default: &'static str,
        allowed: &[&'static str],
    ) -> Result<&'static str> {
        let Some(v) = self.take(name) else {
            return Ok(default);
        };
        match v.as_str().and_then(|s| allowed.iter().find(|a| **a == s)) {
            Some(a) => Ok(a),
            None => Err(self.error(name, &v, format!("expected one of {}", allowed.join(", ")))),
        }
    }

    /// An optional byte size: an integer number of bytes or a string such as `"4gb"`,
    /// `"512MiB"`, `"1.5 TB"` (see [`parse_byte_size`]), at least `min`.
    pub fn opt_bytes(&mut self, name: &'static str, min: u64) -> Result<Option<u64>> {
        let Some(v) = self.take(name) else {
            return Ok(None);
        };
        let n = match &v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => parse_byte_size(s),
            _ => None,
        }
        .ok_or_else(|| {
            self.error(
                name,
                &v,
                "expected a byte count: an integer or a string like \"4gb\" or \"512MiB\"",
            )
        })?;
        if n < min {
            return Err(self.error(name, &v, format!("must be at least {min} bytes")));
        }
        Ok(Some(n))
    }

    /// An optional nested object, as its own [`ConfigFields`] scope (`<scope>.<name>`); a
    /// `null` field in it is an error (rule 4).
    pub fn opt_object(&mut self, name: &'static str) -> Result<Option<ConfigFields>> {
        match self.take(name) {
            None => Ok(None),
            Some(Value::Object(m)) => {
                let scope = format!("{}.{}", self.scope, name);
                refuse_nulls(&scope, &m)?;
                Ok(Some(ConfigFields::new(scope, m)))
            }
            Some(v) => Err(self.error(name, &v, "expected an object")),
        }
    }

    /// Fails if any field was not read, naming it and the fields that were expected.
    pub fn finish(self) -> Result<()> {
        let Some((name, v)) = self.map.iter().next() else {
            return Ok(());
        };
        let mut known: Vec<&str> = self.known.clone();
        known.sort_unstable();
        let reason = if known.is_empty() {
            "unknown field (this scope takes no fields)".to_string()
        } else {
            format!("unknown field (known fields: {})", known.join(", "))
        };
        Err(StorageError::config(&self.scope, name, render(v), reason))
    }
}

/// Parses a byte size: digits with an optional fraction and an optional unit, case-insensitive,
/// spaces allowed before the unit. Decimal units `k/kb`, `m/mb`, `g/gb`, `t/tb` are powers of
/// 1000 (SGLang's "4gb" means 4·10⁹); binary units `kib`, `mib`, `gib`, `tib` are powers of
/// 1024; `b` or no unit means bytes. Returns `None` for anything else or on overflow.
pub fn parse_byte_size(s: &str) -> Option<u64> {
    let s = s.trim().to_ascii_lowercase();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() || num.starts_with('.') || num.ends_with('.') {
        return None;
    }
    let mult: u64 = match unit.trim() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return None,
    };
    match num.split_once('.') {
        None => num.parse::<u64>().ok()?.checked_mul(mult),
        Some((int, frac)) => {
            if frac.contains('.') || frac.len() > 9 {
                return None;
            }
            let int: u64 = int.parse().ok()?;
            let scale = 10u64.pow(frac.len() as u32);
            let frac: u64 = frac.parse().ok()?;
            let whole = int.checked_mul(mult)?;
            let part = (frac as u128 * mult as u128 / scale as u128) as u64;
            whole.checked_add(part)
        }
    }
}

/// The HiCache-level fields of the extra-config (SGLang's `prefetch_threshold`,
/// `prefetch_timeout_*` and the like), parsed once for every backend.
#[derive(Clone, Debug, PartialEq)]
pub struct CommonConfig {
    /// Minimum L3 hit, in tokens, that triggers a prefetch (`prefetch_threshold`, default 256).
    pub prefetch_threshold: u64,
    /// Timeout policy: seconds independent of length (`prefetch_timeout_base`, default 2.0).
    pub prefetch_timeout_base: f64,
    /// Timeout policy: seconds per 1024 tokens (`prefetch_timeout_per_ki_token`, default 0.1).
    pub prefetch_timeout_per_ki_token: f64,
    /// Timeout policy: upper bound in seconds (`prefetch_timeout_max`, default 30).
    pub prefetch_timeout_max: f64,
    /// Whether backends receive the prefix keys of a lookup
    /// (`hicache_storage_pass_prefix_keys`, default false).
    pub pass_prefix_keys: bool,
    /// Capacity of the backend in bytes (`capacity`, an integer or `"4gb"`-style string).
    /// `None`: the backend's default.
    pub capacity_bytes: Option<u64>,
}

impl Default for CommonConfig {
    fn default() -> Self {
        Self {
            prefetch_threshold: 256,
            prefetch_timeout_base: 2.0,
            prefetch_timeout_per_ki_token: 0.1,
            prefetch_timeout_max: 30.0,
            pass_prefix_keys: false,
            capacity_bytes: None,
        }
    }
}

impl CommonConfig {
    /// Takes the common fields out of `fields` (which keeps the rest).
    pub fn take_from(fields: &mut ConfigFields) -> Result<Self> {
        let d = Self::default();
        let c = Self {
            prefetch_threshold: fields.u64(
                "prefetch_threshold",
                d.prefetch_threshold,
                0..=(1 << 32),
            )?,
            prefetch_timeout_base: fields.f64(
                "prefetch_timeout_base",
                d.prefetch_timeout_base,
                0.0..=86_400.0,
            )?,
            prefetch_timeout_per_ki_token: fields.f64(
                "prefetch_timeout_per_ki_token",
                d.prefetch_timeout_per_ki_token,
                0.0..=86_400.0,
            )?,
            prefetch_timeout_max: fields.f64(
                "prefetch_timeout_max",
                d.prefetch_timeout_max,
                0.0..=86_400.0,
            )?,
            pass_prefix_keys: fields
                .bool("hicache_storage_pass_prefix_keys", d.pass_prefix_keys)?,
            capacity_bytes: fields.opt_bytes("capacity", 1)?,
        };
        if c.prefetch_timeout_max < c.prefetch_timeout_base {
            return Err(StorageError::config(
                fields.scope(),
                "prefetch_timeout_max",
                c.prefetch_timeout_max.to_string(),
                format!(
                    "must be at least prefetch_timeout_base ({})",
                    c.prefetch_timeout_base
                ),
            ));
        }
        Ok(c)
    }

    /// The prefetch timeout in seconds for `tokens` tokens:
    /// `min(max, base + per_ki_token · tokens / 1024)`.
    pub fn prefetch_timeout_secs(&self, tokens: u64) -> f64 {
        (self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens as f64 / 1024.0)
            .min(self.prefetch_timeout_max)
    }
}

/// A parsed storage configuration: which backend, the common fields, and the backend's own
/// fields (still to be checked by the backend's factory).
#[derive(Clone, Debug, PartialEq)]
pub struct StorageConfig {
    /// The backend's registry name.
    pub backend: String,
    /// HiCache-level fields.
    pub common: CommonConfig,
    /// The backend's own fields, scoped `backend <name>`.
    pub backend_fields: ConfigFields,
}

/// Largest extra-config file [`read_config_file`] accepts.
pub const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;

/// Reads a configuration file named by `@path`: it must be a regular file (a FIFO, a device
/// such as `/dev/zero` or a directory is refused before it is opened, so the read can neither
/// block nor run forever) of at most [`MAX_CONFIG_FILE_BYTES`], in UTF-8.
pub fn read_config_file(path: &Path) -> Result<String> {
    use std::io::Read;
    let refuse = |reason: String| StorageError::ConfigSyntax {
        source_name: path.display().to_string(),
        reason,
    };
    let kind = |m: &std::fs::Metadata| {
        use std::os::unix::fs::FileTypeExt;
        let t = m.file_type();
        if t.is_dir() {
            "a directory"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        }
    };
    let meta = std::fs::metadata(path).map_err(StorageError::io("read extra-config", path))?;
    if !meta.is_file() {
        return Err(refuse(format!(
            "is {}, not a regular file; an extra-config file must be a regular JSON file",
            kind(&meta)
        )));
    }
    let file = std::fs::File::open(path).map_err(StorageError::io("read extra-config", path))?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(StorageError::io("read extra-config", path))?;
    if bytes.len() as u64 > MAX_CONFIG_FILE_BYTES {
        return Err(refuse(format!(
            "larger than {MAX_CONFIG_FILE_BYTES} bytes; an extra-config is a small JSON object"
        )));
    }
    String::from_utf8(bytes).map_err(|e| refuse(format!("not UTF-8: {e}")))
}

impl StorageConfig {
    /// A configuration with defaults and no backend fields.
    pub fn new(backend: impl Into<String>) -> Self {
        let backend = backend.into();
        Self {
            backend_fields: ConfigFields::new(format!("backend {backend}"), Map::new()),
            backend,
            common: CommonConfig::default(),
        }
    }

    /// Parses the CLI backend name (optional) and the extra-config (optional): inline JSON, or
    /// `@path` naming a JSON file.
    pub fn parse(cli_backend: Option<&str>, extra_config: Option<&str>) -> Result<Self> {
        let value = match extra_config.map(str::trim) {
            None | Some("") => Value::Object(Map::new()),
            Some(s) => match s.strip_prefix('@') {
                Some(path) => return Self::from_file(cli_backend, Path::new(path)),
                None => parse_json("<inline>", s)?,
            },
        };
        Self::from_value(cli_backend, value, "<inline>")
    }

    /// Reads the extra-config from a JSON file (see [`read_config_file`]).
    pub fn from_file(cli_backend: Option<&str>, path: &Path) -> Result<Self> {
        let text = read_config_file(path)?;
        let name = path.display().to_string();
        Self::from_value(cli_backend, parse_json(&name, &text)?, &name)
    }

    /// Builds from an already parsed extra-config value.
    pub fn from_value(cli_backend: Option<&str>, value: Value, source_name: &str) -> Result<Self> {
        let Value::Object(map) = value else {
            return Err(StorageError::ConfigSyntax {
                source_name: source_name.to_string(),
                reason: format!("expected a JSON object, got {}", render(&value)),
            });
        };
        refuse_nulls("extra-config", &map)?;
        let mut fields = ConfigFields::new("extra-config", map);
        let named = fields.opt_string("backend")?;
        let backend = match (cli_backend, named) {
            (None, None) => {
                return Err(StorageError::config(
                    "extra-config",
                    "backend",
                    "<missing>",
                    "no backend named on the command line or in the extra-config",
                ));
            }
            (Some(DYNAMIC_BACKEND), None) => {
                return Err(StorageError::config(
                    "extra-config",
                    "backend",
                    "<missing>",
                    "backend `dynamic` needs the extra-config to name the backend",
                ));
            }
            (Some(cli), None) => cli.to_string(),
            (None | Some(DYNAMIC_BACKEND), Some(doc)) => doc,
            (Some(cli), Some(doc)) if cli == doc => doc,
            (Some(cli), Some(doc)) => {
                return Err(StorageError::config(
                    "extra-config",
                    "backend",
                    format!("\"{doc}\""),
                    format!("conflicts with the backend `{cli}` named on the command line"),
                ));
            }
        };
        let common = CommonConfig::take_from(&mut fields)?;
        Ok(Self {
            backend_fields: fields.with_scope(format!("backend {backend}")),
            backend,
            common,
        })
    }
}

/// Rule 4: a field set to `null` says nothing; it is refused rather than read as "absent", so a
/// templating mistake (`"capacity": null`) is seen instead of silently becoming the default.
fn refuse_nulls(scope: &str, map: &Map<String, Value>) -> Result<()> {
    match map.iter().find(|(_, v)| v.is_null()) {
        None => Ok(()),
        Some((field, _)) => Err(StorageError::config(
            scope,
            field.as_str(),
            "null",
            "null is not a value: leave the field out for its default",
        )),
    }
}

fn parse_json(source_name: &str, text: &str) -> Result<Value> {
    crate::strict_json::parse_strict(text).map_err(|e| StorageError::ConfigSyntax {
        source_name: source_name.to_string(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(cli: Option<&str>, extra: &str) -> String {
        StorageConfig::parse(cli, Some(extra))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn duplicate_keys_and_nulls_are_errors() {
        let e = err(Some("file"), r#"{"dir": "/a", "dir": "/b"}"#);
        assert!(e.contains("\"dir\" appears twice"), "{e}");
        let e = err(None, r#"{"backend": "file", "capacity": null}"#);
        assert!(
            e.contains("`capacity` = null") && e.contains("leave the field out"),
            "{e}"
        );
        let e = err(Some("file"), r#"{"dir": null}"#);
        assert!(e.contains("`dir` = null"), "{e}");
        let mut c = StorageConfig::parse(Some("x"), Some(r#"{"nested": {"a": null}}"#)).unwrap();
        let e = c
            .backend_fields
            .opt_object("nested")
            .unwrap_err()
            .to_string();
        assert!(e.contains("backend x.nested: field `a` = null"), "{e}");
        // Opaque values keep their nulls (a plugin's own config).
        let mut c = StorageConfig::parse(Some("x"), Some(r#"{"opaque": [null]}"#)).unwrap();
        assert_eq!(
            c.backend_fields.opt_value("opaque"),
            Some(serde_json::json!([null]))
        );
    }

    #[test]
    fn defaults_match_sglang() {
        let c = StorageConfig::parse(Some("file"), None).unwrap();
        assert_eq!(c.backend, "file");
        assert_eq!(c.common, CommonConfig::default());
        assert_eq!(c.common.prefetch_threshold, 256);
        assert!((c.common.prefetch_timeout_secs(10 * 1024) - 3.0).abs() < 1e-9);
        assert!((c.common.prefetch_timeout_secs(1 << 30) - 30.0).abs() < 1e-9);
        assert!(c.backend_fields.is_empty());
    }

    #[test]
    fn common_fields_are_taken_and_the_rest_passed_on() {
        let c = StorageConfig::parse(
            Some("file"),
            Some(
                r#"{"prefetch_threshold":512, "prefetch_timeout_base": 0.5,
                   "prefetch_timeout_per_ki_token": 0.25, "capacity": "4gb",
                   "hicache_storage_pass_prefix_keys": true, "dir": "/x", "fsync": "always"}"#,
            ),
        )
        .unwrap();
        assert_eq!(c.common.prefetch_threshold, 512);
        assert_eq!(c.common.prefetch_timeout_base, 0.5);
        assert_eq!(c.common.prefetch_timeout_per_ki_token, 0.25);
        assert_eq!(c.common.capacity_bytes, Some(4_000_000_000));
        assert!(c.common.pass_prefix_keys);
        let mut f = c.backend_fields;
        assert_eq!(f.scope(), "backend file");
        assert_eq!(f.opt_path("dir").unwrap(), Some(PathBuf::from("/x")));
        assert_eq!(
            f.choice("fsync", "batch", &["none", "batch", "always"])
                .unwrap(),
            "always"
        );
        f.finish().unwrap();
    }

    #[test]
    fn wrong_types_name_field_and_value() {
        let e = err(Some("file"), r#"{"prefetch_threshold": "many"}"#);
        assert!(
            e.contains("prefetch_threshold") && e.contains("\"many\""),
            "{e}"
        );
        let e = err(Some("file"), r#"{"prefetch_threshold": -3}"#);
        assert!(e.contains("prefetch_threshold") && e.contains("-3"), "{e}");
        let e = err(Some("file"), r#"{"prefetch_timeout_base": true}"#);
        assert!(
            e.contains("prefetch_timeout_base") && e.contains("true"),
            "{e}"
        );
        let e = err(Some("file"), r#"{"hicache_storage_pass_prefix_keys": 1}"#);
        assert!(e.contains("hicache_storage_pass_prefix_keys"), "{e}");
        let e = err(Some("file"), r#"{"capacity": "lots"}"#);
        assert!(e.contains("capacity") && e.contains("lots"), "{e}");
        let e = err(Some("file"), r#"{"capacity": [1]}"#);
        assert!(e.contains("capacity"), "{e}");
        let e = err(Some("file"), r#"{"backend": 3}"#);
        assert!(e.contains("backend") && e.contains('3'), "{e}");
    }

    #[test]
    fn out_of_range_values_are_refused() {
        let e = err(Some("file"), r#"{"prefetch_timeout_base": -1.0}"#);
        assert!(
            e.contains("prefetch_timeout_base") && e.contains("-1.0"),
            "{e}"
        );
        let e = err(
            Some("file"),
            r#"{"prefetch_timeout_base": 5, "prefetch_timeout_max": 1}"#,
        );
        assert!(e.contains("prefetch_timeout_max"), "{e}");
        let e = err(Some("file"), r#"{"capacity": 0}"#);
        assert!(e.contains("capacity"), "{e}");
        // `tp_lcm_size` (SGLang's head splitting across TP sizes) is not implemented, so it is
        // no common field: it stays with the backend's fields, whose strict check names it.
        let c = StorageConfig::parse(Some("file"), Some(r#"{"tp_lcm_size": 4}"#)).unwrap();
        let e = c.backend_fields.finish().unwrap_err().to_string();
        assert!(e.contains("tp_lcm_size"), "{e}");
        let e = err(Some("file"), r#"{"prefetch_threshold": 1e99}"#);
        assert!(e.contains("prefetch_threshold"), "{e}");
    }

    #[test]
    fn unknown_fields_are_errors_in_the_backend_scope() {
        let c = StorageConfig::parse(Some("memory"), Some(r#"{"colour": "red"}"#)).unwrap();
        let mut f = c.backend_fields;
        let _ = f.opt_bool("verify").unwrap();
        let e = f.finish().unwrap_err().to_string();
        assert!(
            e.contains("backend memory") && e.contains("colour") && e.contains("red"),
            "{e}"
        );
        assert!(e.contains("verify"), "lists known fields: {e}");
    }

    #[test]
    fn syntax_errors_and_non_objects() {
        let e = err(Some("file"), "{not json");
        assert!(e.contains("<inline>"), "{e}");
        let e = err(Some("file"), "[1,2]");
        assert!(e.contains("expected a JSON object"), "{e}");
        let e = StorageConfig::parse(Some("file"), Some("@/nonexistent/x.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/x.json"), "{e}");
    }

    #[test]
    fn extra_config_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("extra.json");
        std::fs::write(&p, r#"{"backend": "memory", "capacity": 1024}"#).unwrap();
        let c = StorageConfig::parse(None, Some(&format!("@{}", p.display()))).unwrap();
        assert_eq!(c.backend, "memory");
        assert_eq!(c.common.capacity_bytes, Some(1024));
        std::fs::write(&p, "{,}").unwrap();
        let e = StorageConfig::parse(None, Some(&format!("@{}", p.display())))
            .unwrap_err()
            .to_string();
        assert!(e.contains("extra.json"), "{e}");
    }

    /// Issue 13: `@/dev/zero` or a FIFO read forever (or blocked); both are refused now, and
    /// an oversized file is refused after a bounded read.
    #[test]
    fn extra_config_files_must_be_small_regular_files() {
        let e = StorageConfig::parse(None, Some("@/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("character device"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if made {
            let e = StorageConfig::parse(None, Some(&format!("@{}", fifo.display())))
                .unwrap_err()
                .to_string();
            assert!(e.contains("a FIFO"), "{e}");
        }
        let e = StorageConfig::parse(None, Some(&format!("@{}", dir.path().display())))
            .unwrap_err()
            .to_string();
        assert!(e.contains("a directory"), "{e}");
        let big = dir.path().join("big.json");
        std::fs::write(&big, vec![b' '; MAX_CONFIG_FILE_BYTES as usize + 10]).unwrap();
        let e = StorageConfig::parse(None, Some(&format!("@{}", big.display())))
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than"), "{e}");
    }

    #[test]
    fn backend_name_rules() {
        let c = StorageConfig::parse(
            Some("dynamic"),
            Some(r#"{"backend": "plugin", "plugin_path": "/opt/x/libfoo.so", "plugin_config": {"a": 1}}"#),
        )
        .unwrap();
        assert_eq!(c.backend, "plugin");
        let mut f = c.backend_fields;
        assert_eq!(f.string("plugin_path").unwrap(), "/opt/x/libfoo.so");
        let inner = f.opt_object("plugin_config").unwrap().unwrap();
        assert_eq!(inner.scope(), "backend plugin.plugin_config");
        f.finish().unwrap();
        assert_eq!(
            StorageConfig::parse(Some("plugin"), Some(r#"{"backend": "plugin"}"#))
                .unwrap()
                .backend,
            "plugin"
        );
        assert_eq!(
            StorageConfig::parse(None, Some(r#"{"backend": "file"}"#))
                .unwrap()
                .backend,
            "file"
        );
        let e = err(Some("file"), r#"{"backend": "plugin"}"#);
        assert!(e.contains("conflicts") && e.contains("file"), "{e}");
        assert!(StorageConfig::parse(None, None).is_err());
        assert!(StorageConfig::parse(Some("dynamic"), None).is_err());
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("4gb"), Some(4_000_000_000));
        assert_eq!(parse_byte_size("4GB"), Some(4_000_000_000));
        assert_eq!(parse_byte_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_byte_size("1.5 TB"), Some(1_500_000_000_000));
        assert_eq!(parse_byte_size("0.5gib"), Some(1 << 29));
        assert_eq!(parse_byte_size("123"), Some(123));
        assert_eq!(parse_byte_size("10k"), Some(10_000));
        for bad in [
            "",
            "gb",
            "1.2.3",
            ".5gb",
            "5.gb",
            "-1",
            "1 zb",
            "99999999999tb",
            "1e9",
        ] {
            assert_eq!(parse_byte_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn choice_and_required_fields() {
        let mut f = ConfigFields::new(
            "backend x",
            serde_json::from_str(r#"{"mode": "loud", "n": 5}"#).unwrap(),
        );
        let e = f
            .choice("mode", "quiet", &["quiet", "normal"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("mode") && e.contains("loud") && e.contains("quiet, normal"),
            "{e}"
        );
        let e = f.string("path").unwrap_err().to_string();
        assert!(e.contains("path") && e.contains("required"), "{e}");
        let e = f.u64("n", 1, 10..=20).unwrap_err().to_string();
        assert!(e.contains("between 10 and 20"), "{e}");
    }
}
